"""The experts forward the planner traces in place of the real one (docs/plan.md, *How
the memory is found*): the dropless expert path cannot run on fake tensors (a
data-dependent count per expert, read on the host, exchanged before an all-to-all with
data-dependent splits), so the planner's own traced copy of the model runs one autograd
Function that allocates, at the sizes the routing fixes, what the expert MLP declares it
keeps for backward (`saved_for_backward` of `ops/expert_mlp/eager.py` or `quant/mlp.py`),
the expert-parallel buffers (`EP` below, the one part stated here) and, in backward, the
fused backward's live set in its order.

S = T x K pairs of this rank's tokens; R = the rows this rank's experts compute: S on one
process (every expert is local, whatever the routing), ceil(S x skew) under expert
parallelism, where `skew` is the busiest rank's load over the mean.
"""

# T tokens, D model dim, F expert hidden dim, N gate/up width, E experts, K top-k,
# S pairs, R rows computed

from __future__ import annotations

import math
import types

import torch
from torch import nn

from ...ops.compute_dtype import expert_input
from ...ops.dispatch import get_recipe


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def declared_saved(x_TD, ids_TK, w1, rows: int) -> tuple[torch.Tensor, ...]:
    """What the expert MLP of this call keeps for backward, as its op declares it: the
    recipe's MLP under a recipe (`dropless.quant.mlp`), else the routed expert MLP's fake
    rule (`dropless.ops.expert_mlp.eager`). Weights [E, N, D] (trans_w) or [E, D, N]."""
    trans_w = w1.shape[1] != x_TD.shape[1]
    recipe = get_recipe()
    if recipe is not None:
        from ...quant.mlp import saved_for_backward

        return saved_for_backward(recipe, x_TD, ids_TK, w1, trans_w, rows)
    from ...ops.expert_mlp.eager import saved_for_backward

    return saved_for_backward(x_TD, ids_TK, w1, trans_w, rows)


def received_rows_saved(x_TD, ids_TK, w1, recv_RD) -> list[torch.Tensor]:
    """What the MLP keeps of the rows recv_RD an expert-parallel rank received: under a
    recipe what the recipe's MLP on rows declares (`dropless.quant.mlp.
    saved_for_backward_rows`: with fp8_saved_activations the rows in E4M3, the received
    rows themselves then freed after forward), else the routed MLP's declaration and the
    received rows."""
    rows = recv_RD.shape[0]
    recipe = get_recipe()
    if recipe is None:
        return [*declared_saved(x_TD, ids_TK, w1, rows), recv_RD]
    from ...quant.mlp import saved_for_backward_rows

    trans_w = w1.shape[1] != x_TD.shape[1]
    kept = list(saved_for_backward_rows(recipe, x_TD, rows, w1, trans_w))
    if not recipe.fp8_saved_activations:  # the rows it keeps are the received ones
        kept[0] = recv_RD
    return kept


class _DeclaredExperts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w1, w2, weights_TK, ids_TK, rows: int, ep: int):
        T, K = weights_TK.shape
        S = T * K
        if ep > 1:  # EP
            send = x_TD.new_empty(S, x_TD.shape[1])  # in flight during the dispatch
            recv = x_TD.new_empty(rows, x_TD.shape[1])  # the received rows
            del send
            kept = received_rows_saved(x_TD, ids_TK, w1, recv)
            del recv
            kept.append(x_TD.new_empty(S, dtype=torch.long))  # token_S of the combine
        else:
            kept = list(declared_saved(x_TD, ids_TK, w1, rows))
        # rows arrive in (source, expert) blocks: reordered by copies when both exceed 1
        ctx.ep, ctx.reorder = ep > 1, ep > 1 and w1.shape[0] > 1
        if ctx.reorder:  # the reorder's permutation and its inverse [R] (int64), saved
            kept += [x_TD.new_empty(rows, dtype=torch.long) for _ in range(2)]
        ctx.save_for_backward(*kept)
        N = w1.shape[1] if w1.shape[1] != x_TD.shape[1] else w1.shape[2]
        ctx.shapes = (w1.shape, w1.dtype, w2.shape, w2.dtype, rows, x_TD.shape[1], N, S)
        return x_TD.new_empty(x_TD.shape)

    @staticmethod
    def backward(ctx, g_TD):
        # the live set of the engine's grouped backward, in its order
        saved = ctx.saved_tensors  # once: under activation checkpointing a second read raises
        s1, d1, s2, d2, rows, D, N, S = ctx.shapes
        x = g_TD  # the compute dtype's tensors are made like the output gradient
        F = N // 2
        if ctx.ep:  # the combine's backward: pairs' grad out, received back, local order
            g_SD = x.new_empty(S, D)
            g_RD = x.new_empty(rows, D)
            del g_SD
            if ctx.reorder:
                g_local = x.new_empty(rows, D)
                del g_RD
        gy, da = x.new_empty(rows, D), x.new_empty(rows, F)  # gathered grad, d(act out)
        dh, a = x.new_empty(rows, N), x.new_empty(rows, F)  # d h, the recomputed activation
        del da
        g2, gp = x.new_empty(s2, dtype=d2), x.new_empty(rows)
        del a, gy
        x_SD = x.new_empty(rows, D)  # recomputed gather for the gate/up weight gradient
        g1 = x.new_empty(s1, dtype=d1)
        del x_SD
        dx_SD = x.new_empty(rows, D)
        if ctx.ep:  # the dispatch's backward: local-order copy, pairs' grad received back
            if ctx.reorder:
                del g_local
                dx_local = x.new_empty(rows, D)
                del dx_SD
                dx_SD = x.new_empty(S, D)
                del dx_local
            else:
                del g_RD, dx_SD
                dx_SD = x.new_empty(S, D)
            # the routing weights' gradient on its way home: reordered, received, scattered
            gp_S = [gp.new_empty(rows), gp.new_empty(S), gp.new_empty(S)]
        dx = g_TD.new_empty(g_TD.shape)
        del dx_SD, dh, gp, saved
        if ctx.ep:
            del gp_S
        return dx, g1, g2, None, None, None, None


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
        x = expert_input(hidden_states, w1)  # as the real forward: the autocast dtype
        out = _DeclaredExperts.apply(x, w1, w2, top_k_weights, top_k_index, rows, ep)
        return out.to(hidden_states.dtype)

    layers = moe_layers(model)
    for layer in layers:
        layer.experts.forward = types.MethodType(forward, layer.experts)
    return len(layers)
