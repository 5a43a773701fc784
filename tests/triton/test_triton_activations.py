"""The Triton activation math (`dropless.ops.activation.activation_kernels`) against the reference.

Every kind's forward and derivative: the gated forms through the row kernels that call
`activations.glu` (`swiglu_fwd` / `swiglu_bwd`), the elementwise f and f' through a
one-program kernel that calls `activations.elementwise`, each against autograd through
`dropless.ops.reference.activation_reference`. `check(case, device)` runs under
TRITON_INTERPRET=1 in a child process (tests/interpreted.py), so nothing here imports triton at
module level; on a CUDA machine the same checks also run compiled (marker `gpu`).
"""

# S rows, F expert hidden dim, N elements

from __future__ import annotations

import torch

from interpreted import interpreted_tests

LIMIT = 2.0  # low, so the clamps of swiglu_clamp / gpt_oss bind on randn * 2
ALPHA = 1.702
GATED = ("swiglu", "gelu", "gelu_tanh", "relu2", "swiglu_clamp", "gpt_oss")
ELEMENTWISE = ("swiglu", "gelu", "gelu_tanh", "relu2")

# name -> ("gated", kind, S, F, interleaved, dtype) or ("elementwise", kind, N)
CASES = {
    **{f"gated_{k}": ("gated", k, 13, 20, False, torch.float32) for k in GATED},
    "gated_gelu_tanh_interleaved": ("gated", "gelu_tanh", 9, 12, True, torch.float32),
    "gated_swiglu_clamp_interleaved": ("gated", "swiglu_clamp", 7, 9, True, torch.float32),
    # elementwise bf16 is exact under the interpreter (only bf16 tl.dot is not)
    "gated_gelu_bf16": ("gated", "gelu", 12, 40, False, torch.bfloat16),
    **{f"elementwise_{k}": ("elementwise", k, 64) for k in ELEMENTWISE},
    "kinds_cover_the_torch_kinds": ("kinds",),
}


def _elementwise_kernel():
    """A kernel writing f(x) and f'(x) of `activations.elementwise` for one tile."""
    import triton
    import triton.language as tl

    from dropless.ops.activation import activation_kernels as activations

    globals()["activations"] = activations  # jit functions resolve names in module globals

    @triton.jit
    def kernel(x_ptr, f_ptr, df_ptr, N, KIND: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        f, df = activations.elementwise(x, KIND)  # noqa: F821 - set in globals above
        tl.store(f_ptr + offs, f, mask=mask)
        tl.store(df_ptr + offs, df, mask=mask)

    return kernel


def _reference(h, kind: str, gated: bool, interleaved: bool = False):
    from dropless.ops.reference import activation_reference

    return activation_reference(
        h, kind, gated=gated, interleaved=interleaved, alpha=ALPHA, limit=LIMIT
    )


def _check_elementwise(kind: str, N: int, device: str) -> None:
    gen = torch.Generator().manual_seed(N)
    x = torch.randn(N, generator=gen) * 3
    f = torch.empty(N, device=device)
    df = torch.empty(N, device=device)
    _elementwise_kernel()[(1,)](x.to(device), f, df, N, KIND=kind, BLOCK=64)
    xr = x.clone().requires_grad_(True)
    fr = _reference(xr.unsqueeze(0), kind, gated=False)[0]
    (dfr,) = torch.autograd.grad(fr, xr, torch.ones_like(fr))
    # fp32 throughout; exp/erf/sigmoid may differ by a few ulps between libraries
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(f.cpu(), fr.detach(), **tol)
    torch.testing.assert_close(df.cpu(), dfr, **tol)


def _check_gated(kind, S, F, interleaved, dtype, device) -> None:
    from dropless.ops.activation import swiglu_kernels as kernels

    gen = torch.Generator().manual_seed(S * 100 + F)
    h_S2F = (torch.randn(S, 2 * F, generator=gen) * 2).to(dtype)
    prob_S = torch.rand(S, generator=gen)
    g_SF = torch.randn(S, F, generator=gen).to(dtype)
    kw = dict(activation=kind, interleaved=interleaved, alpha=ALPHA, limit=LIMIT)
    h, p = h_S2F.to(device), prob_S.to(device)
    a = kernels.swiglu_fwd(h, p, **kw)
    gh, gp, a2 = kernels.swiglu_bwd(g_SF.to(device), h, p, recompute=True, **kw)

    hr = h_S2F.float().requires_grad_(True)
    pr = prob_S.clone().requires_grad_(True)
    ar = _reference(hr, kind, gated=True, interleaved=interleaved) * pr.unsqueeze(1)
    ghr, gpr = torch.autograd.grad(ar, (hr, pr), g_SF.float())
    if kind in ("swiglu_clamp", "gpt_oss"):
        assert (h_S2F.float().abs() > LIMIT).any(), "the clamps must bind somewhere"
    # fp32: a few ulps (library exp/erf); bf16: fp32 math, one rounding of each output
    # (torch's default bf16 tolerance covers one ulp), the reference on the same values
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else {}
    assert a.shape == (S, F) and a.dtype == dtype and gh.dtype == dtype
    for got, want in ((a, ar), (a2, ar), (gh, ghr)):
        torch.testing.assert_close(got.cpu(), want.detach().to(dtype), **tol)
    torch.testing.assert_close(gp.cpu(), gpr, rtol=1e-5, atol=1e-5)


def check(case, device: str) -> None:
    if case[0] == "kinds":
        # every built-in torch kind has its Triton math (registered elementwise
        # functions are the caller's Python and stay on the torch path)
        import dropless  # noqa: F401 - registers the built-in kinds
        from dropless.ops.activation.activation_kernels import ELEMENTWISE_KINDS, KINDS
        from dropless.ops.activation.eager import REGISTERED
        from dropless.ops.specs import ACTIVATION_KINDS

        assert set(KINDS) == set(ACTIVATION_KINDS) - set(REGISTERED), KINDS
        assert set(ELEMENTWISE_KINDS) == set(ELEMENTWISE), ELEMENTWISE_KINDS
    elif case[0] == "elementwise":
        _check_elementwise(*case[1:], device)
    else:
        _check_gated(*case[1:], device)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
