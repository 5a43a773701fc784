"""Memory-lean expert MLP: permute -> gate/up GEMM -> SwiGLU x prob -> down GEMM ->
combine as ONE autograd Function that owns its backward.

Saved for backward, per kept (token, expert) pair (S of them): the gate/up output
h [2F] in the activation dtype, the routing prob (one value) and two int64 indices
(token, pair). Plus x_TD, which the caller holds anyway, and nothing else: the
gathered input x[token_S] and the SwiGLU output are recomputed in backward, and the
expert outputs are never kept. The composed path (`grouped_gemm` + `swiglu` +
`unpermute` autograd nodes) keeps x_SD [D], h [2F], the activation [F] and y [D] per
pair: at D=1024, F=384 that is 2816 values per pair against 768 here (3.7x less).

Two implementations of the same Function, picked by `mlp_plan.plan_expert_mlp`:

- `LoopMLP` (the CPU default, `loop_mlp.py`): one pass per expert that gathers that
  expert's rows into a small buffer, runs both GEMMs with `torch.mm(out=)`, applies
  SwiGLU x prob in place and `index_add_`s the result into the output (an expert sees a
  token at most once, and results are added in expert order, so the sum is
  deterministic). With enough experts per thread, the experts are spread over worker
  threads running single-threaded GEMMs (`expert_threads.py`: work stealing, results
  committed in expert order, bit-identical to the one-thread loop). Backward does
  the same per expert and writes the weight gradients straight into preallocated
  [E, ...] tensors. h is kept as one tensor per expert, and a backward that frees the
  graph frees each as soon as that expert has read it, so the kept h drains while the
  weight gradients fill. The working set of one expert stays in cache, and no [S, D]
  tensor is ever allocated. Needs the per-expert counts on the host (one sync per
  layer, in `sort_by_expert`). Runs any dtype, fp64 included.
- `GroupedMLP`: whole-S gathers and grouped GEMMs through a registered backend
  (`grouped_mm`, `triton`, ...), with the same saved tensors; its gathers and its
  swiglu / gpt_oss activation come from the row-op registry (Triton kernels on CUDA).
  Given the counts as a device tensor and a backend that takes them there (`grouped_mm`,
  `triton`: offsets computed on the device), it never syncs with the host: the path
  used on CUDA and under `torch.compile`.

Both handle biases (the down bias is scaled by the prob), `activation="gpt_oss"`,
interleaved gate/up, `trans_w=False` and dropped pairs (capacity mode: the caller's
SortedPairs leave them out). Low-precision recipes never come here (see expert_mlp.py).

Both take optional low-rank (LoRA) factors for either projection (`lora.py`): the update
runs as two thin GEMMs per expert beside the base GEMM, saves the [S, r] intermediate
and computes gradients for the factors only when the base weights need none.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted (kept) pairs

from __future__ import annotations

import torch

from ..activation.eager import act_forward, act_input_grad, act_parts
from ..activation.swiglu import check_supported
from ..compute_dtype import autocast_off
from ..grouped_gemm.eager import bind_offsets
from ..lora import (
    LowRank,
    check_lowrank,
    grouped_lowrank_bwd,
    grouped_lowrank_dx,
    grouped_lowrank_fwd,
    lora_inputs,
    lowranks,
)
from ..specs import ActivationConfig, as_activation
from .expert_threads import python_modes_active
from .gathered_mlp import gathered_mlp
from .loop_mlp import LoopMLP, free_storage, graph_released
from .mlp_parts import Needs, input_grads
from .mlp_plan import MlpPlan, check_gathered_ok, pick_mlp_path, plan_gathered, plan_grouped

__all__ = ["fused_mlp", "pick_mlp_path"]

# --- whole-S grouped GEMMs through a backend (sync-free with device counts) ----------

_LORA_AT = 12  # where GroupedMLP's low-rank factors start among its inputs


def _expert_of_row(counts_E: torch.Tensor, S: int) -> torch.Tensor:
    """The expert of each sorted row, without a host sync (output_size is known)."""
    return torch.repeat_interleave(
        torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=S
    )


def counts_for(be, counts, device):
    """The counts in the form the backend takes: a device tensor (one copy for every
    GEMM) when it declares `device_counts`, else a host list (a sync for a tensor)."""
    if isinstance(counts, torch.Tensor) and not be.device_counts:
        return counts.tolist()
    if be.device_counts and not isinstance(counts, torch.Tensor):
        return torch.tensor(counts, device=device)
    return counts


def rows_of_experts(counts, x, S, *biases):
    """The expert of each sorted row when a bias needs it, else None."""
    if all(b is None for b in biases):
        return None
    counts_E = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=x.device)
    return _expert_of_row(counts_E, S)


class GroupedMLP(torch.autograd.Function):
    """Same contract as LoopMLP; counts is a host list or a device tensor; `plan` (an
    `MlpPlan` of path "grouped") carries the GEMM backend and the row ops.

    The gathers (permute, combine) and, for the kinds it has, the activation x prob come
    from the row-op registry (`row_ops.py`: Triton kernels on CUDA, fp32 accumulation);
    other activations use the torch math of `activations`."""

    @staticmethod
    @autocast_off
    def forward(ctx, x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, counts, offs, cfg, plan, *lora):  # fmt: skip
        act, trans_w, _ = cfg
        lr1, lr2 = lowranks(lora)
        be, rk, rk_act = plan.backend, plan.row_ops, plan.act_row_ops
        counts = counts_for(be, counts, x.device)
        # one offsets tensor (the sort's, or computed here) for all six GEMMs
        be = bind_offsets(be, counts, offs, x.device)
        x_SD = rk.gather_rows(x, token_S) if token_S is not None else x
        rows_E = rows_of_experts(counts, x, x_SD.shape[0], gu_bias, d_bias)
        h = be.mm(x_SD, gate_up, counts, trans_w)
        u1 = grouped_lowrank_fwd(be, x_SD, lr1, counts, h) if lr1 is not None else None
        del x_SD  # recomputed in backward
        if gu_bias is not None:
            h += gu_bias.index_select(0, rows_E)
        if rk_act is not None:
            a = rk_act.act_fwd(h, prob_S, act.interleaved, act.kind, act.alpha, act.limit)
        else:
            a = act_forward(h, prob_S, act)
        y = be.mm(a, down, counts, trans_w)
        u2 = grouped_lowrank_fwd(be, a, lr2, counts, y) if lr2 is not None else None
        del a
        if d_bias is not None:
            b_SD = d_bias.index_select(0, rows_E)
            y += b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1)
        out = rk.gather_sum(y, slot_TK) if token_S is not None else y
        ctx.save_for_backward(
            x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E, u1, u2,
            *lora[:4],
        )  # fmt: skip
        ctx.counts, ctx.cfg, ctx.plan, ctx.lora_scales = counts, cfg, plan, lora[4:]
        ctx.be = be
        return out

    @staticmethod
    @autocast_off
    def backward(ctx, g_out):
        saved = ctx.saved_tensors
        x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E = saved[:10]
        u1, u2, *ABAB = saved[10:]
        lr1, lr2 = lowranks((*ABAB, *ctx.lora_scales))
        rk, need = ctx.plan.row_ops, Needs.of(ctx, _LORA_AT)
        g_out = g_out.contiguous()
        gy = rk.gather_rows(g_out, token_S) if token_S is not None else g_out
        gdb = None
        if d_bias is not None and need.down_bias:
            p = None if prob_S is None else prob_S.unsqueeze(1)
            gdb = d_bias.new_zeros(d_bias.shape).index_add_(0, rows_E, gy if p is None else gy * p)
        g2a = g2b = None
        if ctx.plan.act_row_ops is not None:
            dh, gp, gd = _act_backward_kernel(ctx, gy, h, prob_S, down, need)
        else:
            dh, gp, gd, g2a, g2b = _act_backward_eager(ctx, gy, h, prob_S, down, need, lr2, u2)
        del h  # freed by the activation backward, its last reader
        if gp is not None and d_bias is not None:
            gp += (gy * d_bias.index_select(0, rows_E)).sum(1)
        del gy
        ggb = None
        if gu_bias is not None and need.gate_up_bias:
            ggb = gu_bias.new_zeros(gu_bias.shape).index_add_(0, rows_E, dh)
        gx, ggu, g1a, g1b = _gate_up_backward(ctx, dh, x, token_S, slot_TK, gate_up, lr1, u1, need)
        base = (gx, gp, ggu, gd, ggb, gdb)
        return input_grads(ctx, _LORA_AT, base, (g1a, g1b, g2a, g2b))


def _gate_up_backward(ctx, dh, x, token_S, slot_TK, gate_up, lr1, u1, need):
    """(dx combined back to tokens, d gate_up, dA, dB of its low-rank update) from dh."""
    be, rk, counts, trans_w = ctx.be, ctx.plan.row_ops, ctx.counts, ctx.cfg[1]
    ggu = g1a = g1b = gu1 = gx = None
    if need.gate_up or lr1 is not None:
        x_SD = rk.gather_rows(x, token_S) if token_S is not None else x
        if need.gate_up:
            ggu = be.wgrad(dh, x_SD, counts) if trans_w else be.wgrad(x_SD, dh, counts)
        if lr1 is not None:
            gu1, g1a, g1b = grouped_lowrank_bwd(be, dh, x_SD, u1, lr1, counts, need.a1, need.b1)
        del x_SD
    if need.x:
        dx = be.mm(dh, gate_up, counts, not trans_w)
        if lr1 is not None:
            grouped_lowrank_dx(be, gu1, lr1, counts, dx)
        gx = rk.gather_sum(dx, slot_TK) if token_S is not None else dx
    return gx, ggu, g1a, g1b


def _act_backward_kernel(ctx, gy, h, prob_S, down, need):
    """(dh, d prob, d down) with one activation-backward pass that also recomputes the
    forward output for the down projection's weight grad."""
    act, trans_w, _ = ctx.cfg
    be, counts = ctx.be, ctx.counts
    da = be.mm(gy, down, counts, not trans_w)
    need_gp = prob_S is not None and need.prob
    dh, gp, a = ctx.plan.act_row_ops.act_bwd(
        da, h, prob_S, act.interleaved, need_gp, need.down, act.kind, act.alpha, act.limit
    )
    _release_h(ctx, h)
    del da
    gd = None
    if need.down:
        gd = be.wgrad(gy, a, counts) if trans_w else be.wgrad(a, gy, counts)
    return dh, gp, gd


def _act_backward_eager(ctx, gy, h, prob_S, down, need, lr2=None, u2=None):
    """(dh, d prob, d down, dA, dB of the down projection's low-rank update)."""
    act, trans_w, _ = ctx.cfg
    be, counts = ctx.be, ctx.counts
    p = None if prob_S is None else prob_S.unsqueeze(1)
    a0, d_gate, d_up = act_parts(h, act)
    dh = torch.empty_like(h)
    _release_h(ctx, h, a0, d_gate, d_up)
    gd = gp = g2a = g2b = None
    if need.down or lr2 is not None:
        ap = a0 if p is None else a0 * p
    if need.down:
        gd = be.wgrad(gy, ap, counts) if trans_w else be.wgrad(ap, gy, counts)
    da = be.mm(gy, down, counts, not trans_w)
    if lr2 is not None:
        gu2, g2a, g2b = grouped_lowrank_bwd(be, gy, ap, u2, lr2, counts, need.a2, need.b2)
        grouped_lowrank_dx(be, gu2, lr2, counts, da)
        del gu2
    if need.down or lr2 is not None:
        del ap
    if p is not None and need.prob:
        gp = (da * a0).sum(1)
    del a0
    if p is not None:
        da.mul_(p)
    dh = act_input_grad(da, d_gate, d_up, act.interleaved, dh)
    return dh, gp, gd, g2a, g2b


def _release_h(ctx, h: torch.Tensor, *parts) -> None:
    """Free the saved h once the activation backward has read it (before the weight
    gradients run), in a backward that frees the graph as it goes; its storage is the
    Function's own (the gate/up GEMM's output). Kept when one of the activation's
    `parts` is a view of it (a registered identity-like elementwise kind), and under
    torch.compile (the compiled backward plans its own memory; storage calls break it) and
    in the custom op's backward (`expert_mlp/custom_op.py`: h is an input there, `keep_h`)."""
    if torch.compiler.is_compiling() or getattr(ctx, "keep_h", False):
        return
    ptr = h.untyped_storage().data_ptr()
    if any(p is not None and p.untyped_storage().data_ptr() == ptr for p in parts):
        return
    if graph_released() and not python_modes_active():
        free_storage(h)


# --- entry point ----------------------------------------------------------------------


def fused_mlp(
    x: torch.Tensor,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts,
    *,
    token_S: torch.Tensor | None = None,
    slot_TK: torch.Tensor | None = None,
    num_out: int | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    path: str = "loop",
    backend: str | None = None,
    lora: tuple[LowRank | None, LowRank | None] | None = None,
    plan: MlpPlan | None = None,
    offsets_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused expert MLP (internal; callers use `expert_mlp` / `grouped_mlp`).

    With token_S/slot_TK (from SortedPairs), x is x_TD and the result is the combined
    out [num_out, D]; without, x is x_SD (sorted rows) and the result is y_SD.
    counts: host list (required by path "loop") or device tensor (paths "grouped",
    "gathered"; see `gathered_mlp.py`: no biases, no low-rank updates).
    `activation`: an ActivationConfig, or a kind name with interleaved/alpha/limit.
    `lora`: optional low-rank updates (gate_up, down) of the projections, each a
    `LowRank` or None (see `lora.py`). `plan`: the caller's `MlpPlan` (path "loop" or
    "grouped"); without one, `path` and `backend` make it here. `offsets_E`: the int32
    end offsets of the counts on x's device (`SortedPairs.offsets_E`), shared by the
    GEMMs; None: computed once here when the GEMM backend takes them.
    """
    if prob_S is not None:
        prob_S = prob_S.to(x.dtype)
    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    cfg = (act, bool(trans_w), num_out)
    extra = _checked_lora(lora, gate_up, down, trans_w)
    has_bias = gate_up_bias is not None or down_bias is not None
    if plan is None:
        down_lora = lora is not None and lora[1] is not None
        plan = MlpPlan("loop") if path == "loop" else plan_grouped(
            x, gate_up, down, act, backend, down_lora=down_lora
        )  # fmt: skip
        if path == "gathered":
            check_gathered_ok(lora, has_bias, act)
            rows = token_S.shape[0] if token_S is not None else x.shape[0]
            plan = plan_gathered(x, gate_up, down, act, plan, rows, trans_w, forced=True)
    if plan.path == "gathered":
        check_gathered_ok(lora, has_bias, act)
        return gathered_mlp(
            x, prob_S, gate_up, down, counts, token_S, slot_TK, act, trans_w, plan.gathered,
            offsets_E,
        )  # fmt: skip
    if plan.path == "loop":
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # host sync: the loop needs the bounds on the host
        return LoopMLP.apply(
            x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, list(counts), cfg, *extra
        )
    return GroupedMLP.apply(
        x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, slot_TK, counts, offsets_E,
        cfg, plan, *extra,
    )  # fmt: skip


def _checked_lora(lora, gate_up, down, trans_w) -> tuple:
    if lora is None:
        return ()
    if not isinstance(lora, (tuple, list)) or len(lora) != 2:
        raise TypeError(
            "lora must be a pair (gate_up update, down update), each a LowRank or None; "
            f"got {type(lora).__name__}"
        )
    E = gate_up.shape[0]
    n1_out, n1_in = gate_up.shape[1:] if trans_w else gate_up.shape[:0:-1]
    n2_out, n2_in = down.shape[1:] if trans_w else down.shape[:0:-1]
    check_lowrank(lora[0], E, n1_in, n1_out, "gate_up")
    check_lowrank(lora[1], E, n2_in, n2_out, "down")
    return lora_inputs(lora)
