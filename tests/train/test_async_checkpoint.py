"""Checkpoint saves in the background (`checkpoint.async_save`, the default): training goes
on while the shards are written, the checkpoint then equals the state it was taken from,
a failure of the write stops the run after the next step with the synchronous save's
error, an error or SIGTERM leaving the loop waits for the save, and a process killed in
the middle of a write leaves the previous checkpoint loadable for `--resume`. The world-2
case is `ckpt_async_w2` in tests/parallel (and every torchrun test that saves)."""

import errno
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from dropless.cli.main import main
from dropless.train.checkpoint import dcp_io
from dropless.train.checkpoint import store as ckpt
from dropless.train.checkpoint.async_save import THREAD_NAME
from dropless.train.config.recipes import tiny
from dropless.train.run.errors import Interrupted
from dropless.train.run.hooks import TrainHooks
from dropless.train.trainer import train
from harness import metrics_by_step, sub_env, tiny_args

QUIET = ("log.plots=false", "log.tensorboard=false", "log.progress=none")
CHILD = Path(__file__).with_name("slow_save_child.py")


def _same_losses(run: Path, ref: Path, steps) -> None:
    got, want = metrics_by_step(run), metrics_by_step(ref)
    for s in steps:  # one thread, the same code: bit for bit
        assert got[s]["loss"] == want[s]["loss"], s
        assert got[s]["eval_loss"] == want[s]["eval_loss"], s


class _Stall:
    """Stops the background writer of checkpoint `step` once, after its first shard bytes
    reached the file, until `release` is set (60 s at most: a failing test goes on)."""

    def __init__(self, monkeypatch, step: int):
        self.step, self.saving = step, None
        self.blocked, self.release = threading.Event(), threading.Event()
        write = dcp_io._HashingStream.write

        def stalled(stream, b):
            n = write(stream, b)
            mine = threading.current_thread().name == THREAD_NAME and self.saving == self.step
            if mine and not self.blocked.is_set():
                stream.flush()
                self.blocked.set()
                self.release.wait(60)
            return n

        monkeypatch.setattr(dcp_io._HashingStream, "write", stalled)


class _Hooks(TrainHooks):
    def __init__(self, stall: _Stall, at_step=None):
        self.stall, self.at_step, self.model, self.seen = stall, at_step, None, {}

    def after_backward(self, step, model):
        self.model = model

    def on_checkpoint(self, phase, step):
        if phase == "before_shards":
            self.stall.saving = step

    def after_step(self, step):
        if self.at_step is not None:
            self.at_step(self, step)


def test_a_save_overlaps_the_next_steps_and_loads_equal(finished_run, tmp_path, monkeypatch):
    run, stall, snap = tmp_path / "run", _Stall(monkeypatch, 4), {}

    def at_step(h, step):
        if step == 4:  # the state the checkpoint of step 4 must hold (saved after this hook)
            snap.update({k: v.detach().clone() for k, v in h.model.state_dict().items()})
        if step in (5, 6):  # trained while the write of step 4 is stalled
            h.seen[step] = (stall.blocked.wait(30), [s for s, _ in ckpt.list_checkpoints(run)])
            partial = run / "checkpoints" / ".tmp-step_00000004"
            assert (partial / "__0_0.distcp").stat().st_size > 0  # its shard, cut short
            assert ckpt.verify_checkpoint(ckpt.step_dir(run, 2)) is None
        if step == 6:  # before step 6's save, which waits for step 4's
            stall.release.set()

    hooks = _Hooks(stall, at_step)
    cfg = tiny(*QUIET, "checkpoint.every=2", "checkpoint.keep=3")
    assert train(cfg, run_dir=str(run), hooks=hooks)["steps"] == 8
    # steps 5 and 6 ran with the write blocked; meanwhile only step 2 was complete
    assert hooks.seen == {5: (True, [2]), 6: (True, [2])}
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [4, 6, 8]
    assert all(ckpt.verify_checkpoint(p) is None for _, p in ckpt.list_checkpoints(run))
    _same_losses(run, finished_run, range(2, 9, 2))  # the same run as finished_run's (every=4)
    model = hooks.model  # at step 8 now
    assert not all(torch.equal(model.state_dict()[k], v) for k, v in snap.items())
    state = ckpt.load_checkpoint(ckpt.step_dir(run, 4), model, restore_rng=False)
    assert state["step"] == 4
    for k, v in snap.items():
        assert torch.equal(model.state_dict()[k], v), k


def _no_save_thread(timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while any(t.name == THREAD_NAME for t in threading.enumerate()):
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_failed_background_write_stops_the_run_after_the_next_step(tmp_path, monkeypatch):
    """The digests file of step 4 hits a full disk in the background: the run stops after
    step 5 with the OSError a synchronous save raises; step 2 stays the newest checkpoint."""
    run, steps = tmp_path / "run", []
    write_synced = ckpt.write_synced

    def full(path, data):
        if threading.current_thread().name == THREAD_NAME and ".tmp-step_00000004" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_synced(path, data)

    def at_step(h, step):
        steps.append(step)
        if step == 5:  # the failed save has ended: the error is raised after this step
            assert _no_save_thread()

    monkeypatch.setattr(ckpt, "write_synced", full)
    hooks = _Hooks(_Stall(monkeypatch, -1), at_step)
    with pytest.raises(OSError, match="No space left on device") as e:
        train(tiny(*QUIET, "checkpoint.every=2"), run_dir=str(run), hooks=hooks)
    assert e.value.errno == errno.ENOSPC
    assert steps == [1, 2, 3, 4, 5]
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    assert ckpt.verify_checkpoint(ckpt.step_dir(run, 2)) is None


def test_an_error_leaving_the_loop_waits_for_the_save(tmp_path, monkeypatch):
    """An error in step 5 while step 4's write is stalled: the run ends only once that
    checkpoint is complete (released 0.3 s later), then the error goes on."""
    run, stall = tmp_path / "run", _Stall(monkeypatch, 4)

    def at_step(h, step):
        if step == 5:
            assert stall.blocked.wait(30)
            threading.Timer(0.3, stall.release.set).start()
            raise RuntimeError("a failure in step 5")

    with pytest.raises(RuntimeError, match="a failure in step 5"):
        train(tiny(*QUIET, "checkpoint.every=2"), run_dir=str(run), hooks=_Hooks(stall, at_step))
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4]
    assert ckpt.verify_checkpoint(ckpt.step_dir(run, 4)) is None
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())


def test_sigterm_finishes_the_save_in_flight_then_writes_its_own(tmp_path, monkeypatch):
    """SIGTERM in step 5 while step 4's write is stalled (released 0.3 s later): the run
    stops after step 5 with both checkpoints complete."""
    run, stall = tmp_path / "run", _Stall(monkeypatch, 4)

    class Term(_Hooks):
        def after_backward(self, step, model):
            if step == 5:
                assert stall.blocked.wait(30)
                threading.Timer(0.3, stall.release.set).start()
                os.kill(os.getpid(), signal.SIGTERM)

    cfg = tiny(*QUIET, "checkpoint.every=2", "checkpoint.keep=3")
    with pytest.raises(Interrupted, match="stopped by SIGTERM after step 5"):
        train(cfg, run_dir=str(run), hooks=Term(stall))
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2, 4, 5]
    assert all(ckpt.verify_checkpoint(p) is None for _, p in ckpt.list_checkpoints(run))
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())


def test_sigkill_during_a_write_keeps_the_previous_checkpoint(finished_run, tmp_path):
    """A real `dropless train` whose write of checkpoint 4 stalls half-way (steps 5 and 6
    train meanwhile) is SIGKILLed: checkpoint 2 is the newest and `--resume` from it
    reproduces the uninterrupted run."""
    run, marker, err = tmp_path / "run", tmp_path / "stalled", tmp_path / "stderr"
    argv = ["train", "--run-dir", str(run), *tiny_args(*QUIET, "checkpoint.every=2", "log.every=1")]
    with err.open("w") as f:  # fault: SIGKILLed while its background save is stalled
        proc = subprocess.Popen(
            [sys.executable, str(CHILD), "4", str(marker), *argv],
            env=sub_env(), stdout=subprocess.DEVNULL, stderr=f,
        )  # fmt: skip
    try:
        end = time.monotonic() + 240
        while not (marker.exists() and 6 in _steps_logged(run)):
            assert proc.poll() is None, err.read_text()[-3000:]
            assert time.monotonic() < end, "step 6 never came while checkpoint 4 was written"
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -9
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [2]
    assert ckpt.verify_checkpoint(ckpt.step_dir(run, 2)) is None
    assert (run / "checkpoints" / ".tmp-step_00000004" / "__0_0.distcp").stat().st_size > 0
    assert main(["train", "--run-dir", str(run), "--resume"]) == 0
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [6, 8]
    assert not (run / "checkpoints" / ".tmp-step_00000004").exists()
    _same_losses(run, finished_run, range(4, 9, 2))


def _steps_logged(run: Path) -> set[int]:
    with warnings.catch_warnings():  # a line the running child is still writing
        warnings.simplefilter("ignore")
        return set(metrics_by_step(run))
