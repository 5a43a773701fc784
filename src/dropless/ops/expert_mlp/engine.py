"""The expert engine: the routed MLP (gather rows -> gate/up GEMM -> activation x prob ->
down GEMM -> combine) as ONE autograd Function, `RoutedMLP`, following a `plan.Schedule`,
and the `forward` / `backward` it runs (the custom op of `eager.py` calls them directly).
Schedules: "loop" (`loop.py`, the CPU default); "grouped": whole-S gathers and grouped
GEMMs, each of `plan.GEMMS` on its backend or, where None, the Triton kernel that
gathers its rows and fuses the activation (`gather_gemm_kernels.py`); "recipe": a
low-precision recipe's slot (`quant/mlp.py`) for the GEMMs and the saved format.

Saved for backward (`Saved`), per kept pair: h [N], the prob and the sort's indices,
plus x_TD, which the caller holds anyway; the gathered x and the activation are
recomputed. Biases (the down bias scaled by the prob), every `ActivationConfig`,
`trans_w=False`, dropped pairs and low-rank (LoRA) factors run on both schedules.
"""

# T tokens, D model dim, F expert hidden dim, N gate/up width, E experts, K top-k,
# S sorted (kept) pairs

from __future__ import annotations

import contextlib
from collections import namedtuple
from dataclasses import dataclass, replace

import torch

from ..activation.eager import act_forward, act_input_grad, act_parts
from ..grouped_gemm.eager import bind_offsets, group_offsets
from ..lora import grouped_lowrank_bwd, grouped_lowrank_dx, grouped_lowrank_fwd, lowranks
from ..specs import ActivationConfig
from . import loop
from .plan import Schedule
from .threads import python_modes_active


@dataclass
class Saved:
    """A call's operands and what the backward reads of them, by name: the forward fills
    in h (the gate/up output [S, N]; the loop keeps one tensor per expert) and u1 / u2
    (the low-rank intermediates [S, r]). x is x_TD with token_S / slot_TK, else the sorted
    rows x_SD; lora: the factors (a1, b1, a2, b2) and their scales. Under a recipe h holds
    its saved-activation format's tensors, meta what they are, and x may be None."""

    x: torch.Tensor | None
    prob_S: torch.Tensor | None
    gate_up: torch.Tensor
    down: torch.Tensor
    gu_bias: torch.Tensor | None
    d_bias: torch.Tensor | None
    token_S: torch.Tensor | None
    slot_TK: torch.Tensor | None
    counts: list[int] | torch.Tensor
    act: ActivationConfig = ActivationConfig()
    trans_w: bool = True
    offs: torch.Tensor | None = None
    lora: tuple = ()
    lora_scales: tuple = ()
    h: torch.Tensor | tuple[torch.Tensor, ...] | None = None
    u1: torch.Tensor | None = None
    u2: torch.Tensor | None = None
    meta: object = None


# which inputs want a gradient, by name (a1 .. b2: the low-rank factors)
Needs = namedtuple("Needs", "x prob gate_up down gate_up_bias down_bias a1 b1 a2 b2")
Needs.__new__.__defaults__ = (False,) * 4

# Saved's tensors in the order autograd sees them, then lora and h flattened
_TENSORS = ("x", "prob_S", "gate_up", "down", "gu_bias", "d_bias", "token_S", "slot_TK", "u1")
_TENSORS += ("u2",)
_LORA_AT = len(_TENSORS)


def _split(sv: Saved) -> tuple[Saved, list]:
    """(sv without its tensors, its tensors); `_join` is the inverse."""
    many = isinstance(sv.h, tuple)
    h = sv.h if many else (sv.h,)
    ts = [*(getattr(sv, n) for n in _TENSORS), *sv.lora, *h]
    meta = replace(sv, **dict.fromkeys(_TENSORS), h=len(h) if many else None, lora=len(sv.lora))
    return meta, ts


def _join(meta: Saved, ts) -> Saved:
    n = _LORA_AT + meta.lora
    lora, hs = tuple(ts[_LORA_AT:n]), tuple(ts[n:])
    h = hs if meta.h is not None else hs[0]
    return replace(meta, **dict(zip(_TENSORS, ts)), lora=lora, h=h)


def _autocast_off(t: torch.Tensor):
    """Autocast off on t's device: the operands are in the compute dtype already and the
    `out=` buffers must not meet GEMMs autocast would switch (a backward may run inside the
    caller's autocast region); a compiled graph carries its own autocast state."""
    dev = t.device.type
    on = dev in ("cpu", "cuda") and not torch.compiler.is_compiling()
    if on and torch.is_autocast_enabled(dev):
        return torch.autocast(dev, enabled=False)
    return contextlib.nullcontext()


def graph_released() -> bool:
    """True inside a backward that frees the graph as it goes (retain_graph and
    create_graph off): only then may a saved tensor be freed before its node ends, as
    autograd would free it right after. False when torch cannot tell: the flag is private
    (torch's AOTAutograd reads it too), pinned by tests/ops/test_torch_internals.py."""
    keep = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return keep is not None and not keep()


def free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


class RoutedMLP(torch.autograd.Function):
    """The routed MLP of `forward` as one autograd node: apply(sched, num_out, meta,
    *tensors), the call's `Saved` split into its tensors and the rest (`routed_mlp`)."""

    @staticmethod
    def forward(ctx, sched, num_out, meta: Saved, *tensors):
        with _autocast_off(tensors[2]):
            out, sv = forward(sched, _join(meta, tensors), num_out)
        ctx.saved, ts = _split(sv)
        ctx.save_for_backward(*ts)
        ctx.sched = sched
        return out

    @staticmethod
    def backward(ctx, g_out):
        sv = _join(ctx.saved, ctx.saved_tensors)
        n = ctx.needs_input_grad[3:]  # in the order of _TENSORS
        need = Needs(*n[:6], *(n[_LORA_AT : _LORA_AT + 4] if sv.lora else ()))
        release = graph_released() and not python_modes_active()
        with _autocast_off(g_out):
            grads = backward(ctx.sched, sv, g_out, need, release)
        lora = grads[6:] if sv.lora else ()
        return (None,) * 3 + grads[:6] + (None,) * (_LORA_AT - 6) + lora + (None,)


def routed_mlp(sched: Schedule, sv: Saved, num_out) -> torch.Tensor:
    meta, ts = _split(sv)
    return RoutedMLP.apply(sched, num_out, meta, *ts)


def forward(sched: Schedule, sv: Saved, num_out, one_h: bool = False) -> tuple:
    """(out_TD [num_out, D] with sv.token_S, else y_SD; sv with h, u1, u2 filled in).
    one_h: h as one [S, N] tensor (the custom op's output)."""
    if sched.path == "recipe":
        y, kept = _recipe_forward(sched, sv)
    else:
        counts = counts_for(sched, sv.counts, sv.x.device)  # the loop's: on the host
        if sched.path == "loop":
            return loop.forward(replace(sv, counts=counts), num_out, *_lowranks(sv), one_h)
        offs = sv.offs
        if offs is None and sched.offsets:  # one offsets tensor for all six GEMMs
            offs = group_offsets(counts, sv.x.device)
        sv = replace(sv, counts=counts, offs=offs)
        h, a, u1 = _up_projection(sched, sv)
        dn, lr2 = _bound(sched, "down", offs), _lowranks(sv)[1]
        y = dn.mm(a, sv.down, counts, sv.trans_w)
        u2 = grouped_lowrank_fwd(dn, a, lr2, counts, y) if lr2 is not None else None
        del a  # recomputed by the activation backward
        kept = replace(sv, h=h, u1=u1, u2=u2)
    if sv.d_bias is not None:
        add_bias(y, sv.d_bias, sv.counts, sv.prob_S)
    out = sched.row_ops.gather_sum(y, sv.slot_TK) if sv.token_S is not None else y
    return out, kept


def add_bias(t_SN, bias_EN, counts, prob_S=None) -> torch.Tensor:
    """t_SN += the bias of each row's expert (times the row's prob), in t's dtype."""
    b = bias_EN.index_select(0, _rows_E(counts, t_SN))
    return t_SN.add_((b if prob_S is None else b * prob_S.unsqueeze(1).to(b.dtype)).to(t_SN.dtype))


def _up_projection(sched: Schedule, sv: Saved):
    """(h, the activation x prob, the low-rank intermediate or None) of the gate/up GEMM."""
    act, counts, prob_S = sv.act, sv.counts, sv.prob_S
    up = _bound(sched, "up", sv.offs)
    kw = (act.interleaved, act.kind, act.alpha, act.limit)
    if up is None:
        h, a = sched.kernels.up_act(sv.x, sv.token_S, sv.gate_up, counts, prob_S, sv.trans_w, *kw)
        return h, a, None
    lr1 = _lowranks(sv)[0]
    x_SD = sched.row_ops.gather_rows(sv.x, sv.token_S) if sv.token_S is not None else sv.x
    h = up.mm(x_SD, sv.gate_up, counts, sv.trans_w)
    u1 = grouped_lowrank_fwd(up, x_SD, lr1, counts, h) if lr1 is not None else None
    del x_SD  # recomputed in backward
    if sv.gu_bias is not None:
        add_bias(h, sv.gu_bias, counts)
    if sched.act_row_ops is not None:
        return h, sched.act_row_ops.act_fwd(h, prob_S, *kw), u1
    return h, act_forward(h, prob_S, act), u1


def backward(sched: Schedule, sv: Saved, g_out, need: Needs, release: bool) -> tuple:
    """(dx, d prob, d gate_up, d down, d gate_up bias, d down bias, dA1, dB1, dA2, dB2),
    None where `need` wants none; release: free h (this call's own) once read."""
    if sched.path == "recipe":
        return _recipe_backward(sched, sv, g_out.contiguous(), need)
    lr1, lr2 = _lowranks(sv)
    sv = replace(sv, counts=counts_for(sched, sv.counts, sv.x.device))
    if sched.path == "loop":
        return loop.backward(sv, g_out, need, release, lr1, lr2)
    prob_S, token_S, h, counts = sv.prob_S, sv.token_S, sv.h, sv.counts
    act, trans_w = sv.act, sv.trans_w
    # the compiled backward plans its own memory: storage calls would break it
    rk, kernels = sched.row_ops, sched.kernels
    release = release and not torch.compiler.is_compiling()
    dd, dw = _bound(sched, "down_dgrad", sv.offs), _bound(sched, "down_wgrad", sv.offs)
    g_out = g_out.contiguous()
    gathered = token_S is not None
    gy = g_out
    if gathered and (dd or dw or sv.d_bias is not None):
        gy = rk.gather_rows(g_out, token_S)
    p = None if prob_S is None else prob_S.unsqueeze(1)
    gd = g2a = g2b = None
    need_gp = prob_S is not None and need.prob
    flags = (act.interleaved, need_gp, need.down, act.kind, act.alpha, act.limit)
    if dd is None:  # gather in the prologue, activation backward in the epilogue
        dh, gp, a = kernels.down_dact(g_out, token_S, sv.down, counts, h, prob_S, trans_w, *flags)
    elif sched.act_row_ops is not None:
        da = dd.mm(gy, sv.down, counts, not trans_w)
        dh, gp, a = sched.act_row_ops.act_bwd(da, h, prob_S, *flags)
        del da
    else:
        dh, gp, gd, g2a, g2b, a = _act_backward_eager(sv, dd, gy, h, p, need, lr2, release)
    if release and (dd is None or sched.act_row_ops is not None):
        free_storage(h)  # its last reader was the activation backward
    del h
    ggb, gdb, gp = _bias_grads(sv, gy, dh, gp, need)
    if need.down and gd is None:
        if dw is None:  # dW = gy^T a (trans_w) or a^T gy, the rows of g_out gathered
            ops = (g_out, a, token_S, None) if trans_w else (a, g_out, None, token_S)
            gd = kernels.wgrad(*ops[:2], counts, *ops[2:])
        else:
            gd = dw.wgrad(gy, a, counts) if trans_w else dw.wgrad(a, gy, counts)
    if release and a is not None:
        free_storage(a)
    del a, gy
    gx, ggu, g1a, g1b = _gate_up_backward(sched, sv, dh, lr1, need)
    return (gx, gp, ggu, gd, ggb, gdb, g1a, g1b, g2a, g2b)


def _recipe_forward(sched: Schedule, sv: Saved):
    """(y_SD, what backward keeps) of a recipe: its slot (`sched.recipe_mlp`, e.g.
    `quant/mlp.py::RecipeSlot`) quantizes, runs each projection's GEMMs and keeps its
    saved format; the engine orders them and adds the biases and their gradients."""
    q = sched.recipe_mlp(sched.recipe, sv)
    h = q.up(sv.x)
    if sv.gu_bias is not None:
        add_bias(h, sv.gu_bias, sv.counts)
    return q.down(h), q.keep(h)


def _recipe_backward(sched: Schedule, sv: Saved, g_out, need: Needs) -> tuple:
    q, token_S = sched.recipe_mlp(sched.recipe, sv), sv.token_S
    gy = g_out.index_select(0, token_S) if token_S is not None else g_out
    dh, gp, gd = q.down_backward(g_out, gy, need.prob)
    ggb, gdb, gp = _bias_grads(sv, gy, dh, gp, need)
    gx, ggu = q.up_backward(dh, need.x)
    if gx is not None and token_S is not None:  # no slot_TK kept: every token has K
        slots = sv.slot_TK if sv.slot_TK is not None else token_S.argsort(stable=True)
        gx = sched.row_ops.gather_sum(gx, slots.reshape(g_out.shape[0], -1))
    return (gx, gp, ggu, gd, ggb, gdb, None, None, None, None)


def _bias_grads(sv: Saved, gy, dh, gp, need: Needs):
    """(d gate_up bias, d down bias, gp plus the down bias's term) from gy and dh."""
    ggb = gdb = None
    if sv.d_bias is not None:
        rows_E = _rows_E(sv.counts, gy)
        if need.down_bias:
            g = gy if sv.prob_S is None else gy * sv.prob_S.unsqueeze(1)
            gdb = torch.zeros_like(sv.d_bias).index_add_(0, rows_E, g.to(sv.d_bias.dtype))
        if gp is not None:
            gp += (gy * sv.d_bias.index_select(0, rows_E)).sum(1)
    if sv.gu_bias is not None and need.gate_up_bias:
        rows_E = _rows_E(sv.counts, dh)
        ggb = torch.zeros_like(sv.gu_bias).index_add_(0, rows_E, dh.to(sv.gu_bias.dtype))
    return ggb, gdb, gp


def _gate_up_backward(sched, sv, dh, lr1, need):
    """(dx combined back to tokens, d gate_up, dA, dB of its low-rank update) from dh."""
    x, token_S, counts, trans_w, rk = sv.x, sv.token_S, sv.counts, sv.trans_w, sched.row_ops
    uw, ud = _bound(sched, "up_wgrad", sv.offs), _bound(sched, "up_dgrad", sv.offs)
    ggu = g1a = g1b = gu1 = gx = None
    if need.gate_up and uw is None:
        ops = (dh, x, None, token_S) if trans_w else (x, dh, token_S, None)
        ggu = sched.kernels.wgrad(*ops[:2], counts, *ops[2:])
    elif need.gate_up or lr1 is not None:
        x_SD = rk.gather_rows(x, token_S) if token_S is not None else x
        if need.gate_up:
            ggu = uw.wgrad(dh, x_SD, counts) if trans_w else uw.wgrad(x_SD, dh, counts)
        if lr1 is not None:
            gu1, g1a, g1b = grouped_lowrank_bwd(uw, dh, x_SD, sv.u1, lr1, counts, need.a1, need.b1)
        del x_SD
    if need.x:
        dx = ud.mm(dh, sv.gate_up, counts, not trans_w)
        if lr1 is not None:
            grouped_lowrank_dx(ud, gu1, lr1, counts, dx)
        gx = rk.gather_sum(dx, sv.slot_TK) if token_S is not None else dx
    return gx, ggu, g1a, g1b


def _act_backward_eager(sv, be, gy, h, p, need, lr2, release):
    """(dh, d prob, d down, dA, dB of the down update, None) by the torch math."""
    counts, trans_w = sv.counts, sv.trans_w
    a0, d_gate, d_up = act_parts(h, sv.act)
    dh = torch.empty_like(h)
    # free h now unless one of the parts is a view of it (an identity-like kind)
    ptr = h.untyped_storage().data_ptr()
    if release and all(
        t is None or t.untyped_storage().data_ptr() != ptr for t in (a0, d_gate, d_up)
    ):
        free_storage(h)
    gd = gp = g2a = g2b = None
    if need.down or lr2 is not None:
        ap = a0 if p is None else a0 * p
    if need.down:
        gd = be.wgrad(gy, ap, counts) if trans_w else be.wgrad(ap, gy, counts)
    da = be.mm(gy, sv.down, counts, not trans_w)
    if lr2 is not None:
        gu2, g2a, g2b = grouped_lowrank_bwd(be, gy, ap, sv.u2, lr2, counts, need.a2, need.b2)
        grouped_lowrank_dx(be, gu2, lr2, counts, da)
    if p is not None and need.prob:
        gp = (da * a0).sum(1)
    if p is not None:
        da.mul_(p)
    return act_input_grad(da, d_gate, d_up, sv.act.interleaved, dh), gp, gd, g2a, g2b, None


def _lowranks(sv: Saved):
    """The call's (gate_up, down) `LowRank`s; (None, None) without factors."""
    return lowranks((*sv.lora, *sv.lora_scales)) if sv.lora else (None, None)


def _bound(sched: Schedule, gemm: str, offs):
    """The backend of `gemm` with the layer's offsets bound in (None: the fused kernel)."""
    be = sched.gemm(gemm)
    return None if be is None else bind_offsets(be, None, offs) if offs is not None else be


def counts_for(sched: Schedule, counts, device):
    """The counts as the schedule's GEMMs take them: a device tensor or a host list."""
    if isinstance(counts, torch.Tensor) and not sched.device_counts:
        return counts.tolist()
    if sched.device_counts and not isinstance(counts, torch.Tensor):
        return torch.tensor(counts, device=device)
    return counts


def _rows_E(counts, like: torch.Tensor) -> torch.Tensor:
    """The expert of each sorted row, without a host sync (the row count is known)."""
    c = counts if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=like.device)
    E = torch.arange(c.numel(), device=like.device)
    return torch.repeat_interleave(E, c.to(like.device), output_size=like.shape[0])
