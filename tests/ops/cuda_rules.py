"""CUDA's operand rules for torch._grouped_mm / torch._scaled_grouped_mm, checked on CPU.

A spy replaces the torch function during a test, records every call and checks it
against the rules of the CUDA kernels (aten/src/ATen/native/cuda/Blas.cpp and
torch/_meta_registrations.py, torch 2.11-2.13):

- operand dtypes: bf16 (grouped_mm) or E4M3 (scaled; mat_a row-major, mat_b column-major);
- every operand has valid strides with its leading stride a multiple of 16 bytes, and
  every dimension it reads spans a multiple of 16 bytes (a group's slice then starts
  aligned whatever the group sizes);
- the grouped dimension is the operand's outer one: in 2D x 3D `a` is row-major; in
  2D x 2D (a weight gradient) `a` [M, S] is column-major and `b` [S, N] row-major;
- offsets: 1-D int32, non-decreasing, ending at the grouped dimension's size;
- no operand with zero rows (its strides are not what the kernels accept).

Then torch's own meta kernel is run on meta tensors of the same shapes and strides.
"""

# S rows (grouped dim), M / N / K feature dims, E groups

from __future__ import annotations

import torch

ALIGN_BYTES = 16


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(-1) == 1 and t.stride(-2) >= max(1, t.shape[-1])


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(-2) == 1 and t.stride(-1) >= max(1, t.shape[-2])


def _dims_read(name, a, b) -> list[int]:
    """The dims of operand `name` other than the grouped one (cut by the offsets)."""
    if a.dim() == 2 and b.dim() == 3:  # a [S, K] grouped along S
        return [a.shape[1]] if name == "a" else list(b.shape[-2:])
    if a.dim() == 2 and b.dim() == 2:  # a [M, S], b [S, N] grouped along S
        return [a.shape[0]] if name == "a" else [b.shape[1]]
    t = a if name == "a" else b
    return list(t.shape[-2:])


def problems(a, b, offs, *, scaled: bool, dtype_rule: bool = True) -> list[str]:
    """Every CUDA rule this call breaks (empty when it would run on CUDA)."""
    out = []
    if dtype_rule:
        want = torch.float8_e4m3fn if scaled else torch.bfloat16
        if a.dtype != want or b.dtype != want:
            out.append(f"dtypes {a.dtype}, {b.dtype}; CUDA needs {want}")
    for name, t in (("a", a), ("b", b)):
        if t.numel() == 0:
            out.append(f"{name} {tuple(t.shape)} is empty")
            continue
        align = ALIGN_BYTES // t.element_size()
        if not (_row_major(t) or _col_major(t)):
            out.append(f"{name} strides {t.stride()} for shape {tuple(t.shape)} are invalid")
        lead = t.stride(-2) if t.stride(-1) == 1 else t.stride(-1)
        if lead % align:
            out.append(f"{name} leading stride {lead} is not a multiple of {ALIGN_BYTES} bytes")
        for d in _dims_read(name, a, b):
            if d % align:
                out.append(f"{name} dim {d} is not a multiple of {ALIGN_BYTES} bytes")
    if a.dim() == 2 and b.dim() == 3 and not _row_major(a):
        out.append(f"2D x 3D: a must be row-major, strides {a.stride()}")
    if a.dim() == 2 and b.dim() == 2:
        if not _col_major(a):
            out.append(f"2D x 2D: a [M, S] must be column-major, strides {a.stride()}")
        if not _row_major(b):
            out.append(f"2D x 2D: b [S, N] must be row-major, strides {b.stride()}")
    if scaled:
        if not _row_major(a):
            out.append("scaled: a must be row-major")
        if not _col_major(b):
            out.append("scaled: b must be column-major")
    if offs is None or offs.dim() != 1 or offs.dtype != torch.int32:
        out.append(f"offs must be a 1-D int32 tensor, got {None if offs is None else offs.dtype}")
    else:
        o = offs.cpu().tolist()
        grouped = a.shape[1] if (a.dim() == 2 and b.dim() == 2) else a.shape[0]
        if any(x > y for x, y in zip(o, o[1:])) or (o and o[-1] != grouped):
            out.append(f"offs {o} are not cumulative ends of {grouped} rows")
    return out


def scale_problems(a, b, scale_a, scale_b) -> list[str]:
    """Row-wise scales of a 2D x 3D scaled call: scale_a [S] and scale_b [E, N], fp32,
    contiguous (torch's _scaled_grouped_mm checks)."""
    out = []
    for name, s in (("scale_a", scale_a), ("scale_b", scale_b)):
        if s.dtype != torch.float32 or not s.is_contiguous():
            out.append(f"{name} must be contiguous fp32, got {s.dtype} strides {s.stride()}")
    if scale_a.dim() != 1 or scale_a.shape[0] != a.shape[0]:
        out.append(f"scale_a must be [{a.shape[0]}], got {tuple(scale_a.shape)}")
    if b.dim() == 3 and tuple(scale_b.shape) != (b.shape[0], b.shape[2]):
        out.append(f"scale_b must be [{b.shape[0]}, {b.shape[2]}], got {tuple(scale_b.shape)}")
    return out


def _meta(t: torch.Tensor, dtype) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")


class GemmSpy:
    """Monkeypatches torch._grouped_mm / torch._scaled_grouped_mm; `calls` holds one
    dict per call (kind, shapes, strides, dtypes, offsets, problems)."""

    def __init__(self, monkeypatch, *, dtype_rule: bool = True, scaled_impl=None):
        self.calls: list[dict] = []
        self.dtype_rule = dtype_rule
        real = torch._grouped_mm

        def grouped_mm(a, b, offs=None, bias=None, out_dtype=None):
            self._record("grouped_mm", a, b, offs, scaled=False)
            return real(a, b, offs=offs, bias=bias, out_dtype=out_dtype)

        monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
        self._real = real
        if scaled_impl is not None:

            def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, **kw):
                self._record(
                    "scaled_grouped_mm", a, b, offs, scaled=True, scales=(scale_a, scale_b)
                )
                return scaled_impl(a, b, scale_a, scale_b, offs=offs, **kw)

            monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)

    def _record(self, kind, a, b, offs, *, scaled, scales=None):
        found = problems(a, b, offs, scaled=scaled, dtype_rule=self.dtype_rule)
        if scales is not None:
            found += scale_problems(a, b, *scales)
        if not found and not scaled:  # torch's own checks, on meta tensors
            try:
                self._real(_meta(a, torch.bfloat16), _meta(b, torch.bfloat16), offs=offs.to("meta"))
            except RuntimeError as e:
                found.append(f"torch's meta kernel: {e}")
        self.calls.append(
            dict(
                kind=kind,
                shapes=(tuple(a.shape), tuple(b.shape)),
                strides=(a.stride(), b.stride()),
                dtypes=(a.dtype, b.dtype),
                offs=None if offs is None else offs.tolist(),
                problems=found,
            )
        )

    def bad(self) -> list[dict]:
        return [c for c in self.calls if c["problems"]]
