"""Triton SwiGLU x routing weight kernels against the reference, forward and backward.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# S rows (sorted pairs), F expert hidden dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

# name -> (S, F, with_prob, interleaved, activation); interpreter tiles: 16 rows x 32 cols
CASES = {
    "basic": (13, 20, True, False, "swiglu"),
    "no_prob": (9, 16, False, False, "swiglu"),
    "single_row": (1, 8, True, False, "swiglu"),
    "not_block_multiples": (37, 45, True, False, "swiglu"),
    "interleaved": (11, 20, True, True, "swiglu"),
    "zero_rows": (0, 8, True, False, "swiglu"),
    "gpt_oss_clamped": (10, 12, True, False, "gpt_oss"),
    "gpt_oss_interleaved_no_prob": (7, 9, False, True, "gpt_oss"),
    "bf16_h_fp32_prob": (12, 40, True, False, "swiglu", torch.bfloat16),
}
GPT_OSS = dict(alpha=1.702, limit=2.0)  # a low limit so the clamps bind on randn * 2


def check(case, device: str) -> None:
    from dropless.ops import swiglu
    from dropless.ops.activation import swiglu_kernels as kernels
    from dropless.ops.reference import swiglu_reference

    S, F, with_prob, interleaved, activation, *dtype = case
    dtype = dtype[0] if dtype else torch.float32
    kw = dict(activation=activation, interleaved=interleaved)
    if activation == "gpt_oss":
        kw.update(GPT_OSS)
    gen = torch.Generator().manual_seed(S * 100 + F)
    h_S2F = (torch.randn(S, 2 * F, generator=gen) * 2).to(dtype)
    prob_S = torch.rand(S, generator=gen) if with_prob else None
    g_SF = torch.randn(S, F, generator=gen).to(dtype)
    # fp32: tight; bf16: math in fp32, one rounding of the output (torch's default bf16
    # tolerance covers one ulp); the reference runs in fp32 on the same bf16 values
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}

    h = h_S2F.to(device).requires_grad_(True)
    p = prob_S.to(device).requires_grad_(True) if with_prob else None
    a = kernels.swiglu(h, p, **kw)
    inputs = (h, p) if with_prob else (h,)
    grads = torch.autograd.grad(a, inputs, g_SF.to(device), allow_unused=True)

    hr = h_S2F.float().requires_grad_(True)
    pr = prob_S.clone().requires_grad_(True) if with_prob else None
    if activation == "gpt_oss":  # no loop reference: the torch op (autograd) is the spec
        ar = swiglu(hr, pr, **kw)
        assert (h_S2F.abs() > GPT_OSS["limit"]).any(), "the clamps must bind somewhere"
    elif interleaved:  # the reference splits halves: de-interleave its input
        hr_halves = torch.cat([hr[:, 0::2], hr[:, 1::2]], dim=1)
        ar = swiglu_reference(hr_halves, pr)
        torch.testing.assert_close(ar, swiglu(hr, pr, interleaved=True), **tol)
    else:
        ar = swiglu_reference(hr, pr)
    inputs_r = (hr, pr) if with_prob else (hr,)
    grads_r = torch.autograd.grad(ar, inputs_r, g_SF.float(), allow_unused=True)
    ar = ar.to(dtype)
    grads_r = [grads_r[0].to(dtype), *grads_r[1:]]  # the prob grad stays in prob's dtype

    assert a.shape == (S, F) and a.dtype == h_S2F.dtype
    torch.testing.assert_close(a.detach().cpu(), ar.detach(), **tol)
    for got, want in zip(grads, grads_r):
        torch.testing.assert_close(got.cpu(), want, **tol)

    # raw backward with the activation recomputed in the same pass; no prob grad asked
    gh, gp, a2 = kernels.swiglu_bwd(
        g_SF.to(device), h_S2F.to(device), p.detach() if with_prob else None,
        need_prob_grad=False, recompute=True, **kw,
    )  # fmt: skip
    assert gp is None
    torch.testing.assert_close(a2.cpu(), ar.detach(), **tol)
    torch.testing.assert_close(gh.cpu(), grads_r[0], **tol)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
