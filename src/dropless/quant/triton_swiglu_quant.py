"""Triton kernel: SwiGLU x routing prob, quantized to E4M3 for the down GEMM, in one pass.

Each program reads a [BLOCK_S, 32] tile of gate and the matching tile of up
(h = [gate | up], [S, 2F]), computes a = silu(gate) * up * prob in fp32, and writes
only the quantized a:

- MXFP8 mode: the tile is BLOCK_S rows of one 32-column MX block, so the block amax is
  a row max of the tile; the E8M0 exponent comes from the fp32 bits of the amax
  (floor(log2) = biased exponent - 127; subnormal amaxes clamp to -127 either way),
  with the "floor" or "rceil" rule; a block holding NaN/Inf gets scale 0xFF and
  elements 0x7F; columns past F (the last partial block) are zeros.
- scaled mode (delayed scaling: the scale is known before the pass): q = a * scale
  (saturating; a NaN keeps its sign bit, as torch's cast), and each program writes its
  tile's amax for the history.

The E4M3 encoding is done with integer ops on the fp32 bits (round to nearest even,
saturating at 448, subnormals below 2**-6), so the interpreter and the GPU give the
same bytes as torch's cast. ACT=False skips the silu (gate * up * prob): that mode is
what the bit-exact tests use, since exp may differ by an ulp between libraries.
"""

# S rows (sorted pairs), F expert hidden dim, B MX blocks per row

from __future__ import annotations

import torch

from .formats import BLOCK, QTensor


def _import_triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the fused SwiGLU+quantize kernel needs triton: pip install 'dropless[triton]'"
        ) from e
    return triton, tl


triton, tl = _import_triton()


@triton.jit
def _e4m3_bits(v):
    """fp32 (|v| <= 448, finite) -> E4M3 byte (int32), round to nearest even."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(v)
    # subnormals (and zero): multiples of 2**-9, rounded with the 1.5 * 2**23 trick
    m = (a * 512.0 + 12582912.0) - 12582912.0
    sub = m.to(tl.int32)
    b = a.to(tl.int32, bitcast=True)
    b = (b + 0x7FFFF + ((b >> 20) & 1)) & 0x7FF00000
    normal = ((((b >> 23) & 0xFF) - 120) << 3) | ((b >> 20) & 7)
    code = tl.where(a < 0.015625, sub, normal)
    return code | sign


@triton.jit
def _e4m3_code(v):
    """fp32 -> E4M3 byte: saturating (|v| > 448 and +-Inf give +-448), NaN keeps its sign
    bit (0x7F / 0xFF), as torch's clamp-then-cast."""
    nan = v != v
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    c = tl.minimum(tl.maximum(tl.where(nan, 0.0, v), -448.0), 448.0)
    return tl.where(nan, 0x7F | sign, _e4m3_bits(c))


@triton.jit
def _mx_encode(a, RCEIL: tl.constexpr):
    """MXFP8 of a [rows, 32] fp32 tile (one block per row): (E4M3 bytes [rows, 32],
    E8M0 scale bytes [rows]), as described in the module docstring."""
    absa = tl.abs(a)
    bad = tl.max(((a != a) | (absa == float("inf"))).to(tl.int32), axis=1) > 0
    amax = tl.where(bad, 0.0, tl.max(tl.where(a != a, 0.0, absa), axis=1))
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 8
    if RCEIL:
        e = tl.maximum(e, -134)
        thresh = (((e + 135) << 23) | 0x600000).to(tl.float32, bitcast=True)  # 448 * 2**e
        e = e + (amax > thresh).to(tl.int32)
    e = tl.minimum(tl.maximum(e, -127), 127)
    e = tl.where(amax > 0, e, -127)
    inv = ((127 - e) << 23).to(tl.float32, bitcast=True)  # 2**-e, exact
    v = tl.minimum(tl.maximum(a * inv[:, None], -448.0), 448.0)
    code = tl.where(bad[:, None], 0x7F, _e4m3_bits(tl.where(bad[:, None], 0.0, v)))
    return code, tl.where(bad, 255, e + 127)


@triton.jit
def _offsets(rows, cols, stride):
    """rows x stride + cols in int64: at real sizes an [S, 2F] tensor passes 2**31
    elements (S = 131072, F = 8192), where int32 products wrap around."""
    return rows.to(tl.int64)[:, None] * stride + cols[None, :]


@triton.jit
def _swiglu_tile(
    h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB: tl.constexpr, ACT: tl.constexpr
):
    mask = (rows < S)[:, None] & (cols < F)[None, :]
    offs = _offsets(rows, cols, stride_h)
    gate = tl.load(h_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + offs + F, mask=mask, other=0.0).to(tl.float32)
    if ACT:
        a = gate * tl.sigmoid(gate) * up
    else:
        a = gate * up
    if HAS_PROB:
        p = tl.load(prob_ptr + rows, mask=rows < S, other=0.0).to(tl.float32)
        a = a * p[:, None]
    return a


@triton.jit
def _mx_kernel(
    h_ptr,
    prob_ptr,
    q_ptr,
    s_ptr,
    S,
    F,
    stride_h,
    stride_q,
    stride_s,
    HAS_PROB: tl.constexpr,
    ACT: tl.constexpr,
    RCEIL: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    blk = tl.program_id(1)
    cols = blk * 32 + tl.arange(0, 32)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    code, sbits = _mx_encode(a, RCEIL)
    row_ok = rows < S
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + blk, sbits.to(tl.uint8), mask=row_ok)


@triton.jit
def _scaled_kernel(
    h_ptr,
    prob_ptr,
    scale_ptr,
    q_ptr,
    amax_ptr,
    S,
    F,
    stride_h,
    stride_q,
    HAS_PROB: tl.constexpr,
    ACT: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    scale = tl.load(scale_ptr)
    code = _e4m3_code(a * scale)
    mask = (rows < S)[:, None] & (cols < F)[None, :]
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=mask)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(amax_ptr + pid, tl.max(tl.max(tl.abs(a), axis=1), axis=0))


def _check(h_S2F: torch.Tensor, prob_S):
    if h_S2F.dim() != 2 or h_S2F.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F], got {tuple(h_S2F.shape)}")
    h = h_S2F.contiguous()
    prob = prob_S.contiguous() if prob_S is not None else h.new_zeros(1)
    return h, prob, h.shape[0], h.shape[1] // 2


def swiglu_quant_mx(
    h_S2F, prob_S=None, *, fmt="e4m3", scale_rule="floor", act=True, block_s=32
) -> QTensor:
    """silu(gate) * up * prob as MXFP8 (E4M3, blocks of 32 along F): QTensor like
    `formats.quantize_mx(a, 1)` (data [S, B*32], E8M0 scale_inv [S, B])."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    B = -(-F // BLOCK)
    q = torch.empty(S, B * BLOCK, dtype=torch.uint8, device=h.device)
    s = torch.empty(S, B, dtype=torch.uint8, device=h.device)
    if S:
        grid = (triton.cdiv(S, block_s), B)
        _mx_kernel[grid](
            h,
            prob,
            q,
            s,
            S,
            F,
            h.stride(0),
            q.stride(0),
            s.stride(0),
            HAS_PROB=prob_S is not None,
            ACT=act,
            RCEIL=scale_rule == "rceil",
            BLOCK_S=block_s,
        )
    return QTensor(
        q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu), "e4m3", kind="mx", dim=1, size=F
    )


def swiglu_quant_scaled(
    h_S2F, prob_S, fmt: str, scale: torch.Tensor, *, act=True, block_s=32, block_f=64
):
    """silu(gate) * up * prob quantized with a known per-tensor scale (delayed scaling).
    Returns (QTensor, amax of the unquantized result)."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    scale = scale.float().reshape(1).to(h.device)
    q = torch.empty(S, F, dtype=torch.uint8, device=h.device)
    grid = (triton.cdiv(S, block_s), triton.cdiv(F, block_f))
    partial = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=h.device)
    if S and F:
        _scaled_kernel[grid](
            h,
            prob,
            scale,
            q,
            partial,
            S,
            F,
            h.stride(0),
            q.stride(0),
            HAS_PROB=prob_S is not None,
            ACT=act,
            BLOCK_S=block_s,
            BLOCK_F=block_f,
        )
    qt = QTensor(
        q.view(torch.float8_e4m3fn),
        torch.reciprocal(scale.reshape(())),
        "e4m3",
        scale=scale.reshape(()),
    )
    return qt, partial.amax() if partial.numel() else partial.new_zeros(())
