"""Triton RMSNorm (optional fused residual add) against torch's rms_norm, forward and backward.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (conftest.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# R rows, D normalised dim

from __future__ import annotations

import pytest
import torch

# name -> (R, D, with_residual, with_residual_grad); interpreter tiles: 16 rows x 32 cols
CASES = {
    "basic": (13, 20, False, False),
    "residual": (9, 24, True, True),
    "residual_grad_only_from_y": (7, 16, True, False),
    "not_block_multiples": (37, 70, True, True),  # several row programs and column tiles
    "single_row": (1, 8, False, False),
    "zero_rows": (0, 8, True, True),
}
EPS = 1e-6


def check(case, device: str) -> None:
    from dropless.kernels.rmsnorm_kernels import rms_norm
    from dropless.ops.reference import rms_norm_reference

    R, D, with_res, res_grad = case
    gen = torch.Generator().manual_seed(R * 100 + D)
    x = torch.randn(R, D, generator=gen) * 3
    res = torch.randn(R, D, generator=gen) if with_res else None
    w = torch.randn(D, generator=gen)
    gy = torch.randn(R, D, generator=gen)
    gs = torch.randn(R, D, generator=gen) if res_grad else None
    tol = dict(rtol=1e-5, atol=1e-5)

    def run(fn, dev):
        leaves = [t.to(dev).requires_grad_(True) for t in (x, w) + ((res,) if with_res else ())]
        out = fn(leaves[0], leaves[1], EPS, leaves[2] if with_res else None)
        y, s = out if with_res else (out, None)
        loss = (y * gy.to(dev)).sum() + ((s * gs.to(dev)).sum() if gs is not None else 0)
        grads = torch.autograd.grad(loss, leaves) if R else [torch.zeros_like(t) for t in leaves]
        return [y, s, *grads]

    got = run(rms_norm, device)
    want = run(rms_norm_reference, "cpu")
    for name, a, b in zip(["y", "x+residual", "dx", "dw", "dresidual"], got, want):
        if b is None:
            assert a is None, name
            continue
        torch.testing.assert_close(a.detach().cpu(), b.detach(), **tol, msg=name)


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted(interpreted, name):
    if interpreted[name] is not None:
        pytest.fail(interpreted[name], pytrace=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda(name):
    check(CASES[name], "cuda")
