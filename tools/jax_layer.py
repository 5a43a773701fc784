"""The JAX layer's row of the layer table: `dropless.jax.moe_apply` forward+backward (its
tiled grouped GEMM with a custom VJP; routing, sort, SwiGLU and combine included) timed
at the shape `dropless bench layer` just ran, against the dense six-GEMM bound that run
measured (`bench/bound.py`): the same bound, the same FLOPs model, the same machine.

    python -m tools.jax_layer '{"E": 128, "K": 8, "D": 2048, "F": 768,
        "T": 16384, "dtype": "bfloat16", "device": "cuda", "rounds": 5, "warmup": 2,
        "bound": {"ms": 6.1, "tflops": 520.0}}'

prints the row as one JSON line (`summary_row`): status "ok" with ms, share_of_bound,
tflops, jax, device, dtype, dropped; or "skipped: jax[cuda] not importable" with the
reason where JAX does not import or has no CUDA backend (device "cpu": "skipped: jax not
importable"), "fail" with the error where the step raised. It runs in a process
of its own (`scripts/gpu_check.py`'s timing step starts it after the torch rows): JAX
reserves most of the GPU's memory when it starts, which the torch rows must not share.
The router is the JAX layer's own random one (balanced load at random inputs, as the
table's uniform rows); the timed step is the compiled `value_and_grad` of
sum(out * r) with respect to every parameter and the input, median of `rounds` after
`warmup` calls.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import json
import statistics
import sys
import time

SKIPPED = {"cuda": "skipped: jax[cuda] not importable", "cpu": "skipped: jax not importable"}


def jax_device(device: str):
    """(the JAX device for "cuda" or "cpu", None) or (None, why it cannot run there)."""
    try:
        import jax
    except ImportError as e:
        return None, f"import jax failed: {e}; pip install 'jax[cuda12]' (or jax for CPU)"
    try:
        return jax.devices("gpu" if device == "cuda" else "cpu")[0], None
    except RuntimeError as e:  # jax without the CUDA plugin: no "gpu" platform
        return None, f"jax {jax.__version__} has no {device} backend ({e})"


def time_layer(cfg: dict, dev) -> dict:
    """Median ms of one compiled forward+backward of the JAX layer at cfg's shape on dev."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.jax import MoEConfig, init_params, moe_apply

    E, K, D, F, T = (cfg[k] for k in ("E", "K", "D", "F", "T"))
    dtype = jnp.dtype(cfg["dtype"])
    mcfg = MoEConfig(D, F, E, K, backend="tiled")
    rng = np.random.default_rng(0)
    with jax.default_device(dev):
        params = init_params(jax.random.key(0), mcfg, dtype=dtype)
        x = jnp.asarray(rng.standard_normal((T, D), dtype=np.float32), dtype)
        r = jnp.asarray(rng.standard_normal((T, D), dtype=np.float32))

    def loss(p, x):
        out, aux = moe_apply(p, x, mcfg)
        return (out.astype(jnp.float32) * r).sum(), aux.dropped

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    compiled = step.lower(params, x).compile()
    (_, dropped), _ = jax.block_until_ready(compiled(params, x))
    for _ in range(cfg.get("warmup", 1)):
        jax.block_until_ready(compiled(params, x))
    times = []
    for _ in range(cfg.get("rounds", 3)):
        t = time.perf_counter()
        jax.block_until_ready(compiled(params, x))
        times.append((time.perf_counter() - t) * 1e3)
    return dict(ms=statistics.median(times), ms_all=times, dropped=int(dropped))


def measure(cfg: dict) -> dict:
    """The row's result: "ok" with its time, or the skip (or failure) and its reason."""
    device = cfg.get("device", "cuda")
    dev, why = jax_device(device)
    if dev is None:
        return dict(status=SKIPPED[device], reason=why)
    import jax

    base = dict(jax=jax.__version__, device=str(dev), dtype=cfg["dtype"])
    try:
        return dict(status="ok", **base, **time_layer(cfg, dev))
    except Exception as e:  # one row's failure (compile, out of memory) is reported, not raised
        return dict(status="fail", **base, reason=f"{type(e).__name__}: {e}"[:800])


def summary_row(res: dict, bound: dict | None) -> dict:
    """The row in the layer table's units: ms, share_of_bound (the bound's ms over this
    row's) and tflops (the bound's FLOPs model over this row's time), rounded as the
    table's rows; `bound` the table's `dense_bound` row (None: not measured)."""
    row = dict(status=res["status"], ms=None, share_of_bound=None, tflops=None, peak_gib=None)
    if res["status"] != "ok":
        return row | {"reason": res.get("reason")}
    ms = res["ms"]
    row |= dict(ms=round(ms, 3), jax=res["jax"], device=res["device"], dtype=res["dtype"],
                dropped=res["dropped"])  # fmt: skip
    if bound and bound.get("ms"):
        row["share_of_bound"] = round(bound["ms"] / ms, 3)
        if bound.get("tflops") is not None:
            row["tflops"] = round(bound["tflops"] * bound["ms"] / ms, 3)
    return row


if __name__ == "__main__":
    cfg = json.loads(sys.argv[1])
    print(json.dumps(summary_row(measure(cfg), cfg.get("bound"))), flush=True)
