"""The experts forward the planner traces in place of the real one.

The dropless expert path cannot run on fake tensors: it counts tokens per expert
(`bincount`, a data-dependent size), reads the counts on the host to split the grouped
GEMM, and under expert parallelism exchanges those counts before an all-to-all whose
split sizes depend on the routing. So the planner swaps each experts module's forward
(on its own traced copy of the model, never on a training model) for one autograd
Function that allocates what the real fused path declares, at the sizes the routing
fixes:

- forward keeps for backward h [R, 2F] in the compute dtype (the only activation the
  fused MLP saves, `ops/fused_mlp.py`), prob_S [R] and the sort indices token_S [R],
  slot_TK [T, K] (int64); with expert parallelism also the received rows [R, D] (the
  fused MLP's input there, with its routing weights [R]), the all-to-all send buffer
  [S, D] while it is in flight, the unweighted combine's token indices [S] (int64;
  the routing weight is fused into the experts' activation, as on one process) and,
  where received rows are reordered, the permutation and its inverse [R] (int64);
- backward allocates what the fused backward holds, in its order: under expert
  parallelism first the combine's backward (the pairs' output gradient [S, D], then the
  rows received back [R, D] and their local-order copy [R, D]); the gathered output
  gradient [R, D], d(activation) and the recomputed activation [R, F], dh [R, 2F], the
  recomputed x_SD [R, D], dx_SD [R, D], the weights' gradients at the unsharded weights'
  shape and dtype; under expert parallelism dx_SD's local-order copy [R, D] and the
  pairs' input gradient received back [S, D]; and dx [T, D].

S = T x K pairs of this rank's tokens; R = the rows this rank's experts compute: S on one
process (every expert is local, whatever the routing), ceil(S x skew) under expert
parallelism, where `skew` is the busiest rank's load over the mean.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S pairs, R rows computed

from __future__ import annotations

import math
import types

import torch
from torch import nn


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class _DeclaredExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w1, w2, weights_TK, rows: int, ep: int):
        T, K = weights_TK.shape
        S = T * K
        h = x_TD.new_empty(rows, w1.shape[1] if w1.shape[1] != x_TD.shape[1] else w1.shape[2])
        kept = [h, weights_TK.new_empty(rows), x_TD.new_empty(rows, dtype=torch.long)]
        kept.append(x_TD.new_empty(T, K, dtype=torch.long))
        if ep > 1:
            D = x_TD.shape[1]
            send = x_TD.new_empty(S, D)  # in flight during the dispatch
            kept.append(x_TD.new_empty(rows, D))  # received rows, saved
            del send
            kept.append(x_TD.new_empty(S, dtype=torch.long))  # token_S of the combine
        # rows arrive in (source, expert) blocks: reordered by copies when both exceed 1
        ctx.ep, ctx.reorder = ep > 1, ep > 1 and w1.shape[0] > 1
        if ctx.reorder:  # the reorder's permutation and its inverse [R] (int64), saved
            kept += [x_TD.new_empty(rows, dtype=torch.long) for _ in range(2)]
        ctx.save_for_backward(*kept)
        ctx.shapes = (w1.shape, w1.dtype, w2.shape, w2.dtype, rows, x_TD.shape[1])
        return x_TD.new_empty(x_TD.shape)

    @staticmethod
    def backward(ctx, g_TD):
        # the live set of `GroupedMLP.backward`, in its order
        saved = ctx.saved_tensors  # once: under activation checkpointing a second read raises
        h = saved[0]
        s1, d1, s2, d2, rows, D = ctx.shapes
        F = h.shape[1] // 2
        S = saved[3].numel()
        if ctx.ep:  # the combine's backward: pairs' grad out, received back, local order
            g_SD = h.new_empty(S, D)
            g_RD = h.new_empty(rows, D)
            del g_SD
            if ctx.reorder:
                g_local = h.new_empty(rows, D)
                del g_RD
        gy, da = h.new_empty(rows, D), h.new_empty(rows, F)  # gathered grad, d(act out)
        dh, a = torch.empty_like(h), h.new_empty(rows, F)  # d h, the recomputed activation
        del da
        g2, gp = h.new_empty(s2, dtype=d2), h.new_empty(rows)
        del a, gy
        x_SD = h.new_empty(rows, D)  # recomputed gather for the gate/up weight gradient
        g1 = h.new_empty(s1, dtype=d1)
        del x_SD
        dx_SD = h.new_empty(rows, D)
        if ctx.ep:  # the dispatch's backward: local-order copy, pairs' grad received back
            if ctx.reorder:
                del g_local
                dx_local = h.new_empty(rows, D)
                del dx_SD
                dx_SD = h.new_empty(S, D)
                del dx_local
            else:
                del g_RD, dx_SD
                dx_SD = h.new_empty(S, D)
            # the routing weights' gradient on its way home: reordered, received, scattered
            gp_S = [gp.new_empty(rows), gp.new_empty(S), gp.new_empty(S)]
        dx = g_TD.new_empty(g_TD.shape)
        del dx_SD, dh, gp
        if ctx.ep:
            del gp_S
        return dx, g1, g2, None, None, None


def rows_computed(pairs: int, ep: int, skew: float) -> int:
    """The rows the busiest rank's experts compute: all pairs on one rank, else the
    mean (pairs, as many arrive as leave) times the skew."""
    return pairs if ep == 1 else math.ceil(pairs * skew)


def _weight(module: nn.Module, name: str) -> torch.Tensor:
    # the raw parameter: reading one PEFT parametrizes would run its LoRA fold
    from ...hf.lora.peft_lora import raw_weight

    w = raw_weight(module, name)
    return _local(w if w is not None else getattr(module, name))


def declare_experts(model: nn.Module, ep: int, skew: float) -> int:
    """Swap every MoE layer's experts forward for `_DeclaredExperts`; returns how many."""
    from ...hf.layers import moe_layers

    def forward(self, hidden_states, top_k_index, top_k_weights):
        first = "gate_up_proj" if getattr(self, "has_gate", True) else "up_proj"
        w1, w2 = _weight(self, first), _weight(self, "down_proj")
        rows = rows_computed(top_k_index.numel(), ep, skew)
        x = hidden_states.to(w1.dtype)
        out = _DeclaredExperts.apply(x, w1, w2, top_k_weights, rows, ep)
        return out.to(hidden_states.dtype)

    layers = moe_layers(model)
    for layer in layers:
        layer.experts.forward = types.MethodType(forward, layer.experts)
    return len(layers)
