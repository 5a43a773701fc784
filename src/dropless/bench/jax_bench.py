"""`dropless bench jax`: one MoE layer in JAX, forward and forward+backward, each row in its
own child process (so peak memory is its own): dropless (`moe_apply`), ragged_dot (on
XLA:CPU a masked dense matmul over all experts, ~19 GB at the default shape: it runs last,
alone, only with enough free memory, under a watchdog), capacity_einsum (by name, from a
checkout: tools/jax_capacity.py) and dense_bound (the experts' FLOPs as one GEMM chain).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, C capacity per expert

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from .common import add_history_arguments

MODULE = "dropless.bench.jax_bench"
IMPLS = ("dropless", "ragged_dot", "capacity_einsum", "dense_bound")
DEFAULT_IMPLS = ("dropless", "ragged_dot", "dense_bound")
# the layer's shape: option -> (its letter, default)
SHAPE = dict(
    experts=("E", 64), top_k=("K", 8), hidden=("D", 1024), ffn=("F", 384), tokens=("T", 2048)
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    for name, (key, default) in SHAPE.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=default, help=f"{key}")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (median reported)")
    p.add_argument(
        "--ragged-rounds", type=int, default=1, help="timed rounds for the slow ragged_dot row"
    )
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS),
        help=f"comma-separated subset of {IMPLS} (default: {','.join(DEFAULT_IMPLS)})",
    )  # fmt: skip
    p.add_argument(
        "--ragged-min-free-gib",
        type=float,
        default=20.5,
        help="run ragged_dot only if this much memory is available (else: not run)",
    )
    add_history_arguments(p, "jax")


# ----------------------------------------------------------------------------- child


def _median_ms(fn, args, rounds):
    import jax

    compiled = jax.jit(fn).lower(*args).compile()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _child(cfg: dict) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dropless.bench.common import from_checkout, peak_rss_mib, rss_mib
    from dropless.jax import MoEConfig, init_params, moe_apply, swiglu

    base_rss_mib = rss_mib()  # the imported runtime (torch via dropless, jax), before any array
    E, K, D, F, T = cfg["E"], cfg["K"], cfg["D"], cfg["F"], cfg["T"]
    impl, rounds = cfg["impl"], cfg["rounds"]
    x = jnp.asarray(np.random.default_rng(0).standard_normal((T, D), dtype=np.float32))
    mcfg = MoEConfig(D, F, E, K, backend="ragged_dot" if impl == "ragged_dot" else "tiled")
    params = init_params(jax.random.key(0), mcfg)
    extra = {}
    if impl in ("dropless", "ragged_dot"):

        def fwd(p, x):
            out, aux = moe_apply(p, x, mcfg)
            return out, aux.dropped

    elif impl == "capacity_einsum":  # tools/jax_capacity.py, run from a checkout
        C = extra["capacity"] = math.ceil(cfg["capacity_factor"] * T * K / E)
        fwd = from_checkout("jax_capacity", "the row capacity_einsum").layer(E, K, F, C)

    else:  # dense_bound: the experts' FLOPs as two dense GEMMs over T*K rows
        x = jnp.tile(x, (K, 1))
        params = {
            "gate_up": params["experts"]["gate_up_proj"][0],
            "down": params["experts"]["down_proj"][0],
        }

        def fwd(p, x):
            a = swiglu(x @ p["gate_up"].T)
            return a @ p["down"].T, jnp.zeros((), jnp.int32)

    r = jnp.asarray(np.random.default_rng(1).standard_normal((x.shape[0], D), dtype=np.float32))

    def loss(p, x):
        out, _ = fwd(p, x)
        return (out * r).sum()

    fwd_bwd = jax.value_and_grad(loss, argnums=(0, 1))
    dropped = int(jax.jit(fwd)(params, x)[1])
    fwd_ms = _median_ms(lambda p, x: fwd(p, x)[0], (params, x), rounds)
    fwd_bwd_ms = _median_ms(fwd_bwd, (params, x), rounds)
    return dict(
        impl=impl,
        fwd_ms=fwd_ms,
        fwd_bwd_ms=fwd_bwd_ms,
        peak_rss_mib=peak_rss_mib(),
        base_rss_mib=base_rss_mib,
        dropped=dropped,
        jax=jax.__version__,
        **extra,
    )


# ---------------------------------------------------------------------------- parent


def _run_child(cfg: dict, watch_gib: float = 1.0, timeout: float = 3600) -> dict:
    """Run one row in a child under the default allocator; stop it if free memory falls
    under `watch_gib` (no OOM killer)."""
    from dropless.bench.child import run_child_process
    from dropless.bench.common import timing_env

    cmd = [sys.executable, "-m", MODULE, json.dumps(cfg)]
    run = run_child_process(cmd, timeout=timeout, env=timing_env(), min_free_gib=watch_gib)
    if run.status in ("timeout", "killed"):
        return dict(impl=cfg["impl"], status=f"killed: {run.reason}")
    if not run.ok:
        err = run.stderr.strip()
        return dict(
            impl=cfg["impl"], status=f"failed: {err.splitlines()[-1] if err else run.returncode}"
        )
    return dict(run.last_json(), status="ok")


def _table(rows: dict) -> str:
    dense, ours = rows.get("dense_bound", {}), rows.get("dropless", {})
    lines = [
        "| implementation | fwd ms | fwd+bwd ms | fwd+bwd / dense bound | peak RSS MiB | above imported runtime MiB | dropped pairs |",
        "|---|---|---|---|---|---|---|",
    ]
    for impl in IMPLS:
        r = rows.get(impl)
        if r is None:
            continue
        if r.get("status") != "ok":
            lines.append(f"| {impl} | not run: {r.get('status')} | | | | | |")
            continue
        ratio = (
            r["fwd_bwd_ms"] / dense["fwd_bwd_ms"] if dense.get("status") == "ok" else float("nan")
        )
        above = r["peak_rss_mib"] - r.get("base_rss_mib", float("nan"))
        lines.append(
            f"| {impl} | {r['fwd_ms']:,.0f} | {r['fwd_bwd_ms']:,.0f} | {ratio:.2f} | "
            f"{r['peak_rss_mib']:,.0f} | {above:,.0f} | {r['dropped']} |"
        )
    rg = rows.get("ragged_dot", {})
    if ours.get("status") == "ok" and rg.get("status") == "ok":
        lines += [
            "",
            f"dropless vs ragged_dot: {rg['fwd_bwd_ms'] / ours['fwd_bwd_ms']:.0f}x faster (fwd+bwd), "
            f"{rg['peak_rss_mib'] / ours['peak_rss_mib']:.1f}x less peak memory.",
        ]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    from dropless.bench.child import mem_available_gib
    from dropless.bench.common import (
        Recorder,
        from_checkout,
        progress,
        require_extra,
        write_section,
    )

    require_extra("jax", "jax", "jax")

    impls = [i for i in args.impls.split(",") if i]
    bad = [i for i in impls if i not in IMPLS]
    if bad:
        raise ValueError(f"--impls {bad}: allowed {IMPLS}")
    if "capacity_einsum" in impls:
        from_checkout("jax_capacity", "the row capacity_einsum")  # refused before measuring
    rec = Recorder.start(args)
    shape = {key: getattr(args, name) for name, (key, _) in SHAPE.items()}
    base = shape | {"capacity_factor": args.capacity_factor}
    rows = {}
    for impl in sorted(impls, key=lambda i: i == "ragged_dot"):  # the slow one last
        if impl == "ragged_dot":
            free = mem_available_gib()
            if free < args.ragged_min_free_gib:
                rows[impl] = dict(
                    impl=impl, status=f"{free:.1f} GiB available < {args.ragged_min_free_gib}"
                )
                print(f"{impl}: not run ({rows[impl]['status']})", flush=True)
                continue
        rounds = args.ragged_rounds if impl == "ragged_dot" else args.rounds
        progress(f"timing {impl}: {rounds} round(s) in its own process")
        rows[impl] = _run_child(dict(base, impl=impl, rounds=rounds))
        print(json.dumps(rows[impl]), flush=True)
    figures = dict(shape=", ".join(f"{k}={v}" for k, v in shape.items()), rows=rows)
    d, rg = rows.get("dense_bound", {}), rows.get("ragged_dot", {})
    ours = rows.get("dropless", {})
    if ours.get("status") == "ok" and d.get("status") == "ok":
        figures["dropless_over_dense_fwd_bwd"] = ours["fwd_bwd_ms"] / d["fwd_bwd_ms"]
    if ours.get("status") == "ok" and rg.get("status") == "ok":
        figures["ragged_over_dropless_fwd_bwd"] = rg["fwd_bwd_ms"] / ours["fwd_bwd_ms"]
        figures["ragged_over_dropless_peak_rss"] = rg["peak_rss_mib"] / ours["peak_rss_mib"]
    record = rec.finish("jax", figures)
    text = _table(rows)
    print(text)
    write_section(args, rec, "jax", record, text)
    return 0


if __name__ == "__main__":
    print(json.dumps(_child(json.loads(sys.argv[1]))))
