"""Checkpoint saves that overlap training (`checkpoint.async_save`): the blocking part
copies the state into CPU memory, a background thread writes it and commits it as a
synchronous save does; docs/train.md (*Checkpoints and resume*) says when a save waits
and how a failure surfaces.

Why not `dcp.async_save` itself: its executor thread is not a daemon, so an interpreter
leaving on an error or a second Ctrl-C would wait for it (and, with another rank gone, for
the write's collectives until the group times out); and the commit must follow the write
in the same thread. Under a process group the background thread's collectives (DCP's
planning, the commit's barriers) run on a gloo group of their own, so they never interleave
with the training thread's collectives on the default group (NCCL on GPUs).
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from . import store as ckpt
from .dcp_io import hashing_writer

THREAD_NAME = "dropless-checkpoint"
_SINGLE_PROCESS = ".*assuming the intent is to save in a single process"


@dataclass(eq=False)  # stateful: compared and hashed by identity
class CheckpointSaver:
    """Saves checkpoints in the background (`background=False`: every save synchronous;
    `timeout_s`: of the background collectives). Use it as a context manager around the
    training loop so that leaving the loop waits for the save in flight."""

    background: bool = True
    timeout_s: float = 1800.0
    _group: Any = field(default=None, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _job: ckpt.SaveJob | None = field(default=None, init=False, repr=False)
    _error: BaseException | None = field(default=None, init=False, repr=False)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def save(self, req: ckpt.SaveRequest, wait: bool = False) -> Path:
        """Checkpoint `req.step` (all processes call this). Waits for the save in flight
        first; returns once the state is staged (its final path), or once it is complete
        when `wait` (the run's last save) or the saver is synchronous."""
        self.wait()
        if wait or not self.background:
            return ckpt.save_checkpoint(req)
        job = ckpt.begin_save(req)
        writer, fs = hashing_writer(job.tmp)
        staged = writer.stage(job.state)  # copies every tensor to fresh CPU memory
        job.state = None  # training may change the live tensors from here on
        group = self._process_group()
        if group is None:
            # DCP warns on every save without a process group that it assumes one process; the
            # synchronous save's catch_warnings is not thread-safe (it swaps the global filter
            # list), so this one filter goes first (again: a filter that is there only moves)
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        self._job, self._error = job, None
        self._thread = threading.Thread(
            target=self._write, args=(job, [staged], writer, fs, group), name=THREAD_NAME,
            daemon=True,
        )  # fmt: skip
        self._thread.start()
        return job.final

    def _process_group(self):
        """The gloo group of the background collectives (made once, by every process at the
        same save); None without a process group."""
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return self._group

    def _write(self, job: ckpt.SaveJob, box: list, writer, fs, group) -> None:
        from torch.distributed.checkpoint import save

        staged = box.pop()  # the thread's arguments keep no reference: freed once written
        try:
            try:
                save(staged, storage_writer=writer, process_group=group, no_dist=group is None)
            except BaseException:  # DCP's CheckpointException is a BaseException
                ckpt.raise_os_error(fs)
                raise
            del staged
            ckpt.commit_save(job, ckpt.shard_digests(fs, job.tmp), group)
        except BaseException as e:  # raised in the training thread by wait()
            self._error = e

    def wait(self) -> Path | None:
        """Block until the save in flight is complete (its path; None if there was none);
        its failure is raised here."""
        thread, job = self._thread, self._job
        if thread is None:
            return None
        thread.join()
        self._thread = self._job = None
        err, self._error = self._error, None
        if err is not None:
            raise err
        return job.final

    def raise_if_failed(self) -> None:
        """Raise the failure of a background save that has ended (never blocks)."""
        if self._thread is not None and not self._thread.is_alive():
            self.wait()

    def __enter__(self) -> CheckpointSaver:
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is None:
            self.wait()
        elif not issubclass(kind, KeyboardInterrupt):  # a second Ctrl-C stops at once
            step = self._job.step if self._job is not None else None
            try:
                self.wait()
            except BaseException as e:  # the loop's own error is the one raised
                warnings.warn(f"the checkpoint of step {step} was not written: {e}", stacklevel=2)
