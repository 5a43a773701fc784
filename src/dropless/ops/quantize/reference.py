"""Pure-torch specification of the quantizers, written from the format definitions.

Slow on purpose (fp64 arithmetic, Python loops over MX blocks): `formats.py` and the
Triton kernel are tested bit for bit against these.

FP8 (OFP8 / OCP 8-bit floating point v1.0): a value is (-1)^s * 2^e * (1 + m / 2^M) for
normal numbers (e >= emin) and (-1)^s * 2^emin * (m / 2^M) for subnormals.
E4M3: M=3, emin=-6, max 448 (no Inf); E5M2: M=2, emin=-14, max 57344.
Casts round to nearest, ties to even, and saturate (|x| > max and +-Inf give +-max).

MX (OCP Microscaling v1.0, section 6.3): X = 2^(floor(log2(max|V_i|)) - emax_elem),
P_i = cast(V_i / X); emax_elem = 8 for E4M3.
"""

# R rows, N columns, B blocks of 32 per row

from __future__ import annotations

import math

import torch

SPEC = {"e4m3": (3, -6, 448.0, 8), "e5m2": (2, -14, 57344.0, 15)}  # M, emin, max, emax


def fp8_cast_reference(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """The fp8 value (as fp32) nearest to x, ties to even, saturating; NaN stays NaN."""
    mbits, emin, vmax, _ = SPEC[fmt]
    v = x.double()
    a = v.abs()
    _, ex = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    e = torch.clamp(ex.double() - 1, min=emin)  # exponent of a's binade, subnormals at emin
    quantum = torch.pow(2.0, e - mbits)
    r = torch.round(a / quantum) * quantum  # torch.round: half to even
    r = torch.where(torch.isinf(a), torch.full_like(a, vmax), torch.clamp(r, max=vmax))
    r = torch.where(a > 0, r, torch.zeros_like(a))
    out = torch.copysign(r, v)
    return torch.where(torch.isnan(v), v, out).float()


def quantize_scaled_reference(x: torch.Tensor, fmt: str, scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor / per-row FP8: the fp8 values of x * scale (the product taken in fp32)."""
    return fp8_cast_reference(x.float() * scale.float(), fmt)


def current_scale_reference(x: torch.Tensor, fmt: str, margin: int = 0) -> float:
    """fp8_max / amax / 2**margin, or 1.0 when amax is 0, Inf or NaN."""
    amax = max((abs(float(v)) for v in x.reshape(-1)), default=0.0)
    if any(math.isnan(float(v)) for v in x.reshape(-1)):
        amax = math.nan
    if not (amax > 0 and math.isfinite(amax)):
        return 1.0
    scale = float(
        torch.tensor(SPEC[fmt][2], dtype=torch.float32) / torch.tensor(amax, dtype=torch.float32)
    )
    scale = scale / 2.0**margin
    return scale if math.isfinite(scale) else 1.0


def mx_exponent_reference(amax: float, fmt: str = "e4m3", scale_rule: str = "floor") -> int:
    """Unbiased exponent of the block scale; 255 (the E8M0 NaN) for a NaN/Inf block."""
    _, _, vmax, emax = SPEC[fmt]
    if not math.isfinite(amax):
        return 255
    if amax == 0:
        return -127
    m, ex = math.frexp(amax)  # amax = m * 2**ex exactly, m in [0.5, 1)
    e = (ex - 1) - emax  # floor(log2(amax)) - emax_elem
    if scale_rule == "rceil":
        while amax > vmax * 2.0**e:  # round the scale up until nothing saturates
            e += 1
    return max(-127, min(127, e))


def mx_quantize_reference(x_RN: torch.Tensor, fmt: str = "e4m3", scale_rule: str = "floor"):
    """MX quantization of each row in blocks of 32 (a partial last block is zero padded).

    Returns (values_RB32 fp32: the fp8 element values, padded; exps_RB int64: the
    unbiased scale exponents, 255 marking a NaN scale).
    """
    R, N = x_RN.shape
    B = -(-N // 32)
    vals = torch.zeros(R, B * 32, dtype=torch.float32)
    exps = torch.zeros(R, B, dtype=torch.int64)
    for r in range(R):
        for b in range(B):
            block = [float(v) for v in x_RN[r, b * 32 : (b + 1) * 32]]
            block += [0.0] * (32 - len(block))
            amax = 0.0
            for v in block:
                if math.isnan(v) or math.isinf(v):
                    amax = math.inf
                amax = max(amax, abs(v))
            e = mx_exponent_reference(amax, fmt, scale_rule)
            exps[r, b] = e
            if e == 255:
                vals[r, b * 32 : (b + 1) * 32] = math.nan
                continue
            scaled = torch.tensor([v / 2.0**e for v in block], dtype=torch.float64)
            vals[r, b * 32 : (b + 1) * 32] = fp8_cast_reference(scaled, fmt)
    return vals, exps


def mx_groups_reference(
    x_SN: torch.Tensor, counts: list[int], fmt: str = "e4m3", scale_rule: str = "floor"
):
    """Column-wise MX per group of rows: each group of `counts` rows is split in blocks of
    32 rows from its first row, the last one zero padded (no block spans two groups).

    Returns (values [S_pad, N], exps [S_pad / 32, N]) with every group padded to a
    multiple of 32 rows, groups in order.
    """
    vals, exps, start = [], [], 0
    for c in counts:
        v, e = mx_quantize_reference(x_SN[start : start + c].t(), fmt, scale_rule)  # [N, pad(c)]
        vals.append(v.t())
        exps.append(e.t())
        start += c
    N = x_SN.shape[1]
    if not vals:
        return torch.zeros(0, N), torch.zeros(0, N, dtype=torch.int64)
    return torch.cat(vals), torch.cat(exps)
