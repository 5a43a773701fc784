"""How the routed expert MLP runs, decided once per call: the `MlpPlan`.

`expert_mlp` and `grouped_mlp` ask `plan_expert_mlp` and then only follow the plan; the
fused autograd Functions take it as an input, so the grouped-GEMM backend and the row
ops are picked once per layer, for every GEMM and gather of its forward and backward.

The decisions, in order:

1. a low-precision recipe (`dropless.autocast`) is active: its MLP runs ("recipe"); it
   takes x_TD and gathers rows itself when its MLP says so (`takes_tokens`);
2. else the path: the per-expert loop on CPU ("loop", measured fastest there, see
   docs/performance.md), the grouped path elsewhere and under torch.compile;
3. on the grouped path, one GEMM backend that runs both projections and one row-op
   implementation (and, for the kinds the row ops compute, their activation);
4. whether the counts stay on the device: the backend declares it (`device_counts`) and
   the routing is dropless (a capacity limit makes the kept count data-dependent);
5. on CUDA, automatic backend, outside torch.compile, for experts without biases or
   low-rank updates whose activation the gather kernels compute: the "gathered" path
   (`gathered_mlp.py`), each of its six GEMMs the fused kernel that gathers its rows or
   the unfused form on a grouped-GEMM backend, whichever a one-time tuning measured
   faster at this shape (`gemm_tuning.py`: cached on disk); if no GEMM picks a fused
   kernel, the grouped path as above. path="gathered" forces it (on CPU: every GEMM
   unfused, the same backward schedule).
"""

# T tokens, D model dim, F expert hidden dim, E experts

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..activation.eager import ACTIVATIONS
from ..dispatch import get_recipe, recipe_mlp
from ..grouped_gemm.backends import GemmBackend, gemm_backends, pick_gemm_backend
from ..permute.row_ops import RowOps, pick_row_ops
from ..specs import ActivationConfig
from .expert_threads import python_modes_active
from .gathered_mlp import FUSED, GEMMS, gather_kernels, gathered_gemms, tune_gathered
from .gemm_tuning import default_tuner, record

PATHS = ("loop", "grouped", "recipe", "gathered")  # the values of MlpPlan.path
_FORCED = ("loop", "grouped", "gathered")  # the paths `path=` may force


@dataclass(frozen=True)
class MlpPlan:
    """path: one of PATHS. backend / row_ops: the grouped path's GEMM
    backend and gathers; act_row_ops: the row ops that compute its activation (None: the
    torch math of `activations`). device_counts: the counts stay on the device (no host
    sync).
    recipe / recipe_mlp / takes_tokens: the recipe path's recipe, its fused MLP (None:
    composed from its grouped GEMMs) and whether that MLP gathers rows from x_TD itself.
    gathered: the "gathered" path's six GEMMs (a `gathered_mlp.GatheredGemms`)."""

    path: str
    backend: GemmBackend | None = None
    row_ops: RowOps | None = None
    act_row_ops: RowOps | None = None
    device_counts: bool = False
    recipe: object = None
    recipe_mlp: Callable | None = None
    takes_tokens: bool = False
    gathered: object = None


def pick_mlp_path(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str:
    """Which fused path runs these operands at full precision: "loop" or "grouped".

    auto: the per-expert loop on CPU (measured fastest there, see docs/performance.md),
    the grouped GEMM path elsewhere and under torch.compile. backend="loop" forces the
    loop; a named grouped-GEMM backend ("grouped_mm", "triton", ...) the grouped path.
    """
    if backend == "loop":
        return "loop"
    if backend in (None, "auto") and x.device.type == "cpu" and not torch.compiler.is_compiling():
        return "loop"
    return "grouped"


def check_no_recipe(recipe, lora) -> None:
    """Raise ValueError for low-rank factors under a low-precision recipe."""
    if recipe is not None and lora is not None:
        raise ValueError(
            "low-rank (LoRA) factors run at full precision only, but a low-precision recipe "
            f"({getattr(recipe, 'kind', recipe)!r}) is active: call outside dropless.autocast, "
            "or fold the update into the weights first"
        )


def plan_grouped(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: ActivationConfig,
    backend: str | None,
    *,
    down_lora: bool = False,
    capacity: bool = False,
) -> MlpPlan:
    """The grouped path's plan: one backend for both projections (each weight must be
    supported), the row ops for x's device and, when they compute this activation and
    no down-projection update joins its gradient, their activation."""
    be = pick_gemm_backend(None if backend in (None, "auto", "loop") else backend, x, gate_up, down)
    glu = act.gated and act.kind in ACTIVATIONS and not down_lora
    return MlpPlan(
        "grouped",
        backend=be,
        row_ops=pick_row_ops(x),
        act_row_ops=pick_row_ops(x, activation=act.kind) if glu else None,
        device_counts=be.device_counts and not capacity,
    )


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
    rows: int | None = None,
    trans_w: bool = True,
    bias: bool = False,
) -> MlpPlan:
    """The plan for one call of the expert MLP on x (x_TD or sorted rows x_SD).

    path: force "loop", "grouped" or "gathered" (default: `pick_mlp_path`, and
    "gathered" where tuned faster); lora: the call's (gate_up, down) low-rank updates or
    None; capacity: pairs may be dropped (keep_TK); rows: the sorted rows the GEMMs run
    (default x's rows); trans_w: the weights' layout; bias: the experts have biases.
    """
    recipe = get_recipe()
    check_no_recipe(recipe, lora)
    if recipe is not None:
        fused = recipe_mlp(recipe)
        takes_tokens = fused is not None and getattr(fused, "takes_tokens", False)
        return MlpPlan(
            "recipe",
            recipe=recipe,
            recipe_mlp=fused,
            takes_tokens=takes_tokens,
            # a recipe MLP that takes tokens takes device counts too
            device_counts=takes_tokens and not capacity,
        )
    forced = path
    path = path or pick_mlp_path(x, gate_up, backend)
    if path not in _FORCED:
        raise ValueError(
            f"path={path!r}; expected 'loop', 'grouped' or 'gathered' (or None: automatic)"
        )
    if path == "loop":
        plan = MlpPlan("loop")
    else:
        down_lora = lora is not None and lora[1] is not None
        plan = plan_grouped(x, gate_up, down, act, backend, down_lora=down_lora, capacity=capacity)
        auto = forced is None and backend in (None, "auto") and x.is_cuda
        if path == "gathered" or (auto and lora is None and not bias and act.gated):
            if path == "gathered":
                check_gathered_ok(lora, bias, act)
            rows = x.shape[0] if rows is None else rows
            plan = plan_gathered(x, gate_up, down, act, plan, rows, trans_w, path == "gathered")
            plan = replace(plan, device_counts=plan.device_counts and not capacity)
    return plan


def check_gathered_ok(lora, bias: bool, act: ActivationConfig) -> None:
    """Raise ValueError when path="gathered" is forced for experts it does not run."""
    if lora is not None or bias or not act.gated:
        raise ValueError(
            "path='gathered' runs gated experts without biases and without low-rank (LoRA) "
            "updates; use path='grouped' (or None: automatic) for these experts"
        )


def _tuning_backends(x, gate_up, down, plan: MlpPlan) -> dict[str, GemmBackend]:
    """The plan's backend, and on CUDA every other one that takes device counts and runs
    these operands: the unfused candidates of the tuning."""
    backends = {plan.backend.name: plan.backend}
    if x.is_cuda:
        for name in gemm_backends():
            try:
                be = pick_gemm_backend(name, x, gate_up, down)
            except ValueError:
                continue
            if be.device_counts:
                backends.setdefault(name, be)
    return backends


def plan_gathered(x, gate_up, down, act, grouped: MlpPlan, rows: int, trans_w: bool,
                  forced: bool) -> MlpPlan:  # fmt: skip
    """The "gathered" plan (forced), or, automatically, the grouped plan unless the tuning
    picks a fused kernel for some GEMM. Times only on CUDA, outside torch.compile and
    Python modes (there: the cached picks; the grouped path's backend where none)."""
    kernels = gather_kernels(x, act, gate_up, down)
    if kernels is None and not forced:
        return grouped
    backends = _tuning_backends(x, gate_up, down, grouped)
    choice = dict.fromkeys(GEMMS)
    if x.is_cuda and rows > 0:
        # no timing while compiling or under a Python mode (fake tensors, FLOP or memory
        # counters): the cached picks only
        timing = not torch.compiler.is_compiling() and not python_modes_active()
        choice = tune_gathered(x, gate_up, down, act, trans_w, rows, kernels, backends,
                               grouped.row_ops, grouped.act_row_ops, default_tuner(), timing)  # fmt: skip
    # untuned GEMMs run on the grouped path's backend
    choice = {g: impl or grouped.backend.name for g, impl in choice.items()}
    gemms = gathered_gemms(choice, kernels, backends, grouped.row_ops, grouped.act_row_ops)
    E, dims = gate_up.shape[0], f"{tuple(gate_up.shape)}, {tuple(down.shape)}"
    record(
        f"{str(x.dtype).removeprefix('torch.')} E={E} rows={rows} weights {dims}", gemms.describe()
    )
    if not forced and FUSED not in choice.values():
        return grouped
    return replace(grouped, path="gathered", gathered=gemms, device_counts=gemms.device_counts)
