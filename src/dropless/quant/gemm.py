"""Quantized grouped GEMM under a recipe: operand quantization, backends, autograd.

Each GEMM quantizes its operands along its own reduction dim: forward over D, dgrad over
N, wgrad over the rows of each expert (column-wise; for MXFP8 each expert's rows padded to
a multiple of 32). Per-tensor scales do not depend on the dim: quantized once, reused.
Backends: `emulated` (dequantized to fp32), `torch` (row-wise FP8 through
torch._scaled_grouped_mm on sm90+) and `bf16` (MXFP8 on sm90+ as bf16 GEMMs on exact
dequantized values); docs/fp8.md. Device counts are read on the host only by a GEMM
backend that needs a list (the CPU loop). Weights whose quantization depends on the weight
alone are quantized once per optimizer step (`ops.weight_cache`), column-major where the
FP8 GEMMs read them so (`dgrad_layout`).
"""

# S rows (sorted pairs), D in features, N out features, E experts

from __future__ import annotations

import dataclasses
import warnings

import torch

from ..ops.grouped_gemm.backends import pick_gemm_backend
from ..ops.grouped_gemm.eager import expand_bias, group_sum
from ..ops.weight_cache import cached_cast
from .formats import (
    FP8_DTYPES,
    QTensor,
    amax,
    quantize_mx,
    quantize_mx_groups,
    quantize_scaled,
    scale_from_amax,
)
from .fp8_wgrad import col_scaled, fp8_wgrad_available, scaled_wgrad, torch_fp8_available

# --- operand quantization -----------------------------------------------------------------


def scaling_mode(recipe) -> str:
    """'mx', 'row' or 'tensor': how scales are laid out for this recipe."""
    if recipe.kind == "mxfp8":
        return "mx"
    return "row" if getattr(recipe, "granularity", "tensor") == "row" else "tensor"


class _History:
    """Delayed-scaling state of one tensor role: amax history and the scale in use."""

    def __init__(self, length: int, amax_: torch.Tensor):
        self.hist = torch.zeros((length, *amax_.shape), device=amax_.device)
        self.scale = torch.ones_like(amax_, dtype=torch.float32)

    def use_and_update(self, amax_: torch.Tensor, recipe, fmt: str) -> torch.Tensor:
        scale = self.scale
        self.hist = torch.roll(self.hist, 1, 0)
        self.hist[0] = amax_
        a = self.hist.amax(0) if recipe.amax_compute_algo == "max" else self.hist[0]
        ok = (a > 0) & torch.isfinite(a)  # keep the previous scale on 0 / Inf / NaN
        self.scale = torch.where(ok, scale_from_amax(a, fmt, recipe.margin), scale)
        return scale


def delayed_state(recipe, key: torch.Tensor, role: str, amax_: torch.Tensor) -> _History:
    """The delayed-scaling state of `key`'s `role` (created on first use)."""
    roles = recipe.state.get(key)
    if roles is None:
        roles = recipe.state[key] = {}
    st = roles.get(role)
    if st is None or st.scale.shape != amax_.shape:
        st = roles[role] = _History(recipe.amax_history_len, amax_)
    return st


def delayed_scale(
    recipe, key: torch.Tensor, role: str, amax_: torch.Tensor, fmt: str
) -> torch.Tensor:
    """The scale for this call (from past amaxes of `key`'s `role`); records amax_."""
    return delayed_state(recipe, key, role, amax_).use_and_update(amax_.detach(), recipe, fmt)


def quantize_operand(
    recipe, t, role: str, dim: int, *, key=None, counts=None, scale=None
) -> QTensor:
    """Quantize a GEMM operand along its reduction dim `dim`.

    role: "x" (activations) or "w" (weights) use the forward format, "g" (gradients)
    the backward one. counts (with dim 0): column-wise over expert groups of rows.
    scale: reuse a per-tensor scale (delayed scaling must not update twice).
    """
    fmt = recipe.bwd_format if role == "g" else recipe.fwd_format
    mode = scaling_mode(recipe)
    if role == "w" and counts is None and recipe.kind != "delayed":
        # current scaling derives the weight's scale from the weight itself: a scale
        # handed back from forward is the one the cache would compute
        return _cached_weight(recipe, t, dim, fmt, mode, key)
    return _quantize(recipe, t, role, dim, fmt, mode, key, counts, scale)


# one conversion function per weight layout and quantization: `cached_cast` keys its
# entries by the function's identity, so the same layout must get the same object
_WEIGHT_FNS: dict[tuple, object] = {}


def _cached_weight(recipe, w, dim: int, fmt: str, mode: str, key) -> QTensor:
    """The quantized weight from the one weight cache (`ops.weight_cache.cached_cast`):
    made once per optimizer step, also under FSDP2 (the cache also watches the optimizer
    step, which FSDP2's re-gathers into the same tensor cannot hide). A view of a
    parameter (a converted Linear's `weight.unsqueeze(0)`, fresh per call) is cached on
    the parameter it views; a tensor that is no view of a leaf is quantized per call."""
    base = w if w._base is None else w._base  # a view's base shares its storage
    if base.dtype != w.dtype:  # a dtype view: as_strided on the base cannot rebuild it
        return _quantize(recipe, w, "w", dim, fmt, mode, key, None, None)
    layout = (tuple(w.shape), w.stride(), w.storage_offset())
    rule = (
        recipe.kind,
        mode,
        fmt,
        dim,
        getattr(recipe, "scale_rule", None),
        recipe.margin if hasattr(recipe, "margin") else 0,
    )
    fn = _WEIGHT_FNS.get((rule, layout))
    if fn is None:
        fn = _WEIGHT_FNS[(rule, layout)] = _weight_fn(recipe, dim, fmt, mode, layout)
    return cached_cast(base, FP8_DTYPES[fmt], fn)


def _weight_fn(recipe, dim: int, fmt: str, mode: str, layout):
    def quantize(base: torch.Tensor) -> QTensor:
        w = base.detach().as_strided(*layout)
        return dgrad_layout(_quantize(recipe, w, "w", dim, fmt, mode, None, None, None), dim)

    return quantize


def dgrad_layout(q: QTensor, dim: int) -> QTensor:
    """A grouped weight quantized along dim 1 (the GEMMs that read it as b [E, K, N]:
    dgrad of x @ w^T, or the forward of x @ w) stored column-major on CUDA, the layout
    `torch._scaled_grouped_mm` takes, so no GEMM call transposes it (the cache keeps
    this copy for the whole optimizer step)."""
    if not (q.kind == "scaled" and q.data.dim() == 3 and dim == 1 and q.data.is_cuda):
        return q
    return column_major(q)


def column_major(q: QTensor) -> QTensor:
    """q with data [E, K, N] stored as its transpose's contiguous copy (same values)."""
    return dataclasses.replace(q, data=q.data.transpose(1, 2).contiguous().transpose(1, 2))


def _quantize(recipe, t, role, dim, fmt, mode, key, counts, scale) -> QTensor:
    if mode == "mx":
        if counts is not None:
            return quantize_mx_groups(t, counts, fmt=fmt, scale_rule=recipe.scale_rule)
        return quantize_mx(t, dim, fmt=fmt, scale_rule=recipe.scale_rule)
    if scale is None:
        if mode == "row":
            a = amax(t, dim)
        else:  # a grouped weight is one tensor per expert, as in TE's GroupedLinear
            a = amax(t, (1, 2)) if (role == "w" and t.dim() == 3) else amax(t)
        if recipe.kind == "delayed":
            scale = delayed_scale(recipe, key, role, a, fmt)
        else:
            scale = scale_from_amax(a, fmt, recipe.margin)
    return quantize_scaled(t, fmt, scale)


# --- backends -------------------------------------------------------------------------------


def _for(backend, counts):
    """counts as the GEMM backend takes them (a host list unless it takes device counts)."""
    if isinstance(counts, torch.Tensor) and not backend.device_counts:
        return counts.tolist()  # host sync: only backends without device offsets (CPU loop)
    return counts


def _dequantized(dtype):
    """(mm, wgrad) on both operands dequantized to `dtype`, through the grouped GEMM."""

    def mm(aq: QTensor, bq: QTensor, counts, trans_b: bool, out_dtype, fast_accum=False):
        a, b = aq.dequantize(dtype), bq.dequantize(dtype)
        be = pick_gemm_backend(None, a, b)
        return be.mm(a, b, _for(be, counts), trans_b).to(out_dtype)

    def wgrad(aq: QTensor, bq: QTensor, counts, out_dtype) -> torch.Tensor:
        a, b = aq.dequantize(dtype), bq.dequantize(dtype)
        be = pick_gemm_backend(None, a, b)
        return be.wgrad(a, b, _for(be, counts)).to(out_dtype)

    return mm, wgrad


_emu_mm, _emu_wgrad = _dequantized(torch.float32)
_bf16_mm, _bf16_wgrad = _dequantized(torch.bfloat16)


_WARNED_E5M2 = False


def _warn_e5m2_once() -> None:
    global _WARNED_E5M2
    if not _WARNED_E5M2:
        _WARNED_E5M2 = True
        warnings.warn(
            "torch._scaled_grouped_mm takes E4M3 operands only: with fp8_format=HYBRID or "
            "E5M2 the GEMMs that read E5M2 gradients (dgrad) run emulated in fp32, at fp32 "
            "speed. Use fp8_format='E4M3' for real FP8 GEMMs throughout (see docs/fp8.md).",
            stacklevel=3,
        )


def _torch_mm(aq: QTensor, bq: QTensor, counts, trans_b: bool, out_dtype, fast_accum=False):
    """fast_accum: the forward GEMMs' fast FP8 accumulation (as Transformer Engine; the
    gradient GEMMs keep the precise one)."""
    # Ran on an H200 at commit 5d8f939 (2026-11-30; docs/fp8.md).
    # _scaled_grouped_mm takes e4m3 operands, b column-major [E, K, N], and row-wise
    # fp32 scales [S] and [E, N]: a per-tensor scale is expanded.
    e4m3 = torch.float8_e4m3fn
    if aq.kind != "scaled" or aq.data.dtype != e4m3 or bq.data.dtype != e4m3:
        _warn_e5m2_once()
        return _emu_mm(aq, bq, counts, trans_b, out_dtype)
    if aq.data.shape[0] == 0:
        return aq.data.new_zeros(0, bq.data.shape[1] if trans_b else bq.data.shape[2]).to(out_dtype)
    scale_a = aq.scale_inv.float().expand(aq.data.shape)[:, 0].contiguous()
    sb = bq.scale_inv.float().expand(bq.data.shape)
    if trans_b:  # data [E, N, K]: its transpose is already column-major
        b, scale_b = bq.data.transpose(1, 2), sb[:, :, 0].contiguous()
    else:  # data [E, K, N]; a cached weight is column-major already (`dgrad_layout`)
        b, scale_b = bq.data.transpose(1, 2).contiguous().transpose(1, 2), sb[:, 0, :].contiguous()
    if isinstance(counts, torch.Tensor):
        offs = counts.to(aq.data.device).cumsum(0, dtype=torch.int32)
    else:
        offs = torch.tensor(counts, device=aq.data.device).cumsum(0).to(torch.int32)
    y = torch._scaled_grouped_mm(
        aq.data,
        b,
        scale_a,
        scale_b,
        offs=offs,
        out_dtype=torch.bfloat16,
        use_fast_accum=bool(fast_accum),
    )
    return y.to(out_dtype)


def _torch_wgrad(aq: QTensor, bq: QTensor, counts, out_dtype) -> torch.Tensor:
    """Weight gradients of the "torch" backend: FP8 GEMMs where the operands are E4M3 with
    column scales and the device passed the probe, else the bf16 grouped GEMM on
    dequantized operands (E5M2 gradients of HYBRID recipes)."""
    if col_scaled(aq) and col_scaled(bq) and fp8_wgrad_available(aq.data.device):
        return scaled_wgrad(aq, bq, counts, out_dtype)
    return _bf16_wgrad(aq, bq, counts, out_dtype)


BACKENDS = {
    "emulated": (_emu_mm, _emu_wgrad),
    "torch": (_torch_mm, _torch_wgrad),
    "bf16": (_bf16_mm, _bf16_wgrad),
}


def fp8_aligned(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether every dimension the FP8 GEMMs of x with these weights read is a multiple of
    16 (16 bytes of FP8): x's features and both dims of each weight."""
    return x.shape[-1] % 16 == 0 and all(
        t.shape[-1] % 16 == 0 and t.shape[-2] % 16 == 0 for t in weights
    )


def pick_backend(recipe, x: torch.Tensor, w: torch.Tensor | None = None, *more) -> str:
    """The quantized backend for this recipe and input: an explicit one must be able to
    run (else ValueError); "auto" takes the real one where it exists (row-wise FP8:
    "torch"; MXFP8 on sm90+: "bf16"), else emulated. `more`: further weights of the
    same layer (the down projection): every dimension any GEMM reads must be a
    multiple of 16 (F too, the down GEMM's inner dim)."""
    aligned = fp8_aligned(x, *[t for t in (w, *more) if t is not None])
    gpu_ok = x.is_cuda and aligned and torch_fp8_available(x.device)
    mx = scaling_mode(recipe) == "mx"
    if recipe.backend == "emulated":
        return "emulated"
    if recipe.backend == "torch":
        if mx or not gpu_ok:
            why = (
                "MXFP8 has no real grouped GEMM here (torch's sm100 MX path is not wired; "
                "backend='auto' runs it as bf16 GEMMs on exact dequantized values on sm90+)"
                if mx
                else "row-wise FP8 needs torch._scaled_grouped_mm on a CUDA sm90+ GPU and "
                f"dims that are multiples of 16; got {x.device}, x {tuple(x.shape)}"
            )
            raise ValueError(
                f"recipe backend='torch' cannot run: {why}. Use backend='auto' or 'emulated'."
            )
        return "torch"
    if not gpu_ok:
        return "emulated"
    return "bf16" if mx else "torch"


# --- autograd -----------------------------------------------------------------------------


def save_q(ctx_list: list, q: QTensor | None, t: torch.Tensor | None):
    """Append what to save: a quantized tensor's parts, or the full-precision tensor."""
    if q is not None:
        ctx_list.extend(q.tensors())
        return q.meta()
    ctx_list.extend([t, t.new_empty(0), t.new_empty(0)])
    return None


def load_q(tensors, meta):
    return QTensor.from_tensors(tensors, meta) if meta is not None else tensors[0]


class _QGroupedGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_SD, w, bias_EN, counts, trans_w, recipe, key):
        be = pick_backend(recipe, x_SD, w)
        mm, _ = BACKENDS[be]
        tensor_mode = scaling_mode(recipe) == "tensor"
        xq = quantize_operand(recipe, x_SD, "x", 1, key=key)
        wq = quantize_operand(recipe, w, "w", 2 if trans_w else 1, key=key)
        y = mm(xq, wq, counts, trans_w, x_SD.dtype, fast_accum=True)
        if bias_EN is not None:
            y = y + expand_bias(bias_EN, counts).to(y.dtype)
        saved: list = []
        if recipe.fp8_saved_activations:
            xs = (
                xq
                if tensor_mode
                else quantize_operand(recipe, x_SD, "x", 0, key=key, counts=counts)
            )
            ctx.x_meta = save_q(saved, xs, None)
        else:
            ctx.x_meta = save_q(saved, None, x_SD)
        none = x_SD.new_empty(0)
        scales = [xq.scale, wq.scale] if tensor_mode else [none, none]
        ctx.save_for_backward(*saved, w, *scales)
        ctx.counts, ctx.trans_w, ctx.recipe, ctx.key, ctx.be = counts, trans_w, recipe, key, be
        ctx.has_bias, ctx.tensor_mode, ctx.x_dtype = bias_EN is not None, tensor_mode, x_SD.dtype
        return y

    @staticmethod
    def backward(ctx, g_SN):
        *xs_t, w, x_scale, w_scale = ctx.saved_tensors
        recipe, counts, key, trans_w = ctx.recipe, ctx.counts, ctx.key, ctx.trans_w
        mm, wgrad = BACKENDS[ctx.be]
        g_SN = g_SN.contiguous()
        gq = quantize_operand(recipe, g_SN, "g", 1, key=key)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            ws = w_scale if ctx.tensor_mode else None
            wq = quantize_operand(recipe, w, "w", 1 if trans_w else 2, key=key, scale=ws)
            gx = mm(gq, wq, counts, not trans_w, ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            xs = load_q(xs_t, ctx.x_meta)
            if not isinstance(xs, QTensor):
                xsc = x_scale if ctx.tensor_mode else None
                xs = quantize_operand(recipe, xs, "x", 0, key=key, counts=counts, scale=xsc)
            gs = (
                gq
                if ctx.tensor_mode
                else quantize_operand(recipe, g_SN, "g", 0, key=key, counts=counts)
            )
            gw = wgrad(gs, xs, counts, w.dtype) if trans_w else wgrad(xs, gs, counts, w.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = group_sum(g_SN, counts)
        return gx, gw, gb, None, None, None, None


def quantized_grouped_gemm(x_SD, w, counts, bias_EN, trans_w, recipe, key=None):
    """The grouped GEMM of `ops.grouped_gemm` computed in the recipe's format.

    key: the tensor that owns delayed-scaling state (default: w itself; a converted
    Linear passes its weight parameter since w is then a fresh view)."""
    counts = [int(c) for c in counts]
    return _QGroupedGemm.apply(x_SD, w, bias_EN, counts, trans_w, recipe, w if key is None else key)
