"""FP8 element formats and the fast (torch) quantizers: per-tensor, per-row and MXFP8.

Conventions (Transformer Engine's): `scale` multiplies before the cast, so
q = sat_cast(x * scale) and x ~= q * scale_inv with scale_inv = 1 / scale (fp32).
Casts, current scaling, MXFP8 blocks and their NaN and padding rules: docs/fp8.md,
"Numerics". `ops/quantize/reference.py` holds the pure-torch specification these are
tested against bit for bit.
"""

# S rows, N / D features, B blocks of 32

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # MX block size

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# largest exponent of a normal value of the element format (emax_elem in the MX spec)
FP8_EMAX = {"e4m3": 8, "e5m2": 15}
SCALE_RULES = ("floor", "rceil")
E8M0_NAN = 255
FP8_NAN = 0x7F


def _kernels(t: torch.Tensor, fmt: str = "e4m3"):
    """The one-pass Triton casts (`triton_quant`, 2-D) for a CUDA tensor in E4M3 when
    triton is installed, else None (the torch forms below, which are the specification)."""
    if not (t.is_cuda and fmt == "e4m3"):
        return None
    from ..ops.registry import triton_importable

    if not triton_importable():
        return None
    from ..ops.quantize import triton_quant

    return triton_quant


def check_format(fmt: str) -> str:
    if fmt not in FP8_DTYPES:
        raise ValueError(f"fp8 format {fmt!r} is not supported; allowed: {sorted(FP8_DTYPES)}")
    return fmt


def cast_fp8(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Saturating round-to-nearest-even cast of x (any float dtype) to fp8 `fmt`."""
    m = FP8_MAX[check_format(fmt)]
    return x.float().clamp(-m, m).to(FP8_DTYPES[fmt])  # clamp keeps NaN, maps +-Inf to +-max


def scale_from_amax(amax: torch.Tensor, fmt: str, margin: int = 0) -> torch.Tensor:
    """scale = fp8_max / amax / 2**margin (fp32); 1 where amax is 0 or not finite."""
    amax = amax.float()
    # a true division (a python scalar / tensor would be reciprocal-then-multiply)
    scale = torch.div(torch.full_like(amax, FP8_MAX[fmt]), amax) / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax) & torch.isfinite(scale)
    return torch.where(ok, scale, torch.ones_like(scale))


@dataclass
class QTensor:
    """A quantized tensor: fp8 `data`, the multiplier that dequantizes it, the layout.

    kind "scaled": data has the source shape; dequantize = data * scale_inv (fp32,
    broadcastable). kind "mx": data [.., B*32] (blocks along the last dim, zero padded),
    scale_inv E8M0 [.., B]; `dim` is the source dim that was moved last, `size` its length.
    kind "mx_groups": column blocks per expert group, data [S_pad, N] with every group
    padded to a multiple of 32 rows, scale_inv [S_pad / 32, N]; `rows_S` maps source rows to
    padded rows.
    """

    data: torch.Tensor
    scale_inv: torch.Tensor
    fmt: str
    kind: str = "scaled"
    dim: int = -1
    size: int = 0
    rows_S: torch.Tensor | None = None
    scale: torch.Tensor | None = None  # kind "scaled": the scale used (reused in backward)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors to hand to ctx.save_for_backward (see `from_tensors`)."""
        return [
            self.data,
            self.scale_inv,
            self.rows_S if self.rows_S is not None else self.data.new_empty(0),
        ]

    def meta(self) -> tuple:
        return (self.fmt, self.kind, self.dim, self.size)

    @staticmethod
    def from_tensors(tensors, meta) -> QTensor:
        data, scale_inv, rows_S = tensors
        fmt, kind, dim, size = meta
        return QTensor(
            data, scale_inv, fmt, kind, dim, size, rows_S if kind == "mx_groups" else None
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        k = _kernels(self.data, self.fmt)
        if self.kind == "scaled":
            if k is not None and self.data.dim() == 2 and self.scale_inv.dim() <= 2:
                return k.dequant_scaled(self.data, self.scale_inv, dtype)
            return (self.data.float() * self.scale_inv).to(dtype)
        if self.kind == "mx":
            if k is not None:  # blocks along the last dim: leading dims flatten
                lead = self.data.shape[:-1]
                d2 = self.data.reshape(-1, self.data.shape[-1])
                s2 = self.scale_inv.reshape(-1, self.scale_inv.shape[-1])
                x = k.mx_dequant(d2, s2, self.size, dtype).view(*lead, self.size)
                return x.movedim(-1, self.dim)
            x = _mx_dequant_last(self.data, self.scale_inv)[..., : self.size]
            return x.movedim(-1, self.dim).to(dtype)
        if k is not None:  # column blocks: the transposed views are row blocks
            n = self.data.shape[0]
            x = k.mx_dequant(self.data.t(), self.scale_inv.t(), n, dtype).t()
            return x.index_select(0, self.rows_S)
        x = self.data.float().unflatten(0, (-1, BLOCK)) * self.scale_inv.float().unsqueeze(1)
        return x.flatten(0, 1).index_select(0, self.rows_S).to(dtype)

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        n += self.scale_inv.numel() * self.scale_inv.element_size()
        return n + (0 if self.rows_S is None else self.rows_S.numel() * self.rows_S.element_size())


# --- per-tensor / per-row scaling ---------------------------------------------------------


def amax(x: torch.Tensor, dims=None) -> torch.Tensor:
    """max |x| over `dims` (all when None), keepdim, fp32; NaN propagates."""
    if x.is_cuda and (dims is None or isinstance(dims, int)) and x.numel():
        # one pass, no |x| temporary; maximum propagates NaN like amax
        lo, hi = torch.aminmax(x.detach(), dim=dims, keepdim=dims is not None)
        return torch.maximum(hi.float(), lo.float().neg())
    if x.is_cuda and x.dim() == 3 and tuple(dims or ()) == (1, 2) and x.numel():
        # per expert of a grouped weight: the same one pass over each expert's block
        lo, hi = torch.aminmax(x.detach().flatten(1), dim=1, keepdim=True)
        return torch.maximum(hi.float(), lo.float().neg()).unsqueeze(2)
    a = x.detach().abs().float()
    if dims is None:
        return a.amax() if a.numel() else a.new_zeros(())
    return a.amax(dim=dims, keepdim=True) if a.numel() else a.new_zeros([1] * a.dim())


def quantize_scaled(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> QTensor:
    """q = sat_cast(x * scale) with a given fp32 scale (scalar or broadcastable)."""
    scale = scale.float()
    m = FP8_MAX[check_format(fmt)]
    k = _kernels(x, fmt)
    if k is not None and x.dim() in (2, 3) and _broadcasts(scale, x.shape):
        return QTensor(k.scale_cast(x, scale), torch.reciprocal(scale), fmt, scale=scale)
    # one fp32 temporary: the product is clamped in place, then cast (clamp keeps NaN)
    q = (x.float() * scale).clamp_(-m, m).to(FP8_DTYPES[fmt])
    return QTensor(q, torch.reciprocal(scale), fmt, scale=scale)


def _broadcasts(scale: torch.Tensor, shape) -> bool:
    """Whether scale broadcasts to `shape` (a scalar, a row, a column, one per expert)
    without making the result larger: what the cast kernel reads with zero strides."""
    if scale.dim() > len(shape):
        return False
    try:
        return tuple(torch.broadcast_shapes(scale.shape, shape)) == tuple(shape)
    except RuntimeError:
        return False


def quantize_current(x: torch.Tensor, fmt: str, dims=None, margin: int = 0) -> QTensor:
    """Current scaling: one scale per tensor (dims None) or per slice reduced over `dims`."""
    return quantize_scaled(x, fmt, scale_from_amax(amax(x, dims), fmt, margin))


# --- MXFP8 ------------------------------------------------------------------------------


def mx_exponent(amax_B: torch.Tensor, fmt: str = "e4m3", scale_rule: str = "floor") -> torch.Tensor:
    """Unbiased E8M0 exponent e (int32) of each block's scale X = 2**e.

    floor: e = floor(log2(amax)) - emax_elem (the MX spec; the largest values may
    saturate). rceil: the smallest e with amax <= fp8_max * 2**e (nothing saturates).
    Clamped to [-127, 127]; an all-zero block gets -127. Non-finite amax: see E8M0_NAN.
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"scale_rule={scale_rule!r}; allowed: {SCALE_RULES}")
    a = amax_B.float()
    mant, ex = torch.frexp(a)  # a = mant * 2**ex, mant in [0.5, 1)
    e = ex.to(torch.int32) - 1 - FP8_EMAX[fmt]
    if scale_rule == "rceil":
        e = e + (a > torch.ldexp(torch.tensor(FP8_MAX[fmt]), e.float())).to(torch.int32)
    e = torch.where(a > 0, e, torch.full_like(e, -127))
    return e.clamp(-127, 127)


def _mx_blocks_last(x: torch.Tensor, fmt: str, scale_rule: str):
    """Quantize [.., B, 32] blocks: returns (data [.., B, 32] fp8, scale [.., B] e8m0)."""
    xf = x.float()
    a = xf.abs().amax(-1)
    bad = ~torch.isfinite(a)
    e = mx_exponent(torch.where(bad, torch.zeros_like(a), a), fmt, scale_rule)
    inv = torch.ldexp(torch.ones_like(a), (-e).float())  # 1 / X, exact power of two
    q = cast_fp8(xf * inv.unsqueeze(-1), fmt)
    # bits 0x7F are NaN in both E4M3 and E5M2; a select on the device, not a host check
    # of whether any block is bad (that would sync every quantization)
    qb = torch.where(bad.unsqueeze(-1), FP8_NAN, q.view(torch.uint8))
    bits = torch.where(bad, torch.full_like(e, E8M0_NAN), e + 127)
    return qb.view(q.dtype), bits.to(torch.uint8).view(torch.float8_e8m0fnu)


def _mx_dequant_last(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    x = data.float().unflatten(-1, (-1, BLOCK)) * scale.float().unsqueeze(-1)
    return x.flatten(-2)


def quantize_mx(
    x: torch.Tensor, dim: int = -1, *, fmt: str = "e4m3", scale_rule: str = "floor"
) -> QTensor:
    """MXFP8 with blocks of 32 consecutive values along `dim` (the reduction dim)."""
    dim = dim % x.dim()
    xt = x.movedim(dim, -1)
    n = xt.shape[-1]
    k = _kernels(xt, fmt)
    if k is not None:  # 2-D in place (any strides); leading dims flatten (a copy if need be)
        q, s = k.mx_quantize(xt if xt.dim() == 2 else xt.reshape(-1, n), scale_rule)
        lead = xt.shape[:-1]
        return QTensor(q.view(*lead, -1), s.view(*lead, -1), fmt, kind="mx", dim=dim, size=n)
    pad = (-n) % BLOCK
    if pad:
        xt = torch.nn.functional.pad(xt, (0, pad))
    q, s = _mx_blocks_last(xt.unflatten(-1, (-1, BLOCK)), fmt, scale_rule)
    return QTensor(q.flatten(-2), s, fmt, kind="mx", dim=dim, size=n)


def padded_rows(counts, device=None, rows: int | None = None) -> tuple[torch.Tensor, int]:
    """Row map for groups padded to multiples of 32: rows_S[s] is source row s's padded
    row; returns (rows_S, padded row count).

    counts: a host list, or a device tensor with `rows` (= sum of counts) given: then
    nothing is read on the host and the padded count is the bound rows + 31 * E rounded
    up to 32 (the rows past the last group are zeros)."""
    if isinstance(counts, torch.Tensor):
        if rows is None:
            raise ValueError("padded_rows with device counts needs rows= (the sum of counts)")
        c = counts.to(device=device, dtype=torch.long)
        E = c.numel()
        pad_c = (c + BLOCK - 1) // BLOCK * BLOCK
        shift_E = (torch.cumsum(pad_c, 0) - pad_c) - (torch.cumsum(c, 0) - c)
        e_S = torch.repeat_interleave(torch.arange(E, device=c.device), c, output_size=rows)
        rows_S = torch.arange(rows, device=c.device) + shift_E.index_select(0, e_S)
        return rows_S, -(-(rows + (BLOCK - 1) * E) // BLOCK) * BLOCK
    rows_l, p = [], 0
    for n in counts:
        rows_l.append(torch.arange(p, p + n))
        p += -(-n // BLOCK) * BLOCK
    rows_S = torch.cat(rows_l) if rows_l else torch.zeros(0, dtype=torch.long)
    return rows_S.to(device), p


def quantize_mx_groups(
    x_SN: torch.Tensor, counts, *, fmt: str = "e4m3", scale_rule: str = "floor"
) -> QTensor:
    """MXFP8 column-wise (blocks of 32 rows) where no block straddles two groups:
    each group of `counts` rows (a host list or a device tensor) is zero padded to a
    multiple of 32 rows first."""
    rows_S, s_pad = padded_rows(counts, x_SN.device, rows=x_SN.shape[0])
    xp = x_SN.new_zeros(s_pad, x_SN.shape[1]).index_copy_(0, rows_S, x_SN)
    k = _kernels(xp, fmt)
    if k is not None:  # column blocks of xp are row blocks of its transpose
        q, s = k.mx_quantize(xp.t(), scale_rule)
        return QTensor(q.t(), s.t(), fmt, kind="mx_groups", rows_S=rows_S)
    q, s = _mx_blocks_last(xp.unflatten(0, (-1, BLOCK)).transpose(1, 2), fmt, scale_rule)
    return QTensor(q.transpose(1, 2).flatten(0, 1), s, fmt, kind="mx_groups", rows_S=rows_S)
