"""The routed expert MLP as PyTorch custom ops (`dropless::expert_mlp` and its backward),
what `torch.compile` and `torch.export` see of it.

Inside a compiled region the whole routed MLP (sort by expert, gate/up GEMM, activation
x prob, down GEMM, combine) is one graph node: Dynamo neither breaks the graph at the
per-expert counts nor specialises the graph on the routing, and `torch.export` records
the node with its fake (shape-only) rule. Every shape is known from the operands
(S = T*K pairs, dropless), so the fake rules need no data.

The node runs the fused Function eager code runs on that device (forward and backward
called directly, so the math is that one's, not a copy): the per-expert loop on CPU
(`loop_mlp.LoopMLP`, measured fastest there), the grouped path elsewhere
(`fused_mlp.GroupedMLP`). It keeps h [S, N] (the gate/up output; the loop writes its
experts' h as rows of it) and the sort's indices for backward, and its backward is a
second custom op taking them. Inside the node the counts may be read on the host (the
node is opaque to the compiler), so any backend runs.

What the node does not take (a low-precision recipe, LoRA factors, a capacity limit, a
named backend) keeps the eager entry's behaviour: `expert_mlp` runs outside the
graph there (one graph break).
"""

# T tokens, D model dim, N gate/up width (2F gated, F not), E experts, K top-k, S = T*K pairs

from __future__ import annotations

import torch
from torch import Tensor

from ..function_ctx import FunctionContext
from ..grouped_gemm.eager import bind_offsets
from ..permute.eager import sort_by_expert
from ..specs import ActivationConfig
from .fused_mlp import GroupedMLP, counts_for, rows_of_experts
from .loop_mlp import LoopMLP
from .mlp_plan import pick_mlp_path, plan_grouped

_OPTIONAL_GRADS = 6  # x, weights_TK, gate_up, down, gate_up_bias, down_bias


def uses_loop(x_TD: Tensor) -> bool:
    """Whether the node runs the per-expert loop: what eager code picks for x's device."""
    return pick_mlp_path(x_TD, None, None) == "loop"


def _act(kind: str, gated: bool, interleaved: bool, alpha: float, limit: float):
    return ActivationConfig(kind, gated, interleaved, alpha, limit)


def _out_dim(down: Tensor, trans_w: bool) -> int:
    return down.shape[1] if trans_w else down.shape[2]


def _h_dim(gate_up: Tensor, trans_w: bool) -> int:
    return gate_up.shape[1] if trans_w else gate_up.shape[2]


@torch.library.custom_op("dropless::expert_mlp", mutates_args=())
def expert_mlp_op(
    x_TD: Tensor,
    ids_TK: Tensor,
    weights_TK: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    kind: str,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    trans_w: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out_TD, h_SN, pair_S, slot_TK, counts_E): the routed expert MLP of every pair
    (dropless), with what its backward takes (int64 indices of the sort by expert)."""
    act = _act(kind, gated, interleaved, alpha, limit)
    loop = uses_loop(x_TD)
    sp = sort_by_expert(ids_TK, gate_up.shape[0], host_counts=loop)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S).to(x_TD.dtype)
    ctx = FunctionContext(keep_h=True)  # h is an input of the backward op: never freed there
    args = (x_TD, prob_S, gate_up, down, gate_up_bias, down_bias, sp.token_S)
    cfg = (act, trans_w, x_TD.shape[0])
    if loop:
        out = LoopMLP.forward(ctx, *args, sp.counts, cfg)
        h = ctx.h_SN  # the experts' h, in expert order (the loop writes them there)
    else:
        plan = plan_grouped(x_TD, gate_up, down, act, None)
        out = GroupedMLP.forward(ctx, *args, sp.slot_TK, sp.counts_E, sp.offsets_E, cfg, plan)
        h = ctx.saved_tensors[8]
    return out, h, sp.pair_S.long(), sp.slot_TK.long().contiguous(), sp.counts_E.long()


def saved_for_backward(x_TD, ids_TK, gate_up, trans_w: bool = True, rows: int | None = None):
    """(h_RN, pair_R, slot_TK, counts_E): what the routed expert MLP keeps for its backward
    beside its operands (x_TD, the routing weights and the expert weights, which the caller
    holds): the gate/up output h in x's dtype and the sort's int64 indices. R = S = T*K
    (dropless: every pair is a row) unless `rows` says how many rows the experts compute
    (the memory planner's busiest expert-parallel rank). The op's fake rule is this
    declaration, and `dropless plan` allocates it (`train/plan/experts.py`)."""
    T, K = ids_TK.shape
    R = T * K if rows is None else rows
    index = dict(dtype=torch.int64, device=x_TD.device)
    h = x_TD.new_empty(R, _h_dim(gate_up, trans_w))
    return h, x_TD.new_empty(R, **index), x_TD.new_empty(T, K, **index), \
        x_TD.new_empty(gate_up.shape[0], **index)  # fmt: skip


@expert_mlp_op.register_fake
def _(x_TD, ids_TK, weights_TK, gate_up, down, gate_up_bias, down_bias, kind, gated,
      interleaved, alpha, limit, trans_w):  # fmt: skip
    out = x_TD.new_empty(ids_TK.shape[0], _out_dim(down, trans_w))
    return (out, *saved_for_backward(x_TD, ids_TK, gate_up, trans_w))


@torch.library.custom_op("dropless::expert_mlp_backward", mutates_args=())
def expert_mlp_backward_op(
    g_out: Tensor,
    x_TD: Tensor,
    weights_TK: Tensor,
    gate_up: Tensor,
    down: Tensor,
    gate_up_bias: Tensor | None,
    down_bias: Tensor | None,
    h_SN: Tensor,
    pair_S: Tensor,
    slot_TK: Tensor,
    counts_E: Tensor,
    kind: str,
    gated: bool,
    interleaved: bool,
    alpha: float,
    limit: float,
    trans_w: bool,
    needs: list[bool],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of (x, weights_TK, gate_up, down, gate_up_bias, down_bias); an empty
    tensor where `needs` (same order) says none is wanted."""
    act = _act(kind, gated, interleaved, alpha, limit)
    T, K = slot_TK.shape
    prob_S = weights_TK.reshape(-1).index_select(0, pair_S).to(x_TD.dtype)
    token_S = pair_S // K
    weights = (x_TD, prob_S, gate_up, down, gate_up_bias, down_bias, token_S)
    cfg = (act, trans_w, T)
    if uses_loop(x_TD):
        grads = _loop_backward(g_out, weights, slot_TK, h_SN, counts_E, cfg, needs)
    else:
        grads = _grouped_backward(g_out, weights, slot_TK, h_SN, counts_E, cfg, needs)
    gx, gp, ggu, gd, ggb, gdb = grads[:_OPTIONAL_GRADS]
    if gp is not None:  # dropless: pair_S is a permutation of the T*K pairs
        gw = weights_TK.new_empty(T * K).index_copy_(0, pair_S, gp.to(weights_TK.dtype))
        gp = gw.view(T, K)
    grads = (gx, gp, ggu, gd, ggb, gdb)
    return tuple(x_TD.new_empty(0) if g is None else g for g in grads)


def _loop_backward(g_out, weights, slot_TK, h_SN, counts_E, cfg, needs):
    counts = counts_E.tolist()
    hs = h_SN.split(counts)  # views of the op's input: never freed in place (keep_h)
    # LoopMLP's inputs: x, prob, gate_up, down, biases, token_S, counts, cfg
    ctx = FunctionContext((*needs, False, False, False), keep_h=True)
    ctx.saved_tensors = (*weights, None, None, *hs)  # no low-rank factors
    ctx.counts, ctx.cfg, ctx.lora_scales = counts, cfg, ()
    return LoopMLP.backward(ctx, g_out)


def _grouped_backward(g_out, weights, slot_TK, h_SN, counts_E, cfg, needs):
    x_TD, _prob, gate_up, down, gate_up_bias, down_bias, _token = weights
    plan = plan_grouped(x_TD, gate_up, down, cfg[0], None)
    counts = counts_for(plan.backend, counts_E, x_TD.device)
    be = bind_offsets(plan.backend, counts, counts_E.cumsum(0, dtype=torch.int32), x_TD.device)
    rows_E = rows_of_experts(counts, x_TD, h_SN.shape[0], gate_up_bias, down_bias)
    # GroupedMLP's inputs: x, prob, gate_up, down, biases, token_S, slot_TK, counts,
    # offsets, cfg, plan
    ctx = FunctionContext((*needs, False, False, False, False, False, False), keep_h=True)
    ctx.saved_tensors = (*weights, slot_TK, h_SN, rows_E, None, None)
    ctx.counts, ctx.cfg, ctx.plan, ctx.lora_scales, ctx.be = counts, cfg, plan, (), be
    return GroupedMLP.backward(ctx, g_out)


@expert_mlp_backward_op.register_fake
def _(g_out, x_TD, weights_TK, gate_up, down, gate_up_bias, down_bias, h_SN, pair_S, slot_TK,
      counts_E, kind, gated, interleaved, alpha, limit, trans_w, needs):  # fmt: skip
    like = (x_TD, weights_TK, gate_up, down, gate_up_bias, down_bias)
    return tuple(
        torch.empty_like(t) if need and t is not None else x_TD.new_empty(0)
        for t, need in zip(like, needs)
    )


def _setup_context(ctx, inputs, output):
    x, _ids, w, gate_up, down, gub, db, *act_args = inputs
    _out, h, pair_S, slot_TK, counts_E = output
    ctx.save_for_backward(x, w, gate_up, down, gub, db, h, pair_S, slot_TK, counts_E)
    ctx.act_args = tuple(act_args)
    ctx.mark_non_differentiable(h, pair_S, slot_TK, counts_E)


def _backward(ctx, g_out, *_unused):
    x, w, gate_up, down, gub, db, h, pair_S, slot_TK, counts_E = ctx.saved_tensors
    n = ctx.needs_input_grad
    needs = [n[0], n[2], n[3], n[4], gub is not None and n[5], db is not None and n[6]]
    grads = expert_mlp_backward_op(
        g_out.contiguous(), x, w, gate_up, down, gub, db, h, pair_S, slot_TK, counts_E,
        *ctx.act_args, needs,
    )  # fmt: skip
    gx, gw, ggu, gd, ggb, gdb = (g if need else None for g, need in zip(grads, needs))
    return gx, None, gw, ggu, gd, ggb, gdb, None, None, None, None, None, None


torch.library.register_autograd("dropless::expert_mlp", _backward, setup_context=_setup_context)


def takes(recipe, lora, keep_TK, backend) -> bool:
    """Whether the custom op runs this call (else the eager entry does)."""
    return recipe is None and lora is None and keep_TK is None and backend in (None, "auto")


def run(x_TD, ids_TK, weights_TK, gate_up, down, gate_up_bias, down_bias,
        act: ActivationConfig, trans_w: bool):  # fmt: skip
    """(out_TD, pair_S, slot_TK, counts_E) through the custom op."""
    out, _h, pair_S, slot_TK, counts_E = expert_mlp_op(
        x_TD, ids_TK, weights_TK.to(x_TD.dtype), gate_up, down, gate_up_bias, down_bias,
        act.kind, act.gated, act.interleaved, float(act.alpha), float(act.limit), bool(trans_w),
    )  # fmt: skip
    return out, pair_S, slot_TK, counts_E
