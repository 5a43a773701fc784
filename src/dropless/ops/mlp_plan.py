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
5. under torch.compile a path that needs host counts runs eagerly (one graph break
   around sort + MLP) instead of a graph specialised on every routing.
"""

# T tokens, D model dim, F expert hidden dim, E experts

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .activations import ACTIVATIONS
from .dispatch import GemmBackend, get_recipe, pick_gemm_backend, recipe_mlp
from .row_ops import RowOps, pick_row_ops
from .specs import ActivationConfig

PATHS = ("loop", "grouped", "recipe")  # the values of MlpPlan.path


@dataclass(frozen=True)
class MlpPlan:
    """path: "loop", "grouped" or "recipe". backend / row_ops: the grouped path's GEMM
    backend and gathers; act_row_ops: the row ops that compute its activation (None: the
    torch math of `activations`). device_counts: the counts stay on the device (no host
    sync). eager: run outside the compiled graph (host counts under torch.compile).
    recipe / recipe_mlp / takes_tokens: the recipe path's recipe, its fused MLP (None:
    composed from its grouped GEMMs) and whether that MLP gathers rows from x_TD itself."""

    path: str
    backend: GemmBackend | None = None
    row_ops: RowOps | None = None
    act_row_ops: RowOps | None = None
    device_counts: bool = False
    eager: bool = False
    recipe: object = None
    recipe_mlp: Callable | None = None
    takes_tokens: bool = False


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
) -> MlpPlan:
    """The plan for one call of the expert MLP on x (x_TD or sorted rows x_SD).

    path: force "loop" or "grouped" (default: `pick_mlp_path`); lora: the call's
    (gate_up, down) low-rank updates or None; capacity: pairs may be dropped (keep_TK).
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
    path = path or pick_mlp_path(x, gate_up, backend)
    if path not in PATHS[:2]:
        raise ValueError(f"path={path!r}; expected 'loop' or 'grouped' (or None: automatic)")
    if path == "loop":
        plan = MlpPlan("loop")
    else:
        down_lora = lora is not None and lora[1] is not None
        plan = plan_grouped(x, gate_up, down, act, backend, down_lora=down_lora, capacity=capacity)
    if torch.compiler.is_compiling() and not plan.device_counts:
        return MlpPlan(plan.path, plan.backend, plan.row_ops, plan.act_row_ops, eager=True)
    return plan
