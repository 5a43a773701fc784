"""One-time tuning of the expert GEMMs, cached on disk: which implementation of each GEMM
is fastest on this machine, at this shape.

`GemmTuner.choose(key, candidates)` times each candidate (a no-argument callable) once
per key and remembers the fastest; later calls, in this process or any later one, read
the answer. The cache is a JSON file:

- where: `$XDG_CACHE_HOME/dropless/tuning.json`, or `~/.cache/dropless/tuning.json`
  when XDG_CACHE_HOME is unset (`cache_path()`);
- what invalidates it: the environment it was measured in (GPU name, torch and Triton
  versions: `environment()`): a file made in another one is discarded whole and
  retuned; the shapes are part of every key (`shape_key`: GEMM, dtype, experts, rows
  rounded up to a power of two, model and hidden dims, layout, activation), so a new
  shape tunes only itself; a pick that is no longer among the candidates is retuned;
- a file that cannot be read as a tuning cache is reported with a warning, retuned and
  rewritten; every write goes to a temporary file in the same folder, then
  `os.replace`s the cache (atomic: a reader never sees half a file), merged with what
  another process wrote meanwhile. A write that fails warns and leaves the old file.

Delete the file to retune everything. Tuning runs only on CUDA (`cuda_timer`); CPU
paths never ask. Choices made in this process are listed by `recorded()` (shown by
`dropless bench layer`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import warnings
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

import torch

_LOG = logging.getLogger("dropless")
VERSION = 1  # of the file format


def cache_path() -> Path:
    """The tuning cache file (XDG base directory spec for user caches)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dropless" / "tuning.json"


def environment() -> dict:
    """What a measurement depends on besides its shape: GPU name, torch, Triton."""
    try:
        triton = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton}


def shape_key(gemm: str, dtype: torch.dtype, E: int, S: int, D: int, F: int,
              trans_w: bool, kind: str) -> str:  # fmt: skip
    """The cache key of one GEMM of an expert MLP; rows S rounded up to a power of two
    (a dropless layer's S = T * K changes only with the batch)."""
    rows = 1 << max(S - 1, 0).bit_length()
    layout = "nt" if trans_w else "nn"
    return f"{gemm}|{str(dtype).removeprefix('torch.')}|E{E}|S{rows}|D{D}|F{F}|{layout}|{kind}"


def cuda_timer(fn: Callable[[], object], reps: int = 10) -> float:
    """Median seconds of fn() on the current CUDA stream, after one warm-up call (which
    compiles a Triton kernel on first use)."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


class GemmTuner:
    """Per-key choice among candidates, cached on disk (see the module docstring).

    path: the cache file (default `cache_path()`); timer(fn) -> seconds (default
    `cuda_timer`); env() -> the environment fingerprint (default `environment`)."""

    def __init__(self, path=None, timer=None, env=None):
        self.path = Path(path) if path is not None else cache_path()
        self.timer = timer or cuda_timer
        self._env = env or environment
        self._table: dict | None = None

    def choose(self, key: str, candidates: dict[str, Callable[[], object]]) -> str:
        """The fastest of `candidates` for `key`: from the cache, else timed and stored."""
        if not candidates:
            raise ValueError(f"no candidates to choose from for {key!r}")
        table = self._load()
        hit = table.get(key)
        if isinstance(hit, dict) and hit.get("pick") in candidates:
            return hit["pick"]
        if len(candidates) == 1:
            return next(iter(candidates))
        seconds = {name: float(self.timer(fn)) for name, fn in candidates.items()}
        pick = min(seconds, key=seconds.get)
        table[key] = {"pick": pick, "ms": {n: round(s * 1e3, 4) for n, s in seconds.items()}}
        _LOG.info("tuned %s: %s (ms %s)", key, pick, table[key]["ms"])
        self._save(key, table[key])
        return pick

    def lookup(self, key: str, names) -> str | None:
        """The cached pick for `key` if it is among `names`, else None (never times)."""
        hit = self._load().get(key)
        return hit["pick"] if isinstance(hit, dict) and hit.get("pick") in names else None

    def _read(self) -> tuple[dict | None, dict]:
        """(the file's env, its choices); ({}, {}) when it does not exist. Raises
        ValueError when it is not a tuning cache."""
        if not self.path.exists():
            return None, {}
        data = json.loads(self.path.read_text())
        if not (isinstance(data, dict) and data.get("version") == VERSION):
            raise ValueError(f"not a version-{VERSION} tuning cache")
        if not isinstance(data.get("choices"), dict) or not isinstance(data.get("env"), dict):
            raise ValueError("no 'env' and 'choices' objects")
        return data["env"], data["choices"]

    def _load(self) -> dict:
        if self._table is not None:
            return self._table
        env = self._env()
        try:
            file_env, choices = self._read()
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            warnings.warn(
                f"the GEMM tuning cache {self.path} is unreadable ({exc}); retuning and "
                "rewriting it",
                stacklevel=3,
            )
            file_env, choices = None, {}
        if file_env is not None and file_env != env:
            _LOG.info("tuning cache %s was made for %s, not %s: retuning", self.path, file_env, env)
            choices = {}
        self._table = dict(choices)
        return self._table

    def _save(self, key: str, entry: dict) -> None:
        env = self._env()
        try:
            file_env, merged = self._read()  # what another process wrote meanwhile
        except (OSError, ValueError):
            file_env, merged = None, {}
        if file_env != env:
            merged = {}
        merged = {**merged, **self._table, key: entry}
        data = {"version": VERSION, "env": env, "choices": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            warnings.warn(f"could not write the GEMM tuning cache {self.path}: {exc}", stacklevel=3)


_TUNER: GemmTuner | None = None
_RECORDED: dict[str, str] = {}


def default_tuner() -> GemmTuner:
    """The process's tuner over `cache_path()` (made on first use)."""
    global _TUNER
    if _TUNER is None:
        _TUNER = GemmTuner()
    return _TUNER


def record(what: str, choice: str) -> None:
    """Note the implementation choice made for `what` (a layer shape) in this process."""
    _RECORDED[what] = choice


def recorded() -> dict[str, str]:
    """{layer shape: its GEMMs' choice} made in this process, in the order first made."""
    return dict(_RECORDED)


def choices_note() -> str:
    """Markdown lines naming each layer shape's GEMM implementations chosen in this
    process (what `dropless bench layer` prints under its tables)."""
    if not _RECORDED:
        return (
            "Expert GEMMs: no per-GEMM choice in this run (the gathered path is planned on "
            "CUDA only).  \n"
        )
    lines = [f"Expert GEMMs, {what}: {choice}." for what, choice in _RECORDED.items()]
    lines.append(f"GEMM tuning cache: {default_tuner().path}.")
    return "".join(f"{line}  \n" for line in lines)
