"""The check groups of `gpu_check.py`; `python gpu_check_groups.py GROUP [--cpu]` runs one.

Each check compares against `dropless.ops.reference` (or the op's fp64 run) in fp64 on
the same device and records max |got - want| / max |want| with a tolerance for the
dtype. The last stdout line is `GPU-CHECK-RESULT:` + JSON. CPU mode uses small shapes
only (the same as on a GPU), fp32 where the GPU runs bf16, and Triton's interpreter.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs
# ruff: noqa: B023 - the lambdas over loop variables are called at once, inside the loop

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
import time
import traceback
import warnings

import torch

MARK = "GPU-CHECK-RESULT:"
TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
T, E, K, D, F = 24, 6, 2, 64, 32  # small shapes: E not a power of two, an expert empty


class Group:
    def __init__(self, name: str, cpu: bool):
        self.name, self.cpu = name, cpu
        self.dev = torch.device("cpu" if cpu else "cuda")
        self.dt = torch.float32 if cpu else torch.bfloat16
        self.checks: list[dict] = []
        self.extra: dict = {}

    def record(self, name, err=None, tol=None, status=None, note=""):
        if status is None:
            status = "ok" if (err is not None and math.isfinite(err) and err <= tol) else "fail"
        self.checks.append(dict(name=name, status=status, err=err, tol=tol, note=note))
        e = "" if err is None else f" err={err:.2e}" + ("" if tol is None else f" (tol {tol:.0e})")
        print(f"  [{self.name}] {name}: {status}{e}{' ' + note if note else ''}", flush=True)

    def compare(self, name, got, want, dtype, note=""):
        self.record(name, rel_err(got, want), TOL[dtype], note=note)

    @contextlib.contextmanager
    def check(self, name):
        """Records an exception inside the block as a failed check (the group goes on)."""
        try:
            yield
        except Exception as e:  # noqa: BLE001 - every failure is a result here
            self.record(name, status="fail", note=f"{type(e).__name__}: {str(e)[:300]}")
            traceback.print_exc(limit=4)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if want.numel() == 0:
        return 0.0 if got.numel() == 0 else float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def routing(g: torch.Generator) -> torch.Tensor:
    """ids [T, K]: distinct experts per token, expert E-1 never chosen, expert 0 hot."""
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    ids[: T // 2, 0] = 0
    ids[: T // 2, 1] = torch.randint(1, E - 1, (T // 2,), generator=g)
    return ids


def fwd_bwd(fn, leaves, g_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, g_out.to(out.dtype), allow_unused=True)
    return [out.detach(), *grads]


# --- groups ---------------------------------------------------------------------------


def gemm_layouts(G: Group) -> None:
    from dropless import ops
    from dropless.ops.dispatch import pick_gemm_backend
    from dropless.ops.reference import grouped_gemm_reference

    g = torch.Generator().manual_seed(0)
    for counts in ([5, 0, 11, 3, 9, 4], [0] * E, [40, 0, 0, 0, 0, 0]):
        S = sum(counts)
        for trans_w in (True, False):
            x = torch.randn(S, D, generator=g)
            w = torch.randn(E, 48, D, generator=g) / D**0.5
            w = w if trans_w else w.transpose(1, 2).contiguous()
            gy = torch.randn(S, 48, generator=g)
            args = [t.to(G.dev) for t in (x, w, gy)]
            ref = fwd_bwd(
                lambda a, b: grouped_gemm_reference(a, b, counts, trans_w=trans_w),
                [t.double() for t in args[:2]],
                args[2].double(),
            )
            for be in ops.gemm_backends():
                name = f"{be} counts={counts} trans_w={trans_w}"
                xs, ws = args[0].to(G.dt), args[1].to(G.dt)
                try:
                    pick_gemm_backend(be, xs, ws)
                except ValueError as e:
                    G.record(name, status="skipped", note=str(e)[:120])
                    continue
                with G.check(name):
                    got = fwd_bwd(
                        lambda a, b: ops.grouped_gemm(a, b, counts, trans_w=trans_w, backend=be),
                        [xs, ws],
                        args[2],
                    )
                    err = max(rel_err(a, b) for a, b in zip(got, ref))
                    G.record(name, err, TOL[G.dt], note="y, dx, dw")


def _moe_pair(G: Group, dtype, **kw):
    import dropless

    torch.manual_seed(0)
    moe = dropless.MoE(D, F, E, K, **kw).to(G.dev)
    ref = copy.deepcopy(moe).double()
    return moe.to(dtype), ref


def _moe_step(moe, x, g_out):
    x = x.detach().clone().requires_grad_(True)
    out, aux = moe(x)
    (out * g_out.to(out.dtype)).sum().backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return out.detach(), x.grad, grads


def moe_layer(G: Group) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g).to(G.dev)
    g_out = torch.randn(T, D, generator=g).to(G.dev)
    for kw in (dict(), dict(bias=True), dict(activation="gpt_oss", bias=True)):
        name = "moe " + (",".join(f"{k}={v}" for k, v in kw.items()) or "swiglu")
        with G.check(name):
            moe, ref = _moe_pair(G, G.dt, **kw)
            out, gx, grads = _moe_step(moe, x.to(G.dt), g_out)
            out_r, gx_r, grads_r = _moe_step(ref, x.double(), g_out)
            errs = [rel_err(out, out_r), rel_err(gx, gx_r)]
            errs += [rel_err(grads[n], grads_r[n]) for n in grads]
            G.record(name, max(errs), TOL[G.dt], note="out, dx, every weight grad")
    if not G.cpu:
        with G.check("moe local path: no host sync"):
            moe, _ = _moe_pair(G, G.dt)
            _moe_step(moe, x.to(G.dt), g_out)  # warm-up: lazy registrations, caches
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                _moe_step(moe, x.to(G.dt), g_out)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            G.record("moe local path: no host sync", status="ok", note="sync debug mode 'error'")


def _gpt_oss_reference(h, p, alpha=1.702, limit=2.0):
    """gpt_oss's clamped GLU x prob by its definition (autograd through torch.clamp)."""
    gate, up = h.chunk(2, dim=-1)
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1) * p.unsqueeze(1)


def triton_kernels(G: Group) -> None:
    from dropless import kernels
    from dropless.ops.reference import swiglu_reference

    if not kernels.triton_importable():
        G.record("triton", status="skipped", note="triton not importable")
        return
    dtypes = (
        [torch.float32, torch.float16] if G.cpu else [torch.float32, torch.bfloat16, torch.float16]
    )
    g = torch.Generator().manual_seed(2)
    S, N = T * K, 40
    for dt in dtypes:
        x = torch.randn(T, N, generator=g)
        rows = torch.randn(S, N, generator=g)
        slot = torch.randperm(S, generator=g).view(T, K)
        slot[0, 1] = S  # a dropped pair (capacity mode) reads as zero
        w = torch.rand(T, K, generator=g)
        idx = torch.randint(0, T, (S,), generator=g)
        d = lambda t: t.to(G.dev)  # noqa: E731
        with G.check(f"gather_rows {dt}"):
            got = kernels.gather_rows(d(x).to(dt), d(idx))
            G.compare(f"gather_rows {dt}", got, x.to(dt).double()[idx], dt)
        with G.check(f"gather_sum {dt}"):
            got = kernels.gather_sum(d(rows).to(dt), d(slot), d(w))
            pad = torch.cat([rows.to(dt).double(), torch.zeros(1, N, dtype=torch.float64)])
            want = (pad[slot] * w.double().unsqueeze(-1)).sum(1)
            G.compare(f"gather_sum {dt}", got, want, dt)
        with G.check(f"pair_dot {dt}"):
            got = kernels.pair_dot(d(x).to(dt), d(rows).to(dt), d(slot))
            want = (x.to(dt).double().unsqueeze(1) * pad[slot]).sum(-1)
            G.compare(f"pair_dot {dt}", got, want, dt)
        for act in ("swiglu", "gpt_oss"):
            name = f"swiglu fwd+bwd {act} {dt}"
            with G.check(name):
                h = (torch.randn(S, 2 * F, generator=g) * 2).to(dt)
                p = torch.rand(S, generator=g)
                gy = torch.randn(S, F, generator=g).to(dt)
                got = fwd_bwd(
                    lambda a, b: kernels.swiglu(a, b, activation=act, limit=2.0),
                    [d(h), d(p)],
                    d(gy),
                )
                if act == "swiglu":
                    want = fwd_bwd(swiglu_reference, [h.double(), p.double()], gy.double())
                else:
                    want = fwd_bwd(_gpt_oss_reference, [h.double(), p.double()], gy.double())
                G.record(name, max(rel_err(a, b) for a, b in zip(got, want)), TOL[dt])
        if G.cpu and dt != torch.float32:
            G.record(f"grouped_mm {dt}", status="skipped", note="interpreter: tl.dot fp32 only")
            continue
        counts = [7, 0, 13, 1, 20, 7]
        xs = torch.randn(sum(counts), D, generator=g).to(dt)
        wt = (torch.randn(E, 48, D, generator=g) / D**0.5).to(dt)
        gy = torch.randn(sum(counts), 48, generator=g).to(dt)
        with G.check(f"grouped_mm+wgrad {dt}"):
            y = kernels.grouped_mm(d(xs), d(wt), torch.tensor(counts, device=G.dev), True)
            dw = kernels.grouped_wgrad(d(gy), d(xs), counts)
            from dropless.ops.reference import grouped_gemm_reference

            yr = grouped_gemm_reference(xs.double(), wt.double(), counts)
            dwr = torch.stack(
                [a.t() @ b for a, b in zip(gy.double().split(counts), xs.double().split(counts))]
            )
            G.record(f"grouped_mm+wgrad {dt}", max(rel_err(y, yr), rel_err(dw, dwr)), TOL[dt])


def fused_mlp(G: Group) -> None:
    from dropless import ops
    from dropless.ops import fused_mlp as fm
    from dropless.ops.reference import expert_mlp_reference
    from dropless.ops.row_ops import EAGER

    g = torch.Generator().manual_seed(3)
    ids = routing(g).to(G.dev)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, K, generator=g)
    gu = torch.randn(E, 2 * F, D, generator=g) / D**0.5
    dn = torch.randn(E, D, F, generator=g) / F**0.5
    g_out = torch.randn(T, D, generator=g).to(G.dev)
    leaves = [t.to(G.dev) for t in (x, w, gu, dn)]
    ref = fwd_bwd(
        lambda a, b, c, e: expert_mlp_reference(a, ids, b, c, e),
        [t.double() for t in leaves],
        g_out.double(),
    )
    row_impls = [("eager", EAGER)]
    try:
        from dropless import kernels

        if kernels.triton_importable():
            row_impls.append(("triton", kernels.triton_row_ops()))
    except ImportError:
        pass
    from dropless.ops.dispatch import pick_gemm_backend

    for backend in ["loop", *[b for b in ops.gemm_backends() if b != "loop"]]:
        try:
            pick_gemm_backend(backend, *(leaves[i].to(G.dt) for i in (0, 2, 3)))
        except ValueError as e:
            G.record(f"fused MLP backend={backend}", status="skipped", note=str(e)[:120])
            continue
        for rname, impl in row_impls:
            name = f"fused MLP backend={backend} row_ops={rname}"
            real = fm.pick_row_ops
            fm.pick_row_ops = lambda t, name=None, activation=None, impl=impl: impl
            try:
                with G.check(name):
                    got = fwd_bwd(
                        lambda a, b, c, e: ops.expert_mlp(a, ids, b, c, e, backend=backend)[0],
                        [t.to(G.dt) for t in leaves],
                        g_out,
                    )
                    G.record(name, max(rel_err(a, b) for a, b in zip(got, ref)), TOL[G.dt])
            finally:
                fm.pick_row_ops = real


def fp8(G: Group) -> None:
    import dropless
    from dropless.quant import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling, pick_backend

    g = torch.Generator().manual_seed(4)
    x = torch.randn(T, D, generator=g).to(G.dev)
    g_out = torch.randn(T, D, generator=g).to(G.dev)
    recipes = {
        "rowwise_e4m3": lambda: Float8CurrentScaling(fp8_format="E4M3", granularity="row"),
        "delayed_hybrid": lambda: DelayedScaling(),
        "mxfp8": lambda: MXFP8BlockScaling(fp8_saved_activations=True),
    }
    for name, make in recipes.items():
        with G.check(name):
            moe, _ = _moe_pair(G, G.dt)
            recipe = make()
            be = pick_backend(recipe, x.to(G.dt), moe.experts.gate_up_proj)
            base = _moe_step(copy.deepcopy(moe), x.to(G.dt), g_out)
            with dropless.autocast(recipe=recipe), warnings.catch_warnings(record=True):
                _moe_step(copy.deepcopy(moe), x.to(G.dt), g_out)  # delayed: a first history
                out, gx, grads = _moe_step(moe, x.to(G.dt), g_out)
            # against the same model in the same dtype without the recipe: the same
            # routing (the router is not quantized), so only the FP8 noise is measured; an
            # fp64 reference would also count bf16 routing flips of near-tied experts
            out_r, gx_r, grads_r = base
            pairs = [
                (out, out_r),
                (gx, gx_r),
                (grads["experts.gate_up_proj"], grads_r["experts.gate_up_proj"]),
                (grads["experts.down_proj"], grads_r["experts.down_proj"]),
            ]
            sqnr = min(
                float(
                    10
                    * torch.log10(b.double().pow(2).sum() / (a.double() - b.double()).pow(2).sum())
                )
                for a, b in pairs
            )
            # SQNR floor (dB): the expert MLP has four quantized operands per pass
            G.record(
                name,
                status="ok" if sqnr >= 17 else "fail",
                note=f"backend={be} min SQNR {sqnr:.1f} dB (floor 17)",
            )
            if not G.cpu:
                with dropless.autocast(recipe=recipe):
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        _moe_step(moe, x.to(G.dt), g_out)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                G.record(f"{name}: no host sync", status="ok")


def expert_parallel(G: Group) -> None:
    import socket

    import torch.distributed as dist

    from dropless.parallel import ExpertParallelDispatcher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "gloo" if G.cpu else "nccl"
    if not G.cpu:
        torch.cuda.set_device(0)  # NCCL binds the process group to the current device
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        g = torch.Generator().manual_seed(5)
        x = torch.randn(T, D, generator=g).to(G.dev)
        g_out = torch.randn(T, D, generator=g).to(G.dev)
        for chunks, overlap in ((1, False), (2, True)):
            name = f"EP over a 1-rank {backend} group chunks={chunks} overlap={overlap}"
            with G.check(name):
                moe, ref = _moe_pair(G, G.dt)
                moe.dispatcher = ExpertParallelDispatcher(
                    num_experts=E, num_chunks=chunks, overlap=overlap
                )
                out, gx, grads = _moe_step(moe, x.to(G.dt), g_out)
                out_r, gx_r, grads_r = _moe_step(ref, x.double(), g_out)
                errs = [rel_err(out, out_r), rel_err(gx, gx_r)] + [
                    rel_err(grads[n], grads_r[n]) for n in grads
                ]
                note = ""
                if not G.cpu:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                    with warnings.catch_warnings(record=True) as caught:
                        warnings.simplefilter("always")
                        _moe_step(moe, x.to(G.dt), g_out)
                    torch.cuda.set_sync_debug_mode(0)
                    n = sum("synchroniz" in str(c.message) for c in caught)
                    note = f"host syncs per step: {n} (at most 1: the counts exchange)"
                    G.record(f"{name}: host syncs", status="ok" if n <= 1 else "fail", note=note)
                G.record(name, max(errs), TOL[G.dt])
    finally:
        dist.destroy_process_group()


def compile_group(G: Group) -> None:
    backend = "aot_eager" if G.cpu else "inductor"
    g = torch.Generator().manual_seed(6)
    x = torch.randn(T, D, generator=g).to(G.dev)
    g_out = torch.randn(T, D, generator=g).to(G.dev)
    name = f"torch.compile backend={backend}"
    with G.check(name):
        moe, _ = _moe_pair(G, G.dt)
        eager = _moe_step(copy.deepcopy(moe), x.to(G.dt), g_out)
        compiled = torch.compile(moe, backend=backend)
        t0 = time.perf_counter()
        out, gx, grads = _moe_step(compiled, x.to(G.dt), g_out)
        errs = [rel_err(out, eager[0]), rel_err(gx, eager[1])]
        errs += [rel_err(gr, eager[2][n.replace("_orig_mod.", "")]) for n, gr in grads.items()]
        G.record(
            name,
            max(errs),
            TOL[G.dt],
            note=f"vs eager; first call {time.perf_counter() - t0:.1f} s",
        )


def jax_group(G: Group) -> None:
    try:
        import jax
        import jax.numpy as jnp
        import numpy as np
    except ImportError:
        G.record("jax", status="skipped", note="jax not installed")
        return
    from dropless.jax import default_backend, grouped_gemm

    G.extra["jax_devices"] = [str(d) for d in jax.devices()]
    rng = np.random.default_rng(7)
    counts = np.array([5, 0, 11, 3, 9, 4], dtype=np.int32)
    S = int(counts.sum())
    x = rng.standard_normal((S, D)).astype(np.float32)
    w = (rng.standard_normal((E, 48, D)) / D**0.5).astype(np.float32)
    gy = rng.standard_normal((S, 48)).astype(np.float32)
    name = f"jax grouped_gemm backend={default_backend()} on {jax.default_backend()}"
    with G.check(name):

        def loss(x_, w_):
            return (grouped_gemm(x_, w_, jnp.asarray(counts)) * gy).sum()

        y = grouped_gemm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(counts))
        dx, dw = jax.grad(loss, argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
        bounds = np.concatenate([[0], np.cumsum(counts)])
        yr = np.concatenate(
            [
                x[a:b].astype(np.float64) @ w[e].T.astype(np.float64)
                for e, (a, b) in enumerate(zip(bounds, bounds[1:]))
            ]
        )
        dwr = np.stack(
            [
                gy[a:b].T.astype(np.float64) @ x[a:b].astype(np.float64)
                for a, b in zip(bounds, bounds[1:])
            ]
        )
        dxr = np.concatenate(
            [
                gy[a:b].astype(np.float64) @ w[e].astype(np.float64)
                for e, (a, b) in enumerate(zip(bounds, bounds[1:]))
            ]
        )
        errs = [
            rel_err(torch.from_numpy(np.asarray(a)), torch.from_numpy(b))
            for a, b in ((y, yr), (dx, dxr), (dw, dwr))
        ]
        G.record(
            name, max(errs), 1e-4 if G.cpu else 2e-2, note="y, dx, dw (fp32; TF32 allowed on GPU)"
        )


def timing(G: Group) -> None:
    from gpu_check_timing import run_timing

    G.extra["timing"] = run_timing(G)


def e2e(G: Group) -> None:
    from gpu_check_timing import run_e2e

    G.extra["e2e"] = run_e2e(G)


GROUPS = {
    "gemm_layouts": gemm_layouts,
    "moe_layer": moe_layer,
    "triton_kernels": triton_kernels,
    "fused_mlp": fused_mlp,
    "fp8": fp8,
    "expert_parallel": expert_parallel,
    "compile": compile_group,
    "jax": jax_group,
    "timing": timing,
    "e2e": e2e,
}


def main(argv: list[str]) -> int:
    name, cpu = argv[0], "--cpu" in argv
    G = Group(name, cpu)
    info = dict(torch=torch.__version__, device="cpu" if cpu else torch.cuda.get_device_name(0))
    try:
        GROUPS[name](G)
        crashed = None
    except Exception as e:  # noqa: BLE001 - reported, the parent goes on
        traceback.print_exc()
        crashed = f"{type(e).__name__}: {str(e)[:500]}"
    statuses = {c["status"] for c in G.checks}
    status = "fail" if crashed or "fail" in statuses else ("ok" if "ok" in statuses else "skipped")
    res = dict(status=status, info=info, checks=G.checks, **G.extra)
    if crashed:
        res["error"] = crashed
    print(MARK + json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
