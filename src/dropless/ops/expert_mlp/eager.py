"""The routed expert MLP's entries: `grouped_mlp` (rows already sorted by expert: the
expert-parallel dispatcher calls it after its all-to-all) and `expert_mlp` (tokens in,
tokens out: the local sort and combine around it), and the custom op that is their
form under `torch.compile` / `torch.export`.

At full precision both run the engine (`engine.py`, one autograd Function following a
`plan.Schedule`). Under a low-precision recipe (`dropless.autocast`) they run the
recipe's MLP, else the MLP composed from the recipe's grouped GEMMs (`composed_mlp`).
Under `torch.autocast` the operands are first cast to the autocast dtype
(`compute_dtype.py`: tokens per call, weights once per optimizer step).

Inside a compiled region the routed MLP is one `dropless::expert_mlp` node: Dynamo
neither breaks the graph at the per-expert counts nor specialises it on the routing,
and `torch.export` records it with its fake rule (S = T*K pairs, dropless: every shape
is known from the operands). The node calls the engine's `forward` and its backward
node the engine's `backward`, with what that backward reads declared as the node's
outputs (`saved_for_backward`: h and the sort's indices), the same declaration
`dropless plan` allocates. What the node does not take (a recipe, LoRA factors, a
capacity limit, a named backend) runs outside the graph (one graph break).
"""

# T tokens, D model dim, F expert hidden dim, N gate/up width, E experts, K top-k,
# S sorted pairs

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..activation.eager import check_supported
from ..activation.swiglu import swiglu
from ..compute_dtype import to_compute_dtype
from ..dispatch import get_recipe
from ..grouped_gemm import grouped_gemm
from ..grouped_gemm.eager import check_counts, expand_bias
from ..lora import LowRank
from ..permute.eager import SortedPairs, permute, sort_by_expert, unpermute
from ..specs import ActivationConfig, as_activation
from . import engine
from .plan import Needs, Saved, plan_expert_mlp


def composed_mlp(
    x_SD,
    counts,
    prob_S,
    gate_up,
    down,
    *,
    gate_up_bias=None,
    down_bias=None,
    activation=None,
    interleaved=None,
    trans_w=True,
    alpha=None,
    limit=None,
    backend=None,
    gate: Callable | None = None,
    offsets_E=None,
):
    """The routed MLP on sorted rows composed of autograd ops: two grouped GEMMs (through
    the active recipe's GEMM under `dropless.autocast`) with the activation x prob between
    them, or `gate`, a module's own activation h -> a, with the prob applied after it (the
    generic path of a gate with no fused form). What a recipe without an MLP of its own
    runs, and what the engine is tested against."""
    kw = dict(trans_w=trans_w, backend=backend, offsets_E=offsets_E)
    h = grouped_gemm(x_SD, gate_up, counts, gate_up_bias, **kw)
    if gate is None:
        a = swiglu(
            h, prob_S, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit
        )
    else:
        a = gate(h).to(down.dtype)
        a = a if prob_S is None else a * prob_S.unsqueeze(1).to(a.dtype)
    y = grouped_gemm(a, down, counts, None, **kw)
    if down_bias is not None:
        b_SD = expand_bias(down_bias, counts, y.shape[0])
        y = y + (b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1).to(b_SD.dtype))
    return y


def _activation(kw: dict) -> ActivationConfig:
    """Replace the activation keywords in `kw` by one checked ActivationConfig."""
    act = kw.pop("activation", None)
    fields = {k: kw.pop(k, None) for k in ("interleaved", "alpha", "limit")}
    if not isinstance(act, ActivationConfig) or any(v is not None for v in fields.values()):
        act = as_activation(act, **fields)
    kw["activation"] = check_supported(act)
    return kw["activation"]


def grouped_mlp(
    x_SD: torch.Tensor,
    counts,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    backend: str | None = None,
    lora: tuple[LowRank | None, LowRank | None] | None = None,
    offsets_E: torch.Tensor | None = None,
    gate: Callable | None = None,
) -> torch.Tensor:
    """Expert MLP on rows sorted by expert (`counts` rows each), scaled by prob_S.

    gate_up [E, 2F, D] and down [E, D, F] when trans_w (nn.Linear layout), else
    [E, D, 2F] and [E, F, D]. The prob scales the whole expert output, the down bias
    included: y = prob * (act @ down^T + b) = (prob * act) @ down^T + prob * b.
    counts: host list, or a device tensor (kept on the device, no sync, when the
    grouped path's backend takes device counts: `GemmBackend.device_counts`). activation: an ActivationConfig (default
    swiglu), or a kind name with the `interleaved`, `alpha`, `limit` keywords.
    lora: optional low-rank updates (gate_up, down), each a `LowRank` or None: computed
    as thin GEMMs beside the base ones, never folded into the weights (full precision only).
    offsets_E: the int32 cumulative ends of counts on x's device (`SortedPairs.offsets_E`),
    shared by every GEMM of the layer; None: computed once here where a GEMM reads them.
    gate: a module's own activation (h [S, N] -> a [S, F]) in place of `activation`: the
    generic path, `composed_mlp` (autograd through the gate; keeps more for backward).
    """
    if gate is not None:
        return composed_mlp(
            x_SD,
            counts,
            prob_S,
            gate_up,
            down,
            gate_up_bias=gate_up_bias,
            down_bias=down_bias,
            trans_w=trans_w,
            backend=backend,
            gate=gate,
            offsets_E=offsets_E,
        )
    kw = dict(
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        activation=activation,
        interleaved=interleaved,
        alpha=alpha,
        limit=limit,
        trans_w=trans_w,
        backend=backend,
    )
    act = _activation(kw)
    if get_recipe() is None:  # a recipe quantizes its operands itself
        x_SD, gate_up, down, lora = to_compute_dtype(x_SD, gate_up, down, kw, lora)
    has_bias = gate_up_bias is not None or down_bias is not None
    plan = plan_expert_mlp(
        x_SD, gate_up, down, act, backend=backend, lora=lora, trans_w=trans_w, bias=has_bias
    )
    if plan.path == "recipe":
        counts = check_counts(x_SD, gate_up, counts)
        if plan.recipe_mlp is not None:
            return plan.recipe_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
        return composed_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
    if plan.path == "grouped" and isinstance(counts, torch.Tensor) and plan.device_counts:
        _check_device_counts(counts, gate_up.shape[0])
    else:
        counts = check_counts(x_SD, gate_up, counts)
    return engine.run(
        x_SD, prob_S, gate_up, down, counts, plan=plan, lora=lora, offsets_E=offsets_E, **kw
    )


def _check_device_counts(counts: torch.Tensor, num_experts: int) -> None:
    if counts.dim() != 1 or counts.numel() != num_experts or counts.dtype.is_floating_point:
        raise ValueError(
            f"counts must be a 1-D integer tensor with one entry per expert ({num_experts}), "
            f"got {counts.dtype} of shape {tuple(counts.shape)}"
        )


def expert_mlp(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    keep_TK: torch.Tensor | None = None,
    **mlp_kwargs,
) -> tuple[torch.Tensor, SortedPairs]:
    """out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]); returns (out_TD, sorted pairs).

    Every pair is computed unless keep_TK (capacity mode) marks it dropped. On the
    grouped path without keep_TK, with a backend that takes device counts (grouped_mm,
    triton: CUDA, or under torch.compile) nothing is read
    on the host and the returned SortedPairs has `counts=None`; elsewhere the counts
    are read on the host once, in `sort_by_expert`. `mlp_kwargs` are those of
    `grouped_mlp` (biases, activation, trans_w, backend, lora).
    """
    return _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, eager=False)


def _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, *, eager: bool):
    """expert_mlp; `eager`: already outside the compiled graph (never break it again:
    under non-strict torch.export `is_compiling()` stays true inside compiler.disable)."""
    mlp_kwargs = dict(mlp_kwargs)
    act = _activation(mlp_kwargs)
    lora = mlp_kwargs.pop("lora", None)  # only the engine takes it
    recipe = get_recipe()
    if recipe is None:  # a recipe quantizes its operands itself
        x_TD, gate_up, down, lora = to_compute_dtype(x_TD, gate_up, down, mlp_kwargs, lora)
    compiling = torch.compiler.is_compiling() and not eager
    backend = mlp_kwargs.get("backend")
    if (
        compiling
        and recipe is None
        and lora is None
        and keep_TK is None
        and backend in (None, "auto")
    ):
        return _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, act, mlp_kwargs)
    if compiling:  # what the op does not take runs outside the graph: one break, no guards
        return _expert_mlp_eager(
            x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, {**mlp_kwargs, "lora": lora}
        )
    bias = any(mlp_kwargs.get(b) is not None for b in ("gate_up_bias", "down_bias"))
    plan = plan_expert_mlp(
        x_TD,
        gate_up,
        down,
        act,
        backend=backend,
        lora=lora,
        capacity=keep_TK is not None,
        tokens=ids_TK.numel(),
        trans_w=mlp_kwargs.get("trans_w", True),
        bias=bias,
    )
    sp = sort_by_expert(ids_TK, gate_up.shape[0], keep_TK, host_counts=not plan.device_counts)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
    counts = sp.counts_E if plan.device_counts else sp.counts
    if plan.path == "recipe" and not plan.takes_tokens:
        y_SD = grouped_mlp(permute(x_TD, sp), counts, prob_S, gate_up, down, **mlp_kwargs)
        return unpermute(y_SD, sp), sp
    tokens = dict(token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=x_TD.shape[0])
    if plan.path == "recipe":
        # the recipe's MLP gathers rows itself and keeps only x_TD (plus its quantized
        # saved activations) for backward, instead of a permuted [S, D] copy
        out_TD = plan.recipe_mlp(x_TD, counts, prob_S, gate_up, down, **mlp_kwargs, **tokens)
        return out_TD, sp
    out_TD = engine.run(
        x_TD,
        prob_S,
        gate_up,
        down,
        counts,
        plan=plan,
        lora=lora,
        offsets_E=sp.offsets_E,
        **tokens,
        **mlp_kwargs,
    )
    return out_TD, sp


# torch._disable_dynamo is torch.compiler.disable that imports torch._dynamo (and triton)
# on its first call, not at `import dropless`; made here, not inside the compiled region,
# where creating the wrapper would itself break the graph
@torch._disable_dynamo
def _expert_mlp_eager(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs):
    """expert_mlp run outside the compiled graph (what the custom op does not take)."""
    return _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, eager=True)


# --- the custom op --------------------------------------------------------------------


def _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, act, kw):
    """The call as one `dropless::expert_mlp` node (torch.compile, torch.export)."""
    out_TD, _h, pair_S, slot_TK, counts_E = expert_mlp_op(
        x_TD,
        ids_TK,
        weights_TK.to(x_TD.dtype),
        gate_up,
        down,
        kw.get("gate_up_bias"),
        kw.get("down_bias"),
        act.kind,
        act.gated,
        act.interleaved,
        float(act.alpha),
        float(act.limit),
        bool(kw.get("trans_w", True)),
    )
    sp = SortedPairs(
        token_S=pair_S // ids_TK.shape[1],
        pair_S=pair_S,
        slot_TK=slot_TK,
        counts_E=counts_E,
        counts=None,
        offsets_E=counts_E.cumsum(0, dtype=torch.int32),
    )
    return out_TD, sp


def _op_plan(x_TD, gate_up, down, act, trans_w):
    # the node's schedule: what eager code plans for these operands (cached per shape)
    return plan_expert_mlp(x_TD, gate_up, down, act, trans_w=trans_w)


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
    """(out_TD, h_SN, pair_S, slot_TK, counts_E): the engine's forward on every pair
    (dropless) and what its backward reads (`saved_for_backward`)."""
    act = ActivationConfig(kind, gated, interleaved, alpha, limit)
    plan = _op_plan(x_TD, gate_up, down, act, trans_w)
    loop = plan.path == "loop"
    sp = sort_by_expert(ids_TK, gate_up.shape[0], host_counts=loop or not plan.device_counts)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S).to(x_TD.dtype)
    counts = sp.counts if loop else sp.counts_E
    sv = Saved(
        x_TD,
        prob_S,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        sp.token_S,
        sp.slot_TK,
        counts,
        act,
        trans_w,
        sp.offsets_E,
    )
    out, sv = engine.forward(plan, sv, x_TD.shape[0], one_h=True)
    return out, sv.h, sp.pair_S.long(), sp.slot_TK.long().contiguous(), sp.counts_E.long()


def saved_for_backward(x_TD, ids_TK, gate_up, trans_w: bool = True, rows: int | None = None):
    """(h_RN, pair_R, slot_TK, counts_E): what the engine's backward reads beside the
    operands the caller holds (x_TD, the routing and expert weights): the gate/up output
    h in x's dtype and the sort's int64 indices. R = S = T*K (dropless) unless `rows` says
    how many rows the experts compute (the memory planner's busiest expert-parallel
    rank). The op's fake rule is this declaration, and `dropless plan` allocates it
    (`train/plan/experts.py`)."""
    T, K = ids_TK.shape
    R = T * K if rows is None else rows
    index = dict(dtype=torch.int64, device=x_TD.device)
    N = gate_up.shape[1] if trans_w else gate_up.shape[2]
    E = gate_up.shape[0]
    return (
        x_TD.new_empty(R, N),
        x_TD.new_empty(R, **index),
        x_TD.new_empty(T, K, **index),
        x_TD.new_empty(E, **index),
    )


@expert_mlp_op.register_fake
def _(
    x_TD,
    ids_TK,
    weights_TK,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    kind,
    gated,
    interleaved,
    alpha,
    limit,
    trans_w,
):
    out = x_TD.new_empty(ids_TK.shape[0], down.shape[1] if trans_w else down.shape[2])
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
    """Gradients of (x, weights_TK, gate_up, down, gate_up_bias, down_bias) by the
    engine's backward; an empty tensor where `needs` (same order) wants none."""
    act = ActivationConfig(kind, gated, interleaved, alpha, limit)
    plan = _op_plan(x_TD, gate_up, down, act, trans_w)
    T, K = slot_TK.shape
    prob_S = weights_TK.reshape(-1).index_select(0, pair_S).to(x_TD.dtype)
    loop = plan.path == "loop"
    counts = counts_E.tolist() if loop else counts_E
    offs = counts_E.cumsum(0, dtype=torch.int32) if plan.offsets else None
    sv = Saved(
        x_TD,
        prob_S,
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        pair_S // K,
        slot_TK,
        counts,
        act,
        trans_w,
        offs,
        h=h_SN,
    )
    # h is this node's input (its storage the forward node's output): never freed here
    grads = engine.backward(plan, sv, g_out, Needs(*needs), release=False)[:6]
    gx, gp, *rest = grads
    if gp is not None:  # dropless: pair_S is a permutation of the T*K pairs
        gp = weights_TK.new_empty(T * K).index_copy_(0, pair_S, gp.to(weights_TK.dtype)).view(T, K)
    return tuple(x_TD.new_empty(0) if g is None else g for g in (gx, gp, *rest))


@expert_mlp_backward_op.register_fake
def _(
    g_out,
    x_TD,
    weights_TK,
    gate_up,
    down,
    gate_up_bias,
    down_bias,
    h_SN,
    pair_S,
    slot_TK,
    counts_E,
    kind,
    gated,
    interleaved,
    alpha,
    limit,
    trans_w,
    needs,
):
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
        g_out.contiguous(),
        x,
        w,
        gate_up,
        down,
        gub,
        db,
        h,
        pair_S,
        slot_TK,
        counts_E,
        *ctx.act_args,
        needs,
    )
    gx, gw, ggu, gd, ggb, gdb = (g if need else None for g, need in zip(grads, needs))
    return gx, None, gw, ggu, gd, ggb, gdb, None, None, None, None, None, None


torch.library.register_autograd("dropless::expert_mlp", _backward, setup_context=_setup_context)
