"""RoutingConfig / ActivationConfig: validation, the keyword forms, and that the config
and keyword forms of ops, nn and the reference compute the same thing."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S rows

import dataclasses

import pytest
import torch

import dropless
from dropless import ops
from dropless.ops.reference import swiglu_reference
from dropless.ops.specs import ActivationConfig, RoutingConfig, as_activation, as_routing


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(score_func="relu"), "routing.score_func='relu'.*softmax"),
        (dict(renormalize=1), "routing.renormalize"),
        (dict(scaling_factor=float("nan")), "routing.scaling_factor"),
        (dict(n_group=2), "routing.n_group=2 and routing.topk_group=None"),
        (dict(n_group=0, topk_group=1), "routing.n_group=0"),
        (dict(n_group=2, topk_group=3), "routing.topk_group=3"),
        (dict(expert_bias="yes"), "routing.expert_bias"),
    ],
)
def test_routing_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RoutingConfig(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="tanh"), "activation.kind='tanh'.*gpt_oss"),
        (dict(gated="no"), "activation.gated"),
        (dict(limit=0.0), "activation.limit"),
        (dict(alpha=float("inf")), "activation.alpha"),
        (dict(gated=False, interleaved=True), "interleaved"),
    ],
)
def test_activation_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ActivationConfig(**kwargs)


def test_configs_are_frozen_and_hashable():
    r, a = RoutingConfig(), ActivationConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.score_func = "sigmoid"
    assert {r: 1}[RoutingConfig()] == 1 and hash(a) == hash(ActivationConfig())
    assert dropless.RoutingConfig is ops.RoutingConfig is RoutingConfig
    assert dropless.ActivationConfig is ops.ActivationConfig is ActivationConfig


def test_config_and_keywords_are_not_mixed():
    with pytest.raises(TypeError, match="not both"):
        as_routing(RoutingConfig(), renormalize=True)
    with pytest.raises(TypeError, match="not both"):
        as_activation(ActivationConfig(), alpha=1.0)
    with pytest.raises(TypeError, match="ActivationConfig or a kind name"):
        as_activation(3)
    base = RoutingConfig(renormalize=True)
    assert as_routing(None, base, score_func="sigmoid") == RoutingConfig("sigmoid", True)
    assert as_activation("gpt_oss", limit=2.0) == ActivationConfig("gpt_oss", limit=2.0)


def test_route_config_equals_keywords_and_checks_the_bias():
    g = torch.Generator().manual_seed(0)
    logits, bias = torch.randn(9, 8, generator=g), torch.randn(8, generator=g)
    cfg = RoutingConfig("sigmoid", True, 2.5, n_group=4, topk_group=2, expert_bias=True)
    got = ops.route(logits, 3, cfg, expert_bias_E=bias)
    want = ops.route(
        logits, 3, score_func="sigmoid", renormalize=True, scaling_factor=2.5,
        n_group=4, topk_group=2, expert_bias_E=bias,
    )  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs expert_bias_E"):
        ops.route(logits, 3, cfg)
    with pytest.raises(ValueError, match="expert_bias=False"):
        ops.route(logits, 3, RoutingConfig(), expert_bias_E=bias)
    with pytest.raises(ValueError, match=r"\[E=8\]"):
        ops.route(logits, 3, cfg, expert_bias_E=bias[:4])
    with pytest.raises(TypeError, match="not both"):
        ops.route(logits, 3, cfg, renormalize=False, expert_bias_E=bias)


def test_moe_routing_config_equals_keywords():
    kw = dict(score_func="sigmoid", scaling_factor=2.0, n_group=2, topk_group=1, expert_bias=True)
    a = dropless.MoE(16, 8, 4, 2, **kw)
    b = dropless.MoE(16, 8, 4, 2, routing=RoutingConfig(renormalize=True, **kw))
    assert a.router.routing == b.router.routing
    assert a.router.renormalize is True and a.router.scaling_factor == 2.0  # MoE's default
    b.load_state_dict(a.state_dict())
    x = torch.randn(5, 16)
    torch.testing.assert_close(a(x)[0], b(x)[0], rtol=0, atol=0)
    with pytest.raises(TypeError, match="not both"):
        dropless.MoE(16, 8, 4, 2, routing=RoutingConfig(), score_func="softmax")


@pytest.mark.parametrize(
    "act",
    [
        ActivationConfig(),
        ActivationConfig(interleaved=True),
        ActivationConfig("gpt_oss", limit=0.5),
        ActivationConfig("gpt_oss", interleaved=True, alpha=1.1, limit=0.5),
    ],
    ids=["swiglu", "interleaved", "gpt_oss", "gpt_oss_interleaved"],
)
def test_swiglu_config_matches_reference_and_keywords(act):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(6, 8, generator=g, dtype=torch.float64)
    p = torch.rand(6, generator=g, dtype=torch.float64)
    got = ops.swiglu(h, p, activation=act)
    torch.testing.assert_close(got, swiglu_reference(h, p, act), rtol=1e-12, atol=1e-12)
    kw = dict(interleaved=act.interleaved, alpha=act.alpha, limit=act.limit)
    torch.testing.assert_close(ops.swiglu(h, p, activation=act.kind, **kw), got, rtol=0, atol=0)
    args = (h.clone().requires_grad_(True), p.clone().requires_grad_(True))
    assert torch.autograd.gradcheck(lambda h, p: ops.swiglu(h, p, activation=act), args)


def test_non_gated_runs_in_ops_and_is_refused_by_the_layer():
    act = ActivationConfig(gated=False)
    h = torch.randn(2, 4, dtype=torch.float64)
    torch.testing.assert_close(ops.swiglu(h, activation=act), torch.nn.functional.silu(h))
    with pytest.raises(ValueError, match="gated=False"):
        dropless.MoE(16, 8, 4, 2, activation=act)


def test_expert_mlp_gpt_oss_config_matches_reference():
    g = torch.Generator().manual_seed(2)
    T, D, F, E, K = 5, 8, 8, 3, 2
    act = ActivationConfig("gpt_oss", interleaved=True, limit=0.7)
    x = torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    want = ops.reference.expert_mlp_reference(x, ids, w, gu, dn, activation=act)
    for backend in ("loop", "grouped_mm"):
        got, _ = ops.expert_mlp(x, ids, w, gu, dn, activation=act, backend=backend)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
