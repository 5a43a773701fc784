"""Several scripts of examples/ in one process (or one torchrun group), one after another:
each one's `main()` runs as `python SCRIPT ARGS` would run it (`runpy`, run as __main__),
so a group's start-up, and the imports of torch, Transformers and TRL, are paid once.

    python _checks_parallelize_runs.py SCRIPT 'ARG ARG ...' [SCRIPT 'ARGS' ...]

A SCRIPT without a directory is one of examples/; a path is run as given (the refusals'
child). Each prints its RESULT line and writes OUT/losses.json as on its own. Only scripts
that leave the process group up can share a group (not the loop and accelerate scripts,
which end it)."""

import runpy
import shlex
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
EXAMPLES = TESTS.parent / "examples"


def main(argv: list[str]) -> None:
    sys.path[:0] = [str(EXAMPLES), str(TESTS)]
    for script, args in zip(argv[::2], argv[1::2]):
        path = Path(script) if "/" in script else EXAMPLES / script
        sys.argv = [str(path), *shlex.split(args)]
        runpy.run_path(str(path), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
