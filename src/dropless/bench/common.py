"""What every benchmark shares: machine facts, the history file, child processes."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

from ..train.metrics import peak_rss_mib, reset_peak_rss

__all__ = ["peak_rss_mib", "reset_peak_rss"]  # re-exported for the benches

HISTORY = Path("benchmarks") / "history.jsonl"


def git_commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def machine() -> dict:
    import torch

    info = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


def append_history(bench: str, figures: dict, path: Path = HISTORY) -> dict:
    """Append one JSON line: command, commit, machine, date and the figures."""
    record = {
        "bench": bench,
        "command": "dropless " + " ".join(sys.argv[1:]) if sys.argv else bench,
        "commit": git_commit(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "figures": figures,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")
    return record


def run_child(module: str, args: dict, timeout: float = 1800) -> dict:
    """Run `python -m module` with a JSON argument; it prints one JSON line last."""
    proc = subprocess.run(
        [sys.executable, "-m", module, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child {module} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])
