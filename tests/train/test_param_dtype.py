"""model.dtype=bf16: parameters and gradients stored in bf16, the optimizer BF16AdamW
(with or without an fp32 master), and resume bit-exact in both modes."""

import math
import shutil

import pytest
import torch

from dropless.cli.main import main
from dropless.train.config.recipes import tiny
from dropless.train.run.hooks import TrainHooks
from dropless.train.trainer import train
from harness import read_metrics, tiny_args


class _Dtypes(TrainHooks):
    def __init__(self):
        self.params, self.grads = set(), set()

    def after_backward(self, step, model):
        for p in model.parameters():
            if p.requires_grad:
                self.params.add(p.dtype)
                self.grads.add(None if p.grad is None else p.grad.dtype)


def test_bf16_parameters_and_gradients(tmp_path):
    seen = _Dtypes()
    cfg = tiny("model.dtype=bf16", "train.steps=3", "log.tensorboard=false", "log.plots=false")
    train(cfg, run_dir=str(tmp_path / "run"), hooks=seen)
    assert seen.params == {torch.bfloat16} and seen.grads == {torch.bfloat16}
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("master", ["true", "false"])
def test_bf16_resume_is_bit_exact(tmp_path, master):
    run = tmp_path / "run"
    extra = ("model.dtype=bf16", f"optim.master_weights={master}", "log.tensorboard=false")
    assert main(["train", "--run-dir", str(run), *tiny_args(*extra)]) == 0
    half = tmp_path / "half"
    shutil.copytree(run, half)
    shutil.rmtree(half / "checkpoints" / "step_00000008")
    assert main(["train", "--run-dir", str(half), "--resume"]) == 0
    straight = [r for r in read_metrics(run) if "loss" in r]
    resumed = [r for r in read_metrics(half) if "loss" in r]
    assert [r["step"] for r in resumed][-2:] == [6, 8]
    for a, b in zip(straight[-2:], resumed[-2:]):
        for f in ("loss", "eval_loss", "grad_norm"):
            assert a[f] == b[f], (a["step"], f)


def test_master_weights_is_fixed_on_resume(tmp_path, capsys):
    run = tmp_path / "run"
    extra = ("model.dtype=bf16", "train.steps=4", "log.tensorboard=false", "log.plots=false")
    assert main(["train", "--run-dir", str(run), *tiny_args(*extra)]) == 0
    args = ["train", "--run-dir", str(run), "--resume", "--set", "train.steps=8"]
    assert main([*args, "--set", "optim.master_weights=false"]) == 2
    assert "optim.master_weights" in capsys.readouterr().err


def test_measuring_the_cpu_rate_leaves_the_global_rng_alone():
    """The MFU peak is re-measured at each log step; drawing its matrices from the global
    generator moved the stream stochastic rounding (and dropout) read, so a resumed run
    drew other numbers than the uninterrupted one."""
    from dropless.train.report.run_log import measure_cpu_tflops

    before = torch.get_rng_state()
    measure_cpu_tflops(seconds=0.01, n=16, warmup=0.0)
    assert torch.equal(torch.get_rng_state(), before)
