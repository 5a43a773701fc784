"""The registry of routing implementations besides the torch reference (`registry.Registry`):
`gpu.py` registers "triton" (`routing_kernels.py`) on the first pick for a CUDA tensor.
`eager.py` and the custom op (`custom_op.py`) pick from it; the picked entry's counting
sort runs once per plan of the expert MLP (`Schedule.sort`) or per call of
`permute.sort_by_expert`."""

# T tokens, E experts, K top-k

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry

ROUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class RoutingKernels:
    """A routing implementation besides the torch reference.

    route(logits_TE, top_k, routing, expert_bias_E, *, ids_TK=None) -> (weights_TK, ids_TK,
    scores_TE) with autograd, as `route_reference` (ties may go to the lowest expert index:
    torch.topk leaves them unspecified); with ids_TK, the weights and scores of those
    experts, no selection (the recompute of a checkpointed forward);
    sort_by_expert(ids_TK, num_experts, keep_TK, *, host_counts) -> `permute.SortedPairs`
    in the order of `permute.sort_by_expert`; supports(t): whether it runs tensor t;
    max_experts: the widest router it takes (one tile of experts per token);
    route_with_aux: as `route_with_aux` of `eager.py` (same ids_TK keyword), the losses'
    inputs from the routing pass; route_fwd / route_bwd: the raw passes (no autograd) of
    `routing_kernels.route_fwd` / `route_bwd`, which the custom op (`custom_op.py`) runs.
    """

    name: str
    route: Callable
    sort_by_expert: Callable
    supports: Callable[[torch.Tensor], bool]
    priority: int = 0
    max_experts: int = 4096
    route_with_aux: Callable | None = None
    route_fwd: Callable | None = None
    route_bwd: Callable | None = None


ROUTING = Registry("routing backend")


def register_routing_kernels(kernels: RoutingKernels) -> None:
    """Register (or replace) a routing implementation under its name."""
    ROUTING.register(kernels)


def routing_kernel_names() -> list[str]:
    """The routing implementations, best first: "reference" and the registered ones."""
    return ["reference", *ROUTING.names()]


def pick_routing_kernels(t: torch.Tensor, name: str | None = None) -> RoutingKernels | None:
    """The routing implementation for tensor t (None: the torch reference).

    name None / "auto": the best registered one that runs t, none under torch.compile
    (the torch ops compile). "reference": None. Another name must be registered and run t,
    else ValueError."""
    if name == "reference":
        return None
    if name in (None, "auto") and torch.compiler.is_compiling():
        return None
    return ROUTING.pick(name, t)


def route_kernels(logits_TE: torch.Tensor, backend: str | None) -> RoutingKernels | None:
    """The routing implementation that runs these logits (None: the torch reference); a
    named backend that cannot take them raises ValueError."""
    kernels = pick_routing_kernels(logits_TE, backend)
    fits = kernels is not None and logits_TE.dtype in ROUTE_DTYPES
    fits = fits and logits_TE.shape[1] <= kernels.max_experts
    if backend in (None, "auto"):
        return kernels if fits else None
    if kernels is not None and not fits:
        raise ValueError(
            f"routing backend {backend!r} takes {[str(d) for d in ROUTE_DTYPES]} logits of "
            f"at most {kernels.max_experts} experts, got {logits_TE.dtype} with "
            f"{logits_TE.shape[1]}; use backend='reference'"
        )
    return kernels
