"""The run lock is an flock held for the run's life: of processes that start together
exactly one holds it, a holder in another PID namespace keeps others out, what the lock
file says does not matter, and the kernel frees it when the holder dies."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dropless.cli.main import main
from dropless.train.run.rundir import LOCK, RunLock

from .faults_util import args, forked_children, snapshot

HOLDER = Path(__file__).with_name("lock_holder.py")


def _holder(run_dir: Path, *extra: str, launch=()) -> subprocess.Popen:
    # fault: a process that holds the run's lock while the test starts runs beside it
    return subprocess.Popen(
        [*launch, sys.executable, str(HOLDER), str(run_dir), *extra],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def _finish(procs) -> None:
    for p in procs:
        p.stdin.close()
        p.wait(timeout=10)


def test_three_processes_at_once_one_holder_each_time(tmp_path):
    for round_ in range(20):
        run_dir = tmp_path / f"r{round_}"
        run_dir.mkdir()
        procs = [_holder(run_dir, "wait") for _ in range(3)]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        said = [p.stdout.readline().split()[0] for p in procs]
        assert sorted(said) == ["lost", "lost", "won"], (round_, said)
        _finish(procs)


def test_a_holder_whose_details_are_unreadable_still_holds(tmp_path):
    holder = _holder(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "won"
        (tmp_path / LOCK).write_text("")  # as if cut short while writing its details
        with pytest.raises(ValueError, match="is in use by another process"):
            RunLock(tmp_path).acquire()
    finally:
        _finish([holder])
    lock = RunLock(tmp_path)
    lock.acquire()  # released with the holder: taken at once
    assert lock.held
    lock.release()


def test_holder_in_another_pid_namespace_keeps_the_lock(tmp_path):
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a PID namespace")
    # its pid there (sh is 1, each /bin/true one more) is one no process has out here
    pid = next(p for p in range(20, 10_000) if not os.path.exists(f"/proc/{p}"))
    script = f"i=0; while [ $i -lt {pid - 2} ]; do /bin/true; i=$((i+1)); done; {sys.executable} {HOLDER} {tmp_path}"
    # fault: the lock holder in another PID namespace
    holder = subprocess.Popen(
        ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "won"
        assert json.loads((tmp_path / LOCK).read_text())["pid"] == pid
        with pytest.raises(ValueError, match=f"is in use by process {pid} on "):
            RunLock(tmp_path).acquire()
    finally:
        _finish([holder])


def test_second_process_is_refused_and_dead_locks_are_taken_over(run_copy, capsys):
    holder = _holder(run_copy)
    try:
        assert holder.stdout.readline().strip() == "won"
        before = snapshot(run_copy)
        more = ["--resume", "--set", "train.steps=9"]
        assert main(["train", "--run-dir", str(run_copy), *more]) == 2
        err = capsys.readouterr().err
        assert f"is in use by process {holder.pid} on" in err and "pass another --run-dir" in err
        assert snapshot(run_copy) == before
    finally:
        holder.send_signal(signal.SIGKILL)  # dies holding it: the kernel releases the flock
        holder.wait()
    assert main(["train", "--run-dir", str(run_copy), *more]) == 0
    assert not (run_copy / LOCK).exists()


def test_three_dropless_train_starts_one_wins(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["train", "--run-dir", str(run_dir), *args("log.plots=false", "log.tensorboard=false")]
    # the winner is killed after its first step, once the others have failed at the lock
    jobs = [({"kill_after_step": 1, "refused": "others"}, argv) for _ in range(3)]
    results = forked_children(jobs, tmp_path)
    codes = sorted(c for c, _ in results)
    assert codes == [-signal.SIGKILL, 2, 2], results
    for code, err in results:
        if code == 2:
            assert "is in use by process " in err and err.count("\n") == 1, err


def test_a_file_system_without_flock_is_named(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_locks(fd, how):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(
        ValueError, match=r"cannot be locked \(No locks available\): its file system"
    ):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("existing", [False, True], ids=["new-folder", "empty-folder"])
def test_a_run_finished_while_this_one_started_is_kept(
    finished_run, tmp_path, monkeypatch, capsys, existing
):
    """The race of a start checked before it locks, made deterministic: another run
    finishes in the folder just before this process takes the lock (as when it trained
    while this one checked, and released the lock as this one reached it). The checks run
    under the lock, so this start sees the finished run and is refused; its files are
    unchanged."""
    run_dir = tmp_path / "run"
    if existing:
        run_dir.mkdir()
    real, raced = RunLock.acquire, []

    def another_run_finishes_first(self):
        if not raced:
            raced.append(self.path)
            shutil.copytree(finished_run, run_dir, dirs_exist_ok=True)
            before.update(snapshot(run_dir))
        real(self)

    before: dict = {}
    monkeypatch.setattr(RunLock, "acquire", another_run_finishes_first)
    argv = ["train", "--run-dir", str(run_dir), *args("log.plots=false", "log.tensorboard=false")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "already holds checkpoints: pass --resume" in err and err.count("\n") == 1, err
    assert raced and snapshot(run_dir) == before
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no folder of the start left


@pytest.mark.skipif(not os.environ.get("DROPLESS_SLOW_TESTS"), reason="set DROPLESS_SLOW_TESTS=1")
def test_three_starts_at_once_one_winner_and_its_files_kept(tmp_path):
    """20 trials of three `dropless train` (tiny, 2 steps) started together on one new
    --run-dir: exactly one exits 0 each time, the others are refused (the lock in use, or
    the finished run's checkpoints), and the finished run's files, hashed by the winner as
    it returned, are unchanged once every start has exited."""
    won = []
    for trial in range(20):
        run_dir, t = tmp_path / f"run{trial}", tmp_path / f"t{trial}"
        t.mkdir()
        argv = ["train", "--run-dir", str(run_dir), *args("train.steps=2", "log.plots=false",
                "log.tensorboard=false")]  # fmt: skip
        jobs = [({"snapshot": [str(run_dir), str(t / f"snap{i}.json")]}, argv) for i in range(3)]
        results = forked_children(jobs, t)
        codes = [c for c, _ in results]
        assert sorted(codes) == [0, 2, 2], (trial, results)
        for code, err in results:
            if code == 2:
                assert "is in use by process " in err or "already holds checkpoints" in err, err
        winner = codes.index(0)
        kept = json.loads((t / f"snap{winner}.json").read_text())
        assert snapshot(run_dir) == kept, trial
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
        won.append(winner)
    print(f"20 trials: one winner each (job {won}), the finished run's files unchanged")
