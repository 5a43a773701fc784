"""Shared pieces of the fault tests: the tiny run's arguments, subprocess environment,
a snapshot of a directory's files, and hooks for in-process faults. A run's records by
step: `records` (harness.metrics_by_step)."""

import functools
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import torch

from dropless.train import trainer
from dropless.train.run.hooks import TrainHooks
from harness import metrics_by_step, sub_env, tiny_args, torchrun_argv

records, args = metrics_by_step, tiny_args
CHILD = Path(__file__).with_name("train_child.py")


def child(spec: dict, argv: list[str], torchrun: int = 0, before: tuple = ()) -> subprocess.Popen:
    """Start train_child.py on one job (under torchrun with `torchrun` processes when > 0),
    after the (spec, argv) jobs `before`, in the same processes."""
    launch = torchrun_argv(torchrun) if torchrun else [sys.executable]
    jobs = [{"spec": s, "argv": a} for s, a in (*before, (spec, argv))]
    # fault: the test kills or signals it mid-run (not the harness's run-to-exit children)
    return subprocess.Popen(
        [*launch, str(CHILD), json.dumps(jobs)],
        env=sub_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def forked_children(jobs: list[tuple[dict, list[str]]], tmp: Path) -> list[tuple[int, str]]:
    """Run each (spec, argv) in its own process, forked after one set of imports;
    returns (exit status, stderr) per job (status < 0: killed by that signal)."""
    items = [
        {"spec": spec, "argv": argv, "stderr": str(tmp / f"job{i}.err")}
        for i, (spec, argv) in enumerate(jobs)
    ]
    # fault: each job forks and injects its fault (kill, signal) in the forked child
    proc = subprocess.run(
        [sys.executable, str(CHILD), json.dumps(items)],
        env=sub_env(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    codes = json.loads(proc.stdout.strip().splitlines()[-1])
    return [(c, Path(j["stderr"]).read_text()) for c, j in zip(codes, items)]


def snapshot(root: Path) -> dict:
    """Every file under `root` -> SHA-256 of its bytes."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


class NaNAt(TrainHooks):
    """Makes the gradients of step `step` NaN (all of them, on every rank)."""

    def __init__(self, *steps: int):
        self.steps = set(steps)

    def after_backward(self, step, model):
        if step in self.steps:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.fill_(float("nan"))


def with_hooks(monkeypatch, hooks: TrainHooks) -> None:
    """The CLI's next in-process run uses `hooks`."""
    monkeypatch.setattr(trainer, "train", functools.partial(trainer.train, hooks=hooks))


def weights_finite(ck: Path) -> bool:
    from dropless.train.generate import load_run

    _, _, model, _ = load_run(ck)
    return all(torch.isfinite(p).all() for p in model.parameters())
