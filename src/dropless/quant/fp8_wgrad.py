"""FP8 weight-gradient GEMMs: dw[e] = a_e^T b_e as one torch._scaled_grouped_mm 2D x 2D.

The op groups along its inner dimension, so each group's rows start 16-byte aligned: they
are placed at multiples of 32 in transposed FP8 copies of the column-wise quantized
operands (zeros between, `formats.padded_rows`), with one fp32 scale per (group, column).
Used on CUDA sm90+ once a one-time probe per device agrees with an fp32 GEMM of the
dequantized operands (`fp8_wgrad_available`); what has run where: docs/fp8.md.
"""

# S rows, M / N columns, E experts (groups), K the grouped (row) dim

from __future__ import annotations

import warnings

import torch

from .formats import BLOCK, QTensor, padded_rows, quantize_current


def torch_fp8_available(device: torch.device | None = None) -> bool:
    """Row-wise FP8 grouped GEMM (torch._scaled_grouped_mm): CUDA sm90 or newer."""
    if not (torch.cuda.is_available() and hasattr(torch, "_scaled_grouped_mm")):
        return False
    dev = device if device is not None and device.type == "cuda" else torch.device("cuda")
    return torch.cuda.get_device_capability(dev)[0] >= 9


def col_scaled(q: QTensor) -> bool:
    """An E4M3 operand [S, M] with one scale per column (or per tensor): the column-wise
    form the weight-gradient GEMM reads (row-wise and per-tensor recipes)."""
    if q.kind != "scaled" or q.data.dtype != torch.float8_e4m3fn or q.data.dim() != 2:
        return False
    s = q.scale_inv
    return s.numel() == 1 or tuple(s.shape) == (1, q.data.shape[1])


def _group_padded_k(q: QTensor, rows_S: torch.Tensor, s_pad: int) -> torch.Tensor:
    """q's data [S, M] as [M, s_pad] row-major bytes, each group's rows at a multiple of 32
    (zeros between): the grouped (inner) dim of a K-grouped FP8 GEMM operand must start
    16-byte aligned in every group."""
    d = q.data.view(torch.uint8)
    out = d.new_zeros(d.shape[1], s_pad).index_copy_(1, rows_S, d.t())
    return out.view(torch.float8_e4m3fn)


def scaled_wgrad(aq: QTensor, bq: QTensor, counts, out_dtype) -> torch.Tensor:
    """out[e] = a_e^T b_e as one FP8 GEMM, torch._scaled_grouped_mm 2D x 2D grouped along
    the rows (K): a^T [M, K] row-major, b [K, N] column-major, one fp32 scale per (expert,
    column) of each, int32 ends of the 32-row padded groups. An empty group's block is
    zeroed on the device (not every kernel writes it)."""
    (S, M), N = aq.data.shape, bq.data.shape[1]
    E = counts.shape[0] if isinstance(counts, torch.Tensor) else len(counts)
    if S == 0:
        return torch.zeros(E, M, N, dtype=out_dtype, device=aq.data.device)
    dev = aq.data.device
    rows_S, s_pad = padded_rows(counts, dev, rows=S)
    c = counts.to(dev) if isinstance(counts, torch.Tensor) else torch.tensor(counts, device=dev)
    offs = ((c + BLOCK - 1) // BLOCK * BLOCK).cumsum(0, dtype=torch.int32)

    def scales(q, n):  # the column scales of every expert, [E * n]
        return q.scale_inv.float().reshape(-1).expand(n).repeat(E).contiguous()

    a = _group_padded_k(aq, rows_S, s_pad)
    b = _group_padded_k(bq, rows_S, s_pad).t()
    y = torch._scaled_grouped_mm(
        a, b, scales(aq, M), scales(bq, N), offs=offs, out_dtype=torch.bfloat16
    )
    y = torch.where((c == 0).view(E, 1, 1), torch.zeros((), dtype=y.dtype, device=dev), y)
    return y.to(out_dtype)


_WGRAD_OK: dict[str, bool] = {}


def fp8_wgrad_available(device: torch.device) -> bool:
    """Whether the FP8 weight-gradient GEMM (`scaled_wgrad`) runs right on this device:
    sm90+ with torch._scaled_grouped_mm, and a one-time probe (uneven groups, an empty
    one) within bf16 rounding of the emulated GEMM. Checked once per device; a failed
    probe is said once and the weight gradients stay bf16 GEMMs."""
    key = str(device)
    if key not in _WGRAD_OK:
        _WGRAD_OK[key] = torch_fp8_available(device) and _probe_wgrad(device)
    return _WGRAD_OK[key]


def _reference(aq: QTensor, bq: QTensor, counts: list[int]) -> torch.Tensor:
    """a_e^T b_e of the dequantized operands in fp32, group by group."""
    a, b, lo, out = aq.dequantize(), bq.dequantize(), 0, []
    for n in counts:
        out.append(a[lo : lo + n].t() @ b[lo : lo + n])
        lo += n
    return torch.stack(out)


def _probe_wgrad(device) -> bool:
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)  # the probe's one host read, once per process
    try:
        g = torch.Generator(device=device).manual_seed(0)
        counts = torch.tensor([16, 0, 40, 8], device=device)
        a, b = (torch.randn(64, n, generator=g, device=device) for n in (32, 48))
        aq, bq = (quantize_current(t, "e4m3", dims=0) for t in (a, b))
        got = scaled_wgrad(aq, bq, counts, torch.float32)
        want = _reference(aq, bq, counts.tolist())
        ok = bool(((got - want).abs() <= 2**-7 * want.abs() + 1e-3).all())
        why = "it differs from the emulated GEMM"
    except RuntimeError as e:
        ok, why = False, f"it raised {type(e).__name__}: {str(e)[:200]}"
    finally:
        torch.cuda.set_sync_debug_mode(mode)
    if not ok:
        warnings.warn(
            f"the FP8 weight-gradient GEMM (torch._scaled_grouped_mm 2D x 2D) is not used on "
            f"{device}: {why}; weight gradients run as bf16 GEMMs on dequantized operands.",
            stacklevel=4,
        )
    return ok
