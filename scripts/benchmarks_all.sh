#!/usr/bin/env bash
# Regenerate every benchmark section and BENCHMARKS.md, from a checkout with dropless
# installed (`pip install -e '.[all]'`). Run it on an otherwise idle machine: each
# section records the load average and the other busy processes before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
dropless bench layer --shape qwen3 --rounds 5 --impls all --record
dropless bench layer --shape mixtral --rounds 5 --record
dropless bench e2e --rounds 3 --steps 2 --eager-rounds 1 --record
dropless bench e2e --shape mixtral --rounds 3 --steps 2 --eager-rounds 1 --record
dropless bench lora --rounds 3 --steps 2 --record
dropless bench memory --seq-len 8192 32768 --record
dropless bench fp8 --record
dropless bench ep --world 2 --tokens 1024 --record
python scripts/cp_memory.py 65536 1,2,4 --rounds 3 --section benchmarks/sections/cp.md
dropless bench train --record
python scripts/balance_runs.py family:train.balance_loss=family per_layer per_layer+bias:train.expert_bias_rate=1e-3 --section benchmarks/sections/balance.md
dropless bench jax --impls dropless,ragged_dot,capacity_einsum,dense_bound --record
python scripts/benchmarks_md.py
