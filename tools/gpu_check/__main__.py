"""`python -m tools.gpu_check [--cpu] [--budget S] [--only STEPS] [--peers DIR]`."""

from tools.gpu_check.run import main

raise SystemExit(main())
