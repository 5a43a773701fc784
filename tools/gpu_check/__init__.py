"""The GPU check: one command for the day a GPU is lent (`python -m tools.gpu_check`,
or `python scripts/gpu_check.py` where nothing is installed).

- `run.py`: the steps (`pytest -m gpu`, the layer and step tables, the `train` step) and
  the one JSON summary line outside checks read; `__main__.py` calls its `main`;
- `train.py`: the `train` step, `dropless train` on the path a node runs (its torchrun
  children run this module);
- `report.py`: `benchmarks/sections/gpu.md` written from the logs of runs.

Where a GPU step's time and host syncs go is tools/gpu_profile.py's (torch.profiler).

The check runs from a checkout of the repository: it runs its tests and reads its examples.
"""

from __future__ import annotations

from pathlib import Path

#: the checkout this package runs from (tools/gpu_check -> the repository root)
CHECKOUT = Path(__file__).resolve().parents[2]
