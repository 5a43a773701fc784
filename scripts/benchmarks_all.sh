#!/usr/bin/env bash
# Regenerate every benchmark section and BENCHMARKS.md, from a checkout with dropless
# installed (`pip install -e '.[all]'`). Run it on an otherwise idle machine: each
# section records the load average and the other busy processes before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
dropless bench layer --shape qwen3 --rounds 5 --impls all
dropless bench layer --shape mixtral --rounds 5
dropless bench e2e --rounds 3 --steps 2 --eager-rounds 1
dropless bench e2e --shape mixtral --rounds 3 --steps 2 --eager-rounds 1
dropless bench lora --rounds 3 --steps 2
dropless bench memory --seq-len 8192 32768
dropless bench fp8
dropless bench ep --world 2 --tokens 1024
dropless bench train
dropless bench jax
python scripts/benchmarks_md.py
