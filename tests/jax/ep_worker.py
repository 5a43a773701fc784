"""Expert-parallel checks on 4 fake host devices, run in a child process by test_ep.py
(XLA_FLAGS must be set before JAX is imported, so not in the pytest process).
Prints one JSON line: {check name: value} for the test to assert on."""

# T tokens, D model dim, E experts

import json
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from dropless.jax import MoEConfig, ep_bucket, init_params, moe_apply, moe_apply_ep  # noqa: E402

D, F, T = 16, 8, 32
CONFIGS = {
    "sigmoid_group_bias": MoEConfig(
        D, F, 8, 2, score_func="sigmoid", n_group=4, topk_group=2, expert_bias=True
    ),
    "softmax_shared": MoEConfig(D, F, 8, 3, expert_bias=True, shared_expert_intermediate_size=8),
}


def rel_err(a, b):
    return max(
        float(jnp.abs(u - v).max() / (jnp.abs(v).max() + 1e-30))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def loss_fn(apply):
    r = jnp.cos(jnp.arange(T * D, dtype=jnp.float32)).reshape(T, D)

    def loss(p, x):
        out, aux = apply(p, x)
        return (out * r).sum() + 0.1 * aux.lb_loss + 0.01 * aux.z_loss, (out, aux)

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def main():
    results = {}
    x = jax.random.normal(jax.random.key(1), (T, D))
    for name, n, skew, cap_name in (
        ("sigmoid_group_bias", 2, 2.0, "worst"),
        ("softmax_shared", 4, 0.3, "bucket"),
    ):
        cfg = CONFIGS[name]
        params = init_params(jax.random.key(0), cfg)
        # skewed: experts 0 and 1 (on device 0) get most pairs
        state = {"expert_bias": jnp.zeros(8).at[:2].set(skew)}
        (l0, (o0, a0)), g0 = loss_fn(
            lambda p, x, cfg=cfg, state=state: moe_apply(p, x, cfg, state)
        )(params, x)
        mesh = Mesh(np.array(jax.devices()[:n]), ("ep",))
        cap = None if cap_name == "worst" else ep_bucket(params, x, cfg, mesh, state=state)

        def apply(p, x, cfg=cfg, mesh=mesh, state=state, cap=cap):
            return moe_apply_ep(p, x, cfg, mesh, state=state, capacity=cap)

        (l1, (o1, a1)), g1 = loss_fn(apply)(params, x)
        results[f"{name}_n{n}_{cap_name}"] = dict(
            out=rel_err(o1, o0),
            loss=rel_err(l1, l0),
            grads=rel_err(g1, g0),
            dropped=int(a1.dropped),
            counts_equal=bool((a1.tokens_per_expert == a0.tokens_per_expert).all()),
            share_dev0=float(a0.tokens_per_expert[: 8 // n].sum() / a0.tokens_per_expert.sum()),
            capacity=cap,
        )
    # recompiles: one per power-of-two bucket across routings from balanced to fully skewed
    cfg = CONFIGS["softmax_shared"]
    params = init_params(jax.random.key(0), cfg)
    mesh = Mesh(np.array(jax.devices()[:4]), ("ep",))
    fwd = jax.jit(moe_apply_ep, static_argnames=("cfg", "mesh", "capacity"))
    caps, dropped = [], []
    for skew in (0.0, 0.3, 1.0, 0.1, 3.0):
        state = {"expert_bias": jnp.zeros(8).at[:2].set(skew)}
        cap = ep_bucket(params, x, cfg, mesh, state=state)
        out, aux = fwd(params, x, cfg=cfg, mesh=mesh, state=state, capacity=cap)
        caps.append(cap)
        dropped.append(int(aux.dropped))
    results["recompile"] = dict(compiles=fwd._cache_size(), capacities=caps, dropped=dropped)
    # the ragged exchange (GPU/TPU) traces, differentiates and lowers here; XLA:CPU cannot compile it
    state = {"expert_bias": jnp.zeros(8)}
    lowered = jax.jit(
        jax.grad(
            lambda p, x: moe_apply_ep(p, x, cfg, mesh, state=state, exchange="ragged")[0].sum()
        )
    ).lower(params, x)
    results["ragged_lowers"] = "ragged_all_to_all" in lowered.as_text()
    print(json.dumps(results))


if __name__ == "__main__":
    sys.exit(main())
