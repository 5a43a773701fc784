"""`torchrun ... -m dropless train --set parallel.ep=2` on CPU (gloo): the trainer with
FSDP2 x expert parallelism equals one process, a rank killed mid-run loses nothing
but the steps since the last checkpoint, and the run resumes on another process
count (1 process with 2 micro-batches: the same per-micro-batch token sets).
"""

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dropless.cli.main import main  # noqa: E402
from dropless.train.checkpoint import store as ckpt  # noqa: E402
from dropless.train.config.recipes import TINY  # noqa: E402
from harness import read_metrics, torchrun  # noqa: E402

RUN = (
    *TINY,
    "train.steps=4",
    "log.every=1",
    "checkpoint.every=2",
    "log.plots=false",
    "log.tensorboard=false",
)


def _args(*extra):
    out = []
    for item in (*RUN, *extra):
        out += ["--set", item]
    return out


def test_torchrun_ep_kill_and_resume_on_one_process(tmp_path, monkeypatch):
    import torch

    torch.set_num_threads(1)
    ref, run = tmp_path / "ref", tmp_path / "ep"
    # the uninterrupted reference: one process, 2 micro-batches = the 2 ranks' batches
    assert main(["train", "--run-dir", str(ref), *_args("train.grad_accum=2")]) == 0
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    child = Path(__file__).parents[1] / "faults" / "train_child.py"  # injects faults via TrainHooks
    kill = json.dumps({"rank": 1, "kill_after_step": 3})
    args = [child, kill, "train", "--run-dir", str(run), *_args("parallel.ep=2")]
    proc = torchrun(2, args, env=env, timeout=300)
    assert proc.returncode != 0, "rank 1 should have been killed after step 3"
    assert "2 processes on cpu" in proc.stdout, proc.stderr[-3000:]
    assert "suboptimal" not in proc.stderr  # DTensor's per-rank redistribution warning
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]  # step 3 is lost, step 2 kept
    killed = read_metrics(run)
    assert [r["step"] for r in killed] == [0, 1, 2]  # killed inside step 3, before its record
    assert all(r["ep_bytes_per_step"] > 0 and r["ep_expert_s"] > 0 for r in killed[1:])
    # `dropless convert` of the sharded checkpoint: one HF directory equal to the reference's
    _same_hf_weights(tmp_path, ckpt.step_dir(run, 2), ckpt.step_dir(ref, 2))
    # resume the 2-process EP checkpoint in one process
    resume = ["--resume", "--set", "parallel.ep=1", "--set", "train.grad_accum=2"]
    assert main(["train", "--run-dir", str(run), *resume]) == 0
    want = {r["step"]: r for r in read_metrics(ref)}
    got = read_metrics(run)
    assert [r["step"] for r in got] == [0, 1, 2, 3, 4]  # step 3 recomputed after the restart
    for r in got:
        w = want[r["step"]]
        assert r["eval_loss"] == pytest.approx(w["eval_loss"], rel=1e-5)
        if "loss" in w:
            assert r["loss"] == pytest.approx(w["loss"], rel=1e-5)
            assert r["grad_norm"] == pytest.approx(w["grad_norm"], rel=1e-4)


def _same_hf_weights(tmp_path, sharded, single):
    from safetensors.torch import load_file

    tensors = []
    for name, src in (("from_ep", sharded), ("from_one", single)):
        out = tmp_path / name
        assert main(["convert", str(src), str(out)]) == 0
        tensors.append(load_file(out / "model.safetensors"))
    a, b = tensors
    # Transformers writes the original per-expert layout: every expert must be there
    experts = {k for k in a if ".mlp.experts." in k}
    assert sorted(a) == sorted(b) and len(experts) == 2 * 4 * 3  # 2 layers x 4 experts x 3
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch_close(a[k], b[k], k)


def torch_close(x, y, name):
    import torch

    # two AdamW steps: where a gradient is ~0, reduction-order noise becomes a visible
    # step difference on single elements; 1e-5 is 1/1000 of a step (lr 1e-2)
    torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")
