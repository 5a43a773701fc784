"""The routing kernels on a GPU, at layer sizes, in fp32 and bf16 logits.

`dropless.ops.route` / `route_with_aux` / `sort_by_expert` pick the "triton" routing
kernels for CUDA tensors; these checks compare them with the torch ops on the same
device: the ids with the kernel's documented tie rule (lowest index first) applied to
torch's fp32 scores, scores and weights against fp64, gradients against autograd through
fp64 scores at the kernel's ids, the sort bit for bit against torch's stable argsort, and
no host sync on the dropless path. The interpreter runs the kernels on CPU in
tests/triton/test_triton_routing.py; these run only on CUDA (`pytest -m gpu`).
"""

# T tokens, E experts, K top-k, G expert groups

from __future__ import annotations

import pytest
import torch

from dropless.ops.specs import RoutingConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

T = 4096
DSV3 = RoutingConfig("sigmoid", True, 2.5, 8, 4, True)
# name -> (E, K, routing)
ROUTINGS = {
    "qwen3_softmax_renorm_E128_K8": (128, 8, RoutingConfig(renormalize=True)),
    "dsv3_sigmoid_groups_bias_E256_K8": (256, 8, DSV3),
    "mixtral_E8_K2": (8, 2, RoutingConfig(renormalize=True)),
    "E60_not_power_of_two_K4_raw": (60, 4, RoutingConfig()),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# grads: fp32 sums over <= 256 experts (fp32 logits), one bf16 rounding (bf16 logits)
GRAD_TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-7}


def rel_err(got, want) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _stable_ids(logits, K, routing, bias):
    """The kernel's selection rule written with torch ops on fp32 scores."""
    x = logits.float()
    s = x.softmax(-1) if routing.score_func == "softmax" else x.sigmoid()
    choice = s if bias is None else s + bias
    if routing.n_group is not None:
        n, E = choice.shape
        per = E // routing.n_group
        top = torch.sort(choice.view(n, routing.n_group, per), dim=-1, descending=True, stable=True)
        gs = top.values[..., :2].sum(-1)
        keep_g = torch.sort(gs, dim=-1, descending=True, stable=True).indices
        keep_g = keep_g[:, : routing.topk_group]
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, keep_g, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, 1), float("-inf"))
    return torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :K], choice


def _at_ids(logits, ids, routing):
    """Weights and scores in fp64 at the given ids (autograd to the logits)."""
    x = logits.double()
    s = x.softmax(-1) if routing.score_func == "softmax" else x.sigmoid()
    w = s.gather(1, ids)
    if routing.renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * routing.scaling_factor, s


# each (routing, dtype) compiles its own kernels (~3): the pairs that cover every branch
PAIRS = [
    ("qwen3_softmax_renorm_E128_K8", "bf16"),
    ("qwen3_softmax_renorm_E128_K8", "fp32"),
    ("dsv3_sigmoid_groups_bias_E256_K8", "bf16"),
    ("mixtral_E8_K2", "bf16"),
    ("E60_not_power_of_two_K4_raw", "fp32"),
]


@pytest.mark.parametrize("name, dtype", PAIRS)
def test_route_kernel_on_cuda(name, dtype):
    from dropless.ops.routing import pick_routing_kernels, route, route_with_aux

    E, K, routing = ROUTINGS[name]
    dt = DTYPES[dtype]
    gen = torch.Generator(device="cuda").manual_seed(E * 10 + K)
    logits = torch.randn(T, E, device="cuda", generator=gen).to(dt)
    bias = torch.randn(E, device="cuda", generator=gen) * 0.05 if routing.expert_bias else None
    assert pick_routing_kernels(logits).name == "triton"
    lg = logits.clone().requires_grad_(True)
    w, ids, s = route(lg, K, routing, expert_bias_E=bias)
    want, choice = _stable_ids(logits, K, routing, bias)
    agree = (ids == want).all(-1)
    # rows that differ may only hold a near tie (torch's and the kernel's fp32 scores
    # differ by ulps): the chosen choice scores agree
    assert agree.float().mean() >= 0.999, float(agree.float().mean())
    got_v = choice.gather(1, ids).sort(-1).values
    want_v = choice.gather(1, want).sort(-1).values
    assert float((got_v - want_v).abs().max()) <= 1e-6
    lr = logits.clone().requires_grad_(True)
    wr, sr = _at_ids(lr, ids, routing)
    assert rel_err(s, sr) <= 1e-6 and rel_err(w, wr) <= 1e-6
    g_w = torch.randn(T, K, device="cuda", generator=gen)
    g_s = torch.randn(T, E, device="cuda", generator=gen)
    (dl,) = torch.autograd.grad((w * g_w).sum() + (s * g_s).sum(), lg)
    (dlr,) = torch.autograd.grad((wr * g_w).sum() + (sr * g_s).sum(), lr)
    assert dl.dtype == dt and rel_err(dl, dlr) <= GRAD_TOL[dt]
    # the fused loss inputs against the torch losses on the same device
    from dropless.ops.losses import z_loss

    out = route_with_aux(logits, K, routing, expert_bias_E=bias)
    probs = sr / sr.sum(-1, keepdim=True)
    assert rel_err(out[3], probs.mean(0)) <= 1e-5
    assert rel_err(out[4], z_loss(logits.double())) <= 1e-5


@pytest.mark.parametrize("E,K,drop", [(128, 8, False), (7, 2, False), (60, 4, True)])
def test_sort_kernel_on_cuda_matches_stable_argsort(E, K, drop):
    from dropless.ops import sort_by_expert

    n = 16384 if E == 128 else 3000
    gen = torch.Generator(device="cuda").manual_seed(E)
    ids = torch.rand(n, E, device="cuda", generator=gen).argsort(-1)[:, :K]
    ids[: n // 4] = 3  # an overloaded expert (and, for E=7, most experts nearly empty)
    keep = torch.rand(n, K, device="cuda", generator=gen) > 0.2 if drop else None
    sp = sort_by_expert(ids, E, keep)
    flat = ids.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, torch.full_like(flat, E))
    order = torch.argsort(flat, stable=True)
    S = sp.num_slots
    assert sp.pair_S.dtype == torch.int32 and torch.equal(sp.pair_S.long(), order[:S])
    assert torch.equal(sp.token_S.long(), order[:S] // K)
    counts = torch.bincount(flat, minlength=E + 1)[:E]
    assert torch.equal(sp.counts_E, counts) and sp.counts == counts.tolist()
    assert torch.equal(sp.offsets_E, counts.cumsum(0).to(torch.int32))
    slot = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device="cuda"))
    assert torch.equal(sp.slot_TK.long().reshape(-1), slot.clamp_max(S))


def test_dropless_routing_and_sort_read_nothing_on_the_host():
    from dropless.ops import sort_by_expert
    from dropless.ops.routing import route_with_aux

    logits = torch.randn(T, 128, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        w, ids, s, probs_mean, z = route_with_aux(logits, 8, RoutingConfig(renormalize=True))
        sp = sort_by_expert(ids, 128, host_counts=False)
        loss = w.square().sum() + s.sum() + probs_mean.sum() + z
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert sp.counts is None and int(sp.counts_E.sum()) == T * 8
