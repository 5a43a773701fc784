"""`python -m tools.gpu_check [--cpu] [--budget S] [--only STEPS] [--peers DIR]`."""

import sys

from tools.gpu_check.run import main

sys.exit(main())
