"""Triton kernel: SwiGLU x routing prob, quantized to E4M3 for the down GEMM, in one pass.

Each program reads a [BLOCK_S, 32] tile of gate and the matching tile of up
(h = [gate | up], [S, 2F]), computes a = silu(gate) * up * prob in fp32, and writes
only the quantized a:

- MXFP8 mode: the tile is BLOCK_S rows of one 32-column MX block, so the block amax is
  a row max of the tile (`triton_fp8.mx_encode`); columns past F (the last partial
  block) are zeros.
- scaled mode (delayed scaling: the scale is known before the pass): q = a * scale
  (saturating; a NaN keeps its sign bit, as torch's cast), and each program writes its
  tile's amax for the history.
- row mode (current scaling, one scale per row): each program owns BLOCK_S whole rows;
  a first walk over F takes each row's amax, the scale fp8_max / amax / 2**margin
  (correctly rounded division; 1 where amax is 0, Inf or NaN, as `formats.scale_from_amax`)
  is written, and a second walk recomputes a and writes its bytes. When one tile spans F
  the tile stays in registers between the two.
- current per-tensor mode: a first launch writes each tile's amax (NaN if the tile holds
  one), torch reduces them to the scale, and the scaled kernel writes the bytes.

The functions return raw tensors (E4M3 bytes and their scales); `dropless.quant.mlp`
wraps them in its quantized-tensor type (the FP8 recipes' MLP is their only caller).

The E4M3 and E8M0 encodings are those of `triton_fp8.py` (integer ops on the fp32
bits), so the interpreter and the GPU give the same bytes as torch's cast. ACT=False
skips the silu (gate * up * prob): that mode is what the bit-exact tests use, since exp
may differ by an ulp between libraries.
"""

# S rows (sorted pairs), F expert hidden dim, B MX blocks per row

# `# fmt: skip` below: a kernel's signature and its launches keep their arguments as a few
# lines of names (the formatter puts one per line, which makes each kernel a page of names)

from __future__ import annotations

import torch

from ..quantize.reference import SPEC
from ..quantize.triton_fp8 import MX_BLOCK as BLOCK
from ..quantize.triton_fp8 import e4m3_code, mx_encode, tl, triton
from .activation_kernels import glu_fwd

E4M3_MAX = SPEC["e4m3"][2]


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
        a = glu_fwd(gate, up, 0.0, 0.0, "swiglu")
    else:
        a = gate * up
    if HAS_PROB:
        p = tl.load(prob_ptr + rows, mask=rows < S, other=0.0).to(tl.float32)
        a = a * p[:, None]
    return a


@triton.jit
def mx_kernel(
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
    code, sbits = mx_encode(a, RCEIL)
    row_ok = rows < S
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=row_ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + blk, sbits.to(tl.uint8), mask=row_ok)


@triton.jit
def scaled_kernel(
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
    code = e4m3_code(a * scale)
    mask = (rows < S)[:, None] & (cols < F)[None, :]
    tl.store(q_ptr + _offsets(rows, cols, stride_q), code.to(tl.uint8), mask=mask)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(amax_ptr + pid, tl.max(tl.max(tl.abs(a), axis=1), axis=0))


@triton.jit
def _row_scale(amax, nan, max_over_margin):
    """fp8_max / 2**margin / amax, 1 where amax is 0 / Inf / NaN or the scale overflows."""
    scale = tl.math.div_rn(tl.full(amax.shape, 1.0, tl.float32) * max_over_margin, amax)
    ok = (amax > 0) & (amax < float("inf")) & (nan == 0) & (scale < float("inf"))
    return tl.where(ok, scale, 1.0)


@triton.jit
def row_kernel(
    h_ptr, prob_ptr, q_ptr, scale_ptr, S, F, stride_h, stride_q, max_over_margin,
    HAS_PROB: tl.constexpr, ACT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr,
    ONE_TILE: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    amax = tl.zeros((BLOCK_S,), tl.float32)
    nan = tl.zeros((BLOCK_S,), tl.int32)
    cols = tl.arange(0, BLOCK_F)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    for f0 in range(0, F, BLOCK_F):
        if not ONE_TILE:
            a = _swiglu_tile(h_ptr, prob_ptr, rows, f0 + cols, S, F, stride_h, HAS_PROB, ACT)
        nan = tl.maximum(nan, tl.max((a != a).to(tl.int32), axis=1))
        amax = tl.maximum(amax, tl.max(tl.where(a != a, 0.0, tl.abs(a)), axis=1))
    scale = _row_scale(amax, nan, max_over_margin)
    row_ok = rows < S
    tl.store(scale_ptr + rows, scale, mask=row_ok)
    for f0 in range(0, F, BLOCK_F):
        if not ONE_TILE:
            a = _swiglu_tile(h_ptr, prob_ptr, rows, f0 + cols, S, F, stride_h, HAS_PROB, ACT)
        code = e4m3_code(a * scale[:, None])
        mask = row_ok[:, None] & (f0 + cols < F)[None, :]
        tl.store(q_ptr + _offsets(rows, f0 + cols, stride_q), code.to(tl.uint8), mask=mask)


@triton.jit
def amax_kernel(
    h_ptr, prob_ptr, amax_ptr, S, F, stride_h,
    HAS_PROB: tl.constexpr, ACT: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_F: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    a = _swiglu_tile(h_ptr, prob_ptr, rows, cols, S, F, stride_h, HAS_PROB, ACT)
    m = tl.max(tl.max(tl.where(a != a, 0.0, tl.abs(a)), axis=1), axis=0)
    has_nan = tl.max(tl.max((a != a).to(tl.int32), axis=1), axis=0)
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(amax_ptr + pid, tl.where(has_nan > 0, float("nan"), m))


def _check(h_S2F: torch.Tensor, prob_S):
    if h_S2F.dim() != 2 or h_S2F.shape[1] % 2:
        raise ValueError(f"h must be [S, 2F], got {tuple(h_S2F.shape)}")
    h = h_S2F.contiguous()
    prob = prob_S.contiguous() if prob_S is not None else h.new_zeros(1)
    return h, prob, h.shape[0], h.shape[1] // 2


def quantize_mx(h_S2F, prob_S=None, *, fmt="e4m3", scale_rule="floor", act=True, block_s=32):
    """silu(gate) * up * prob as MXFP8 (E4M3, blocks of 32 along F): (data [S, B*32]
    E4M3, scale_inv [S, B] E8M0), the bytes of `quant.formats.quantize_mx(a, 1)`."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    B = -(-F // BLOCK)
    q = torch.empty(S, B * BLOCK, dtype=torch.uint8, device=h.device)
    s = torch.empty(S, B, dtype=torch.uint8, device=h.device)
    if S:
        grid = (triton.cdiv(S, block_s), B)
        mx_kernel[grid](
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
    return q.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu)


def quantize_scaled(
    h_S2F, prob_S, fmt: str, scale: torch.Tensor, *, act=True, block_s=32, block_f=64
):
    """silu(gate) * up * prob quantized with a known per-tensor scale (delayed scaling).
    Returns (data [S, F] E4M3, amax of the unquantized result)."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    scale = scale.float().reshape(1).to(h.device)
    q = torch.empty(S, F, dtype=torch.uint8, device=h.device)
    grid = (triton.cdiv(S, block_s), triton.cdiv(F, block_f))
    partial = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=h.device)
    if S and F:
        scaled_kernel[grid](
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
    amax = partial.amax() if partial.numel() else partial.new_zeros(())
    return q.view(torch.float8_e4m3fn), amax


def _pow2_at_least(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def quantize_rows(
    h_S2F, prob_S, fmt: str = "e4m3", margin: int = 0, *, act=True, block_s=4, max_f=1024
):
    """silu(gate) * up * prob with one current scale per row (E4M3): (data [S, F] E4M3,
    scale [S, 1]), those of `quant.formats.quantize_current(a, fmt, dims=1, margin=margin)`."""
    if fmt != "e4m3":
        raise ValueError(f"the fused kernel writes E4M3 only, got fmt={fmt!r}")
    h, prob, S, F = _check(h_S2F, prob_S)
    q = torch.empty(S, F, dtype=torch.uint8, device=h.device)
    scale = torch.ones(S, dtype=torch.float32, device=h.device)
    if S and F:
        block_f = min(_pow2_at_least(F), max_f)
        row_kernel[(triton.cdiv(S, block_s),)](
            h, prob, q, scale, S, F, h.stride(0), q.stride(0), E4M3_MAX / 2.0**margin,
            HAS_PROB=prob_S is not None, ACT=act, BLOCK_S=block_s, BLOCK_F=block_f,
            ONE_TILE=block_f >= F,
        )  # fmt: skip
    return q.view(torch.float8_e4m3fn), scale.unsqueeze(1)


def amax(h_S2F, prob_S, *, act=True, block_s=32, block_f=64) -> torch.Tensor:
    """max |silu(gate) * up * prob| (fp32 scalar; NaN if a value is NaN), a as torch's
    `amax` sees it, without writing a."""
    h, prob, S, F = _check(h_S2F, prob_S)
    if not (S and F):
        return torch.zeros((), dtype=torch.float32, device=h.device)
    grid = (triton.cdiv(S, block_s), triton.cdiv(F, block_f))
    partial = torch.empty(grid[0] * grid[1], dtype=torch.float32, device=h.device)
    amax_kernel[grid](
        h, prob, partial, S, F, h.stride(0), HAS_PROB=prob_S is not None, ACT=act,
        BLOCK_S=block_s, BLOCK_F=block_f,
    )  # fmt: skip
    return partial.amax()
