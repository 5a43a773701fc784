"""Triton device functions that encode and decode FP8: E4M3 bytes and MXFP8 blocks, the
one home of the bit arithmetic the FP8 kernels share (`triton_quant.py`,
`ops/activation/swiglu_quant_kernels.py`). It imports only triton: `formats.py` imports
the cast kernels lazily, so an import back would be a loop. Integer ops on the fp32 bits
make the interpreter and the GPU give torch's bytes (round to nearest even, saturating,
NaN as 0x7F / 0xFF); an MX block's exponent comes from its amax's fp32 bits, "floor" or
"rceil", and a block holding NaN/Inf gets scale 0xFF and elements 0x7F.
"""

from __future__ import annotations

MX_BLOCK = 32  # the tile width of `mx_encode`: one MX block (formats.BLOCK, tested equal)


def _import_triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the FP8 Triton kernels need triton: pip install 'dropless[triton]'"
        ) from e
    return triton, tl


triton, tl = _import_triton()


@triton.jit
def e4m3_bits(v):
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
def e4m3_code(v):
    """fp32 -> E4M3 byte: saturating (|v| > 448 and +-Inf give +-448), NaN keeps its sign
    bit (0x7F / 0xFF), as torch's clamp-then-cast."""
    nan = v != v
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    c = tl.minimum(tl.maximum(tl.where(nan, 0.0, v), -448.0), 448.0)
    return tl.where(nan, 0x7F | sign, e4m3_bits(c))


@triton.jit
def e4m3_value(code):
    """E4M3 byte (int32) -> fp32, exact; 0x7F / 0xFF are NaN."""
    sign = (code & 0x80) << 24
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = m.to(tl.float32) * 0.001953125  # m * 2**-9
    mag = tl.where(e == 0, sub, normal)
    mag = tl.where((e == 15) & (m == 7), float("nan"), mag)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def mx_encode(a, RCEIL: tl.constexpr):
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
    code = tl.where(bad[:, None], 0x7F, e4m3_bits(tl.where(bad[:, None], 0.0, v)))
    return code, tl.where(bad, 255, e + 127)
