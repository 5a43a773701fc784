"""`parallel.force_distributed=true`: one process takes the parallel path (a 1-process gloo
group, FSDP2, DTensor experts behind the all-to-all dispatcher) and its run equals the
one-process run; a DCP checkpoint written under it resumes to the same losses, and a
checkpoint of the one-process path resumes under it (DCP reshards)."""

import shutil

import pytest
import torch.distributed as dist

from dropless.cli.main import main
from harness import read_metrics, tiny_args, tiny_moe_config

FORCE = "parallel.force_distributed=true"
# fp32: the same GEMMs in another order (a 1-rank all-to-all, FSDP2's gradient division by
# its world of 1) move the last bits; 8 AdamW steps of the tiny model stay within 1e-5
REL = 1e-5


def _same(got, want, steps):
    by_step = {r["step"]: r for r in want}
    assert [r["step"] for r in got] == steps
    for r in got:
        w = by_step[r["step"]]
        assert r["eval_loss"] == pytest.approx(w["eval_loss"], rel=REL), r["step"]
        if "loss" in w:
            assert r["loss"] == pytest.approx(w["loss"], rel=REL), r["step"]
            assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4), r["step"]
            assert r["tokens_per_expert"] == w["tokens_per_expert"], r["step"]


@pytest.fixture(scope="module")
def forced_run(tmp_path_factory):
    """The forced tiny run, and the collectives the step and the evaluation issued in it."""
    from dropless.train import evaluation, step
    from dropless.train.run import setup

    run_dir = tmp_path_factory.mktemp("forced") / "run"
    issued = []
    with pytest.MonkeyPatch.context() as mp:
        for mod in (step, evaluation):
            real = mod.all_reduce

            def spy(t, *a, real=real, name=mod.__name__, **k):
                issued.append(name)
                return real(t, *a, **k)

            mp.setattr(mod, "all_reduce", spy)
        real_b = setup.broadcast_object
        mp.setattr(
            setup, "broadcast_object", lambda o, **k: issued.append("bcast") or real_b(o, **k)
        )
        assert main(["train", "--run-dir", str(run_dir), *tiny_args(FORCE)]) == 0
    return run_dir, issued


def test_forced_run_takes_the_parallel_path_and_equals_one_process(forced_run, finished_run):
    forced_run, issued = forced_run
    # the step's and the evaluation's all-reduce run as on a node (on NCCL at world 1 too)
    assert issued.count("dropless.train.step") == 8
    # step 0 and every log step: the forward count and the sums
    assert issued.count("dropless.train.evaluation") == 2 * 5
    assert issued.count("bcast") >= 3  # rank 0's run-directory claim, data preparation, summary
    got = read_metrics(forced_run)
    _same(got, read_metrics(finished_run), [0, 2, 4, 6, 8])
    # the expert-parallel dispatcher ran (its stats are logged; one rank sends no bytes)
    assert all(r["ep_bytes_per_step"] == 0 for r in got[1:])
    assert all("ep_bytes_per_step" not in r for r in read_metrics(finished_run))
    assert not dist.is_initialized()  # the 1-process group is left at the end of the run


def test_forced_checkpoint_resumes_to_the_same_losses(forced_run, tmp_path):
    forced_run, _ = forced_run
    half = tmp_path / "half"
    shutil.copytree(forced_run, half)
    shutil.rmtree(half / "checkpoints" / "step_00000008")  # as if it had stopped after step 4
    assert main(["train", "--run-dir", str(half), "--resume"]) == 0  # config: the run dir's
    _same(read_metrics(half), read_metrics(forced_run), [0, 2, 4, 6, 8])


def test_one_process_checkpoint_resumes_under_force_distributed(finished_run, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(finished_run, half)
    shutil.rmtree(half / "checkpoints" / "step_00000008")
    assert main(["train", "--run-dir", str(half), "--resume", "--set", FORCE]) == 0
    got = read_metrics(half)
    _same(got, read_metrics(finished_run), [0, 2, 4, 6, 8])
    assert "ep_bytes_per_step" in got[-1]


def test_lora_fine_tune_of_a_checkpoint_reads_shards_and_equals_one_process(tmp_path):
    """With model.path, the forced run builds on meta and reads its shards from the
    safetensors files (the loader a node uses), and LoRA trains the same adapters."""
    pytest.importorskip("peft")
    import torch
    import transformers as tf

    from dropless.hf.distributed import sharded_load as hf_parallel

    cfg = tiny_moe_config(
        vocab_size=264, num_experts=4, norm_topk_prob=False, pad_token_id=None, bos_token_id=None
    )
    torch.manual_seed(0)
    src = tmp_path / "src"
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    args = [
        f"model.path={src}", "finetune.method=lora", "finetune.lora_rank=4", "train.steps=3",
        "train.seq_len=16", "train.batch_size=2", "optim.warmup_steps=1", "optim.lr=2e-2",
        "log.every=1", "checkpoint.every=0", "log.plots=false", "log.tensorboard=false",
    ]  # fmt: skip
    assert main(["train", "--run-dir", str(tmp_path / "one"), *tiny_args(*args)]) == 0
    loads = []
    real = hf_parallel.load_sharded_hf
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(hf_parallel, "load_sharded_hf", lambda *a, **k: loads.append(1) or real(*a, **k))
        assert main(["train", "--run-dir", str(tmp_path / "f"), *tiny_args(*args, FORCE)]) == 0
    assert loads == [1]
    _same(read_metrics(tmp_path / "f"), read_metrics(tmp_path / "one"), [0, 1, 2, 3])


def test_the_planner_shards_a_forced_run_over_a_fake_group_of_one():
    """`dropless plan` (and the trainer's preflight) trace a forced run as it runs: FSDP2
    and DTensor experts over a fake 1-rank group, which is left afterwards."""
    from dropless.train.plan.trace import fake_world

    with fake_world(1, force_distributed=True):
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert dist.get_backend() == "fake"
    assert not dist.is_initialized()
    with fake_world(1):  # the one-process path needs no group
        assert not dist.is_initialized()
