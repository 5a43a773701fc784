#!/usr/bin/env bash
# Install everything into .venv (torch==2.13.0 first: the CPU wheel on CPU machines)
# and run the test suite. This is the README's test command and what CI runs.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q torch==2.13.0
pip install -q -e '.[dev]'
ruff check src tests
ruff format --check src tests  # the layout is ruff's (a `# fmt: skip` says why it is not)
# two workers (pytest-xdist) on the 2-core machine CI runs on; the tests that share a
# fixture built once (a tiny run, an interpreted-Triton child) stay on one worker
# (`worker_group` in tests/conftest.py)
exec python -m pytest -q --durations=15 -n 2 --dist loadgroup "$@"
