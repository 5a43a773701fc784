"""What every benchmark shares: the history file and its records (command line, commit,
dirty flag, machine, load), child processes under the default allocator, peak memory.
`Recorder.start(args)` resolves the history file (or refuses) and samples the load;
`rec.finish(name, figures)` samples it again and appends one JSON line (docs/performance.md,
"Benchmark records").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..train.report.metrics import peak_rss_mib, reset_peak_rss  # noqa: F401  (re-exported for the benches)

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # .../src/dropless
HISTORY_IN_CHECKOUT = Path("benchmarks") / "history.jsonl"
# Benchmark outputs: writing them does not make the tree dirty for the next benchmark.
OUTPUTS = ("benchmarks/", "BENCHMARKS.md")
# Environment variables that change glibc malloc (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_,
# MALLOC_ARENA_MAX, ... and GLIBC_TUNABLES=glibc.malloc.*): timings run without them.
_MALLOC_PREFIX = "MALLOC_"
# mallopt parameters (glibc malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_RECORDED_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "XLA_FLAGS")


# --- where the history goes -----------------------------------------------------------------


def find_checkout(package_dir: Path | None = None) -> Path | None:
    """The git checkout this package runs from (`<root>/src/dropless`), or None.

    An installed (non-editable) package has no checkout, even when the current directory
    or the venv lies inside one: its code is not that checkout's code."""
    package_dir = package_dir or PACKAGE_DIR
    root = package_dir.parent.parent
    if package_dir.name != "dropless" or package_dir.parent.name != "src":
        return None
    if not (root / ".git").exists() or not (root / "pyproject.toml").is_file():
        return None
    return root


def from_checkout(module: str, what: str):
    """tools/MODULE.py of the checkout this package runs from (`find_checkout`): the rows
    that compare against other libraries' layers and the section writers are not in the
    wheel; `what` names what needs it."""
    import importlib

    root = find_checkout()
    if root is None or not (root / "tools" / f"{module}.py").is_file():
        raise ValueError(
            f"{what}: runs from a dropless checkout (tools/{module}.py, not in the wheel): "
            "in a clone, `pip install -e .` and run the same command"
        )
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"tools.{module}")


def add_history_arguments(p: argparse.ArgumentParser, section: str) -> None:
    """`--record`, `--history [FILE]`, `--no-history` and `--section FILE`, the same for
    every benchmark; `section` names its file in the checkout's benchmarks/sections/."""
    p.add_argument(
        "--record", action="store_true",
        help="append the result to the checkout's benchmarks/history.jsonl and rewrite its "
        "benchmarks/sections/ file (refused when not running from a checkout); "
        "by default nothing is written",
    )  # fmt: skip
    p.add_argument(
        "--history", nargs="?", const="", default=None, metavar="FILE",
        help="append the result to FILE (no FILE: the checkout's benchmarks/history.jsonl)",
    )  # fmt: skip
    p.add_argument(
        "--no-history", action="store_true",
        help="append to no history file, even with --record (the default without --record)",
    )  # fmt: skip
    p.add_argument(
        "--section", default=None, metavar="FILE",
        help=f"markdown file for the table (default: the checkout's benchmarks/sections/{section}.md; "
        "'' to skip)",
    )  # fmt: skip


def history_path(
    history: str | None, no_history: bool, package_dir: Path | None = None, record: bool = False
):
    """-> (path or None, why not). Raises ValueError when the checkout's history was asked
    for (`--record`, or `--history` without a file) outside a checkout."""
    if no_history:
        return None, "--no-history"
    if history:
        return Path(history).resolve(), ""
    if history is None and not record:
        return None, "not asked"
    root = find_checkout(package_dir)
    if root is not None:
        return root / HISTORY_IN_CHECKOUT, ""
    flag = "--record" if record else "--history"
    raise ValueError(
        f"{flag}: this dropless runs from {package_dir or PACKAGE_DIR}, not from a git checkout "
        "of the project (<checkout>/src/dropless), so there is no benchmarks/history.jsonl to "
        "append to. Run from a clone installed with `pip install -e .`, or give a file "
        "(--history FILE)."
    )


def write_section(args, rec: Recorder, name: str, record: dict, *text: str) -> None:
    """Hand the run's record and printed text to the checkout's section writer
    (tools/bench_sections.py, not in the wheel): `--section FILE` writes FILE; by default
    `--record` writes the checkout's benchmarks/sections/NAME.md; `--section ''` nothing."""
    if args.section is None and not rec.record:
        print(
            f"section: not written (--record writes benchmarks/sections/{name}.md, "
            "--section FILE writes FILE)",
            file=sys.stderr,
        )
    elif args.section != "":
        from_checkout("bench_sections", "--section").write(name, args.section, rec, record, *text)


def progress(text: str) -> None:
    """One progress line on stderr (stdout keeps the tables), flushed at once."""
    print(text, file=sys.stderr, flush=True)


# --- what a record holds ----------------------------------------------------------------------


def command_line(cmdline: list[str] | None = None) -> tuple[str, list[str]]:
    """-> (the command as typed, the exact argv of this process).

    The argv comes from /proc/self/cmdline (interpreter, script, arguments); the typed
    form drops the directories of the interpreter and of a console script
    (`/venv/bin/python /venv/bin/dropless bench layer` -> `dropless bench layer`)."""
    if cmdline is None:
        try:
            with open("/proc/self/cmdline", "rb") as f:
                cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            cmdline = [sys.executable, *sys.argv]
    argv = list(cmdline)
    shown = list(argv)
    if len(shown) >= 2 and not shown[1].startswith("-") and Path(shown[1]).name == "dropless":
        shown = ["dropless", *shown[2:]]  # console script run by its interpreter
    elif shown:
        shown[0] = Path(shown[0]).name
    return shlex.join(shown), argv


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def git_state(root: Path | None) -> dict:
    """{"commit", "dirty", "dirty_files"}: dirty = changed or untracked files outside the
    benchmark outputs (benchmarks/, BENCHMARKS.md); None where git cannot tell."""
    if root is None:
        return {"commit": None, "dirty": None, "dirty_files": []}
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=normal")
    if commit is None or status is None:
        return {"commit": None, "dirty": None, "dirty_files": []}
    files = [line[3:] for line in status.splitlines() if line.strip()]
    files = [f for f in files if not f.startswith(OUTPUTS)]
    return {"commit": commit.strip()[:12], "dirty": bool(files), "dirty_files": files[:20]}


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


# --- the machine's load --------------------------------------------------------------------------


def _proc_table() -> dict[int, tuple[int, float, str]]:
    """pid -> (parent pid, CPU seconds used so far, command name), from /proc/<pid>/stat."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    table = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                raw = f.read()
        except OSError:
            continue  # the process ended meanwhile
        name = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        # fields after the name: state ppid ... utime (11) stime (12), 0-based from state
        table[int(d)] = (int(rest[1]), (int(rest[11]) + int(rest[12])) / tick, name)
    return table


def load_sample(window_s: float = 0.5, busy_share: float = 0.25) -> dict:
    """The load average (1, 5, 15 min) and the other processes that used more than
    `busy_share` of a core over `window_s` seconds (this process and its children excluded)."""
    try:
        with open("/proc/loadavg") as f:
            loadavg = [float(v) for v in f.read().split()[:3]]
        t0, first = time.monotonic(), _proc_table()
        time.sleep(window_s)
        second = _proc_table()
        dt = time.monotonic() - t0
    except OSError:
        return {"loadavg": None, "busy_processes": None, "busy": []}
    mine, grew = {os.getpid()}, True  # this process and its descendants: not 'other' load
    while grew:
        new = {pid for pid, (ppid, _, _) in second.items() if ppid in mine} - mine
        mine, grew = mine | new, bool(new)
    busy = []
    for pid in second.keys() & first.keys() - mine:
        share = (second[pid][1] - first[pid][1]) / dt
        if share > busy_share:
            busy.append((share, second[pid][2]))
    busy.sort(reverse=True)
    return {
        "loadavg": loadavg,
        "busy_processes": len(busy),
        "busy": [f"{name} {share:.0%}" for share, name in busy[:12]],
    }


def under_load(load: dict) -> list[str]:
    """The other processes found busy in any sample of a run's load (before, between
    rounds, after), each once: a run with any is not a result."""
    samples = [load.get("before") or {}, *(load.get("during") or []), load.get("after") or {}]
    names = [b.rsplit(" ", 1)[0] for s in samples for b in s.get("busy") or []]
    return list(dict.fromkeys(names))


def load_sentence(load: dict) -> str:
    """One line for a table header: the measured load before and after the run, and
    "under load: not a result" when another process was busy in a sample."""
    b, a = load.get("before") or {}, load.get("after") or {}
    if not b.get("loadavg") or not a.get("loadavg"):
        return "Machine load: not recorded."
    during = [s["busy_processes"] for s in load.get("during") or [] if s.get("loadavg")]
    mid = f"at most {max(during)} between rounds, " if during else ""
    text = (
        f"Machine load: 1-min load average {b['loadavg'][0]:.2f} before, {a['loadavg'][0]:.2f} "
        f"after (the 'after' includes this benchmark); other processes busy (> 25% of a core): "
        f"{b['busy_processes']} before, {mid}{a['busy_processes']} after."
    )
    busy = under_load(load)
    return text + (f" **Under load: not a result** (busy: {', '.join(busy[:6])})." if busy else "")


# --- paired rounds -----------------------------------------------------------------------------

MIN_STEPS = MIN_ROUNDS = 5  # timed steps per child and rounds of a run that is a result


def add_round_arguments(p, steps: str = "timed steps per child") -> None:
    """`--rounds` and `--steps` of a paired-rounds bench, their defaults what a result needs."""
    p.add_argument(
        "--rounds", type=int, default=MIN_ROUNDS,
        help=f"rounds, each runs every row once in a fresh child, the order rotated "
        f"(default {MIN_ROUNDS}; fewer is not a result)",
    )  # fmt: skip
    p.add_argument(
        "--steps", type=int, default=MIN_STEPS,
        help=f"{steps} (default {MIN_STEPS}; fewer is not a result)",
    )  # fmt: skip


def rotated(names: list, r: int) -> list:
    """Round r's order of the rows: rotated by r, so each row goes first in turn."""
    k = r % len(names) if names else 0
    return names[k:] + names[:k]


def paired(row: dict, base: dict) -> dict | None:
    """A row against its baseline from per-round speeds ({round: value}, higher is faster;
    give 1/ms for times): the median of the ratios of the rounds both ran (the rows of a
    round ran back to back), their min and max, and the best-of-rounds ratio (the row's
    fastest round over the baseline's). None when no round has both."""
    both = sorted(row.keys() & base.keys())
    if not both:
        return None
    ratios = [row[r] / base[r] for r in both]
    best = max(row.values()) / max(base.values())
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "best": best, "rounds": ratios}  # fmt: skip


def paired_text(p: dict | None) -> str:
    """'1.42x (1.30-1.50x; best 1.45x)' for a table cell; '-' for None."""
    if not p:
        return "-"
    return f"{p['median']:.2f}x ({p['min']:.2f}-{p['max']:.2f}x; best {p['best']:.2f}x)"


def verdict(steps: int, rounds: int, load: dict, quick: bool = False, dirty=False) -> str:
    """The line a run prints under its table: whether it is a result (>= MIN_ROUNDS rounds
    of >= MIN_STEPS timed steps per child, not a smoke shape, no other busy process, a
    committed tree) and why not."""
    busy = under_load(load)
    why = [text for text, bad in (
        ("a tiny smoke shape", quick),
        (f"{steps} timed step(s) per child (fewer than {MIN_STEPS})", steps < MIN_STEPS),
        (f"{rounds} round(s) (fewer than {MIN_ROUNDS})", rounds < MIN_ROUNDS),
        (f"under load: other processes busy ({', '.join(busy[:6])})", busy),
        ("uncommitted changes in the measured tree", dirty),
    ) if bad]  # fmt: skip
    if not why:
        return f"A result: {rounds} paired rounds of {steps} timed steps per child, no other busy process."
    return "**Not a result**: " + "; ".join(why) + "."


# --- the record ------------------------------------------------------------------------------------


@dataclass
class Recorder:
    """One benchmark run: where its history line goes and what was measured around it."""

    path: Path | None
    command: str = ""
    argv: list[str] = field(default_factory=list)
    load_before: dict = field(default_factory=dict)
    started: str = ""
    package_dir: Path | None = None
    record: bool = False
    load_during: list = field(default_factory=list)
    load_after: dict | None = None

    @classmethod
    def start(cls, args, package_dir: Path | None = None) -> Recorder:
        """Resolve the history file first (so a refusal comes before an hour of
        measuring), check the allocator, then sample the load."""
        for flag, module in (("section", "bench_sections"), ("profile", "bench_profile")):
            if getattr(args, flag, None):  # run from a checkout: refused before the measuring
                from_checkout(module, f"--{flag}")
        record = bool(getattr(args, "record", False))
        path, why = history_path(
            getattr(args, "history", None), getattr(args, "no_history", False), package_dir, record
        )
        if why and not getattr(args, "no_history", False):
            print(
                f"history: not recorded ({why}; --record appends to the checkout's "
                "benchmarks/history.jsonl, --history FILE to FILE)",
                file=sys.stderr,
            )
        command, argv = command_line()
        before = load_sample()
        return cls(
            path, command, argv, before, started=_now(), package_dir=package_dir, record=record
        )

    def sample_load(self) -> None:
        """One more load sample, between two rounds (no child runs then)."""
        self.load_during.append(load_sample())

    def end_load(self) -> dict:
        """The load samples of the run: before, between rounds and (sampled now, once)
        after the measuring."""
        if self.load_after is None:
            self.load_after = load_sample()
        return {"before": self.load_before, "during": self.load_during, "after": self.load_after}

    def verdict(self, steps: int, rounds: int, quick: bool = False) -> str:
        """`verdict` of this run: its load samples (the one after taken now), its tree."""
        dirty = git_state(find_checkout(self.package_dir))["dirty"]
        return verdict(steps, rounds, self.end_load(), quick, bool(dirty))

    def finish(self, bench: str, figures: dict) -> dict:
        """Sample the load again (unless `end_load` did) and append the record (unless
        there is no history file)."""
        load = self.end_load()
        record = {
            "bench": bench,
            "command": self.command,
            "argv": self.argv,
            "cwd": os.getcwd(),
            "env": {k: os.environ[k] for k in _RECORDED_ENV if k in os.environ},
            **git_state(find_checkout(self.package_dir)),
            "machine": machine(),
            "started": self.started,
            "date": _now(),
            "load": load,
            "figures": figures,
        }
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"history: appended to {self.path}", file=sys.stderr)
        return record


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# --- allocator and children -------------------------------------------------------------------


def malloc_settings(env: dict | None = None) -> dict:
    """The glibc malloc settings in an environment (empty: the default allocator)."""
    env = os.environ if env is None else env
    found = {k: v for k, v in env.items() if k.startswith(_MALLOC_PREFIX)}
    if "glibc.malloc" in env.get("GLIBC_TUNABLES", ""):
        found["GLIBC_TUNABLES"] = env["GLIBC_TUNABLES"]
    return found


def timing_env() -> dict:
    """This environment without malloc settings: timed children use the default allocator."""
    env = dict(os.environ)
    for k in malloc_settings(env):
        env.pop(k)
    return env


def require_default_allocator(bench: str) -> None:
    """Benchmarks that time in this process (or in children that inherit its allocator)
    refuse to run under non-default malloc settings: they change which implementation wins."""
    found = malloc_settings()
    if found:
        raise ValueError(
            f"dropless bench {bench}: {', '.join(sorted(found))} is set in the environment; "
            "timings are taken under the default allocator users run with. Unset it "
            f"(e.g. `env -u {sorted(found)[0]} dropless bench {bench} ...`)."
        )


def require_extra(bench: str, extra: str, *modules: str) -> None:
    """Before a benchmark starts a child: ModuleNotFoundError naming the extra that
    installs a missing module (the command line prints it as one line; a child that
    fails to import would end in a traceback)."""
    import importlib.util

    for m in modules:
        if importlib.util.find_spec(m) is None:
            raise ModuleNotFoundError(
                f"dropless bench {bench} needs {m}: pip install 'dropless[{extra}]'", name=m
            )


def run_json_child(
    argv: list[str], args: dict, what: str, env: dict | None = None, timeout: float = 1800
) -> dict:
    """Run `python *argv JSON(args)` under the default allocator (malloc settings removed
    from its environment, then `env` added); it prints one JSON line last, returned. A
    failure raises with `what`, the reason and the end of its stderr."""
    from dropless.bench.child import run_child_process

    cmd = [sys.executable, *argv, json.dumps(args)]
    run = run_child_process(cmd, timeout=timeout, env=timing_env() | (env or {}))
    if not run.ok:
        why = run.reason or f"exit status {run.returncode}"
        raise RuntimeError(f"{what} failed ({why}):\n{run.stderr_tail()}")
    return run.last_json()


def run_child(module: str, args: dict, timeout: float = 1800) -> dict:
    """`python -m module` with a JSON argument (`run_json_child`)."""
    return run_json_child(["-m", module], args, f"benchmark child {module}", timeout=timeout)


def step_times(fn, rounds: int, warmup: int = 0, sync=None) -> list[float]:
    """Seconds of each of `rounds` calls of fn() after `warmup` untimed ones; `sync` (a
    device's synchronize) runs before the clock starts and before it stops."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def vm_kib(field: str) -> int:
    """A `Vm*` field of /proc/self/status (VmRSS, VmSize, ...), KiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def rss_mib() -> float:
    """This process's resident memory now, MiB."""
    return vm_kib("VmRSS") / 1024


def follow_live_memory() -> bool:
    """Make RSS track live tensors in this process: glibc serves blocks >= 128 KiB by mmap
    and gives freed memory back at once (trimming the heap now). False where it cannot.

    Call it when the process starts, before any large allocation: glibc's default raises
    its mmap threshold as mmapped blocks are freed (up to 32 MiB), so earlier large
    blocks come from the heap, and the heap's free chunks are reused later (resident
    again) and stay resident when freed: measured, ~250 MiB above the live tensors after
    an e2e training step when this was first called after the warm-up step."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 128 * 1024) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 0) == 1
        libc.malloc_trim(0)
        return bool(ok)
    except (OSError, AttributeError):
        return False
