"""Runs `dropless` with faults injected through `TrainHooks` (never through the library's
environment). argv[1] is a JSON list of jobs {"spec": {...}, "argv": [...], "stderr": path},
or one spec followed by the dropless arguments; a spec has any of

    {"rank": 1,                               # only this rank (default: every rank)
     "checkpoint": ["before_manifest", 9],    # SIGKILL at this phase of this step's save
     "kill_after_step": 3,                    # SIGKILL right after this optimizer step, once
                                              # the checkpoints begun are complete (a save
                                              # runs in the background: checkpoint.async_save)
     "refused": "others",                     # ... and once the other forked jobs' stderr
                                              # holds the run lock's refusal
     "signal_in_step": [9, "SIGINT", 1],      # send the signal (this many times) mid-step
     "snapshot": [run_dir, path],             # once the run returned 0: the SHA-256 of each
                                              # file of run_dir, as JSON, into path
     "error_to": dir}                         # the error `train` raised on this rank, as
                                              # "Type: message", into dir/rank{RANK}.txt

Jobs without a "stderr" run in this process one after the other (under torchrun too, in
one process group). Jobs with one are forked from this process after
the imports, each a real process of its own (so each dies its own death) without paying
the imports again; the exit statuses are printed as a JSON list (negative: killed by that
signal).
"""

import functools
import hashlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from dropless.cli.main import main
from dropless.train import trainer
from dropless.train.run.hooks import TrainHooks


class Faults(TrainHooks):
    def __init__(self, spec: dict):
        self.spec = spec
        self.mine = spec.get("rank") in (None, int(os.environ.get("RANK", "0")))
        self.saves = threading.Condition()
        self.begun, self.done = set(), set()

    def on_checkpoint(self, phase, step):
        if self.mine and self.spec.get("checkpoint") == [phase, step]:
            os.kill(os.getpid(), signal.SIGKILL)
        with self.saves:  # after_rename comes from the save's background thread
            if phase in ("before_shards", "after_rename"):
                (self.begun if phase == "before_shards" else self.done).add(step)
                self.saves.notify_all()

    def after_step(self, step):
        if self.mine and self.spec.get("kill_after_step") == step:
            with self.saves:
                assert self.saves.wait_for(lambda: self.begun <= self.done, timeout=120)
            _wait_for_refusals(self.spec.get("refused", []))
            os.kill(os.getpid(), signal.SIGKILL)

    def after_backward(self, step, model):
        sig = self.spec.get("signal_in_step")
        if self.mine and sig and sig[0] == step:
            for _ in range(sig[2] if len(sig) > 2 else 1):
                os.kill(os.getpid(), getattr(signal, sig[1]))


def _wait_for_refusals(paths: list[str], timeout_s: float = 120.0) -> None:
    """Until the run-lock refusal is in every other job's stderr (or a timeout): the run
    holding the lock dies only once the others have met it (a job reaching the lock after
    the holder died would take the dead lock over)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if all(os.path.exists(p) and "is in use by process" in open(p).read() for p in paths):
            return
        time.sleep(0.05)


def _snapshot(run_dir: str, path: str) -> None:
    root = Path(run_dir)
    files = {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }
    Path(path).write_text(json.dumps(files))


TRAIN = trainer.train


def _recording_errors(train, where: str):
    def run(*args, **kwargs):
        try:
            return train(*args, **kwargs)
        except Exception as e:
            out = Path(where) / f"rank{os.environ.get('RANK', '0')}.txt"
            out.write_text(f"{type(e).__name__}: {e}")
            raise

    return run


def run(job: dict) -> int:
    spec = job.get("spec", {})
    train = functools.partial(TRAIN, hooks=Faults(spec))
    trainer.train = _recording_errors(train, spec["error_to"]) if "error_to" in spec else train
    code = main(job["argv"])
    if code == 0 and "snapshot" in job.get("spec", {}):
        _snapshot(*job["spec"]["snapshot"])
    return code


def run_forked(jobs: list[dict]) -> list[int]:
    pids = []
    for i, job in enumerate(jobs):
        if job["spec"].get("refused") == "others":  # the other jobs' stderr files
            job["spec"]["refused"] = [j["stderr"] for k, j in enumerate(jobs) if k != i]
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(job["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 2)
                sys.stderr = os.fdopen(2, "w", buffering=1)
                code = run(job)
            finally:
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


if __name__ == "__main__":
    torch.set_num_threads(1)
    jobs = json.loads(sys.argv[1])
    if isinstance(jobs, dict):  # one spec, then the dropless arguments
        jobs = [{"spec": jobs, "argv": sys.argv[2:]}]
    if all("stderr" not in job for job in jobs):
        # the process group of a torchrun is kept from one job to the next: a group made
        # again in the same process can meet the previous one's gloo addresses in
        # torchrun's store (the same group name) and fail to connect
        close = trainer.close_env
        trainer.close_env = lambda: None
        for job in jobs[:-1]:
            run(job)
        trainer.close_env = close
        sys.exit(run(jobs[-1]))
    print(json.dumps(run_forked(jobs)), flush=True)
