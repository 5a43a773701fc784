#!/usr/bin/env python
"""`python scripts/gpu_check.py ARGS` is `python -m dropless.bench.gpu_check ARGS` in a
checkout where nothing is installed (the GPU machine): ./src goes on the path first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dropless.bench.gpu_check.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
