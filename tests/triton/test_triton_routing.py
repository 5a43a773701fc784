"""Triton routing kernel and routing-metadata sort against the torch reference.

`check(case, device)` runs under TRITON_INTERPRET=1 in the folder's child process
(tests/interpreted.py), in fp32 (bf16 logits: loaded and computed in fp32 as the
reference does); on a CUDA machine the same checks run compiled (marker `gpu`). The
tests at the bottom run in the pytest process and never import triton.
"""

# T tokens, E experts, K top-k, G expert groups, D model dim, S sorted pairs

from __future__ import annotations

import pytest
import torch

from dropless.ops.specs import RoutingConfig
from interpreted import interpreted_tests

# fp32 scores: softmax/sigmoid of the same fp32 logits, sums over <= 12 terms in another
# order than torch's; a few ulps
TOL = dict(rtol=2e-6, atol=1e-7)
DSV3 = dict(score_func="sigmoid", renormalize=True, scaling_factor=2.5, expert_bias=True)

# name -> ("route", T, E, K, routing fields, logits mode) or ("sort", T, E, K, mode)
CASES = {
    "softmax": ("route", 9, 6, 2, {}, "randn"),
    "softmax_renorm_scaled": (
        "route",
        7,
        8,
        3,
        dict(renormalize=True, scaling_factor=0.5),
        "randn",
    ),
    "sigmoid_E_not_power_of_two": ("route", 10, 7, 2, dict(score_func="sigmoid"), "randn"),
    "groups_on_dsv3": ("route", 9, 12, 3, dict(DSV3, n_group=4, topk_group=2), "randn"),
    "groups_softmax_bias": (
        "route",
        6,
        12,
        4,
        dict(n_group=3, topk_group=2, expert_bias=True),
        "randn",
    ),
    "groups_of_one_expert": ("route", 5, 6, 2, dict(n_group=6, topk_group=3), "randn"),
    "single_token_T1": ("route", 1, 5, 2, dict(renormalize=True), "randn"),
    "K_equals_E": ("route", 6, 5, 5, dict(renormalize=True, score_func="sigmoid"), "randn"),
    "expert_with_zero_tokens": ("route", 9, 6, 2, dict(expert_bias=True), "starve1"),
    "all_tokens_on_one_expert": ("route", 9, 6, 1, dict(expert_bias=True), "flood3"),
    "bf16_logits": ("route", 9, 10, 3, dict(renormalize=True), "bf16"),
    "ties_lowest_index_first": ("route", 4, 6, 3, {}, "ties"),
    "ties_groups_lowest_group_first": ("route", 3, 12, 3, dict(n_group=4, topk_group=2), "ties"),
    "aux_softmax_renorm": ("aux", 9, 6, 2, dict(renormalize=True), "randn"),
    "aux_sigmoid_groups_bias": ("aux", 10, 12, 3, dict(DSV3, n_group=4, topk_group=2), "randn"),
    "aux_T1_bf16": ("aux", 1, 5, 2, {}, "bf16"),
    "checkpoint_recompute_replays_the_kernel_choice": ("replay",),
    "sort_random": ("sort", 19, 7, 3, "random"),
    "sort_many_blocks_and_bucket_chunks": ("sort", 50, 21, 2, "random"),
    "sort_expert_with_zero_tokens": ("sort", 12, 5, 2, "skip1"),
    "sort_all_on_one_expert": ("sort", 9, 4, 2, "one"),
    "sort_single_token_T1": ("sort", 1, 3, 2, "random"),
    "sort_K_equals_E": ("sort", 6, 4, 4, "random"),
    "sort_capacity_dropped": ("sort", 17, 5, 2, "drop"),
    "sort_device_counts": ("sort", 13, 6, 2, "sync_free"),
    "sort_no_tokens_T0": ("sort", 0, 4, 2, "random"),
}


def _logits(T, E, mode, gen):
    if mode == "ties":
        # rows of equal logits (and a row with a tie at the k-th place)
        out = torch.zeros(T, E)
        out[1, 2:5] = 1.0
        out[2, ::2] = -1.0
        return out
    return torch.randn(T, E, generator=gen)


def _bias(E, mode, gen):
    bias = torch.randn(E, generator=gen) * 0.1
    if mode == "starve1":
        bias[1] = -1e4  # never chosen
    if mode == "flood3":
        bias[3] = 1e4  # every token's first choice
    return bias


def _route_check(T, E, K, fields, mode, device):
    from dropless.ops.reference import route_reference
    from dropless.ops.routing import routing_kernels as rk

    routing = RoutingConfig(**fields)
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + K)
    logits = _logits(T, E, mode, gen)
    if mode == "bf16":
        logits = logits.bfloat16()
    bias = _bias(E, mode, gen) if routing.expert_bias else None
    g_w, g_s = torch.randn(T, K, generator=gen), torch.randn(T, E, generator=gen)

    lg = logits.to(device).requires_grad_(True)
    w, ids, s = rk.route(lg, K, routing, None if bias is None else bias.to(device))
    assert w.dtype == s.dtype == torch.float32 and ids.dtype == torch.int64
    lr = logits.clone().requires_grad_(True)
    wr, idr, sr = route_reference(lr, K, routing, expert_bias_E=bias)
    if mode == "ties":
        # torch.topk leaves the order of equal scores unspecified; the kernel's rule is the
        # lowest index first (experts, and groups), as a stable descending sort
        _check_tie_rule(ids.cpu(), logits, K, routing)
        idr = ids.cpu()
        wr = sr.gather(1, idr)
        wr = wr / (wr.sum(-1, keepdim=True) + 1e-20) if routing.renormalize else wr
        wr = wr * routing.scaling_factor
    assert torch.equal(ids.cpu(), idr), (ids, idr)
    if mode == "starve1":
        assert not (ids == 1).any()
    if mode == "flood3":
        assert (ids[:, 0] == 3).all()
    torch.testing.assert_close(s.detach().cpu(), sr.detach(), **TOL)
    torch.testing.assert_close(w.detach().cpu(), wr.detach(), **TOL)
    # backward: through the weights only, the scores only, and both
    for gw, gs in ((g_w, None), (None, g_s), (g_w, g_s)):
        (dl,) = torch.autograd.grad(_loss(w, s, gw, gs), lg, retain_graph=True)
        (dlr,) = torch.autograd.grad(_loss(wr, sr, gw, gs), lr, retain_graph=True)
        assert dl.dtype == logits.dtype
        if mode == "bf16":  # fp32 grads equal to ulps, each rounded to bf16 once: <= 1 ulp
            err = (dl.cpu().float() - dlr.float()).abs().max()
            assert err <= 2**-7 * dlr.float().abs().max(), err
        else:
            torch.testing.assert_close(dl.cpu(), dlr, **TOL)


def _loss(w, s, g_w, g_s):
    loss = 0 if g_w is None else (w * g_w.to(w.device)).sum()
    return loss + (0 if g_s is None else (s * g_s.to(s.device)).sum())


def _aux_check(T, E, K, fields, mode, device):
    """route_with_aux: the kernel's fused loss inputs against the torch losses (values
    and gradients through weights, scores, the load-balancing and the z loss together)."""
    from dropless.ops.losses import (
        load_balancing_loss_from_mean,
        load_balancing_loss_global,
        z_loss,
    )
    from dropless.ops.routing import route_with_aux
    from dropless.ops.routing import routing_kernels as rk

    routing = RoutingConfig(**fields)
    gen = torch.Generator().manual_seed(T * 1000 + E * 10 + K + 7)
    logits = _logits(T, E, mode, gen)
    logits = logits.bfloat16() if mode == "bf16" else logits
    bias = _bias(E, mode, gen) if routing.expert_bias else None
    g_w, g_s = torch.randn(T, K, generator=gen), torch.randn(T, E, generator=gen)
    counts_E = torch.randint(0, 5, (E,), generator=gen)
    lg = logits.to(device).requires_grad_(True)
    out = rk.route_with_aux(lg, K, routing, None if bias is None else bias.to(device))
    lr = logits.clone().requires_grad_(True)
    ref = route_with_aux(lr, K, routing, expert_bias_E=bias)  # CPU: the torch losses
    assert torch.equal(out[1].cpu(), ref[1])
    for got, want in zip((out[0], out[2], out[3], out[4]), (ref[0], ref[2], ref[3], ref[4])):
        assert got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got.detach().cpu(), want.detach(), **TOL)
    # the contract the MoE layer relies on: the same losses as ops.losses
    lb = load_balancing_loss_from_mean(out[3], counts_E.to(device), 7)
    torch.testing.assert_close(lb.cpu(), load_balancing_loss_global(ref[2], counts_E, 7), **TOL)
    torch.testing.assert_close(out[4].cpu(), z_loss(lr), **TOL)

    def loss(w, s, pm, z):
        lb = load_balancing_loss_from_mean(pm, counts_E.to(pm.device), 7)
        return _loss(w, s, g_w, g_s) + lb + 0.3 * z

    (dl,) = torch.autograd.grad(loss(out[0], out[2], out[3], out[4]), lg)
    (dlr,) = torch.autograd.grad(loss(ref[0], ref[2], ref[3], ref[4]), lr)
    if mode == "bf16":
        err = (dl.cpu().float() - dlr.float()).abs().max()
        assert err <= 2**-7 * dlr.float().abs().max(), err
    else:
        torch.testing.assert_close(dl.cpu(), dlr, **TOL)


def _replay_check(device):
    """In a checkpointed region the kernel path routes the recompute at the forward's
    experts (ops.replay), with today's scores: the expert bias changed between forward
    and backward does not move the gradient."""
    from torch.utils.checkpoint import checkpoint

    from dropless.ops import routing as R
    from dropless.ops.routing import routing_kernels as rk

    calls = []

    def counted(*args, **kw):
        calls.append(kw.get("ids_TK") is not None)
        return rk.route_with_aux(*args, **kw)

    # the interpreter's kernels, picked for these CPU tensors in this child process only
    R.register_routing_kernels(
        R.RoutingKernels(
            "interpreted", rk.route, rk.sort_by_expert, lambda t: True, 99, route_with_aux=counted
        )  # fmt: skip
    )
    try:
        T, E, K, D = 8, 6, 2, 5
        routing = RoutingConfig(renormalize=True, expert_bias=True)
        gen = torch.Generator().manual_seed(11)
        x, W = torch.randn(T, D, generator=gen), torch.randn(E, D, generator=gen)
        g = torch.randn(T, K, generator=gen)
        bias = torch.zeros(E)

        def region(x, W):
            w, ids, s, pm, z = R.route_with_aux(x @ W.t(), K, routing, expert_bias_E=bias)
            return (w * g).sum() + s[:, 0].sum() + 0.3 * pm.square().sum() + z

        xr, Wr = x.clone().requires_grad_(True), W.clone().requires_grad_(True)
        want = torch.autograd.grad(region(xr, Wr), (xr, Wr))
        calls.clear()
        xc, Wc = x.clone().requires_grad_(True), W.clone().requires_grad_(True)
        loss = checkpoint(region, xc, Wc, use_reentrant=False)
        ids_before = R.route(x @ W.t(), K, routing, expert_bias_E=bias)[1]
        bias[ids_before[:, 0]] -= 10.0  # a fresh routing now chooses other experts
        assert not torch.equal(R.route(x @ W.t(), K, routing, expert_bias_E=bias)[1], ids_before)
        got = torch.autograd.grad(loss, (xc, Wc))
        assert calls == [False, True], calls  # forward selects, the recompute replays
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    finally:
        del R.ROUTING.entries["interpreted"]


def _check_tie_rule(ids_TK, logits_TE, K, routing):
    scores = logits_TE.float().softmax(-1)
    choice = scores
    if routing.n_group is not None:
        T, E = scores.shape
        per = E // routing.n_group
        top2 = torch.sort(
            scores.view(T, routing.n_group, per), dim=-1, descending=True, stable=True
        )
        group_score = top2.values[..., : min(2, per)].sum(-1)
        groups = torch.sort(group_score, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros(T, routing.n_group, dtype=torch.bool)
        keep.scatter_(1, groups[:, : routing.topk_group], True)
        choice = scores.masked_fill(~keep.repeat_interleave(per, 1), float("-inf"))
    want = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :K]
    assert torch.equal(ids_TK, want), (ids_TK, want)


def _sort_check(T, E, K, mode, device):
    from dropless.ops import permute, sort_by_expert, unpermute
    from dropless.ops.reference import permute_reference
    from dropless.ops.routing import routing_kernels as rk

    gen = torch.Generator().manual_seed(T * 100 + E * 10 + K)
    ids = torch.rand(T, E, generator=gen).argsort(-1)[:, :K]
    if mode == "skip1":
        ids = torch.where(ids == 1, torch.zeros_like(ids), ids)
    if mode == "one":
        ids = torch.full((T, K), E - 1, dtype=torch.long)
    keep = torch.rand(T, K, generator=gen) > 0.3 if mode == "drop" else None
    if keep is not None:
        keep[0] = False  # a token with every pair dropped
    host = mode != "sync_free"
    sp = rk.sort_by_expert(
        ids.to(device), E, None if keep is None else keep.to(device), host_counts=host
    )
    want = sort_by_expert(ids, E, keep, host_counts=host)  # the torch sort (CPU)
    assert sp.token_S.dtype == sp.pair_S.dtype == sp.slot_TK.dtype == torch.int32
    for name in ("token_S", "pair_S", "slot_TK", "counts_E", "offsets_E"):
        got = getattr(sp, name).cpu().long()
        assert torch.equal(got, getattr(want, name).long()), (name, got, getattr(want, name))
    assert sp.counts == want.counts and sp.num_dropped == want.num_dropped
    assert sp.offsets_E.dtype == torch.int32 and sp.counts_E.dtype == torch.int64
    if keep is None:
        assert torch.equal(sp.token_S.cpu().long(), permute_reference(torch.zeros(T, 1), ids, E)[1])
    # the int32 metadata drives permute / combine as the int64 one does
    x = torch.randn(T, 5, generator=gen)
    x_SD = permute(x.to(device), sp)
    assert torch.equal(x_SD.cpu(), permute(x, want))
    assert torch.equal(unpermute(x_SD, sp).cpu(), unpermute(permute(x, want), want))


def check(case, device: str) -> None:
    if case[0] == "route":
        return _route_check(*case[1:], device)
    if case[0] == "aux":
        return _aux_check(*case[1:], device)
    if case[0] == "replay":
        return _replay_check(device)
    return _sort_check(*case[1:], device)


# compiled on a GPU: the cases whose kernel branches the layer-size checks of
# tests/gpu_check/test_gpu_check_routing.py do not reach (each case compiles its own)
CUDA_CASES = [
    "ties_groups_lowest_group_first",
    "groups_of_one_expert",
    "K_equals_E",
    "single_token_T1",
    "sort_capacity_dropped",
    "sort_device_counts",
    "sort_no_tokens_T0",
]

test_interpreted, test_cuda = interpreted_tests(CASES, check, cuda_cases=CUDA_CASES)


# --- picking (pytest process: no triton import) -------------------------------------


def test_registered_and_never_picked_for_cpu_tensors():
    from dropless.ops import route, sort_by_expert
    from dropless.ops.routing import ROUTING, pick_routing_kernels, routing_kernel_names

    ROUTING.load_gpu()  # what the first pick for a CUDA tensor does
    assert routing_kernel_names()[:1] == ["reference"] and "triton" in routing_kernel_names()
    logits = torch.randn(4, 6)
    assert pick_routing_kernels(logits) is None
    assert pick_routing_kernels(logits, "auto") is None
    w, ids, _ = route(logits, 2)
    assert ids.dtype == torch.int64 and w.shape == (4, 2)
    sp = sort_by_expert(ids, 6)
    assert sp.pair_S.dtype == torch.int64  # the torch sort on CPU
    assert torch.equal(sp.offsets_E, sp.counts_E.cumsum(0).to(torch.int32))


def test_naming_a_routing_backend_that_cannot_run_raises():
    from dropless.ops import route

    logits = torch.randn(4, 6)
    with pytest.raises(ValueError, match="'triton' cannot run on torch.float32 tensors on cpu"):
        route(logits, 2, backend="triton")
    with pytest.raises(ValueError, match="'nope' is not registered"):
        route(logits, 2, backend="nope")
    w, ids, s = route(logits, 2, backend="reference")
    assert ids.shape == (4, 2)


def test_fake_cuda_tensors_take_the_torch_path():
    """A FakeTensorMode trace on CUDA tensors (shapes only) routes and sorts with the torch
    ops: a kernel would read memory a fake tensor does not have."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from dropless.ops import sort_by_expert
    from dropless.ops.routing import pick_routing_kernels, route_with_aux

    with FakeTensorMode():
        logits = torch.empty(6, 8, device="cuda")
        assert pick_routing_kernels(logits) is None
        w, ids, s, probs_mean, z = route_with_aux(logits, 2, RoutingConfig(renormalize=True))
        sp = sort_by_expert(ids, 8, host_counts=False)
    assert w.shape == (6, 2) and ids.device.type == "cuda" and probs_mean.shape == (8,)
    assert sp.pair_S.dtype == torch.int64 and sp.offsets_E.shape == (8,)
