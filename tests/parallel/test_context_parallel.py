"""Context parallelism in real processes (gloo): one spawned group of 4 runs every check
of `_checks_cp.CHECKS` (cp=4 over all ranks, cp=2 over {0, 1} and {2, 3}); each check
is reported as its own test."""

from pathlib import Path

import pytest
import torch
from _checks_cp import CHECKS

from dropless.parallel import context as cpx
from harness import run_group

_results: dict[str, str] = {}


@pytest.mark.parametrize("check", CHECKS)
def test_cp_world4(check):
    if not _results:
        _results.update(run_group(4, "_checks_cp", CHECKS))
    res = _results[check]
    assert res == "ok", res


def test_shard_round_trip_and_layout():
    """Rank r holds chunks r and 2*cp-1-r; unsharding the ranks' parts gives the input back."""
    x = torch.arange(2 * 24).view(2, 24)
    parts = [cpx.shard_sequence(x, 3, r) for r in range(3)]
    assert parts[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert parts[2][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(cpx.unshard_sequence(parts), x)
    b = cpx.shard_batch({"input_ids": x, "labels": x + 1}, 3, 1)
    assert b["position_ids"][1].tolist() == cpx.local_positions(24, 3, 1).tolist()
    assert b["position_ids"][1].tolist() == [4, 5, 6, 7, 16, 17, 18, 19]


CASES = [  # B, H, G, C, (Dq, Dv), cp, dtype
    (2, 6, 2, 8, (8, 8), 3, torch.float64),  # GQA (3 query heads per K/V head), odd cp
    (1, 2, 1, 1, (4, 4), 4, torch.float64),  # one-token chunks
    (1, 4, 4, 5, (16, 16), 1, torch.float64),  # no GQA, one rank: chunks 0 and 1
    (1, 4, 1, 16, (8, 8), 2, torch.bfloat16),
    (1, 4, 4, 4, (12, 8), 2, torch.float64),  # MLA: query/key and value head dims apart
]
# on CUDA (`pytest -m gpu`, scripts/gpu_check.py's pytest step): SDPA with causal_lower_right
# and K/V at their own heads (enable_gqa), in bf16 at a flash-kernel head dim, and at
# 32,768 tokens over cp=4
GPU_CASES = [
    (1, 8, 2, 64, (64, 64), 3, torch.bfloat16),
    (1, 16, 4, 4096, (128, 128), 4, torch.bfloat16),
]
DEVICE_CASES = [("cpu", *c) for c in CASES] + [
    pytest.param("cuda", *c, marks=pytest.mark.gpu) for c in [*CASES[:1], *GPU_CASES]
]


@pytest.mark.parametrize("device, B, H, G, C, dims, cp, dtype", DEVICE_CASES)
def test_attend_gathered_equals_reference(device, B, H, G, C, dims, cp, dtype):
    """The attention of each cp rank after the gathers (on CPU blockwise: each chunk's
    unmasked and causal key blocks merged by their log-sum-exps; on CUDA SDPA with a
    bottom-right causal mask; K/V at their own heads on both) equals whole-sequence
    causal SDPA, output and the gradients of q, k and v, for every rank's chunks of a
    sequence split 2 x cp ways (the ranks simulated in one process: each rank's K/V
    gradient is its share of the sum)."""
    from dropless.parallel.context.attention import attend_gathered

    g = torch.Generator().manual_seed(0)
    L, scale, (Dq, Dv) = 2 * cp * C, 0.3, dims
    q, k, v = (torch.randn(B, n, L, d, generator=g).to(device, dtype) for n, d in ((H, Dq), (G, Dq), (G, Dv)))  # fmt: skip
    dout = torch.randn(B, H, L, Dv, generator=g).to(device, dtype)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = cpx.reference_attention(*ref, scale=scale)
    out_ref.backward(dout)
    outs, dqs, dk, dv = [], [], 0, 0
    for r in range(cp):
        q_r = cpx.shard_sequence(q, cp, r, dim=2).requires_grad_()
        k_r, v_r = k.clone().requires_grad_(), v.clone().requires_grad_()
        out = attend_gathered(q_r, k_r, v_r, (r, 2 * cp - 1 - r), scale)
        out.backward(cpx.shard_sequence(dout, cp, r, dim=2))
        outs.append(out.detach())
        dqs.append(q_r.grad)
        dk, dv = dk + k_r.grad.double(), dv + v_r.grad.double()
    # float64: the summation order only (the log-sum-exp merge keeps float64)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-2, atol=4e-2)
    got = (cpx.unshard_sequence(outs, 2), cpx.unshard_sequence(dqs, 2), dk, dv)
    want = (out_ref, ref[0].grad, ref[1].grad, ref[2].grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_seq_len_error_names_the_fix():
    with pytest.raises(
        ValueError, match=r"not divisible by 2 x cp = 4.*multiple of 4, e.g. 8 or 12"
    ):
        cpx.check_seq_len(10, 2)


def test_cp_sizes_resolve_and_errors_name_the_fix():
    """world = dp_replicate x dp_shard x cp; ep divides dp_shard x cp (experts see tokens:
    the expert group may span context-parallel ranks)."""
    from dropless.parallel import ParallelConfig, resolve_sizes

    cfg = resolve_sizes(ParallelConfig(cp=2, ep=4), 8, 8)
    assert (cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.ep) == (1, 4, 2, 4)
    assert resolve_sizes(ParallelConfig(cp=4, ep=4), 4, 8).dp_shard == 1  # ep spans cp ranks
    for kw, world, needle in (
        (dict(cp=3), 4, "parallel.dp_replicate x parallel.cp = 1 x 3 = 3 does not divide"),
        (dict(cp=2, dp_shard=4), 4, "1 x 4 x 2 = 8 must equal the world size 4"),
        (dict(cp=2, ep=8), 4, "parallel.ep=8 must divide parallel.dp_shard x parallel.cp = 4"),
    ):
        with pytest.raises(ValueError) as e:
            resolve_sizes(ParallelConfig(**kw), world, 8)
        assert needle in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=r"parallel.cp=0 must be an int >= 1"):
        ParallelConfig(cp=0)


def test_train_cp4_equals_one_process_and_resumes_at_cp2_then_cp1(tmp_path):
    """`torchrun --nproc-per-node 4 -m dropless train --set parallel.cp=4`: the 4 ranks read
    the same 4 sequences and keep a quarter of each; the losses, gradient norms and
    held-out losses equal one process's. (Had the ranks not split the sequences, the
    run's dropped-token check would fail it: each rank would route 4x its share.) Its
    checkpoint (DCP, dense parameters sharded over dp_shard x cp) resumes at cp=2 on 2
    processes, and that one's on one process with cp=1, each continuing as the reference
    does, the load-balancing loss included (counted over whole sequences)."""
    from dropless.cli.main import main
    from dropless.train.config.recipes import TINY
    from harness import read_metrics, torchrun

    torch.set_num_threads(1)
    run = (*TINY, "log.every=1", "checkpoint.every=0", "log.plots=false",
           "log.tensorboard=false", "train.aux_loss_coef=0.1")  # fmt: skip
    args = [a for item in run for a in ("--set", item)]
    ref, cp = tmp_path / "ref", tmp_path / "cp"
    assert main(["train", "--run-dir", str(ref), *args, "--set", "train.steps=3"]) == 0
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    cmd = ["-m", "dropless", "train", "--run-dir", str(cp)]
    proc = torchrun(4, [*cmd, *args, "--set", "train.steps=1", "--set", "parallel.cp=4"], env=env, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "4 processes on cpu" in proc.stdout
    assert [r["step"] for r in read_metrics(cp)] == [0, 1]
    # the last checkpoint (step 1), resharded onto 2 processes at cp=2: step 2
    resume = ["--resume", "--set", "parallel.cp=2", "--set", "train.steps=2"]
    proc = torchrun(2, [*cmd, *resume], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    # and that one (step 2) onto one process without cp: step 3
    resume = ["--resume", "--set", "parallel.cp=1", "--set", "train.steps=3"]
    assert main(["train", "--run-dir", str(cp), *resume]) == 0
    want, got = read_metrics(ref), read_metrics(cp)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [0, 1, 2, 3]
    for w, g in zip(want, got, strict=True):
        assert g["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-5)
        if "loss" in w:
            assert g["loss"] == pytest.approx(w["loss"], rel=1e-5)
            assert g["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)


def test_train_cp_refuses_a_seq_len_it_cannot_split():
    """train.seq_len not a multiple of 2 x cp: the error names the key and the sizes."""
    from dropless.train.data.context_split import ContextSplit

    with pytest.raises(
        ValueError, match=r"sequence length 30 is not divisible by 2 x cp = 4.*train.seq_len"
    ):
        ContextSplit(0, 1, 0, 2).check(30)
    x = torch.arange(16).view(1, 16)
    xs, ys, pos = ContextSplit(0, 1, 1, 2).split(x, x + 1)
    assert xs[0].tolist() == pos[0].tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert ys[0].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]  # shifted before the split


def test_argument_errors_say_what_to_do():
    """Each refusal of the sharding and attention helpers, without processes."""
    from torch import nn

    with pytest.raises(ValueError, match=r"context parallel size cp=0 must be an int >= 1"):
        cpx.check_seq_len(8, 0)
    with pytest.raises(ValueError, match=r"cp rank 2 is outside 0..1"):
        cpx.chunk_ids(2, 2)
    with pytest.raises(ValueError, match=r"unshard_sequence needs 2 parts of one even length"):
        cpx.unshard_sequence([torch.zeros(1, 4), torch.zeros(1, 6)])
    with pytest.raises(ValueError, match=r"shard_batch needs `input_ids` or `labels`"):
        cpx.shard_batch({"attention_mask": torch.ones(1, 8)}, 2, 0)
    with pytest.raises(ValueError, match=r"batch\['labels'\] has length 6 along the sequence"):
        cpx.shard_batch({"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 6)}, 2, 0)
    q, kv = torch.zeros(1, 4, 6, 8), torch.zeros(1, 3, 6, 8)
    with pytest.raises(ValueError, match=r"query heads 4 must be a multiple of key/value heads 3"):
        cpx.context_parallel_attention(q, kv, kv, None)
    q, kv = torch.zeros(1, 4, 5, 8), torch.zeros(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"local sequence length 5 must be even.*shard_batch"):
        cpx.context_parallel_attention(q, kv, kv, None)
    m, q, kv = nn.Module(), torch.zeros(1, 4, 6, 8), torch.zeros(1, 2, 6, 8)
    with pytest.raises(ValueError, match=r"sliding_window=16\): set the config's sliding_window"):
        cpx.attention_forward(m, q, kv, kv, None, sliding_window=16)
    with pytest.raises(ValueError, match=r"does not support `s_aux` in attention"):
        cpx.attention_forward(m, q, kv, kv, None, s_aux=torch.zeros(4))
    with pytest.raises(ValueError, match=r"takes a 2-D padding mask \[B, S\] or none; got a 4-D"):
        cpx.attention_forward(m, q, kv, kv, torch.zeros(1, 1, 6, 6))
    with pytest.raises(RuntimeError, match=r"needs the cp process group: call .*enable"):
        cpx.attention_forward(m, q, kv, kv, None)


def test_preflight_counts_cp_groups_in_the_batch():
    """At world 4 with cp=2 the batch is split over 2 groups, not 4 processes."""
    from dropless.train.config.load import load_config
    from dropless.train.config.recipes import TINY
    from dropless.train.plan.preflight import preflight
    from dropless.train.run.setup import Env

    env = Env(rank=0, world=4, local_rank=0, device=torch.device("cpu"))
    cfg = load_config(None, [*TINY, "train.batch_size=3", "parallel.cp=2"])
    with pytest.raises(ValueError, match=r"context-parallel groups \(world 4 / parallel.cp 2\)"):
        preflight(cfg, env, Path("/nonexistent/run"))


def test_plan_with_cp_traces_each_ranks_share():
    """`dropless plan` with parallel.cp=2 traces the trainer's step on half of the
    sequence per rank (the context-parallel attention declared as the GPU runs it): one
    sequence over 2 GPUs holds half the tokens per GPU, and a lower activation peak, than
    on one GPU."""
    from dropless.train.config.load import load_config
    from dropless.train.config.recipes import TINY
    from dropless.train.plan.trace import make_plan

    plans = {}
    for cp in (1, 2):
        cfg = load_config(None, [*TINY, "train.seq_len=2048", "train.batch_size=1",
                                 "model.max_position_embeddings=2048", f"parallel.cp={cp}"])  # fmt: skip
        plans[cp] = make_plan(cfg, gpus=cp, gpu_memory_gib=80, compare_checkpointing=False)
    one, two = plans[1], plans[2]
    assert (one.layout["tokens_per_gpu"], two.layout["tokens_per_gpu"]) == (2048, 1024)
    assert (two.layout["cp"], two.layout["dp_shard"], two.layout["micro_batch"]) == (2, 1, 1)
    assert "context_parallel" in two.assumptions
    assert two.activation_peak_gib < 0.6 * one.activation_peak_gib


def test_preflight_plans_cp_on_cuda(monkeypatch):
    """On CUDA (the device's memory faked), `dropless train` with parallel.cp=2 gets the
    traced plan `dropless plan` makes, through the planner's fake process group: one
    256-token sequence over 2 GPUs runs without a warning on a memory just above the
    plan's need, and is refused just below it. The host-memory check counts a rank's share
    of the sequence too."""
    import warnings

    from dropless.train.config.load import load_config
    from dropless.train.config.recipes import TINY
    from dropless.train.plan import preflight as PF
    from dropless.train.plan.memory_fit import _activation_bytes
    from dropless.train.plan.trace import make_plan, resolve_hf_config

    cfg = load_config(None, [*TINY, "train.seq_len=256", "train.batch_size=1",
                             "parallel.cp=2"])  # fmt: skip
    hc = resolve_hf_config(cfg)
    p = make_plan(cfg, 2, 80, hf_config=hc, compare_checkpointing=False)
    assert p.layout["cp"] == 2 and p.layout["tokens_per_gpu"] == 128
    per_token = hc.hidden_size * hc.num_hidden_layers * 4
    assert _activation_bytes(cfg, hc, 2, 4) == 128 * per_token  # half of the one sequence
    need, cuda = p.peak_gib_per_gpu + p.reserve_gib, torch.device("cuda", 0)
    monkeypatch.setattr(PF, "device_memory_gib", lambda device: need * 1.001)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # planned, not skipped
        PF.check_plan_fits(cfg, hc, 2, cuda)
    monkeypatch.setattr(PF, "device_memory_gib", lambda device: need * 0.999)
    monkeypatch.setattr(PF, "_suggestions", lambda *a: [])  # more plans, tested elsewhere
    with pytest.raises(ValueError, match=r"the plan predicts this run does not fit: "):
        PF.check_plan_fits(cfg, hc, 2, cuda)
