"""What `dropless train` tells its user: warnings as one line without a Python source
line, a resume names its step, the header counts total and trainable parameters, a
missing optional extra is one error line with exit status 2, an all-warmup run warns,
and a run stopped by a signal still writes its plots and a summary marked interrupted."""

import json
import os
import re
import shutil
import signal
import sys

import pytest
import torch

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from harness import tiny_args, tiny_moe_config

SOURCE_LINE = re.compile(r"\.py:\d+: |warnings\.warn\(")


def _damage_newest(run):
    newest = ckpt.list_checkpoints(run)[-1][1]
    with open(newest / "trainer.json", "a") as f:
        f.write(" ")  # no longer the bytes its manifest lists
    return newest


def test_resume_says_its_step_and_warnings_are_one_line(finished_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    damaged = _damage_newest(run)
    more = ["--set", "train.steps=10", "--set", "log.plots=false", "--set", "log.progress=plain"]
    assert main(["train", "--run-dir", str(run), "--resume", *more]) == 0
    cap = capsys.readouterr()
    warned = [line for line in cap.err.splitlines() if "warning" in line]
    assert warned and all(line.startswith("dropless: warning: ") for line in warned), cap.err
    assert any(f"skipping checkpoint {str(damaged)!r}" in line for line in warned)
    assert not SOURCE_LINE.search(cap.err) and "UserWarning" not in cap.err, cap.err
    assert (
        f"dropless train: resumed from step 4 of 10 ({run / 'checkpoints' / 'step_00000004'})"
        in cap.out
    )


def test_all_warmup_warns(tmp_path, capsys):
    args = tiny_args(
        "train.steps=2", "optim.warmup_steps=4", "log.plots=false", "log.tensorboard=false"
    )
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 0
    err = capsys.readouterr().err
    assert (
        "dropless: warning: train.steps=2 <= optim.warmup_steps=4: the whole run is warmup (the "
        "learning rate reaches 50% of optim.lr" in err
    )
    assert "--set optim.warmup_steps=1" in err and not SOURCE_LINE.search(err)


def test_header_counts_total_and_trainable_parameters(tmp_path, capsys):
    pytest.importorskip("peft")
    import transformers as tf

    cfg = tiny_moe_config(
        vocab_size=264, num_experts=4, norm_topk_prob=False, pad_token_id=None, bos_token_id=None
    )
    base = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    base.save_pretrained(tmp_path / "src")
    n_base = sum(p.numel() for p in base.parameters())
    args = tiny_args(
        f"model.path={tmp_path / 'src'}", "finetune.method=lora", "finetune.lora_rank=4",
        "train.steps=1", "train.seq_len=16", "train.batch_size=2", "optim.warmup_steps=0",
        "log.every=1", "checkpoint.every=1", "log.plots=false", "log.tensorboard=false",
    )  # fmt: skip
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 0
    out = capsys.readouterr().out
    m = re.search(r"Qwen3MoeForCausalLM (\d+\.\d\d)M params \((\d+\.\d\d)M trainable\)", out)
    assert m, out
    total, trainable = float(m[1]), float(m[2])
    assert 0 < trainable < total and abs(total - trainable - n_base / 1e6) <= 0.011


def test_a_missing_extra_is_one_line_and_exit_2(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    monkeypatch.setitem(sys.modules, "peft", None)  # `import peft` fails as if not installed
    args = tiny_args(f"model.path={tmp_path}", "finetune.method=lora")
    (tmp_path / "config.json").write_text("{}")
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "dropless train: error: finetune.method='lora' needs peft: pip install 'dropless[lora]'\n"
    )
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ModuleNotFoundError):  # --debug keeps the traceback
        main(["--debug", "train", "--run-dir", str(tmp_path / "r2"), *args])
    from dropless.cli.messages import is_missing_extra, missing_module_line

    assert not is_missing_extra(ModuleNotFoundError("x", name="dropless.train.gone"))
    bare = ModuleNotFoundError("No module named 'rich'", name="rich")
    assert missing_module_line("train", bare).startswith(
        "dropless train: error: No module named 'rich'; install rich (pip install 'dropless[train]'"
    )


class _SignalAfter:
    """A SIGTERM to this process during step `step` (as a scheduler sends it)."""

    def __init__(self, step: int):
        self.step = step

    def after_backward(self, step, model):
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def after_step(self, step):
        pass

    def on_checkpoint(self, phase, step):
        pass


def test_an_interrupted_run_writes_plots_and_a_summary(tmp_path):
    from dropless.train.config.recipes import tiny
    from dropless.train.run.errors import Interrupted
    from dropless.train.trainer import train

    run = tmp_path / "run"
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted, match="stopped by SIGTERM after step 3"):
        train(tiny("log.tensorboard=false"), run_dir=str(run), hooks=_SignalAfter(3))
    assert signal.getsignal(signal.SIGTERM) is before
    summary = json.loads((run / "summary.json").read_text())
    assert summary["interrupted"] is True and summary["stopped_by"] == "SIGTERM"
    assert summary["steps"] == 3 and summary["checkpoint"].endswith("step_00000003")
    assert (run / "loss.png").stat().st_size > 0 and (run / "expert_load.png").stat().st_size > 0
    assert summary["plot_loss"] == str(run / "loss.png")
