"""Triton zero_groups (the empty groups of a grouped weight gradient) against the
eager masked fill.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# E groups, M x N one group's block

from __future__ import annotations

import torch

from interpreted import interpreted_tests

# name -> (E, M, N, empty groups); interpreter blocks: 64 elements, so several chunks
CASES = {
    "some_empty": (6, 5, 7, [1, 4]),
    "none_empty": (3, 4, 4, []),
    "all_empty": (4, 3, 9, [0, 1, 2, 3]),
    "many_chunks": (3, 40, 50, [0, 2]),  # 2000 elements per group: > 64 chunks x 64
    "one_group": (1, 2, 3, [0]),
}


def check(case, device: str) -> None:
    from dropless.ops.grouped_gemm.group_kernels import zero_groups
    from dropless.ops.permute.row_ops import zero_groups_eager

    E, M, N, empty = case
    gen = torch.Generator().manual_seed(E * 100 + M)
    out = (torch.randn(E, M, N, generator=gen) + 10).to(device)
    empty_E = torch.zeros(E, dtype=torch.bool)
    empty_E[empty] = True
    want = zero_groups_eager(out.clone().cpu(), empty_E)
    got = zero_groups(out, empty_E.to(device), block=64)
    assert got is out
    assert torch.equal(got.cpu(), want)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
