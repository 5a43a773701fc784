"""Zero the blocks of a grouped weight gradient whose group had no rows.

`torch._grouped_mm`'s 2D x 2D form (the weight gradient) does not write every empty
group's [M, N] block on every kernel version, so those blocks must be zeroed after it.
A masked fill over the whole [E, M, N] result reads and writes every element (about
1.6 GB at E=128, M=1536, N=2048 in bf16: ~0.5 ms on an H200, per weight gradient); this
kernel writes only the empty groups' blocks: a program per (group, chunk) reads its
group's flag and returns at once when the group had rows. Nothing is read on the host.
"""

# E groups, M x N one group's block

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def zero_groups_kernel(out_ptr, empty_ptr, MN, CHUNKS, BLOCK: tl.constexpr):
    e = tl.program_id(0)
    if tl.load(empty_ptr + e) != 0:
        base = out_ptr + e.to(tl.int64) * MN
        for start in range(tl.program_id(1) * BLOCK, MN, CHUNKS * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            tl.store(
                base + offs, tl.zeros((BLOCK,), dtype=out_ptr.dtype.element_ty), mask=offs < MN
            )


def zero_groups(out_EMN: torch.Tensor, empty_E: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """out[e] = 0 where empty_E[e] (bool [E]), in place; out contiguous [E, ...]."""
    if not out_EMN.is_contiguous():
        raise ValueError("zero_groups needs a contiguous [E, ...] tensor")
    E = out_EMN.shape[0]
    MN = out_EMN[0].numel() if E else 0
    if E and MN:
        chunks = min(triton.cdiv(MN, block), 64)
        zero_groups_kernel[(E, chunks)](out_EMN, empty_E.to(torch.int8), MN, chunks, BLOCK=block)
    return out_EMN
