"""Every GPU path against the reference at small shapes: grouped-GEMM backends and
layouts, the MoE layer (SwiGLU, biases, gpt_oss), the fused expert MLP per backend and
row ops, the FP8/MXFP8 recipes (SQNR floor), expert parallelism over a 1-rank group.

`check(case, device)` runs on CPU under TRITON_INTERPRET=1 in the interpreted child
(tests/interpreted.py), in fp32; on a GPU machine (`pytest -m gpu`) the same cases run
compiled in bf16, with the GPU-only checks below them: no host sync in a step, the
layer under `torch.compile` (inductor), the JAX grouped GEMM on the GPU. Errors: max
|got - want| / max |want| against an fp64 run on the same device.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs
# ruff: noqa: B023 - the lambdas over loop variables are called at once, inside the loop

from __future__ import annotations

import copy
import socket
import warnings

import pytest
import torch

from interpreted import interpreted_tests

# fp32: reductions over <= 64 terms, compared in fp64; bf16: 8 mantissa bits, rounded
# at each GEMM's output
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}
T, E, K, D, F = 24, 6, 2, 64, 32  # small shapes: E not a power of two, an expert empty
SQNR_FLOOR_DB = 17  # the expert MLP has four quantized operands per pass
COUNTS = {"uneven": [5, 0, 11, 3, 9, 4], "all_empty": [0] * E, "one_expert": [40, 0, 0, 0, 0, 0]}
CASES = {
    **{f"gemm_{c}_trans_w={t}": ("gemm", c, t) for c in COUNTS for t in (True, False)},
    "moe_swiglu": ("moe", {}),
    "moe_bias": ("moe", {"bias": True}),
    "moe_gpt_oss_bias": ("moe", {"activation": "gpt_oss", "bias": True}),
    "fused_mlp": ("fused_mlp",),
    "fp8_rowwise_e4m3": ("fp8", "rowwise_e4m3"),
    "fp8_delayed_hybrid": ("fp8", "delayed_hybrid"),
    "fp8_mxfp8_saved": ("fp8", "mxfp8"),
    "ep_1rank_chunks=1": ("ep", 1, False),
    "ep_1rank_chunks=2_overlap": ("ep", 2, True),
}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    if want.numel() == 0:
        return 0.0 if got.numel() == 0 else float("inf")
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def fwd_bwd(fn, leaves, g_out):
    leaves = [t.detach().clone().requires_grad_(True) for t in leaves]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, g_out.to(out.dtype), allow_unused=True)
    return [out.detach(), *grads]


def _dtype(device: str):
    return torch.float32 if device == "cpu" else torch.bfloat16


def _routing(g: torch.Generator) -> torch.Tensor:
    """ids [T, K]: distinct experts per token, expert E-1 never chosen, expert 0 hot."""
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    ids[: T // 2, 0] = 0
    ids[: T // 2, 1] = torch.randint(1, E - 1, (T // 2,), generator=g)
    return ids


def moe_pair(device: str, **kw):
    """A dropless.MoE in the device's dtype and its fp64 copy."""
    import dropless

    torch.manual_seed(0)
    moe = dropless.MoE(D, F, E, K, **kw).to(device)
    return moe.to(_dtype(device)), copy.deepcopy(moe).double()


def moe_step(moe, x, g_out):
    x = x.detach().clone().requires_grad_(True)
    out, _ = moe(x)
    (out * g_out.to(out.dtype)).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in moe.named_parameters()}


def _inputs(device: str, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, D, generator=g).to(device), torch.randn(T, D, generator=g).to(device)


def _max_err(got, want) -> float:
    (out, gx, grads), (out_r, gx_r, grads_r) = got, want
    return max(
        [rel_err(out, out_r), rel_err(gx, gx_r)] + [rel_err(grads[n], grads_r[n]) for n in grads]
    )


# --- the cases ------------------------------------------------------------------------------


def check_gemm(device: str, counts_name: str, trans_w: bool) -> None:
    from dropless import ops
    from dropless.ops.grouped_gemm import GEMM_BACKENDS, pick_gemm_backend
    from dropless.ops.reference import grouped_gemm_reference

    counts, dt = COUNTS[counts_name], _dtype(device)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), D, generator=g).to(device)
    w = (torch.randn(E, 48, D, generator=g) / D**0.5).to(device)
    w = w if trans_w else w.transpose(1, 2).contiguous()
    gy = torch.randn(sum(counts), 48, generator=g).to(device)
    ref = fwd_bwd(
        lambda a, b: grouped_gemm_reference(a, b, counts, trans_w=trans_w),
        [x.double(), w.double()],
        gy.double(),
    )
    ran = []
    GEMM_BACKENDS.load_gpu()  # the Triton backend, as the first CUDA pick registers it
    for be in ops.gemm_backends():
        try:
            pick_gemm_backend(be, x.to(dt), w.to(dt))
        except ValueError:
            continue  # this backend does not run these tensors (e.g. triton on CPU)
        got = fwd_bwd(
            lambda a, b: ops.grouped_gemm(a, b, counts, trans_w=trans_w, backend=be),
            [x.to(dt), w.to(dt)],
            gy,
        )
        err = max(rel_err(a, b) for a, b in zip(got, ref))
        assert err <= TOL[dt], f"backend {be}: y, dx, dw error {err:.2e} > {TOL[dt]}"
        ran.append(be)
    assert "loop" in ran, ran


def check_moe(device: str, kw: dict) -> None:
    x, g_out = _inputs(device, 1)
    moe, ref = moe_pair(device, **kw)
    err = _max_err(moe_step(moe, x.to(_dtype(device)), g_out), moe_step(ref, x.double(), g_out))
    assert err <= TOL[_dtype(device)], f"out, dx, weight grads: error {err:.2e}"


def check_fused_mlp(device: str) -> None:
    """ops.expert_mlp on every backend that runs the tensors, with each row-op set."""
    from dropless import ops
    from dropless.ops.grouped_gemm import GEMM_BACKENDS, pick_gemm_backend
    from dropless.ops.permute import row_ops
    from dropless.ops.reference import expert_mlp_reference

    dt = _dtype(device)
    g = torch.Generator().manual_seed(3)
    ids = _routing(g).to(device)
    x, w = torch.randn(T, D, generator=g), torch.rand(T, K, generator=g)
    gu = torch.randn(E, 2 * F, D, generator=g) / D**0.5
    dn = torch.randn(E, D, F, generator=g) / F**0.5
    g_out = torch.randn(T, D, generator=g).to(device)
    leaves = [t.to(device) for t in (x, w, gu, dn)]
    ref = fwd_bwd(
        lambda a, b, c, e: expert_mlp_reference(a, ids, b, c, e),
        [t.double() for t in leaves],
        g_out.double(),
    )
    GEMM_BACKENDS.load_gpu()  # the Triton entries, as the first CUDA pick registers them
    row_ops.ROW_OPS.load_gpu()
    row_sets = [[]] + ([["triton"]] if "triton" in row_ops._ROW_OPS else [])
    for backend in ops.gemm_backends():
        try:
            pick_gemm_backend(backend, *(leaves[i].to(dt) for i in (0, 2, 3)))
        except ValueError:
            continue
        for hidden in row_sets:  # [] keeps every registered row-op set; ["triton"] hides it
            saved = {n: row_ops._ROW_OPS.pop(n) for n in hidden}
            try:
                got = fwd_bwd(
                    lambda a, b, c, e: ops.expert_mlp(a, ids, b, c, e, backend=backend)[0],
                    [t.to(dt) for t in leaves],
                    g_out,
                )
            finally:
                row_ops._ROW_OPS.update(saved)
            err = max(rel_err(a, b) for a, b in zip(got, ref))
            assert err <= TOL[dt], f"backend {backend} hiding {hidden}: error {err:.2e}"


def _recipe(name: str):
    from dropless.quant import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

    return {
        "rowwise_e4m3": lambda: Float8CurrentScaling(fp8_format="E4M3", granularity="row"),
        "delayed_hybrid": lambda: DelayedScaling(),
        "mxfp8": lambda: MXFP8BlockScaling(fp8_saved_activations=True),
    }[name]()


def fp8_steps(device: str, name: str):
    """(model, recipe, x, g_out, step under the recipe, the same step without it)."""
    import dropless

    x, g_out = _inputs(device, 4)
    x = x.to(_dtype(device))
    moe, _ = moe_pair(device)
    recipe = _recipe(name)
    base = moe_step(copy.deepcopy(moe), x, g_out)
    with dropless.autocast(recipe=recipe), warnings.catch_warnings(record=True):
        moe_step(copy.deepcopy(moe), x, g_out)  # delayed: a first amax history
        got = moe_step(moe, x, g_out)
    return moe, recipe, x, g_out, got, base


def check_fp8(device: str, name: str) -> None:
    # against the same model in the same dtype without the recipe: the same routing (the
    # router is not quantized), so only the FP8 noise is measured; an fp64 reference
    # would also count bf16 routing flips of near-tied experts
    *_, (out, gx, grads), (out_r, gx_r, grads_r) = fp8_steps(device, name)
    pairs = [(out, out_r), (gx, gx_r)]
    pairs += [(grads[n], grads_r[n]) for n in ("experts.gate_up_proj", "experts.down_proj")]
    sqnr = min(
        float(10 * torch.log10(b.double().pow(2).sum() / (a.double() - b.double()).pow(2).sum()))
        for a, b in pairs
    )
    assert sqnr >= SQNR_FLOOR_DB, f"min SQNR {sqnr:.1f} dB < {SQNR_FLOOR_DB}"


def ep_moe(device: str, chunks: int, overlap: bool):
    """(MoE with an EP dispatcher, fp64 copy, x, g_out); the caller holds the group."""
    from dropless.parallel import ExpertParallelDispatcher

    x, g_out = _inputs(device, 5)
    moe, ref = moe_pair(device)
    moe.dispatcher = ExpertParallelDispatcher(num_experts=E, num_chunks=chunks, overlap=overlap)
    return moe, ref, x, g_out


class one_rank_group:
    """A 1-rank process group (gloo on CPU, NCCL on CUDA) for the block."""

    def __init__(self, device: str):
        self.device = device

    def __enter__(self):
        import torch.distributed as dist

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if self.device == "cuda":
            torch.cuda.set_device(0)  # NCCL binds the process group to the current device
        backend = "gloo" if self.device == "cpu" else "nccl"
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
        )

    def __exit__(self, *exc):
        import torch.distributed as dist

        dist.destroy_process_group()


def check_ep(device: str, chunks: int, overlap: bool) -> None:
    with one_rank_group(device):
        moe, ref, x, g_out = ep_moe(device, chunks, overlap)
        err = _max_err(moe_step(moe, x.to(_dtype(device)), g_out), moe_step(ref, x.double(), g_out))
    assert err <= TOL[_dtype(device)], f"EP over one rank: error {err:.2e}"


def check(case, device: str) -> None:
    kind, *params = case
    {"gemm": check_gemm, "moe": check_moe, "fused_mlp": check_fused_mlp, "fp8": check_fp8,
     "ep": check_ep}[kind](device, *params)  # fmt: skip


test_interpreted, test_cuda = interpreted_tests(CASES, check)


# --- GPU only -------------------------------------------------------------------------------


def host_syncs(step) -> int:
    """Host synchronizations one call of `step` makes (CUDA sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(c.message) for c in caught)


@pytest.mark.gpu
def test_moe_step_makes_no_host_sync():
    x, g_out = _inputs("cuda", 1)
    moe, _ = moe_pair("cuda")
    moe_step(moe, x.bfloat16(), g_out)  # warm-up: lazy registrations, caches
    assert host_syncs(lambda: moe_step(moe, x.bfloat16(), g_out)) == 0


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["rowwise_e4m3", "delayed_hybrid", "mxfp8"])
def test_fp8_step_makes_no_host_sync(name):
    import dropless

    moe, recipe, x, g_out, *_ = fp8_steps("cuda", name)
    with dropless.autocast(recipe=recipe):
        assert host_syncs(lambda: moe_step(moe, x, g_out)) == 0


@pytest.mark.gpu
def test_ep_step_makes_at_most_the_counts_exchange_sync():
    with one_rank_group("cuda"):
        moe, _, x, g_out = ep_moe("cuda", 2, True)
        moe_step(moe, x.bfloat16(), g_out)
        assert host_syncs(lambda: moe_step(moe, x.bfloat16(), g_out)) <= 1


@pytest.mark.gpu
def test_compiled_layer_matches_eager():
    x, g_out = _inputs("cuda", 6)
    moe, _ = moe_pair("cuda")
    eager = moe_step(copy.deepcopy(moe), x.bfloat16(), g_out)
    out, gx, grads = moe_step(torch.compile(moe, backend="inductor"), x.bfloat16(), g_out)
    grads = {n.replace("_orig_mod.", ""): v for n, v in grads.items()}
    assert _max_err((out, gx, grads), eager) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_jax_grouped_gemm_on_the_gpu():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np

    from dropless.jax import grouped_gemm

    counts = np.array(COUNTS["uneven"], dtype=np.int32)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    rng = np.random.default_rng(7)
    x = rng.standard_normal((int(counts.sum()), D)).astype(np.float32)
    w = (rng.standard_normal((E, 48, D)) / D**0.5).astype(np.float32)
    gy = rng.standard_normal((int(counts.sum()), 48)).astype(np.float32)
    y = grouped_gemm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(counts))
    dx, dw = jax.grad(
        lambda a, b: (grouped_gemm(a, b, jnp.asarray(counts)) * gy).sum(), argnums=(0, 1)
    )(jnp.asarray(x), jnp.asarray(w))
    spans = list(enumerate(zip(bounds, bounds[1:])))
    x64, w64, gy64 = x.astype(np.float64), w.astype(np.float64), gy.astype(np.float64)
    want = (
        np.concatenate([x64[a:b] @ w64[e].T for e, (a, b) in spans]),
        np.concatenate([gy64[a:b] @ w64[e] for e, (a, b) in spans]),
        np.stack([gy64[a:b].T @ x64[a:b] for _, (a, b) in spans]),
    )
    for got, ref in zip((y, dx, dw), want):  # fp32 with TF32 allowed on the GPU
        assert rel_err(torch.from_numpy(np.asarray(got)), torch.from_numpy(ref)) <= 2e-2
