#!/usr/bin/env python
"""`python scripts/gpu_profile.py [CASE...]` is `python -m dropless.bench.gpu_check.profile`
in a checkout where nothing is installed: ./src goes on the path first."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dropless.bench.gpu_check.profile import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
