"""The expert engine's recipe slot (`RecipeSlot`): FP8 / MXFP8 GEMMs and saved activations.

Forward: gate/up GEMM -> SwiGLU x prob quantized for the down GEMM in one pass
(`swiglu_quant`) -> down GEMM. Kept: x and h in full precision, or with
fp8_saved_activations h in E4M3 (one scale per row) and x as its weight gradient's FP8
operand (x_TD itself on the token path). Backward recomputes the SwiGLU output in the
pass of its backward (`_swiglu_grads`). With row or MX scales the token path quantizes
the T token rows once and gathers the FP8 bytes (`_operand_rows`). Other activations are
composed from the recipe's grouped GEMMs.
"""

# S rows (sorted pairs), D model dim, F expert hidden dim, E experts

from __future__ import annotations

import dataclasses
from dataclasses import replace
from functools import partial
from types import SimpleNamespace

import torch

from ..ops.activation.eager import act_forward
from ..ops.dispatch import recipe_active
from ..ops.expert_mlp.eager import composed_mlp
from ..ops.expert_mlp.engine import Saved, routed_mlp
from ..ops.expert_mlp.plan import Schedule
from ..ops.permute import permute, unpermute
from ..ops.permute.row_ops import pick_row_ops
from ..ops.registry import triton_importable
from ..ops.specs import ActivationConfig
from . import gemm
from .formats import QTensor, quantize_current, scale_from_amax
from .gemm import BACKENDS, delayed_state, load_q, pick_backend, quantize_operand, save_q

_SWIGLU = ActivationConfig()


def _swiglu_f32(h_S2F: torch.Tensor, prob_S) -> torch.Tensor:
    """silu(gate) * up * prob in fp32 (the down GEMM's input before quantization)."""
    return act_forward(h_S2F.float(), None if prob_S is None else prob_S.float(), _SWIGLU)


def _swiglu_grads(h_S2F, prob_S, g_SF, want_prob, recipe, scale, dtype, quantize_col):
    """(grad_h in `dtype`, grad_prob or None, the recomputed activation quantized for the
    down weight gradient): one Triton pass with a per-tensor scale from forward on CUDA
    in E4M3 (`swiglu_bwd_quant`), else the row ops' SwiGLU backward, then `quantize_col`."""
    if scale is not None and h_S2F.is_cuda and recipe.fwd_format == "e4m3" and triton_importable():
        kw = dict(need_prob_grad=want_prob, grad_dtype=dtype)
        return swiglu_bwd_quant(g_SF, h_S2F, prob_S, scale, **kw)
    rows = pick_row_ops(h_S2F, activation="swiglu")
    dh, dprob, a = rows.act_bwd(g_SF, h_S2F, prob_S, False, want_prob, True, "swiglu")
    return dh.to(dtype), dprob, quantize_col(a, scale=scale)


def swiglu_quant(h_S2F, prob_S, recipe, key) -> QTensor:
    """silu(gate) * up * prob quantized row-wise for the down GEMM: one Triton kernel on
    CUDA for E4M3 (`fused_swiglu_quant`), else fp32 math quantized in torch (the spec)."""
    if h_S2F.is_cuda and recipe.fwd_format == "e4m3" and triton_importable():
        return fused_swiglu_quant(h_S2F, prob_S, recipe, key)
    return quantize_operand(recipe, _swiglu_f32(h_S2F, prob_S), "x", 1, key=key)


def swiglu_quant_mx(h_S2F, prob_S=None, **kw) -> QTensor:
    """`ops/activation/swiglu_quant_kernels.quantize_mx` as `formats.quantize_mx(a, 1)`."""
    from ..ops.activation.swiglu_quant_kernels import quantize_mx

    q, s = quantize_mx(h_S2F, prob_S, **kw)
    return QTensor(q, s, "e4m3", kind="mx", dim=1, size=h_S2F.shape[1] // 2)


def swiglu_quant_scaled(h_S2F, prob_S, fmt: str, scale: torch.Tensor, **kw):
    """`quantize_scaled` as (QTensor of the per-tensor `scale`, amax before quantizing)."""
    from ..ops.activation.swiglu_quant_kernels import quantize_scaled

    q, amax = quantize_scaled(h_S2F, prob_S, fmt, scale, **kw)
    scale = scale.float().reshape(()).to(q.device)
    return QTensor(q, torch.reciprocal(scale), "e4m3", scale=scale), amax


def swiglu_quant_rows(h_S2F, prob_S, fmt: str = "e4m3", margin: int = 0, **kw) -> QTensor:
    """`quantize_rows` as `formats.quantize_current(a, fmt, dims=1, margin=margin)`."""
    from ..ops.activation.swiglu_quant_kernels import quantize_rows

    q, scale = quantize_rows(h_S2F, prob_S, fmt, margin, **kw)
    return QTensor(q, torch.reciprocal(scale), "e4m3", scale=scale)


def swiglu_bwd_quant(g_SF, h_S2F, prob_S, scale, **kw):
    """`swiglu_bwd_quant_kernels.bwd_quant` as (grad_h, grad_prob or None, the activation
    as an E4M3 QTensor of the per-tensor `scale`)."""
    from ..ops.activation.swiglu_bwd_quant_kernels import bwd_quant

    grad_h, grad_p, q = bwd_quant(g_SF, h_S2F, prob_S, scale, **kw)
    scale = scale.float().reshape(()).to(q.device)
    return grad_h, grad_p, QTensor(q, torch.reciprocal(scale), "e4m3", scale=scale)


def fused_swiglu_quant(h_S2F, prob_S, recipe, key, **kw) -> QTensor:
    """The fused SwiGLU + E4M3 kernels by scaling mode: MX blocks; delayed (the scale known
    before, the amax recorded after); current per row or per tensor (an amax launch, then
    the cast). `kw` (act=False) is for the bit-exact tests."""
    from ..ops.activation.swiglu_quant_kernels import amax as swiglu_amax

    mode = gemm.scaling_mode(recipe)
    if mode == "mx":
        return swiglu_quant_mx(h_S2F, prob_S, fmt="e4m3", scale_rule=recipe.scale_rule, **kw)
    if recipe.kind == "delayed":
        st = delayed_state(recipe, key, "x", h_S2F.new_zeros((), dtype=torch.float32))
        q, a_amax = swiglu_quant_scaled(h_S2F, prob_S, "e4m3", st.scale, **kw)
        st.use_and_update(a_amax, recipe, "e4m3")
        return q
    if mode == "row":
        return swiglu_quant_rows(h_S2F, prob_S, "e4m3", recipe.margin, **kw)
    scale = scale_from_amax(swiglu_amax(h_S2F, prob_S, **kw), "e4m3", recipe.margin)
    return swiglu_quant_scaled(h_S2F, prob_S, "e4m3", scale, **kw)[0]


def _gather_q(q: QTensor, index_S: torch.Tensor) -> QTensor:
    """Rows index_S of a row-quantized tensor: its FP8 bytes and its row scales."""

    def rows(t):
        if t is None or t.dim() != 2 or t.shape[0] != q.data.shape[0]:
            return t
        if t.element_size() == 1:  # fp8 / e8m0: gathered as bytes
            return t.view(torch.uint8).index_select(0, index_S).view(t.dtype)
        return t.index_select(0, index_S)

    return dataclasses.replace(
        q, data=rows(q.data), scale_inv=rows(q.scale_inv), scale=rows(q.scale)
    )


def _operand_rows(recipe, t, token_S, role, key, every_row: bool = False):
    """The row-wise quantized GEMM operand t[token_S] (t when token_S is None). Row and MX
    scales depend on each row alone: the T rows are quantized once and the FP8 rows
    gathered (the same bytes). A per-tensor scale is the gathered rows' amax: t's when
    `every_row` of t is gathered (dropless), else the rows are gathered first."""
    if token_S is None:
        return quantize_operand(recipe, t, role, 1, key=key)
    if gemm.scaling_mode(recipe) == "tensor" and not every_row:
        return quantize_operand(recipe, t.index_select(0, token_S), role, 1, key=key)
    return _gather_q(quantize_operand(recipe, t.contiguous(), role, 1, key=key), token_S)


def _store_h(h_S2F) -> QTensor:
    # storage only (no GEMM reads it): E4M3 with one fp32 scale per row, 4 bytes per
    # 2F values, for every recipe
    return quantize_current(h_S2F, "e4m3", dims=1)


def saved_for_backward(
    recipe, x_TD, ids_TK, gate_up, trans_w: bool = True, rows: int | None = None
):
    """What `RecipeSlot.keep` keeps on the token path (dropless) beside x_TD and the weights: h
    [R, N] (as `_store_h` stores it with fp8_saved_activations), prob_S, token_S and
    pair_S [R] (R = T*K unless `rows` says). What `dropless plan` allocates."""
    T, K = ids_TK.shape
    R = T * K if rows is None else rows
    N = gate_up.shape[1] if trans_w else gate_up.shape[2]
    fp8 = recipe.fp8_saved_activations  # E4M3 values and one fp32 scale per row
    h = [x_TD.new_empty(R, N, dtype=torch.float8_e4m3fn if fp8 else None)]
    h += [x_TD.new_empty(R, 1, dtype=torch.float32)] if fp8 else []
    index = [x_TD.new_empty(R, dtype=torch.int64) for _ in range(2)]  # token_S, pair_S
    return (*h, x_TD.new_empty(R), *index)


def saved_for_backward_rows(recipe, like, rows: int, gate_up, trans_w: bool = True):
    """What `RecipeSlot.keep` keeps on the rows path (expert parallelism's received rows) beside
    the weights: with fp8_saved_activations x [R, D] in E4M3 with its column-wise scales
    (per group and column under row scaling; under MXFP8 per 32-row block of each group,
    with the rows' positions in that padded layout: an upper bound) and h as `_store_h`
    stores it; else x and h in the rows' dtype. like: a tensor like the rows [., D]."""
    R, D = rows, like.shape[-1]
    E = gate_up.shape[0]
    N = gate_up.shape[1] if trans_w else gate_up.shape[2]
    if not recipe.fp8_saved_activations:
        return like.new_empty(R, D), like.new_empty(R, N)
    fp8 = dict(dtype=torch.float8_e4m3fn)
    mode = gemm.scaling_mode(recipe)
    if mode == "mx":
        blocks = R // 32 + E  # at most one partial block per group
        x = [like.new_empty(32 * blocks, D, **fp8), like.new_empty(blocks, D, dtype=torch.uint8)]
        x.append(like.new_empty(R, dtype=torch.int64))
    else:
        x = [like.new_empty(R, D, **fp8)]
        if mode == "row":
            x.append(like.new_empty(E, D, dtype=torch.float32))
    h = [like.new_empty(R, N, **fp8), like.new_empty(R, 1, dtype=torch.float32)]
    return (*x, *h)


class RecipeSlot:
    """One call's FP8 / MXFP8 quantizers and GEMMs, per projection, and its saved format:
    what the engine's recipe steps call, in its order (`engine._recipe_forward`). Per-tensor
    scales of the forward are kept and reused by backward; other modes requantize."""

    def __init__(self, recipe, sv: Saved):
        self.recipe, self.sv, self.qs = recipe, sv, []
        n, slot_TK = 0 if sv.token_S is None else sv.token_S.numel(), sv.slot_TK
        # dropless (backward: slot_TK not kept): every token row is gathered at least once
        self.every_row = n > 0 and (slot_TK is None or n == slot_TK.numel())
        if sv.meta is None:  # forward
            self.be = pick_backend(recipe, sv.x, sv.gate_up, sv.down)
            self.tensor, self.scale = gemm.scaling_mode(recipe) == "tensor", {}
        else:
            x_meta, h_meta, self.be, self.tensor = sv.meta
            self.x, h = load_q(sv.h[0:3], x_meta), load_q(sv.h[3:6], h_meta)
            self.h = h.dequantize() if isinstance(h, QTensor) else h
            self.scale = dict(zip(("x", "gate_up", "a", "down"), sv.h[6:10]))
        self._mm, self._wgrad = BACKENDS[self.be]

    def _q(self, t, role: str, key, dim: int = 1, scale=None):
        kw = dict(key=key, counts=self.sv.counts, scale=scale) if dim == 0 else dict(key=key)
        return quantize_operand(self.recipe, t, role, dim, **kw)

    def _gemm(self, aq, w, dgrad: bool, dtype, name=None):
        """aq @ w[e]^T (forward, nn.Linear layout) or aq @ w[e] (dgrad), w quantized."""
        trans_w, scale = self.sv.trans_w, self.scale.get(name)
        wq = quantize_operand(self.recipe, w, "w", 2 if trans_w != dgrad else 1, key=w, scale=scale)
        self.qs.append(wq)
        return self._mm(aq, wq, self.sv.counts, trans_w != dgrad, dtype, fast_accum=not dgrad)

    def _wgrad_of(self, gq, g_S, a_col, w):
        """d w from the gradient rows (gq itself under per-tensor scales) and the input."""
        g = gq if self.tensor else self._q(g_S, "g", w, 0)
        a, b = (g, a_col) if self.sv.trans_w else (a_col, g)
        return self._wgrad(a, b, self.sv.counts, w.dtype)

    def up(self, x):
        """h = x[token_S] @ gate_up (x's rows quantized once, `_operand_rows`)."""
        xq = _operand_rows(self.recipe, x, self.sv.token_S, "x", self.sv.gate_up, self.every_row)
        self.qs.append(xq)
        return self._gemm(xq, self.sv.gate_up, False, x.dtype)

    def down(self, h_S2F):
        """y = (SwiGLU x prob, quantized in its pass: `swiglu_quant`) @ down."""
        self.qs.append(swiglu_quant(h_S2F, self.sv.prob_S, self.recipe, self.sv.down))
        return self._gemm(self.qs[-1], self.sv.down, False, h_S2F.dtype)

    def down_backward(self, g_out, g_SD, want_prob: bool):
        """(dh, d prob, d down): dgrad, the SwiGLU backward recomputing the activation from
        the kept h (quantized for the weight gradient), wgrad."""
        sv, dtype = self.sv, g_out.dtype
        gq = _operand_rows(self.recipe, g_out, sv.token_S, "g", sv.down, self.every_row)
        # the real FP8 GEMMs (and MXFP8's bf16 ones) round to bf16 anyway: an fp32 copy of
        # their output would be one more [S, F] pass; the emulation keeps its fp32
        da_dtype = torch.float32 if self.be == "emulated" else dtype
        da = self._gemm(gq, sv.down, True, da_dtype, "down")
        col = partial(self._q, role="x", key=sv.down, dim=0)
        a_scale = self.scale.get("a")
        dh, gp, a = _swiglu_grads(
            self.h, sv.prob_S, da, want_prob, self.recipe, a_scale, dtype, col
        )
        return dh, gp, self._wgrad_of(gq, g_SD, a, sv.down)

    def up_backward(self, dh, want_x: bool):
        """(dx_SD or None, d gate_up)."""
        sv, x = self.sv, self.x
        dhq = self._q(dh, "g", sv.gate_up)
        dx = self._gemm(dhq, sv.gate_up, True, dh.dtype, "gate_up") if want_x else None
        if not isinstance(x, QTensor):
            x_SD = x.index_select(0, sv.token_S) if sv.token_S is not None else x
            x = self._q(x_SD, "x", sv.gate_up, 0, self.scale.get("x"))
        return dx, self._wgrad_of(dhq, dh, x, sv.gate_up)

    def keep(self, h_S2F) -> Saved:
        """The call's `Saved` as backward reads it: x and h in full precision, or with
        fp8_saved_activations h in E4M3 and x as its weight gradient's operand (x_TD, the
        caller's, as it is); the per-tensor scales; slot_TK only when some pair dropped."""
        sv, recipe, saved = self.sv, self.recipe, []
        x, xq = sv.x, self.qs[0]
        if not recipe.fp8_saved_activations:
            x_meta, h_meta = save_q(saved, None, x), save_q(saved, None, h_S2F)
        else:
            if sv.token_S is not None:
                x_meta = save_q(saved, None, x)
            elif self.tensor:
                x_meta = save_q(saved, xq, None)
            else:
                x_meta = save_q(saved, self._q(x, "x", sv.gate_up, 0), None)
            h_meta = save_q(saved, _store_h(h_S2F), None)
        if self.tensor:  # x, gate_up, a, down
            saved += [q.scale for q in self.qs]
        # dropless: the engine recomputes each token's slots from token_S in backward
        dropped = sv.token_S is not None and sv.token_S.numel() != sv.slot_TK.numel()
        slot_TK = sv.slot_TK if dropped else None
        meta = (x_meta, h_meta, self.be, self.tensor)
        return replace(sv, x=None, slot_TK=slot_TK, h=tuple(saved), meta=meta)


def quantized_grouped_mlp(
    x,
    counts,
    prob_S,
    gate_up,
    down,
    *,
    gate_up_bias=None,
    down_bias=None,
    activation: ActivationConfig | None = None,
    trans_w=True,
    backend=None,
    recipe=None,
    token_S=None,
    slot_TK=None,
    num_out=None,
):
    """`ops.grouped_mlp` under a recipe (its `grouped_mlp`): the engine with the recipe's
    slot. x is x_SD, or x_TD with token_S and slot_TK (-> the combined out [T, D]).
    `backend` is ignored (the recipe's chooses); activations other than swiglu are
    composed from the recipe's grouped GEMMs."""
    if recipe is None:
        raise ValueError("quantized_grouped_mlp needs recipe=; use dropless.autocast(recipe=...)")
    if (token_S is None) != (slot_TK is None):
        raise ValueError("token_S and slot_TK go together (both from SortedPairs) or not at all")
    if not isinstance(counts, torch.Tensor):  # a device tensor stays there (no sync)
        counts = [int(c) for c in counts]
    act = activation if activation is not None else ActivationConfig()
    if act.kind != "swiglu" or act.interleaved:
        sp = SimpleNamespace(token_S=token_S, slot_TK=slot_TK)
        x_SD = x if token_S is None else permute(x, sp)
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        kw = dict(gate_up_bias=gate_up_bias, down_bias=down_bias, trans_w=trans_w, activation=act)
        with recipe_active(recipe):  # its grouped GEMMs read the active recipe: this one
            y = composed_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
        return y if token_S is None else unpermute(y, sp)
    b1, b2, tw = gate_up_bias, down_bias, bool(trans_w)
    sv = Saved(x, prob_S, gate_up, down, b1, b2, token_S, slot_TK, counts, act, tw)
    sched = Schedule("recipe", row_ops=pick_row_ops(x), recipe=recipe, recipe_mlp=RecipeSlot)
    return routed_mlp(sched, sv, None)  # the combine has slot_TK's rows


# tells `ops.expert_mlp` it may pass x_TD with token_S / slot_TK / num_out
quantized_grouped_mlp.takes_tokens = True
