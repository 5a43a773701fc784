"""The JAX layer against its specifications: routing vs `route_reference`, the grouped
GEMM vs a per-expert numpy loop, the whole layer vs the PyTorch `dropless.MoE` (outputs
and gradients, fp32), dropless and recompile invariants."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted rows, N out features

import functools

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax", reason="JAX not installed: pip install 'dropless[jax]'")
import jax.numpy as jnp  # noqa: E402

import dropless  # noqa: E402
from dropless.jax import MoE, grouped_gemm, route  # noqa: E402
from dropless.ops.reference import route_reference  # noqa: E402
from harness import run_python  # noqa: E402

RTOL, ATOL = 1e-5, 1e-5

ROUTES = {
    # name: (E, K, kwargs)
    "softmax_topk": (8, 2, dict(score_func="softmax", renormalize=False)),
    "softmax_renorm_scaled": (
        8,
        3,
        dict(score_func="softmax", renormalize=True, scaling_factor=2.5),
    ),
    "sigmoid_group_bias": (
        8,
        2,
        dict(score_func="sigmoid", renormalize=True, n_group=4, topk_group=2),
    ),
    "sigmoid_group_of_one": (4, 2, dict(score_func="sigmoid", n_group=4, topk_group=3)),
}


@pytest.mark.parametrize("case", list(ROUTES))
def test_route_matches_reference(case):
    E, K, kw = ROUTES[case]
    logits = torch.randn(12, E)
    bias = torch.randn(E) * 0.1 if "bias" in case else None
    w_ref, ids_ref, s_ref = route_reference(logits, K, expert_bias_E=bias, **kw)
    jb = None if bias is None else jnp.asarray(bias.numpy())
    w, ids, s = route(jnp.asarray(logits.numpy()), K, expert_bias_E=jb, **kw)
    np.testing.assert_array_equal(np.asarray(ids), ids_ref.numpy())
    np.testing.assert_allclose(np.asarray(w), w_ref.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(s), s_ref.numpy(), rtol=RTOL, atol=ATOL)


def test_route_bad_args():
    with pytest.raises(ValueError, match="score_func"):
        route(jnp.zeros((2, 4)), 1, score_func="relu")
    with pytest.raises(ValueError, match="top_k"):
        route(jnp.zeros((2, 4)), 5)


GEMM_CASES = {
    # name: counts per expert (tile=16, min_chunk=4 so full tiles and remainders both run)
    "balanced": [5, 7, 6, 6],
    "zero_tokens_expert": [9, 0, 12, 3],
    "all_on_one": [37, 0, 0, 0],
    "one_row_each": [1, 1, 1, 1],
    "last_expert_only": [0, 0, 0, 21],
}


def _gemm_ref(x, w, counts, trans_w):
    out, start = [], 0
    for e, n in enumerate(counts):
        we = w[e].T if trans_w else w[e]
        out.append(x[start : start + n] @ we)
        start += n
    return np.concatenate(out)


ROWS = 40  # every case padded to the same row count: one compile per trans_w


@functools.partial(jax.jit, static_argnames="trans_w")
def _gemm_and_grads(x, w, counts, g, trans_w):
    y, vjp = jax.vjp(
        lambda x, w: grouped_gemm(
            x, w, counts, trans_w=trans_w, backend="tiled", tile=16, min_chunk=4
        ),
        x,
        w,
    )
    return (y, *vjp(g))


@pytest.mark.parametrize("trans_w", [True, False], ids=["trans_w", "no_trans"])
@pytest.mark.parametrize("case", list(GEMM_CASES))
def test_grouped_gemm_tiled_forward_backward(case, trans_w):
    counts = GEMM_CASES[case]
    S, D, N, E = sum(counts), 6, 5, len(counts)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((ROWS, D)).astype(np.float32)
    w = rng.standard_normal((E, N, D) if trans_w else (E, D, N)).astype(np.float32)
    g = rng.standard_normal((ROWS, N)).astype(np.float32)
    y, dx, dw = _gemm_and_grads(x, w, jnp.asarray(counts, jnp.int32), g, trans_w=trans_w)
    np.testing.assert_allclose(
        np.asarray(y[:S]), _gemm_ref(x, w, counts, trans_w), rtol=RTOL, atol=ATOL
    )
    assert not np.asarray(y[S:]).any()  # rows past the groups are zeros
    # gradients of sum(y * g) by the reference, through torch autograd
    xt, wt = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    yt, start = [], 0
    for e, n in enumerate(counts):
        yt.append(xt[start : start + n] @ (wt[e].t() if trans_w else wt[e]))
        start += n
    (torch.cat(yt) * torch.tensor(g[:S])).sum().backward()
    np.testing.assert_allclose(np.asarray(dx), xt.grad.numpy(), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(dw), wt.grad.numpy(), rtol=RTOL, atol=ATOL)


def test_grouped_gemm_ragged_dot_backend_agrees():
    counts = jnp.asarray([3, 0, 5], jnp.int32)
    x = jax.random.normal(jax.random.key(0), (8, 4))
    w = jax.random.normal(jax.random.key(1), (3, 6, 4))
    a = grouped_gemm(x, w, counts, backend="ragged_dot")
    b = grouped_gemm(x, w, counts, backend="tiled")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    with pytest.raises(ValueError, match="backend"):
        grouped_gemm(x, w, counts, backend="cutlass")


LAYERS = {
    "softmax_topk": dict(num_experts=8, top_k=2, score_func="softmax", renormalize=False),
    "sigmoid_group_bias": dict(
        num_experts=8,
        top_k=3,
        score_func="sigmoid",
        n_group=4,
        topk_group=2,
        expert_bias=True,
        scaling_factor=2.5,
    ),
    "shared_experts": dict(
        num_experts=6, top_k=2, shared_expert_intermediate_size=12, shared_expert_gate=True
    ),
}


@pytest.mark.parametrize("case", list(LAYERS))
def test_layer_matches_pytorch_moe(case):
    D, F, T = 16, 8, 24
    tm = dropless.MoE(D, F, **LAYERS[case])
    if tm.router.expert_bias is not None:
        tm.router.expert_bias.copy_(torch.randn(tm.num_experts) * 0.05)
    x = torch.randn(2, T // 2, D, requires_grad=True)
    r = torch.randn(2, T // 2, D)
    out, aux = tm(x)
    ((out * r).sum() + 0.1 * aux.lb_loss + 0.01 * aux.z_loss).backward()

    layer, params, state = MoE.from_torch(tm)

    def loss(p, x):
        o, a = layer(p, x, state)
        return (o * jnp.asarray(r.numpy())).sum() + 0.1 * a.lb_loss + 0.01 * a.z_loss, (o, a)

    grad_fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    (_, (o, a)), (gp, gx) = grad_fn(params, jnp.asarray(x.detach().numpy()))
    close = dict(rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(np.asarray(o), out.detach().numpy(), **close)
    np.testing.assert_allclose(float(a.lb_loss), aux.lb_loss.item(), **close)
    np.testing.assert_allclose(float(a.z_loss), aux.z_loss.item(), **close)
    np.testing.assert_array_equal(np.asarray(a.tokens_per_expert), aux.tokens_per_expert.numpy())
    assert int(a.dropped) == 0 == aux.dropped
    np.testing.assert_allclose(np.asarray(gx), x.grad.numpy(), **close)
    torch_grads = {
        ("router", "weight"): tm.router.weight.grad,
        ("experts", "gate_up_proj"): tm.experts.gate_up_proj.grad,
        ("experts", "down_proj"): tm.experts.down_proj.grad,
    }
    if tm.shared_expert is not None:
        for name in ("gate_proj", "up_proj", "down_proj", "gate"):
            torch_grads["shared_expert", name] = getattr(tm.shared_expert, name).weight.grad
    for (group, name), g in torch_grads.items():
        np.testing.assert_allclose(
            np.asarray(gp[group][name]), g.numpy(), err_msg=f"{group}.{name}", **close
        )


def test_recompiles_bounded_and_padding_exact():
    """Routings never change a shape (1 compile); token counts compile once per bucket."""
    layer = MoE(8, 4, 8, 2, bucket_tokens=True, expert_bias=True)
    params, state = layer.init(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (16, 8))
    for i, skew in enumerate([0.0, 1.0, 5.0, 50.0]):  # from balanced to every token on experts 0, 1
        s = {"expert_bias": state["expert_bias"].at[:2].set(skew)}
        out, aux = layer(params, x * (1 + i), s)
        assert int(aux.dropped) == 0
    assert int(aux.tokens_per_expert[:2].sum()) == 32  # fully skewed: all pairs on two experts
    assert layer.compilations() == 1
    lengths = [3, 5, 7, 8, 9, 13, 16]
    for T in lengths:
        out, aux = layer(params, x[:T], state)
        assert int(aux.dropped) == 0 and int(aux.tokens_per_expert.sum()) == 2 * T
    assert layer.compilations() == len({4, 8, 16})  # one per power-of-two bucket
    plain = MoE(8, 4, 8, 2, expert_bias=True)
    ref, _ = plain(params, x[:13], state)
    got, _ = layer(params, x[:13], state)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=RTOL, atol=ATOL)


def test_bad_input_errors():
    with pytest.raises(ValueError, match="num_experts"):
        MoE(8, 4, 0, 2)
    with pytest.raises(ValueError, match="n_group"):
        MoE(8, 4, 8, 2, n_group=3, topk_group=1)
    layer = MoE(8, 4, 4, 2)
    params, state = layer.init(jax.random.key(0))
    with pytest.raises(ValueError, match="hidden_size=8"):
        layer(params, jnp.zeros((3, 5)), state)
    with pytest.raises(ValueError, match="expert_bias"):
        MoE(8, 4, 4, 2, expert_bias=True)(params, jnp.zeros((3, 8)), {})


def test_import_dropless_does_not_import_jax_and_missing_jax_names_the_extra():
    code = (
        "import sys, dropless\n"
        "assert 'jax' not in sys.modules, 'import dropless imported jax'\n"
        "sys.modules['jax'] = None\n"
        "try:\n"
        "    import dropless.jax\n"
        "except ImportError as e:\n"
        "    assert 'dropless[jax]' in str(e), str(e)\n"
        "    print('ok')\n"
    )
    out = run_python(["-c", code], env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr
