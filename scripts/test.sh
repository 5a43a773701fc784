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
exec python -m pytest -q --durations=15 "$@"
