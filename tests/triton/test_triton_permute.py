"""Triton permute / unpermute (combine) kernels against the references, fwd and bwd.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py),
so nothing here imports triton at module level; on a CUDA machine the same checks also
run compiled (marker `gpu`).
"""

# T tokens, D model dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import torch

from interpreted import interpreted_tests

# name -> (T, K, E, D, routing); routing: "random" top-k, "skip1" (expert 1 gets no
# token), "one" (every pair on expert E-1), "drop" (capacity mode: some pairs dropped)
CASES = {
    "basic": (7, 2, 4, 20, "random"),
    "expert_with_zero_tokens": (6, 2, 4, 16, "skip1"),
    "all_tokens_on_one_expert": (9, 1, 3, 20, "one"),
    "single_token_T1": (1, 2, 3, 16, "random"),
    "K_equals_E": (5, 3, 3, 12, "random"),
    "E_not_power_of_two_odd_D": (11, 2, 7, 33, "random"),
    "not_block_multiples": (19, 3, 5, 41, "random"),
    "capacity_dropped_pairs": (8, 2, 4, 20, "drop"),
    "bf16_rows_fp32_weights": "bf16",
}


def _routing(T, K, E, mode, gen):
    scores = torch.rand(T, E, generator=gen)
    if mode == "skip1":
        scores[:, 1] = -1.0
    ids_TK = scores.topk(K, dim=-1).indices
    if mode == "one":
        ids_TK = torch.full((T, K), E - 1, dtype=torch.long)
    keep_TK = None
    if mode == "drop":
        keep_TK = torch.rand(T, K, generator=gen) > 0.3
        keep_TK[0, :] = False  # a token with every pair dropped gets zero output and grad
    return ids_TK, keep_TK


def _check_bf16(device: str) -> None:
    """bf16 rows, fp32 routing weights: sums in fp32, one rounding to bf16 at the end."""
    from dropless.ops import sort_by_expert
    from dropless.ops.permute import permute_kernels as kernels
    from dropless.ops.reference import permute_reference, unpermute_reference

    T, K, E, D = 9, 2, 4, 40
    gen = torch.Generator().manual_seed(3)
    ids_TK = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    x_TD = torch.randn(T, D, generator=gen).bfloat16()
    w_TK = torch.rand(T, K, generator=gen)
    g_TD = torch.randn(T, D, generator=gen).bfloat16()
    sp = sort_by_expert(ids_TK.to(device), E)
    x_SD = kernels.permute(x_TD.to(device), sp.token_S, sp.slot_TK)
    assert x_SD.dtype == torch.bfloat16
    assert torch.equal(x_SD.cpu(), permute_reference(x_TD, ids_TK, E)[0])
    y = x_SD.detach().requires_grad_(True)
    w = w_TK.to(device).requires_grad_(True)
    out = kernels.unpermute(y, sp.token_S, sp.pair_S, sp.slot_TK, w)
    gy, gw = torch.autograd.grad(out, (y, w), g_TD.to(device))
    yr = x_SD.detach().cpu().float().requires_grad_(True)
    wr = w_TK.clone().requires_grad_(True)
    outr = unpermute_reference(yr, ids_TK, wr, E)
    gyr, gwr = torch.autograd.grad(outr, (yr, wr), g_TD.float())
    assert out.dtype == gy.dtype == torch.bfloat16 and gw.dtype == torch.float32
    torch.testing.assert_close(out.cpu(), outr.detach().bfloat16())
    torch.testing.assert_close(gy.cpu(), gyr.bfloat16())
    torch.testing.assert_close(gw.cpu(), gwr, rtol=1e-5, atol=1e-5)  # fp32 dots of bf16 data


def check(case, device: str) -> None:
    from dropless.ops import permute, sort_by_expert, unpermute
    from dropless.ops.permute import permute_kernels as kernels
    from dropless.ops.reference import permute_reference, unpermute_reference

    if case == "bf16":
        return _check_bf16(device)
    T, K, E, D, mode = case
    gen = torch.Generator().manual_seed(T * 100 + K * 10 + E)
    ids_TK, keep_TK = _routing(T, K, E, mode, gen)
    x_TD = torch.randn(T, D, generator=gen)
    w_TK = torch.rand(T, K, generator=gen)
    g_SD_seed = torch.randn(T * K, D, generator=gen)
    g_TD = torch.randn(T, D, generator=gen)
    sp = sort_by_expert(ids_TK.to(device), E, None if keep_TK is None else keep_TK.to(device))
    S = sp.num_slots
    tol = dict(rtol=1e-5, atol=1e-6)

    # permute forward: rows, in expert order; backward: gather-sum over each token's slots
    x = x_TD.to(device).requires_grad_(True)
    x_SD = kernels.permute(x, sp.token_S, sp.slot_TK)
    g_SD = g_SD_seed[:S].to(device)
    (gx,) = torch.autograd.grad(x_SD, x, g_SD)
    if keep_TK is None:
        xr = x_TD.clone().requires_grad_(True)
        ref_SD, token_S, counts_E = permute_reference(xr, ids_TK, E)
        assert torch.equal(sp.token_S.cpu(), token_S)
        assert sp.counts == counts_E.tolist()
        (gxr,) = torch.autograd.grad(ref_SD, xr, g_SD.cpu())
    else:  # the reference has no capacity mode: the torch op is the spec there
        xr = x_TD.clone().requires_grad_(True)
        sp_cpu = sort_by_expert(ids_TK, E, keep_TK)
        ref_SD = permute(xr, sp_cpu)
        (gxr,) = torch.autograd.grad(ref_SD, xr, g_SD.cpu())
        assert torch.equal(gxr[0], torch.zeros(D)), "fully dropped token must get zero grad"
    torch.testing.assert_close(x_SD.detach().cpu(), ref_SD.detach(), rtol=0, atol=0)
    torch.testing.assert_close(gx.cpu(), gxr, **tol)

    # weighted combine: forward, grad of the rows and of the routing weights
    y_SD = torch.randn(S, D, generator=gen)
    y = y_SD.to(device).requires_grad_(True)
    w = w_TK.to(device).requires_grad_(True)
    out = kernels.unpermute(y, sp.token_S, sp.pair_S, sp.slot_TK, w)
    gy, gw = torch.autograd.grad(out, (y, w), g_TD.to(device))
    yr, wr = y_SD.clone().requires_grad_(True), w_TK.clone().requires_grad_(True)
    if keep_TK is None:
        outr = unpermute_reference(yr, ids_TK, wr, E)
    else:
        outr = unpermute(yr, sort_by_expert(ids_TK, E, keep_TK), wr)
    gyr, gwr = torch.autograd.grad(outr, (yr, wr), g_TD)
    torch.testing.assert_close(out.detach().cpu(), outr.detach(), **tol)
    torch.testing.assert_close(gy.cpu(), gyr, **tol)
    torch.testing.assert_close(gw.cpu(), gwr, **tol)

    # unweighted combine (the transpose of permute)
    out1 = kernels.unpermute(y, sp.token_S, sp.pair_S, sp.slot_TK)
    (gy1,) = torch.autograd.grad(out1, y, g_TD.to(device))
    yr1 = y_SD.clone().requires_grad_(True)
    if keep_TK is None:
        outr1 = unpermute_reference(yr1, ids_TK, None, E)
    else:
        outr1 = unpermute(yr1, sort_by_expert(ids_TK, E, keep_TK))
    (gyr1,) = torch.autograd.grad(outr1, yr1, g_TD)
    torch.testing.assert_close(out1.detach().cpu(), outr1.detach(), **tol)
    torch.testing.assert_close(gy1.cpu(), gyr1, **tol)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
