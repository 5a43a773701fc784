"""Takes the run lock of argv[1] in a process that imports no torch (a few ms to start):
`run/rundir.py` and `run/atomic.py` are loaded from the sources as a package of their own. Prints
"won" or "lost" once it tried, then holds what it won until stdin closes. With argv[2]
"wait", it reads one line from stdin before trying (so several start together)."""

import sys
import types
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dropless" / "train" / "run"
pkg = types.ModuleType("lockpkg")
pkg.__path__ = [str(SRC)]
sys.modules["lockpkg"] = pkg

from lockpkg.rundir import RunLock  # noqa: E402

if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] == "wait":
        sys.stdin.readline()
    lock = RunLock(Path(sys.argv[1]))
    try:
        lock.acquire()
        print("won", flush=True)
    except ValueError as e:
        print("lost", e, flush=True)
    sys.stdin.read()  # hold until the parent closes stdin
    lock.release()
