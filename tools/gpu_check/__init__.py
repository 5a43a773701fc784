"""The GPU check (`python -m tools.gpu_check`, or `python scripts/gpu_check.py` where nothing
is installed), run from a checkout: `run.py` the steps and the JSON summary, `train.py` the
`train` step; `tools/gpu_report.py` writes BENCHMARKS.md's section from the logs
(docs/kernels.md)."""

from pathlib import Path

#: the checkout this package runs from (tools/gpu_check -> the repository root)
CHECKOUT = Path(__file__).resolve().parents[2]
