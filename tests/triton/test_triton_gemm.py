"""Triton grouped GEMM (forward, dx, dw) against the reference, and as a GEMM backend.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`) through the registered "triton" backend.
"""

# S rows, D in features, N out features, E experts, T tokens, K top-k, F hidden dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

# name -> (counts per expert, D, N, also test the [E, D, N] weight layout and strided
# weights); interpreter tiles are 16 x 32 x 32 (wgrad: 16 x 32 x 16), so these span
# several tiles and partial ones
CASES = {
    "basic": ([5, 3, 9, 4], 20, 33, True),
    "expert_with_zero_rows": ([5, 0, 17, 3], 20, 24, True),
    "all_rows_on_one_expert": ([0, 0, 25, 0], 40, 17, False),
    "single_row_T1": ([0, 1, 0], 8, 16, False),
    "no_rows_at_all": ([0, 0, 0], 8, 16, False),
    "E_not_power_of_two": ([2, 7, 1, 0, 6], 36, 20, True),
    "expert_mlp_end_to_end": "mlp",
    "fp16_operands": "fp16",
}

_INTERP = "triton_interp"


def _backend(device: str) -> str:
    """The backend name to test: the real "triton" on CUDA; on CPU (interpreter) a
    test-only registration, since "triton" refuses CPU tensors by design."""
    if device == "cuda":
        return "triton"
    from dropless.ops import GemmBackend, register_gemm_backend
    from dropless.ops.grouped_gemm import gemm_kernels as kernels

    register_gemm_backend(
        GemmBackend(_INTERP, kernels.grouped_mm, kernels.grouped_wgrad, lambda a, b: True, -1)
    )
    return _INTERP


def _check_mlp(device: str) -> None:
    from dropless.ops import expert_mlp
    from dropless.ops.reference import expert_mlp_reference

    T, K, E, D, F = 6, 2, 3, 12, 10
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(T, D, generator=gen)
    ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=gen)
    gate_up = torch.randn(E, 2 * F, D, generator=gen) * 0.3
    down = torch.randn(E, D, F, generator=gen) * 0.3
    g = torch.randn(T, D, generator=gen)
    params = [t.to(device).requires_grad_(True) for t in (x, w, gate_up, down)]
    out, _ = expert_mlp(params[0], ids.to(device), *params[1:], backend=_backend(device))
    grads = torch.autograd.grad(out, params, g.to(device))
    ref_params = [t.clone().requires_grad_(True) for t in (x, w, gate_up, down)]
    xr, wr, gur, dr = ref_params
    ref = expert_mlp_reference(xr, ids, wr, gur, dr)
    grads_r = torch.autograd.grad(ref, ref_params, g)
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, grads_r):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def _check_fp16(device: str) -> None:
    """16-bit operands, fp32 accumulation, one rounding of each output. fp16, not bf16:
    the Triton 3.9 interpreter's tl.dot returns garbage for bf16 (numpy has no bf16);
    bf16 is compiled for sm_90 in test_triton_aot.py and checked on a GPU by test_cuda."""
    from dropless.ops import grouped_gemm
    from dropless.ops.reference import grouped_gemm_reference

    counts, D, N = [6, 0, 11], 40, 24
    gen = torch.Generator().manual_seed(11)
    x_SD = torch.randn(sum(counts), D, generator=gen).half()
    w_END = (torch.randn(3, N, D, generator=gen) * 0.2).half()
    g_SN = torch.randn(sum(counts), N, generator=gen).half()
    params = [t.to(device).requires_grad_(True) for t in (x_SD, w_END)]
    y = grouped_gemm(*params, counts, backend=_backend(device))
    grads = torch.autograd.grad(y, params, g_SN.to(device))
    ref_params = [t.float().requires_grad_(True) for t in (x_SD, w_END)]
    yr = grouped_gemm_reference(*ref_params, counts)
    grads_r = torch.autograd.grad(yr, ref_params, g_SN.float())
    assert y.dtype == grads[0].dtype == grads[1].dtype == torch.float16
    for got, want in zip([y, *grads], [yr, *grads_r]):  # one fp16 ulp (2^-11 relative)
        torch.testing.assert_close(got.detach().cpu(), want.detach().half(), rtol=1e-3, atol=1e-3)


def check(case, device: str) -> None:
    from dropless.ops import grouped_gemm
    from dropless.ops.grouped_gemm import gemm_kernels as kernels
    from dropless.ops.reference import grouped_gemm_reference

    if case == "mlp":
        return _check_mlp(device)
    if case == "fp16":
        return _check_fp16(device)
    counts, D, N, full = case
    E, S = len(counts), sum(counts)
    gen = torch.Generator().manual_seed(S * 100 + D + N)
    x_SD = torch.randn(S, D, generator=gen)
    w_END = torch.randn(E, N, D, generator=gen)
    bias_EN = torch.randn(E, N, generator=gen)
    g_SN = torch.randn(S, N, generator=gen)
    tol = dict(rtol=1e-5, atol=1e-5)
    x, w, g = x_SD.to(device), w_END.to(device), g_SN.to(device)

    # raw mm: counts as a device tensor (no host read), [E, D, N] weight, out= in place
    ref = grouped_gemm_reference(x_SD, w_END, counts)
    w_EDN = w.transpose(1, 2).contiguous()
    out = torch.full((S, N), float("nan"), device=device)
    y = kernels.grouped_mm(x, w_EDN, torch.tensor(counts, device=device), False, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y.cpu(), ref, **tol)
    if full:  # a strided (non-contiguous) weight view: the kernel reads through strides
        y = kernels.grouped_mm(x, w_EDN.transpose(1, 2), counts, True)
        torch.testing.assert_close(y.cpu(), ref, **tol)

    # through ops.grouped_gemm: forward with bias, dx, dw, dbias against the reference
    name = _backend(device)
    # trans_w=False swaps which of forward / dx runs the kernel with trans_b
    for trans_w in (True, False) if full else (True,):
        w_in = w_END if trans_w else w_END.transpose(1, 2).contiguous()
        params = [t.to(device).requires_grad_(True) for t in (x_SD, w_in, bias_EN)]
        y = grouped_gemm(params[0], params[1], counts, params[2], trans_w=trans_w, backend=name)
        grads = torch.autograd.grad(y, params, g)
        ref_params = [t.clone().requires_grad_(True) for t in (x_SD, w_in, bias_EN)]
        xr, wr, br = ref_params
        yr = grouped_gemm_reference(xr, wr, counts, br, trans_w=trans_w)
        grads_r = torch.autograd.grad(yr, ref_params, g_SN)
        torch.testing.assert_close(y.detach().cpu(), yr.detach(), **tol)
        for got, want in zip(grads, grads_r):
            torch.testing.assert_close(got.cpu(), want, **tol)
        for e, c in enumerate(counts):  # the weight grad of an empty group is exactly zero
            if c == 0:
                assert not grads[1][e].any()


test_interpreted, test_cuda = interpreted_tests(CASES, check)
