"""Checks in spawned processes: under `torch.autocast("cpu", dtype=torch.bfloat16)` with
fp32 weights, expert parallelism moves bf16 over the all-to-all (forward and backward)
and multiplies bf16 operands in every expert GEMM, for `dropless.MoE` and a patched
Transformers model, within bf16 tolerance of one process under the same autocast; under
FSDP2 without a mixed-precision policy the cached weight casts follow every step."""

# T tokens per rank, D model dim, F expert hidden dim, E experts

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from _checks_hf import B, E, L, V, _model
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.hf import shard_hf_experts
from dropless.nn import MoE
from dropless.ops.expert_mlp.engine import RoutedMLP
from dropless.ops.grouped_gemm.eager import GroupedGemm
from dropless.parallel import ParallelConfig, build_mesh, comm, shard_moe_experts

BF16 = torch.bfloat16
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm"}
# bf16's step is 2^-8 (0.4%): one expert layer differs from one process's bf16 run by
# the order of its sums only; a few bf16 roundings of the output's norm
RTOL = 2e-2


class _GemmSpy(TorchDispatchMode):
    def __init__(self, seen):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ in GEMMS:
            flat = [*args, *kwargs.values()]
            self.seen.update(a.dtype for a in flat if isinstance(a, torch.Tensor))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _spies():
    """(dtypes of all-to-all payloads, dtypes of expert GEMM operands) while active."""
    payload, gemm = [], set()
    launch = comm._launch
    saved = [(cls, n, cls.__dict__[n]) for cls in (RoutedMLP, GroupedGemm)
             for n in ("forward", "backward")]  # fmt: skip

    def spy_launch(x, *a, **k):
        payload.append((x.dim(), x.dtype))
        return launch(x, *a, **k)

    def wrap(fn):
        def run(*a, **k):
            with _GemmSpy(gemm):
                return fn(*a, **k)

        return staticmethod(run)

    comm._launch = spy_launch
    for cls, n, f in saved:
        setattr(cls, n, wrap(f.__func__))
    try:
        yield payload, gemm
    finally:
        comm._launch = launch
        for cls, n, f in saved:
            setattr(cls, n, f)


def _rel(a, ref) -> float:
    return float((a.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())


def _check_spies(payload, gemm):
    # the rows (dispatch, combine and their grads) in bf16; each row's routing weight (one
    # value beside D) and its gradient in the router's dtype, bf16 under autocast too
    rows = [dt for dim, dt in payload if dim == 2]
    assert rows and set(rows) == {BF16}, payload
    assert len(rows) >= 4, payload
    assert {dt for dim, dt in payload if dim == 1} == {BF16}, payload
    assert gemm == {BF16}, gemm


def ep_autocast_bf16_moe(rank, world):
    D, F, T = 16, 12, 8
    torch.manual_seed(0)
    moe = MoE(D, F, 8, 2)
    x_all, g_all = torch.randn(world * T, D), torch.randn(world * T, D)
    ref = copy.deepcopy(moe)
    with torch.autocast("cpu", dtype=BF16):
        out_r, _ = ref(x_all)
    (out_r.float() * g_all).sum().backward()
    pm = build_mesh(ParallelConfig(dp_shard=world, ep=world), num_experts=8)
    ep = copy.deepcopy(moe)
    shard_moe_experts(ep, pm)
    sl = slice(rank * T, (rank + 1) * T)
    with _spies() as (payload, gemm):
        with torch.autocast("cpu", dtype=BF16):
            out, _ = ep(x_all[sl].requires_grad_(True))
        (out.float() * g_all[sl]).sum().backward()
    _check_spies(payload, gemm)
    assert out.dtype == BF16 and _rel(out, out_r[sl]) < RTOL
    p = ep.experts.gate_up_proj
    got = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
    Le = 8 // world
    want = ref.experts.gate_up_proj.grad[rank * Le : (rank + 1) * Le]
    assert got.dtype == torch.float32 and _rel(got, want) < RTOL


def hf_ep_autocast_bf16(rank, world):
    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    ref = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=BF16):
        ref_logits = ref(input_ids=ids).logits
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    ep = copy.deepcopy(model)
    assert len(shard_hf_experts(ep, pm)) == 2
    sl = slice(rank * B, (rank + 1) * B)
    with _spies() as (payload, gemm):
        with torch.autocast("cpu", dtype=BF16):
            out = ep(input_ids=ids[sl], labels=ids[sl])
        out.loss.backward()
    _check_spies(payload, gemm)
    assert _rel(out.logits, ref_logits[sl]) < RTOL
    grads = [p.grad for p in ep.parameters() if p.grad is not None]
    assert grads and all(gr.dtype == torch.float32 for gr in grads)
    dist.barrier()


def fsdp_autocast_casts_fresh_each_step(rank, world):
    """FSDP2 without a mixed-precision policy under autocast: the experts' unsharded fp32
    weights are re-gathered into the same Parameter objects every step; the weight cache
    must re-cast them after each optimizer step (a stale cast would run step 2 with step
    1's weights). Every rank feeds the same batch, so FSDP's mean gradient is the one
    process's gradient and the losses must follow the one-process run."""
    from torch.distributed.fsdp import fully_shard

    D, F, T = 16, 12, 8
    torch.manual_seed(0)
    moe = MoE(D, F, 8, 2)
    x, g = torch.randn(T, D), torch.randn(T, D)
    ref, sharded = copy.deepcopy(moe), copy.deepcopy(moe)
    fully_shard(sharded.experts, reshard_after_forward=True)
    fully_shard(sharded)

    def steps(model):
        opt = torch.optim.SGD(model.parameters(), lr=2.0)
        losses = []
        for _ in range(3):
            with torch.autocast("cpu", dtype=BF16):
                out, _ = model(x)
            loss = (out.float() - g).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    want, got = steps(ref), steps(sharded)
    assert want[2] < 0.8 * want[1] < 0.8**2 * want[0], want  # each step moves the loss
    for a, b in zip(got, want):
        assert abs(a - b) <= RTOL * abs(b), (got, want)
