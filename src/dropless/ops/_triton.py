"""Launch-size helpers shared by the kernel modules (imports triton: load lazily)."""

from __future__ import annotations

import torch
import triton


def on_gpu(t: torch.Tensor) -> bool:
    """False under TRITON_INTERPRET=1 with CPU tensors (tests): use small tiles there,
    so tiny test shapes still span several programs and partial tiles."""
    return t.is_cuda


def row_blocks(t: torch.Tensor, n_cols: int) -> tuple[int, int, int]:
    """(rows per program, columns per program, num_warps) for a memory-bound row kernel."""
    if not on_gpu(t):
        return 16, 32, 1
    block_n = min(triton.next_power_of_2(max(n_cols, 1)), 1024)
    warps = 4 if block_n >= 512 else 2
    return max(1, 2048 // block_n), block_n, warps


def check_2d(name: str, t: torch.Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")


def check_index(name: str, t: torch.Tensor, dim: int) -> None:
    if t.dim() != dim or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise TypeError(f"{name} must be a {dim}-D integer tensor, got {t.dtype} {tuple(t.shape)}")
