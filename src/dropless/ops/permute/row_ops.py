"""Registry of the memory-bound row ops of the expert path: gathers and activations.

A `RowOps` bundles the raw (non-autograd) functions that the autograd Functions of
`eager.py` (permute, combine), `activation/swiglu.py` and
`expert_mlp/engine.py` call; those Functions exist once and take
their implementation from here. "eager" (torch ops: the specification, fp32 sums and
activation math) is always registered; `gpu.py` registers "triton" (CUDA tensors only)
on the first pick for a CUDA tensor. Picking never chooses an
implementation that cannot run the tensor; naming one that cannot raises.
"""

# T tokens, S sorted pairs, N features, K top-k, F expert hidden dim

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..activation.eager import ACTIVATIONS, act_bwd_eager, act_fwd_eager
from ..registry import Registry
from .eager_rows import gather_rows_eager, gather_sum, pair_dot_eager, zero_groups_eager

__all__ = [
    "EAGER",
    "RowOps",
    "pick_row_ops",
    "register_row_ops",
    "registered_row_ops",
    "row_ops_names",
    "zero_groups_eager",
]


@dataclass(frozen=True)
class RowOps:
    """One implementation of the row ops (all raw: no autograd).

    gather_rows(x_TD, index_S, scale=None, scale_index_S=None) -> x_SD (x's dtype):
        out[s] = x[index[s]] * scale[scale_index[s]];
    gather_sum(rows_SN, slot_TK, weights_TK=None) -> out_TN: out[t] = sum_k w[t,k] *
        rows[slot[t,k]] summed in fp32 in k order, slots >= S read as zero;
    pair_dot(g_TN, y_SN, slot_TK) -> fp32 [T, K]: <g[t], y[slot[t,k]]> (0 when dropped);
    act_fwd / act_bwd: as `activation/eager.py`'s `act_fwd_eager` / `act_bwd_eager`, for
    the kinds in `activations`; supports(t): whether it runs on tensor t;
    zero_groups(out_EMN, empty_E) -> out: out[e] = 0 where empty_E[e], in place (the
    blocks of a grouped weight gradient whose group had no rows).
    """

    name: str
    gather_rows: Callable
    gather_sum: Callable
    pair_dot: Callable
    act_fwd: Callable
    act_bwd: Callable
    activations: tuple[str, ...]
    supports: Callable[[torch.Tensor], bool]
    priority: int = 0
    zero_groups: Callable = zero_groups_eager


ROW_OPS = Registry("row ops")
_ROW_OPS: dict[str, RowOps] = ROW_OPS.entries


def register_row_ops(impl: RowOps) -> None:
    """Register (or replace) a row-op implementation under its name."""
    ROW_OPS.register(impl)


def row_ops_names() -> list[str]:
    """Registered row-op implementations, best first."""
    return ROW_OPS.names()


def pick_row_ops(t: torch.Tensor, name: str | None = None, activation: str | None = None):
    """The implementation for tensor t: `name` if given (error if it cannot run t),
    else the best registered one that runs t (and `activation`, when given)."""

    def runs(impl: RowOps) -> bool:
        return impl.supports(t) and (activation is None or activation in impl.activations)

    what = f" ({activation})" if activation is not None else ""
    return ROW_OPS.pick(name, t, runs=runs, detail=what) or EAGER


def registered_row_ops(name: str) -> RowOps:
    """The entry `name`, the GPU entries registered first if they were not: what the
    autograd wrappers of the kernel modules run, whatever the tensor's device."""
    ROW_OPS.load_gpu()
    return ROW_OPS.entries[name]


EAGER = RowOps(
    "eager",
    gather_rows_eager,
    gather_sum,
    pair_dot_eager,
    act_fwd_eager,
    act_bwd_eager,
    ACTIVATIONS,
    supports=lambda t: True,
    priority=0,
)
register_row_ops(EAGER)
