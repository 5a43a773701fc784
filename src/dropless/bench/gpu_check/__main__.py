"""`python -m dropless.bench.gpu_check [--cpu] [--budget S] [--only STEPS] [--peers DIR]`."""

import sys

from dropless.bench.gpu_check.run import main

sys.exit(main())
