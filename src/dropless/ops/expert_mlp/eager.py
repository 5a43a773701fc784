"""The routed expert MLP's entries, both through `run`: `grouped_mlp` (rows sorted by
expert, as the expert-parallel dispatcher hands them) and `expert_mlp` (tokens in and
out, sorted and combined here); and the custom op `dropless::expert_mlp`, their form
inside a compiled region: one node that neither breaks the graph at the per-expert
counts nor specialises it on the routing, calling the engine's `forward` and `backward`,
with what that backward reads declared as its outputs (`saved_for_backward`, what
`dropless plan` allocates). What the node does not take (a recipe, LoRA factors, a
capacity limit, a named backend) runs outside the graph (one graph break).
"""

# T tokens, D model dim, F expert hidden dim, N gate/up width, E experts, K top-k,
# S sorted pairs

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
from torch import Tensor

from ..activation.swiglu import swiglu
from ..compute_dtype import to_compute_dtype
from ..dispatch import get_recipe
from ..grouped_gemm import grouped_gemm
from ..grouped_gemm.eager import check_counts, expand_bias
from ..lora import LowRank, check_lowrank, lora_inputs
from ..permute.eager import SortedPairs, permute, unpermute
from ..specs import ActivationConfig, as_activation
from . import engine
from .engine import Needs, Saved
from .plan import Schedule, plan_expert_mlp


def composed_mlp(
    x_SD, counts, prob_S, gate_up, down, *, gate_up_bias=None, down_bias=None, gate=None, **act
):
    """The routed MLP on sorted rows of autograd ops: two `grouped_gemm`s (the active
    recipe's under `dropless.autocast`) with `swiglu` (its keywords in `act`) x prob or
    `gate`, a module's own h -> a, then the prob, between them. What a recipe without an
    MLP of its own runs, and what the engine is tested against."""
    kw = {k: act.pop(k) for k in ("trans_w", "backend", "offsets_E") if k in act}
    h = grouped_gemm(x_SD, gate_up, counts, gate_up_bias, **kw)
    if gate is None:
        a = swiglu(h, prob_S, **act)
    else:
        a = gate(h).to(down.dtype)
        a = a if prob_S is None else a * prob_S.unsqueeze(1).to(a.dtype)
    y = grouped_gemm(a, down, counts, None, **kw)
    if down_bias is not None:
        b_SD = expand_bias(down_bias, counts, y.shape[0])
        y = y + (b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1).to(b_SD.dtype))
    return y


def grouped_mlp(x_SD, counts, prob_S, gate_up, down, *, gate: Callable | None = None, **kw):
    """Expert MLP on rows sorted by expert (`counts` rows each), scaled by prob_S.

    gate_up [E, 2F, D] and down [E, D, F] when trans_w (nn.Linear layout), else
    [E, D, 2F] and [E, F, D]. The prob scales the whole expert output, the down bias
    included. counts: a host list, or a device tensor (kept there when the backend takes
    device counts). Keywords: those of `run`; lora: low-rank updates (gate_up, down),
    each a `LowRank` or None (full precision only); offsets_E: `SortedPairs.offsets_E`.
    gate: a module's own activation (h [S, N] -> a [S, F]): `composed_mlp`.
    """
    if gate is not None:
        kw.pop("lora", None)  # folded into the weights by the caller
        return composed_mlp(x_SD, counts, prob_S, gate_up, down, gate=gate, **kw)
    return run(x_SD, prob_S, gate_up, down, counts, **kw)


def run(
    x: Tensor,
    prob_S: Tensor | None,
    gate_up: Tensor,
    down: Tensor,
    counts,
    *,
    gate_up_bias: Tensor | None = None,
    down_bias: Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    backend: str | None = None,
    lora: tuple[LowRank | None, LowRank | None] | None = None,
    offsets_E: Tensor | None = None,
    path: str | None = None,
    plan: Schedule | None = None,
    ids_TK: Tensor | None = None,
    keep_TK: Tensor | None = None,
    token_S: Tensor | None = None,
    slot_TK: Tensor | None = None,
    num_out: int | None = None,
):
    """The routed MLP, every entry's one keyword list. x = x_SD sorted by expert ->
    y_SD; x = x_TD with token_S / slot_TK / num_out from SortedPairs -> out [num_out, D];
    or x_TD with ids_TK (prob_S the [T, K] weights, keep_TK a capacity limit's kept
    pairs), sorted here -> (out_TD, SortedPairs). activation: an ActivationConfig or a
    kind with interleaved / alpha / limit. path: "loop", "grouped" or "gathered"
    (default `expert_path()`); plan: the caller's `Schedule`."""
    if isinstance(activation, ActivationConfig) and (interleaved, alpha, limit) == (None,) * 3:
        act = activation
    else:
        act = as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    trans_w = bool(trans_w)
    kw = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, activation=act, trans_w=trans_w)
    kw["backend"] = backend
    if get_recipe() is None:  # a recipe quantizes its operands itself
        x, gate_up, down, lora = to_compute_dtype(x, gate_up, down, kw, lora)
    if plan is None:
        bias = gate_up_bias is not None or down_bias is not None
        tokens = None if ids_TK is None else ids_TK.numel()
        args = dict(backend=backend, path=path, lora=lora, capacity=keep_TK is not None)
        plan = plan_expert_mlp(
            x, gate_up, down, act, tokens=tokens, trans_w=trans_w, bias=bias, **args
        )
    sp = None
    if ids_TK is not None:
        sp = plan.sort(ids_TK, gate_up.shape[0], keep_TK, host_counts=not plan.device_counts)
        prob_S = prob_S.reshape(-1).index_select(0, sp.pair_S)
        counts = sp.counts_E if plan.device_counts else sp.counts
        token_S, slot_TK, num_out, offsets_E = sp.token_S, sp.slot_TK, x.shape[0], sp.offsets_E
    if plan.path == "recipe" and token_S is not None:
        if plan.takes_tokens:
            # the recipe's MLP gathers rows itself and keeps only x_TD (plus its quantized
            # saved activations) for backward, instead of a permuted [S, D] copy
            tokens = dict(token_S=token_S, slot_TK=slot_TK, num_out=num_out)
            out = plan.recipe_mlp(x, counts, prob_S, gate_up, down, **kw, **tokens)
        else:  # the rows form between a gather and a combine
            rows = sp or SimpleNamespace(token_S=token_S, slot_TK=slot_TK)
            out = unpermute(run(permute(x, rows), prob_S, gate_up, down, counts, **kw), rows)
        return out if sp is None else (out, sp)
    if plan.path == "recipe":
        counts = check_counts(x, gate_up, counts)
        return (plan.recipe_mlp or composed_mlp)(x, counts, prob_S, gate_up, down, **kw)
    if token_S is None:
        counts = _rows_counts(x, gate_up, counts, plan.device_counts)
    prob_S = None if prob_S is None else prob_S.to(x.dtype)
    b1, b2 = kw["gate_up_bias"], kw["down_bias"]
    sv = Saved(x, prob_S, gate_up, down, b1, b2, token_S, slot_TK, counts, act, trans_w, offsets_E)
    if lora is not None:
        extra = _checked_lora(lora, gate_up, down, trans_w)
        sv.lora, sv.lora_scales = extra[:4], extra[4:]
    out = engine.routed_mlp(plan, sv, num_out)
    return out if sp is None else (out, sp)


def _rows_counts(x, gate_up, counts, device_counts: bool):
    """The rows form's counts, checked; a tensor stays one on a device-counts plan."""
    if not (device_counts and isinstance(counts, torch.Tensor)):
        return check_counts(x, gate_up, counts)
    if counts.dim() != 1 or counts.numel() != gate_up.shape[0] or counts.is_floating_point():
        raise ValueError(
            f"counts must be a 1-D integer tensor with one entry per expert "
            f"({gate_up.shape[0]}), got {counts.dtype} of shape {tuple(counts.shape)}"
        )
    return counts


def _checked_lora(lora, gate_up, down, trans_w) -> tuple:
    E = gate_up.shape[0]
    n1_out, n1_in = gate_up.shape[1:] if trans_w else gate_up.shape[:0:-1]
    n2_out, n2_in = down.shape[1:] if trans_w else down.shape[:0:-1]
    check_lowrank(lora[0], E, n1_in, n1_out, "gate_up")
    check_lowrank(lora[1], E, n2_in, n2_out, "down")
    return lora_inputs(lora)


def expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, *, keep_TK=None, **kw):
    """out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]); returns (out_TD, sorted pairs).

    Every pair is computed unless keep_TK (capacity mode) marks it dropped. With a
    backend that takes device counts and no keep_TK nothing is read on the host (the
    SortedPairs' `counts` is None). `kw` are those of `grouped_mlp`.
    """
    if not torch.compiler.is_compiling():
        return run(x_TD, weights_TK, gate_up, down, None, ids_TK=ids_TK, keep_TK=keep_TK, **kw)
    if get_recipe() is None and keep_TK is None and kw.get("lora") is None:
        if kw.get("backend") in (None, "auto"):
            return _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, **kw)
    # what the op does not take runs outside the graph: one break, no guards
    return _expert_mlp_eager(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, kw)


# torch._disable_dynamo: torch.compiler.disable without importing torch._dynamo at
# `import dropless`; made here, since making it in a compiled region breaks the graph
@torch._disable_dynamo
def _expert_mlp_eager(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, kw):
    return run(x_TD, weights_TK, gate_up, down, None, ids_TK=ids_TK, keep_TK=keep_TK, **kw)


# --- the custom op --------------------------------------------------------------------


def _needs_grad(*tensors) -> bool:
    """Whether the call records a backward (the op keeps h only then)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, *, trans_w=True, **kw):
    kw.pop("backend", None), kw.pop("lora", None)
    b = {k: kw.pop(k, None) for k in ("gate_up_bias", "down_bias")}
    act = as_activation(kw.pop("activation", None), **kw)
    x_TD, gate_up, down, _ = to_compute_dtype(x_TD, gate_up, down, b, None)
    b1, b2 = b["gate_up_bias"], b["down_bias"]
    w = weights_TK.to(x_TD.dtype)
    args = (act.kind, act.gated, act.interleaved, float(act.alpha), float(act.limit), bool(trans_w))
    keep_h = _needs_grad(x_TD, w, gate_up, down, b1, b2)
    out_TD, _h, pair_S, slot_TK, counts_E = expert_mlp_op(
        x_TD, ids_TK, w, gate_up, down, b1, b2, *args, keep_h
    )
    offs = counts_E.cumsum(0, dtype=torch.int32)
    sp = SortedPairs(pair_S // ids_TK.shape[1], pair_S, slot_TK, counts_E, None, offsets_E=offs)
    return out_TD, sp


def _op_plan(x_TD, gate_up, down, act, trans_w):
    # the node's schedule: what eager code plans for these operands (cached per shape)
    return plan_expert_mlp(x_TD, gate_up, down, act, trans_w=trans_w)


def _op_saved(operands, token_S, pair_S, slot_TK, counts, act, trans_w, offs, h=None):
    """The engine's `Saved` of a node's operands and sort (h: the forward node's)."""
    x_TD, weights_TK, gate_up, down, b1, b2 = operands
    prob_S = weights_TK.reshape(-1).index_select(0, pair_S).to(x_TD.dtype)
    return Saved(
        x_TD, prob_S, gate_up, down, b1, b2, token_S, slot_TK, counts, act, trans_w, offs, h=h
    )


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
    keep_h: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out_TD, h_SN, pair_S, slot_TK, counts_E): the engine's forward on every pair
    and what its backward reads (`saved_for_backward`). keep_h False (no backward): h is
    [0, N] (a fresh [S, N] allocation per call costs ~5% in page faults at 16k tokens)."""
    act = ActivationConfig(kind, gated, interleaved, alpha, limit)
    plan = _op_plan(x_TD, gate_up, down, act, trans_w)
    host = plan.path == "loop" or not plan.device_counts
    sp = plan.sort(ids_TK, gate_up.shape[0], host_counts=host)
    operands = (x_TD, weights_TK, gate_up, down, gate_up_bias, down_bias)
    sort = (sp.token_S, sp.pair_S, sp.slot_TK, sp.counts_E)
    sv = _op_saved(operands, *sort, act, trans_w, sp.offsets_E)
    out, sv = engine.forward(plan, sv, x_TD.shape[0], one_h=keep_h)
    h = sv.h if keep_h else x_TD.new_empty(0, gate_up.shape[1 if trans_w else 2])
    return out, h, sp.pair_S.long(), sp.slot_TK.long().contiguous(), sp.counts_E.long()


def saved_for_backward(x_TD, ids_TK, gate_up, trans_w: bool = True, rows: int | None = None):
    """(h_RN, pair_R, slot_TK, counts_E): what the engine's backward reads beside the
    operands: h in x's dtype and the sort's int64 indices; R = T*K unless `rows` says
    (the planner's busiest expert-parallel rank). The op's fake rule and what `dropless
    plan` allocates (`train/plan/experts.py`)."""
    T, K = ids_TK.shape
    R = T * K if rows is None else rows
    index = dict(dtype=torch.int64, device=x_TD.device)
    N = gate_up.shape[1] if trans_w else gate_up.shape[2]
    E = gate_up.shape[0]
    h = x_TD.new_empty(R, N)
    return h, x_TD.new_empty(R, **index), x_TD.new_empty(T, K, **index), x_TD.new_empty(E, **index)


@expert_mlp_op.register_fake
def _(x_TD, ids_TK, weights_TK, gate_up, down, *rest):
    trans_w, keep_h = rest[-2:]
    out = x_TD.new_empty(ids_TK.shape[0], down.shape[1] if trans_w else down.shape[2])
    h, *indices = saved_for_backward(x_TD, ids_TK, gate_up, trans_w)
    return (out, h if keep_h else h.new_empty(0, h.shape[1]), *indices)


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
    """Gradients of (x, weights_TK, gate_up, down, the biases) by the engine's backward;
    empty where `needs` (same order) wants none."""
    act = ActivationConfig(kind, gated, interleaved, alpha, limit)
    plan = _op_plan(x_TD, gate_up, down, act, trans_w)
    T, K = slot_TK.shape
    offs = counts_E.cumsum(0, dtype=torch.int32) if plan.offsets else None
    operands = (x_TD, weights_TK, gate_up, down, gate_up_bias, down_bias)
    sort = (pair_S // K, pair_S, slot_TK, counts_E)
    sv = _op_saved(operands, *sort, act, trans_w, offs, h=h_SN)
    # h is this node's input (its storage the forward node's output): never freed here
    gx, gp, *rest = engine.backward(plan, sv, g_out, Needs(*needs), release=False)[:6]
    if gp is not None:  # dropless: pair_S is a permutation of the T*K pairs
        gp = weights_TK.new_empty(T * K).index_copy_(0, pair_S, gp.to(weights_TK.dtype)).view(T, K)
    return tuple(x_TD.new_empty(0) if g is None else g for g in (gx, gp, *rest))


@expert_mlp_backward_op.register_fake
def _(g_out, x_TD, *rest):
    like, needs = (x_TD, *rest[:5]), rest[-1]
    empty = x_TD.new_empty(0)
    return tuple(torch.empty_like(t) if n and t is not None else empty for t, n in zip(like, needs))


def _setup_context(ctx, inputs, output):
    x, _ids, w, gate_up, down, gub, db, *act_args = inputs
    ctx.save_for_backward(x, w, gate_up, down, gub, db, *output[1:])
    ctx.act_args = tuple(act_args)[:6]  # kind .. trans_w, not keep_h
    ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, g_out, *_unused):
    n, (gub, db) = ctx.needs_input_grad, ctx.saved_tensors[4:6]
    needs = [n[0], n[2], n[3], n[4], gub is not None and n[5], db is not None and n[6]]
    grads = expert_mlp_backward_op(g_out.contiguous(), *ctx.saved_tensors, *ctx.act_args, needs)
    gx, gw, ggu, gd, ggb, gdb = (g if need else None for g, need in zip(grads, needs))
    return gx, None, gw, ggu, gd, ggb, gdb, *(None,) * 7  # the activation's five, trans_w, keep_h


torch.library.register_autograd("dropless::expert_mlp", _backward, setup_context=_setup_context)
