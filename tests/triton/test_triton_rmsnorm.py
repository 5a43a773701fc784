"""Triton RMSNorm (optional fused residual add) against torch's rms_norm, forward and backward.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# R rows, D normalised dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

# name -> (R, D, with_residual, with_residual_grad); interpreter tiles: 16 rows x 32 cols
CASES = {
    "basic": (13, 20, False, False),
    "residual": (9, 24, True, True),
    "residual_grad_only_from_y": (7, 16, True, False),
    "not_block_multiples": (37, 70, True, True),  # several row programs and column tiles
    "single_row": (1, 8, False, False),
    "zero_rows": (0, 8, True, True),
}
# bf16 storage, fp32 math, compiled only: Triton 3.9's interpreter casts fp32 to bf16 by
# truncation (round toward zero), the GPU rounds to nearest even
CUDA_ONLY_CASES = {"bf16_residual": (11, 40, True, True, torch.bfloat16)}
EPS = 1e-6


def check(case, device: str) -> None:
    from dropless.ops.reference import rms_norm_reference
    from dropless.ops.rmsnorm import rmsnorm_kernels as kernels
    from dropless.ops.rmsnorm.eager import rms_norm_with

    def rms_norm(*args):  # the op's one autograd Function on the Triton passes
        return rms_norm_with(kernels.rms_norm_fwd, kernels.rms_norm_bwd, *args)

    R, D, with_res, res_grad, *dtype = case
    dtype = dtype[0] if dtype else torch.float32
    gen = torch.Generator().manual_seed(R * 100 + D)
    x = (torch.randn(R, D, generator=gen) * 3).to(dtype)
    res = torch.randn(R, D, generator=gen).to(dtype) if with_res else None
    w = torch.randn(D, generator=gen).to(dtype)
    gy = torch.randn(R, D, generator=gen).to(dtype)
    gs = torch.randn(R, D, generator=gen).to(dtype) if res_grad else None
    # fp32: tight; bf16: the reference runs in fp32 on the same bf16 values, compared
    # after one rounding to bf16, with torch's default bf16 tolerance
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}

    def run(fn, dev):
        leaves = [t.to(dev).requires_grad_(True) for t in (x, w) + ((res,) if with_res else ())]
        out = fn(leaves[0], leaves[1], EPS, leaves[2] if with_res else None)
        y, s = out if with_res else (out, None)
        loss = (y * gy.to(dev)).sum() + ((s * gs.to(dev)).sum() if gs is not None else 0)
        grads = torch.autograd.grad(loss, leaves) if R else [torch.zeros_like(t) for t in leaves]
        return [y, s, *grads]

    got = run(rms_norm, device)
    if dtype != torch.float32:  # the sum is rounded to bf16 as `x + residual` rounds it
        x, res = (x + res).float(), torch.zeros(R, D)
    x, w, gy = x.float(), w.float(), gy.float()
    gs = gs.float() if res_grad else None
    want = run(rms_norm_reference, "cpu")
    for name, a, b in zip(["y", "x+residual", "dx", "dw", "dresidual"], got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == dtype, name
        torch.testing.assert_close(a.detach().cpu(), b.detach().to(dtype), **tol, msg=name)


test_interpreted, test_cuda = interpreted_tests(
    CASES, check, cuda_cases={**CASES, **CUDA_ONLY_CASES}
)
