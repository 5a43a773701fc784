#!/usr/bin/env bash
# Regenerate every benchmark section and BENCHMARKS.md, from a checkout with dropless
# installed (`pip install -e '.[all]'`). Run it on an otherwise idle machine: each
# section records the load average and the other busy processes before and after.
set -euo pipefail
cd "$(dirname "$0")/.."
dropless bench layer --shape qwen3 --impls all --record
dropless bench layer --shape mixtral --record
dropless bench e2e --record
dropless bench e2e --shape mixtral --record
dropless bench e2e --impls grouped_mm,dropless --compile --no-memory --no-history --section benchmarks/sections/e2e_compile.md
python scripts/bench_optimizer_step.py --section benchmarks/sections/optimizer_step.md
dropless bench lora --record
dropless bench memory --seq-len 8192 32768 --record
dropless bench fp8 --record
dropless bench ep --world 2 --tokens 1024 --record
python scripts/cp_memory.py 65536 1,2,4 --rounds 3 --section benchmarks/sections/cp.md
dropless bench train --record
python scripts/balance_runs.py family:train.balance_loss=family per_layer per_layer+bias:train.expert_bias_rate=1e-3 --section benchmarks/sections/balance.md
dropless bench jax --impls dropless,ragged_dot,capacity_einsum,dense_bound --record
python scripts/benchmarks_md.py
