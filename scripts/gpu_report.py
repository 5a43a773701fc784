#!/usr/bin/env python
"""`python scripts/gpu_report.py ARGS` is `python -m tools.gpu_report ARGS` where
nothing is installed: the checkout's root (for `tools`) and ./src go on the path first."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from tools.gpu_report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
