"""The CPU loop's experts on worker threads (ops/expert_mlp/threads.py): the same numbers as
the loop in the calling thread, forward and backward, on every edge case; commits in
item order whatever order the items finish in; errors reach the caller."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

import threading

import pytest
import torch

from dropless import ops
from dropless.ops.expert_mlp import loop as loop_mlp
from dropless.ops.expert_mlp import threads as expert_threads
from dropless.ops.reference import expert_mlp_reference
from dropless.ops.specs import ActivationConfig


@pytest.fixture
def threads(monkeypatch):
    """Two torch threads and no floors: every multi-expert call goes to the workers."""
    keep = torch.get_num_threads()
    torch.set_num_threads(2)
    monkeypatch.setattr(loop_mlp, "MIN_THREADED_FLOPS", 0)
    monkeypatch.setattr(loop_mlp, "MIN_EXPERTS_PER_THREAD", 1)
    yield
    torch.set_num_threads(keep)


def _ids(T, K, E, g, mode):
    if mode == "one_expert":  # every pair on expert 0 (K=1)
        return torch.zeros(T, K, dtype=torch.long)
    if mode == "empty_expert":  # expert E-1 gets no token
        return torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])


CASES = {
    "basic": dict(),
    "biases_gpt_oss": dict(bias=True, activation="gpt_oss"),
    "interleaved_untransposed": dict(interleaved=True, trans_w=False),
    "non_gated_gelu": dict(activation="gelu", gated=False),
    "expert_with_zero_tokens": dict(ids="empty_expert"),
    "all_tokens_on_one_expert": dict(ids="one_expert", K=1),
    "one_token": dict(T=1),
    "k_equals_e": dict(K=4, E=4),
    "e_not_power_of_two": dict(E=5, K=3, T=7),
    "fp64": dict(dtype=torch.float64),
}


def _run(case: str, seed=0):
    c = dict(CASES[case])
    T, K, E, D, F = c.get("T", 9), c.get("K", 2), c.get("E", 6), 8, 4
    act, dtype = c.get("activation", "swiglu"), c.get("dtype", torch.float32)
    g = torch.Generator().manual_seed(seed)
    act = ActivationConfig(
        act, gated=c.get("gated", True), interleaved=c.get("interleaved", False), limit=3.0
    )
    N = 2 * F if act.gated else F
    x = torch.randn(T, D, generator=g, dtype=dtype)
    ids_TK = _ids(T, K, E, g, c.get("ids", "random"))
    w_TK = torch.rand(T, K, generator=g, dtype=dtype)
    gu = torch.randn(E, N, D, generator=g, dtype=dtype)
    dn = torch.randn(E, D, F, generator=g, dtype=dtype)
    if not c.get("trans_w", True):
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    gb = torch.randn(E, N, generator=g, dtype=dtype) if c.get("bias") else None
    db = torch.randn(E, D, generator=g, dtype=dtype) if c.get("bias") else None
    leaves = [t.requires_grad_(True) for t in (x, w_TK, gu, dn, gb, db) if t is not None]
    out = ops.expert_mlp(
        x, ids_TK, w_TK, gu, dn, gate_up_bias=gb, down_bias=db, activation=act,
        trans_w=c.get("trans_w", True),
    )[0]  # fmt: skip
    out.backward(torch.randn(out.shape, generator=g, dtype=dtype))
    return [out.detach()] + [t.grad for t in leaves]


@pytest.mark.parametrize("case", list(CASES))
def test_threads_equal_the_calling_thread_loop(case, threads, monkeypatch):
    seen = set()
    act_fwd = loop_mlp.act_forward

    def spy(*a, **kw):
        seen.add(threading.current_thread().name)
        return act_fwd(*a, **kw)

    monkeypatch.setattr(loop_mlp, "act_forward", spy)
    got = _run(case)
    workers_used = seen - {threading.current_thread().name}
    monkeypatch.setattr(loop_mlp, "MIN_THREADED_FLOPS", 2**62)
    seen.clear()
    want = _run(case)
    assert seen == {threading.current_thread().name}  # the floor keeps it in this thread
    assert workers_used or case in ("all_tokens_on_one_expert", "one_token")
    for i, (a, b) in enumerate(zip(got, want)):
        # same ops on the same rows, one thread each: the same bits
        assert torch.equal(a, b), f"{case}: tensor {i} differs by {(a - b).abs().max()}"


def test_threads_match_the_reference_and_repeat_bitwise(threads):
    g = torch.Generator().manual_seed(4)
    T, K, E, D, F = 12, 3, 7, 8, 4
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g, dtype=torch.float64)
    gu = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64)
    dn = torch.randn(E, D, F, generator=g, dtype=torch.float64)
    got = ops.expert_mlp(x, ids_TK, w_TK, gu, dn)[0]
    torch.testing.assert_close(got, expert_mlp_reference(x, ids_TK, w_TK, gu, dn))
    for _ in range(3):
        assert torch.equal(ops.expert_mlp(x, ids_TK, w_TK, gu, dn)[0], got)
    # gradcheck on a smaller problem: every perturbation is one more threaded call
    T, K, E, D, F = 4, 2, 3, 3, 2
    ids_TK = ids_TK[:T, :K] % E
    leaves = [
        t.requires_grad_(True)
        for t in (x[:T, :D], w_TK[:T, :K], gu[:E, : 2 * F, :D], dn[:E, :D, :F])
    ]
    assert torch.autograd.gradcheck(lambda *t: ops.expert_mlp(t[0], ids_TK, *t[1:])[0], leaves)


def test_commits_in_item_order_whatever_finishes_first():
    items = list(range(40))
    done, committed = [], []
    big = torch.randn(200, 200)

    def compute(i, scratch, buf):
        for _ in range(8 if i % 3 == 0 else 1):  # uneven work: later items finish first
            torch.mm(big, big)
        buf["item"] = i
        done.append(i)

    def commit(i, buf):
        assert buf["item"] == i  # the buffer still holds this item's result
        committed.append(i)

    expert_threads.run_experts(items, compute, workers=3, commit=commit, new_out=dict)
    assert committed == items and sorted(done) == items


def test_worker_error_reaches_the_caller_and_the_pool_survives():
    keep = torch.get_num_threads()

    def compute(i, scratch, buf):
        if i == 5:
            raise RuntimeError("item 5 failed")

    with pytest.raises(RuntimeError, match="item 5 failed"):
        expert_threads.run_experts(
            list(range(12)), compute, workers=2, commit=lambda i, b: None, new_out=dict
        )
    out = []
    expert_threads.run_experts(list(range(6)), lambda i, s, b: out.append(i), workers=2)
    assert sorted(out) == list(range(6))
    assert torch.get_num_threads() == keep  # starting workers left the caller's count alone


def test_a_script_that_ends_after_a_threaded_backward_exits_cleanly(tmp_path):
    """A user's script whose last line is the backward exits with status 0 (it aborted
    with 'terminate called without an active exception' when a worker still held the
    run's tensors at interpreter exit)."""
    import subprocess
    import sys

    script = tmp_path / "last_line_backward.py"
    script.write_text(
        "import torch\n"
        "from dropless import nn as dnn\n"
        "torch.set_num_threads(2)\n"
        "moe = dnn.MoE(256, 96, 32, 4, renormalize=True)\n"
        "x = torch.randn(1024, 256, requires_grad=True)\n"
        "moe(x)[0].sum().backward()\n"
    )
    for _ in range(3):
        run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-2000:]


def test_threads_under_inference_mode(threads):
    """Tensors made under inference mode may only be written in inference mode: the
    workers run in the caller's mode."""
    g = torch.Generator().manual_seed(6)
    T, K, E, D, F = 9, 2, 5, 8, 4
    x = torch.randn(T, D, generator=g)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    with torch.inference_mode():
        got = ops.expert_mlp(x, ids_TK, w_TK, gu, dn)[0]
    torch.testing.assert_close(got, expert_mlp_reference(x, ids_TK, w_TK, gu, dn))


def test_a_dispatch_mode_sees_every_op(threads):
    """Modes are per thread: under one (here a FLOP counter) the loop stays in the
    calling thread, so the mode sees every expert GEMM."""
    from torch.utils.flop_counter import FlopCounterMode

    g = torch.Generator().manual_seed(7)
    T, K, E, D, F = 9, 2, 5, 8, 4
    x = torch.randn(T, D, generator=g)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    with FlopCounterMode(display=False) as fc:
        ops.expert_mlp(x, ids_TK, w_TK, gu, dn)
    assert fc.get_total_flops() == 2 * T * K * D * 3 * F  # gate/up [D -> 2F] + down [F -> D]


def test_lora_factors_on_threads_equal_the_calling_thread(threads, monkeypatch):
    g = torch.Generator().manual_seed(8)
    T, K, E, D, F, r = 9, 2, 5, 8, 4, 2
    x = torch.randn(T, D, generator=g)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    factors = [
        torch.randn(shape, generator=g)
        for shape in ((E, r, D), (E, 2 * F, r), (E, r, F), (E, D, r))
    ]

    def run():
        leaves = [t.clone().requires_grad_(True) for t in [x, *factors]]
        a1, b1, a2, b2 = leaves[1:]
        lora = (ops.LowRank(a1, b1, 1.5), ops.LowRank(a2, b2, 0.5))
        out = ops.expert_mlp(leaves[0], ids_TK, w_TK, gu, dn, lora=lora)[0]
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    got = run()
    monkeypatch.setattr(loop_mlp, "MIN_THREADED_FLOPS", 2**62)
    for a, b in zip(got, run()):
        assert torch.equal(a, b)


def _in_forked_child(q):
    out = []
    expert_threads.run_experts(list(range(8)), lambda i, s, b: out.append(i), workers=2)
    q.put(sorted(out))


def test_a_forked_child_starts_its_own_workers():
    """Worker threads do not survive fork (e.g. DataLoader workers): the child must not
    queue work to threads that are not there."""
    import multiprocessing

    expert_threads.run_experts(list(range(4)), lambda i, s, b: None, workers=2)
    assert expert_threads._POOL  # the parent has its workers
    ctx = multiprocessing.get_context("fork")  # fault: a fork with the worker threads running
    q = ctx.Queue()
    p = ctx.Process(target=_in_forked_child, args=(q,))
    p.start()
    got = q.get(timeout=60)
    p.join(timeout=60)
    assert got == list(range(8)) and p.exitcode == 0


class _Twice(torch.overrides.TorchFunctionMode):
    """A mode that changes results (every mm doubled): escaping it changes the numbers."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.mm else out


class _NoOpDispatch(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


MODES = {
    "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "inference": torch.inference_mode,
    "function_mode": _Twice,
    "dispatch_mode": _NoOpDispatch,
    "no_autocast_inside_autocast": lambda: _nested_autocast_off(),
}


def _nested_autocast_off():
    import contextlib

    stack = contextlib.ExitStack()
    stack.enter_context(torch.autocast("cpu", dtype=torch.bfloat16))
    stack.enter_context(torch.autocast("cpu", enabled=False))
    return stack


@pytest.mark.parametrize("mode", list(MODES))
def test_one_and_n_workers_agree_bitwise_under_each_mode(mode):
    """Every thread-local mode a result depends on reaches the workers (or keeps the
    items in the calling thread): the per-item results of 1 and 2 workers are the same
    bits, dtype included. The items run autocast-eligible ops (mm without out=)."""
    g = torch.Generator().manual_seed(9)
    a, b = torch.randn(6, 32, 16, generator=g), torch.randn(6, 16, 8, generator=g)

    def run(workers):
        got = [None] * 6

        def compute(e, scratch, buf):
            got[e] = torch.mm(a[e], b[e]).relu()

        keep = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            with MODES[mode]():
                # what run_experts leaves to its caller runs here, as loop.py does
                if not expert_threads.run_experts(list(range(6)), compute, workers=workers):
                    for e in range(6):
                        compute(e, {}, None)
        finally:
            torch.set_num_threads(keep)
        return got

    one, many = run(1), run(2)
    for e, (x, y) in enumerate(zip(one, many)):
        assert x.dtype == y.dtype and torch.equal(x, y), f"{mode}: item {e} differs"


def test_workers_that_cannot_carry_a_guard_leave_the_items_to_the_caller(monkeypatch):
    """A dispatch-key guard the workers cannot reproduce: no item runs on a worker, and
    run_experts says so (the loop then runs every item in the calling thread)."""
    monkeypatch.setattr(expert_threads, "_dispatch_keys", lambda: (threading.get_ident(),))
    ran = []

    def compute(item, scratch, buf):
        ran.append((item, threading.current_thread().name))

    keep = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert not expert_threads.run_experts(list(range(5)), compute, workers=2)
    finally:
        torch.set_num_threads(keep)
    assert ran == []


@pytest.mark.parametrize("workers", ["one", "two"])
def test_the_loop_computes_in_its_inputs_dtype_under_autocast(workers, threads, monkeypatch):
    """Under autocast the expert path casts its operands to the autocast dtype at its
    entry and the loop computes in that dtype, whatever the number of workers: the same
    bits as bf16 inputs without autocast (its buffers are in its inputs' dtype)."""
    if workers == "one":
        monkeypatch.setattr(loop_mlp, "MIN_THREADED_FLOPS", 2**62)
    g = torch.Generator().manual_seed(10)
    T, K, E, D, F = 9, 2, 5, 8, 4
    x = torch.randn(T, D, generator=g, requires_grad=True)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g)
    gu, dn = torch.randn(E, 2 * F, D, generator=g), torch.randn(E, D, F, generator=g)
    bf = torch.bfloat16
    want = ops.expert_mlp(x.to(bf), ids_TK, w_TK, gu.to(bf), dn.to(bf))[0]
    (want_dx,) = torch.autograd.grad(want.float().sum(), x)
    with torch.autocast("cpu", dtype=bf):
        got = ops.expert_mlp(x, ids_TK, w_TK, gu, dn)[0]
    (got_dx,) = torch.autograd.grad(got.float().sum(), x)
    assert got.dtype == bf and torch.equal(got, want) and torch.equal(got_dx, want_dx)


@pytest.mark.parametrize("compiled", ["eager", "aot_eager"])
def test_the_custom_op_runs_its_experts_on_the_workers(compiled, threads, monkeypatch):
    """The custom op runs its implementation with the Autograd keys excluded (eager, and
    every call of a compiled graph): the workers take on that key state, so the loop's
    experts run on them, forward and backward, with the reference's numbers. (Each
    graph's first call runs under torch's custom-op aliasing check, a TorchDispatchMode:
    that one stays in the calling thread.)"""
    seen = {"forward": set(), "backward": set()}
    act_fwd, act_grad = loop_mlp.act_forward, loop_mlp.act_input_grad

    def fwd_spy(*a, **kw):
        seen["forward"].add(threading.get_ident())
        return act_fwd(*a, **kw)

    def bwd_spy(*a, **kw):
        seen["backward"].add(threading.get_ident())
        return act_grad(*a, **kw)

    monkeypatch.setattr(loop_mlp, "act_forward", fwd_spy)
    monkeypatch.setattr(loop_mlp, "act_input_grad", bwd_spy)
    g = torch.Generator().manual_seed(11)
    T, K, E, D, F = 16, 2, 8, 8, 4
    x = torch.randn(T, D, generator=g, dtype=torch.float64)
    ids_TK = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w_TK = torch.rand(T, K, generator=g, dtype=torch.float64)
    gu = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64)
    dn = torch.randn(E, D, F, generator=g, dtype=torch.float64)
    g_out = torch.randn(T, D, generator=g, dtype=torch.float64)

    def run(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, w_TK, gu, dn)]
        out = fn(leaves[0], ids_TK, *leaves[1:])
        out.backward(g_out)
        return [out.detach()] + [t.grad for t in leaves]

    def mlp(x, ids, w, gu, dn):
        return ops.expert_mlp(x, ids, w, gu, dn)[0]

    fn = mlp if compiled == "eager" else torch.compile(mlp, backend=compiled, fullgraph=True)
    run(fn)  # a compiled graph's first call runs under torch's aliasing check (a dispatch mode)
    for ids in seen.values():
        ids.clear()
    got = run(fn)
    me = threading.get_ident()
    for phase, ids in seen.items():
        assert ids and me not in ids, f"{compiled} {phase}: the experts ran in the calling thread"
    for a, b in zip(got, run(expert_mlp_reference)):
        torch.testing.assert_close(a, b)
