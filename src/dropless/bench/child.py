"""The one way a benchmark runs a child process: `run_child_process`.

Benchmarks time in children (one import of torch per row, a fresh allocator, an
out-of-memory end that does not take the parent with it). Output is collected while a
child runs, so one that is stopped (timeout, low free memory) still gives back what it
printed, and the caller gets one `ChildRun` whatever happened.
"""

from __future__ import annotations

import json
import subprocess
import time
from dataclasses import dataclass

POLL_S = 0.5  # how often a running child's time and the machine's free memory are read


@dataclass(frozen=True)
class ChildRun:
    """What a child did. `status`: "ok" (exit 0), "fail" (another exit status),
    "timeout" (stopped past its timeout) or "killed" (stopped for memory, `reason` says)."""

    status: str
    returncode: int | None  # None when this process stopped the child
    stdout: str
    stderr: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def last_json(self) -> dict:
        """The last line of stdout as JSON: the record every benchmark child prints last."""
        lines = self.stdout.strip().splitlines()
        if not lines:
            raise ValueError(f"the child printed nothing on stdout; stderr:\n{self.stderr_tail()}")
        return json.loads(lines[-1])

    def stderr_tail(self) -> str:
        return self.stderr[-3000:]


def mem_available_gib() -> float:
    """The machine's available memory (MemAvailable of /proc/meminfo), GiB; inf where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("inf")


def run_child_process(
    cmd: list[str],
    *,
    timeout: float,
    env: dict | None = None,
    cwd=None,
    min_free_gib: float | None = None,
) -> ChildRun:
    """Run `cmd` to its end, or stop it past `timeout` seconds or, with `min_free_gib`,
    when the machine's available memory falls under that floor (a child that would
    otherwise bring in the OOM killer). Output printed before a stop is kept."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd
    )
    start, reason = time.monotonic(), ""
    while True:
        try:
            # communicate() keeps reading both pipes (no full-pipe stall); on TimeoutExpired
            # nothing read so far is lost, the next call goes on from it
            out, err = proc.communicate(timeout=POLL_S)
            break
        except subprocess.TimeoutExpired:
            late = time.monotonic() - start > timeout
            if late:
                reason = f"past its timeout of {timeout:.0f} s"
            elif min_free_gib is not None and mem_available_gib() < min_free_gib:
                reason = f"the machine's free memory fell under {min_free_gib} GiB"
            if reason:
                proc.kill()
                out, err = proc.communicate()
                status = "timeout" if late else "killed"
                return ChildRun(status, None, out or "", err or "", reason)
    status = "ok" if proc.returncode == 0 else "fail"
    return ChildRun(status, proc.returncode, out or "", err or "")
