"""What one call of the routed expert MLP runs (`Schedule`), decided once per layer shape
and kept (`plan_expert_mlp`).

A low-precision recipe (`dropless.autocast`) runs its GEMMs; else `expert_path`: "auto"
is the loop on CPU and the grouped path elsewhere and under torch.compile; "gathered"
(opt-in, not yet run on a GPU) fuses the gathers of the GEMMs a tuning measured faster
fused. The tuning (`GemmTuner`) is keyed on the layer's shape (never on the rows one
rank received), reads the cache `dropless bench tune` writes, and times only where
asked: a cached pick allocates nothing.
"""

# T tokens, D model dim, F expert hidden dim, N gate/up width, E experts, S sorted pairs

from __future__ import annotations

import contextlib
import json
import logging
import os
import statistics
import tempfile
import warnings
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import metadata
from pathlib import Path

import torch

from ..activation.eager import ACTIVATIONS
from ..dispatch import get_recipe, recipe_mlp
from ..grouped_gemm.backends import GEMM_BACKENDS, GemmBackend, pick_gemm_backend
from ..grouped_gemm.gpu import supports_triton_gemm
from ..permute.eager import sort_by_expert, torch_sort_by_expert
from ..permute.row_ops import ROW_OPS, RowOps, pick_row_ops
from ..registry import Registry, lazy
from ..routing.backends import ROUTING, pick_routing_kernels
from ..specs import KERNEL_KINDS, ActivationConfig
from .threads import python_modes_active

_LOG = logging.getLogger("dropless")
GEMMS = ("up", "down", "down_dgrad", "down_wgrad", "up_wgrad", "up_dgrad")
FUSABLE = ("up", "down_dgrad", "down_wgrad", "up_wgrad")  # the ones a gather kernel runs
FUSED = "gathered"  # the name of the row-gathering kernels in a tuning choice
EXPERT_PATHS = ("auto", "loop", "grouped", "gathered")


@dataclass(frozen=True)
class GatherKernels:
    """Kernels that gather their rows (`gather_gemm_kernels.py`); supports(x, w): whether
    they run these operands; kinds: the activation kinds their epilogues compute."""

    up_act: Callable
    down_dact: Callable
    wgrad: Callable
    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    kinds: tuple[str, ...]
    name: str = "triton"
    priority: int = 10


GATHER_KERNELS = Registry("row-gathering GEMMs")


def triton_gather_kernels() -> GatherKernels:
    """The Triton row-gathering GEMMs (no triton import until their first call)."""
    mod = "dropless.ops.expert_mlp.gather_gemm_kernels"
    up, down, wgrad = (lazy(mod, f) for f in ("up_act", "down_dact", "gathered_wgrad"))
    return GatherKernels(up, down, wgrad, supports=supports_triton_gemm, kinds=KERNEL_KINDS)


def register_gpu() -> None:
    GATHER_KERNELS.register(triton_gather_kernels())


GATHER_KERNELS.on_first_cuda(register_gpu)


@dataclass(frozen=True)
class Schedule:
    """path: "loop", "grouped" or "recipe". gemms: per GEMM of `GEMMS`, its backend, or
    None where `kernels` run it fused. device_counts: the counts stay on the device.
    recipe / recipe_mlp / takes_tokens: the recipe, its MLP (the plan's: its
    `grouped_mlp` or None, composed; the engine's: its slot class, `RecipeSlot`) and whether it
    takes x_TD. sort: the `sort_by_expert` for the call's device."""

    path: str
    gemms: tuple[GemmBackend | None, ...] = ()
    kernels: GatherKernels | None = None
    row_ops: RowOps | None = None
    act_row_ops: RowOps | None = None
    device_counts: bool = False
    recipe: object = None
    recipe_mlp: Callable | None = None
    takes_tokens: bool = False
    sort: Callable = sort_by_expert

    @property
    def backend(self) -> GemmBackend | None:
        """The backend of the first unfused GEMM (the down projection's always is)."""
        return self.gemms[1] if self.gemms else None

    def gemm(self, name: str) -> GemmBackend | None:
        return self.gemms[GEMMS.index(name)]

    @property
    def offsets(self) -> bool:
        """Whether some GEMM's backend reads the groups' end offsets."""
        return any(b is not None and b.offsets for b in self.gemms)

    def describe(self) -> str:
        return " ".join(f"{g}={FUSED if b is None else b.name}" for g, b in zip(GEMMS, self.gemms))


# --- the plan ---------------------------------------------------------------------------

_EXPERT_PATH = ["auto"]
_PLANS: dict = {}


def set_expert_path(path: str) -> None:
    """The expert path of every later call: one of `EXPERT_PATHS` ("auto" by default)."""
    if path not in EXPERT_PATHS:
        raise ValueError(f"expert_path={path!r}; expected one of {EXPERT_PATHS}")
    _EXPERT_PATH[0] = path
    _PLANS.clear()


def expert_path() -> str:
    return _EXPERT_PATH[0]


def plan_expert_mlp(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: ActivationConfig,
    *,
    backend: str | None = None,
    path: str | None = None,
    lora=None,
    capacity: bool = False,
    tokens: int | None = None,
    trans_w: bool = True,
    bias: bool = False,
    tuner: GemmTuner | None = None,
) -> Schedule:
    """The schedule of one call on x (x_TD or sorted rows x_SD), kept per layer shape.

    path: default `expert_path()`; backend: a grouped-GEMM backend name ("loop" forces
    the loop path); lora: the call's (gate_up, down) low-rank updates or None; capacity:
    pairs may be dropped; tokens: the T*K pairs before any dispatch (None: cached picks
    only, the same on every expert-parallel rank); tuner: the gathered path's
    `GemmTuner` (default: the cache file's, timing on CUDA)."""
    if lora is not None and (not isinstance(lora, (tuple, list)) or len(lora) != 2):
        raise TypeError(
            "lora must be a pair (gate_up update, down update), each a LowRank or None; "
            f"got {type(lora).__name__}"
        )
    recipe = get_recipe()
    if recipe is not None and lora is not None:
        raise ValueError(
            "low-rank (LoRA) factors run at full precision only, but a low-precision recipe "
            f"({getattr(recipe, 'kind', recipe)!r}) is active: call outside dropless.autocast, "
            "or fold the update into the weights first"
        )
    if recipe is not None:
        fused = recipe_mlp(recipe)
        takes = fused is not None and getattr(fused, "takes_tokens", False)
        kw = dict(recipe=recipe, recipe_mlp=fused, takes_tokens=takes)
        return Schedule("recipe", device_counts=takes and not capacity, **kw)
    path = path or expert_path()
    if path not in EXPERT_PATHS:
        raise ValueError(f"path={path!r}; expected one of {EXPERT_PATHS} (or None)")
    lora_key = None if lora is None else tuple(lr is not None for lr in lora)
    tokens = tokens if path == "gathered" else None  # only its tuning reads them
    req = _Request(path, backend, lora_key, capacity, tokens, trans_w, bias, act)
    # type(x): a fake tensor's plan (`dropless plan`) picks no kernel that reads data
    key = (req, torch.compiler.is_compiling(), type(x), x.device, x.dtype, x.shape[1:])
    key += (x.stride()[1:],)
    key += (_shape(gate_up), _shape(down), _registered(), id(tuner))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) > 256:
            _PLANS.clear()
        plan = _PLANS[key] = _plan(x, gate_up, down, req, tuner, key[1])
    return plan


# what a call asks of the plan (part of its cache key); lora: which projections have
# low-rank factors (None: none)
_Request = namedtuple("_Request", "path backend lora capacity tokens trans_w bias act")


def _shape(w):
    return (w.dtype, w.device, tuple(w.shape), w.stride())


def _registered() -> tuple:
    # a registration (first CUDA pick, a test's backend) makes a new plan
    return tuple(
        id(e) for r in (GEMM_BACKENDS, ROW_OPS, GATHER_KERNELS, ROUTING) for e in r.entries.values()
    )


def _plan(x, gate_up, down, req: _Request, tuner, compiling: bool) -> Schedule:
    backend, path, act = req.backend, req.path, req.act
    cpu_auto = backend in (None, "auto") and x.device.type == "cpu" and not compiling
    routing = pick_routing_kernels(x)  # the sort that runs x's device, called directly
    sort = torch_sort_by_expert if routing is None else routing.sort_by_expert
    if backend == "loop" or path == "loop" or (path == "auto" and cpu_auto):
        return Schedule("loop", sort=sort)
    down_lora = req.lora is not None and req.lora[1]
    be = pick_gemm_backend(None if backend in (None, "auto") else backend, x, gate_up, down)
    glu = act.gated and act.kind in ACTIVATIONS and not down_lora
    grouped = Schedule(
        "grouped",
        gemms=(be,) * len(GEMMS),
        row_ops=pick_row_ops(x),
        act_row_ops=pick_row_ops(x, activation=act.kind) if glu else None,
        device_counts=be.device_counts and not req.capacity,
        sort=sort,
    )
    if path != "gathered":
        return grouped
    if req.lora is not None or req.bias or not act.gated:
        raise ValueError(
            "path='gathered' runs gated experts without biases and without low-rank (LoRA) "
            "updates; use path='grouped' (or None: automatic) for these experts"
        )

    def runs(k: GatherKernels) -> bool:
        return act.kind in k.kinds and all(k.supports(x, w) for w in (gate_up, down))

    kernels = GATHER_KERNELS.pick(None, x, gate_up, down, runs=runs)
    if kernels is None:
        return grouped
    # no timing while compiling, under a Python mode (fake tensors, FLOP counters) or for
    # the rows form (expert parallelism: the cached picks, the same on every rank)
    timing = req.tokens is not None and not compiling and not python_modes_active()
    if tuner is None:
        tuner, timing = default_tuner(), timing and x.is_cuda
    args = (x, gate_up, down, act, req.trans_w, req.tokens, kernels, grouped, tuner, timing)
    choice = tune_gathered(*args)
    gemms = tuple(None if choice.get(g) == FUSED else grouped.gemm(g) for g in GEMMS)
    plan = replace(grouped, gemms=gemms, kernels=kernels)
    what = f"E={gate_up.shape[0]} weights {tuple(gate_up.shape)}, {tuple(down.shape)}"
    _RECORDED[f"{str(x.dtype).removeprefix('torch.')} {what}"] = plan.describe()  # choices_note
    return plan


# --- the gathered path's tuning ---------------------------------------------------------


def _dims(down, trans_w):
    return (down.shape[1], down.shape[2]) if trans_w else (down.shape[2], down.shape[1])


def _stand_ins(x, gate_up, down, rows: int, trans_w: bool):
    """Operands at the layer's shape: balanced counts, random tokens and probs."""
    E, dev = gate_up.shape[0], x.device
    D, F = _dims(down, trans_w)
    counts = torch.full((E,), rows // E, device=dev, dtype=torch.int64)
    counts[: rows % E] += 1
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=x.dtype, generator=gen)

    idx = torch.randint(0, x.shape[0], (rows,), device=dev, generator=gen)
    return counts, idx, rand(rows).abs(), rand(*x.shape), rand(rows, 2 * F), rand(rows, F)


def _candidates(g: str, kernels: GatherKernels, be: GemmBackend, ops: RowOps, args):
    """{implementation: no-argument callable} for fusable GEMM g: fused and unfused."""
    cnt, idx, p, gx, h, a, x, gate_up, down, act, trans_w = args
    rk, ak = ops.row_ops, ops.act_row_ops or ops.row_ops
    kw = (act.interleaved, act.kind, act.alpha, act.limit)
    gy = (lambda: rk.gather_rows(gx, idx)) if g in ("down_dgrad", "down_wgrad") else None
    unfused = {
        "up": lambda: ak.act_fwd(be.mm(rk.gather_rows(x, idx), gate_up, cnt, trans_w), p, *kw),
        "down_dgrad": lambda: ak.act_bwd(
            be.mm(gy(), down, cnt, not trans_w), h, p, act.interleaved, True, True, *kw[1:]
        ),
        "down_wgrad": lambda: be.wgrad(gy(), a, cnt),
        "up_wgrad": lambda: be.wgrad(h, rk.gather_rows(x, idx), cnt),
    }
    fused = {
        "up": lambda: kernels.up_act(x, idx, gate_up, cnt, p, trans_w, *kw),
        "down_dgrad": lambda: kernels.down_dact(
            gx, idx, down, cnt, h, p, trans_w, act.interleaved, True, True, *kw[1:]
        ),
        "down_wgrad": lambda: kernels.wgrad(gx, a, cnt, idx, None),
        "up_wgrad": lambda: kernels.wgrad(h, x, cnt, None, idx),
    }
    return {be.name: unfused[g], FUSED: fused[g]}


@torch.no_grad()
def tune_gathered(
    x, gate_up, down, act, trans_w, tokens, kernels, grouped: Schedule, tuner, timing: bool = True
) -> dict[str, str | None]:
    """{GEMM: implementation} for the fusable GEMMs: the tuner's cached pick or, with
    `timing` and `tokens`, the faster of fused and unfused on stand-ins of `tokens` rows
    (made only when something is timed); None where neither."""
    D, F = _dims(down, trans_w)
    E, names = gate_up.shape[0], (FUSED, grouped.backend.name)
    keys = {g: shape_key(g, x.dtype, E, D, F, trans_w, act.kind) for g in FUSABLE}
    choice = {g: tuner.lookup(k, names) for g, k in keys.items()}
    missing = [g for g, c in choice.items() if c is None]
    if not (timing and missing and tokens):
        return choice
    args = (*_stand_ins(x, gate_up, down, tokens, trans_w), x, gate_up, down, act, trans_w)
    for g in missing:
        choice[g] = tuner.choose(keys[g], _candidates(g, kernels, grouped.backend, grouped, args))
    return choice


VERSION = 1  # of the tuning file's format


def cache_path() -> Path:
    """The tuning cache: `$XDG_CACHE_HOME/dropless/tuning.json` (or ~/.cache/...)."""
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


def shape_key(
    gemm: str, dtype: torch.dtype, E: int, D: int, F: int, trans_w: bool, kind: str
) -> str:
    """The cache key of one GEMM: the layer's shape only (no device, no row count: every
    rank makes the same choice)."""
    layout = "nt" if trans_w else "nn"
    return f"{gemm}|{str(dtype).removeprefix('torch.')}|E{E}|D{D}|F{F}|{layout}|{kind}"


def cuda_timer(fn: Callable[[], object], reps: int = 10) -> float:
    """Median seconds of fn() on the current CUDA stream, after one warm-up call."""
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
    """Per-key choice among candidates, cached in a JSON file {version, env, choices}
    (discarded when made in another `env()`; written atomically, merged with what another
    process wrote). timer(fn) -> seconds (default `cuda_timer`)."""

    def __init__(self, path=None, timer=None, env=None):
        self.path = Path(path) if path is not None else cache_path()
        self.timer = timer or cuda_timer
        self._env = env or environment
        self._table: dict | None = None

    def choose(self, key: str, candidates: dict[str, Callable[[], object]]) -> str:
        """The fastest of `candidates` for `key`: from the cache, else timed and stored."""
        if not candidates:
            raise ValueError(f"no candidates to choose from for {key!r}")
        hit = self.lookup(key, candidates)
        if hit is not None:
            return hit
        if len(candidates) == 1:
            return next(iter(candidates))
        seconds = {name: float(self.timer(fn)) for name, fn in candidates.items()}
        pick = min(seconds, key=seconds.get)
        entry = {"pick": pick, "ms": {n: round(s * 1e3, 4) for n, s in seconds.items()}}
        self._load()[key] = entry
        _LOG.info("tuned %s: %s (ms %s)", key, pick, entry["ms"])
        self._save(key, entry)
        return pick

    def lookup(self, key: str, names) -> str | None:
        """The cached pick for `key` if it is among `names`, else None (never times)."""
        hit = self._load().get(key)
        return hit["pick"] if isinstance(hit, dict) and hit.get("pick") in names else None

    def _read(self) -> tuple[dict | None, dict]:
        if not self.path.exists():
            return None, {}
        data = json.loads(self.path.read_text())
        ok = isinstance(data, dict) and data.get("version") == VERSION
        if not (ok and isinstance(data.get("choices"), dict) and isinstance(data.get("env"), dict)):
            raise ValueError(f"not a version-{VERSION} tuning cache with 'env' and 'choices'")
        return data["env"], data["choices"]

    def _load(self) -> dict:
        if self._table is not None:
            return self._table
        try:
            file_env, choices = self._read()
        except (OSError, ValueError) as exc:  # JSONDecodeError is a ValueError
            msg = f"the GEMM tuning cache {self.path} is unreadable ({exc}); retuning"
            warnings.warn(msg, stacklevel=3)
            file_env, choices = None, {}
        if file_env is not None and file_env != self._env():
            _LOG.info("tuning cache %s was made for %s: retuning", self.path, file_env)
            choices = {}
        self._table = dict(choices)
        return self._table

    def _save(self, key: str, entry: dict) -> None:
        env = self._env()
        try:
            file_env, merged = self._read()  # what another process wrote meanwhile
        except (OSError, ValueError):
            file_env, merged = None, {}
        merged = {**(merged if file_env == env else {}), **self._table, key: entry}
        data = {"version": VERSION, "env": env, "choices": merged}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, self.path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        except OSError as exc:
            warnings.warn(f"could not write the GEMM tuning cache {self.path}: {exc}", stacklevel=3)


_TUNER: list[GemmTuner] = []
_RECORDED: dict[str, str] = {}


def default_tuner() -> GemmTuner:
    """The process's tuner over `cache_path()` (made on first use)."""
    if not _TUNER:
        _TUNER.append(GemmTuner())
    return _TUNER[0]


def choices_note() -> str:
    """Markdown lines naming each layer shape's planned GEMMs (`dropless bench layer`)."""
    if not _RECORDED:
        return "Expert GEMMs: no gathered plan in this run (expert_path='gathered' is opt-in).  \n"
    lines = [f"Expert GEMMs, {what}: {choice}." for what, choice in _RECORDED.items()]
    lines.append(f"GEMM tuning cache: {default_tuner().path}.")
    return "".join(f"{line}  \n" for line in lines)
