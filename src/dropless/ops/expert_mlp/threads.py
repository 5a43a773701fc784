"""Per-expert work of the CPU loop on worker threads, each running torch ops with one
thread: no OpenMP barrier per op, work stealing off a shared counter, one expert's rows
kept in its core's cache. Results several experts add into the same rows are committed
in item order from a bounded pool of output buffers (a thread takes a buffer before it
claims an item, so the lowest unfinished item always holds one: no deadlock).

Thread-local modes (grad, inference, autocast, a guard's dispatch keys) are carried into
the workers (`_Modes`); where they cannot be (a Python TorchFunctionMode /
TorchDispatchMode, dispatch keys a worker cannot reproduce) the caller runs the items
itself, so 1 and N workers give the same bits.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Callable, Sequence

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

_POOL: list[_Worker] = []
_POOL_LOCK = threading.Lock()


class _Worker(threading.Thread):
    def __init__(self):
        super().__init__(name="dropless-expert-worker", daemon=True)
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.ready = threading.Event()

    def run(self):
        # the first parallel op of a thread reads the process-wide count once; read it
        # now, so that the count of 1 set below is not undone by that lazy read later
        torch.get_num_threads()
        torch.set_num_threads(1)
        self.ready.set()
        while True:
            task, done = self.tasks.get()
            try:
                task()  # never raises: _Run.work keeps its error for the caller
            finally:
                # the caller goes on once every worker is done: by then no worker may
                # hold the run (its tensors), or the last reference would be dropped
                # here, later, and at interpreter exit a thread that frees a tensor is
                # killed mid-C++ (std::terminate: the process aborts)
                del task
                done.release()


def _workers(n: int) -> list[_Worker]:
    with _POOL_LOCK:
        if len(_POOL) < n:
            keep = torch.get_num_threads()
            new = [_Worker() for _ in range(n - len(_POOL))]
            for w in new:
                w.start()
            for w in new:
                w.ready.wait()
            torch.set_num_threads(keep)  # the workers' set_num_threads(1) changed it
            _POOL.extend(new)
        return _POOL[:n]


def _forget_workers():
    _POOL.clear()  # threads do not survive fork: a child starts its own


os.register_at_fork(after_in_child=_forget_workers)


def _dispatch_keys() -> tuple[str, str]:
    """This thread's local dispatch-key state (what guards and autocast include or exclude)."""
    c = torch._C
    return repr(c._dispatch_tls_local_include_set()), repr(c._dispatch_tls_local_exclude_set())


def python_modes_active() -> bool:
    """A TorchDispatchMode / TorchFunctionMode is active (per thread, not carried)."""
    return is_in_torch_dispatch_mode() or torch._C._is_torch_function_mode_enabled()


class _Modes:
    """The caller's thread-local modes, entered again in a worker (`enter`)."""

    def __init__(self):
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        self.autocast = (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))
        self.autocast_cache = torch.is_autocast_cache_enabled()
        c = torch._C
        self.key_sets = (c._dispatch_tls_local_include_set(), c._dispatch_tls_local_exclude_set())
        self.keys = _dispatch_keys()

    def enter(self, stack: contextlib.ExitStack) -> bool:
        """Enter the modes in this thread; False if its dispatch keys still differ."""
        stack.enter_context(torch.inference_mode(self.inference))
        stack.enter_context(torch.set_grad_enabled(self.grad))
        enabled, dtype = self.autocast
        stack.enter_context(
            torch.autocast("cpu", dtype=dtype, enabled=enabled, cache_enabled=self.autocast_cache)
        )
        # the caller's key sets as any guard left them (a custom op excludes Autograd)
        stack.enter_context(torch._C._ForceDispatchKeyGuard(*self.key_sets))
        return _dispatch_keys() == self.keys


class _Run:
    """One call's shared state: the claim counter, the commit turn, the buffer pool."""

    def __init__(self, items, compute, commit, new_out, make_scratch, max_out):
        self.items, self.compute, self.commit = items, compute, commit
        self.new_out, self.make_scratch, self.max_out = new_out, make_scratch, max_out
        self.cond = threading.Condition()
        self.next_claim = self.next_commit = self.n_out = 0
        self.finished: dict[int, object] = {}
        self.free: list = []
        self.committing = False
        self.error: BaseException | None = None
        self.modes = _Modes()  # the caller's thread-local modes, carried into the workers
        self.uncarried = False  # a worker could not reproduce them: the caller runs all

    def _claim(self):
        with self.cond:
            while True:
                if self.error or self.uncarried or self.next_claim >= len(self.items):
                    return None, None
                if self.commit is None:
                    buf = None
                    break
                if self.free:
                    buf = self.free.pop()
                    break
                if self.n_out < self.max_out:
                    self.n_out += 1
                    buf = self.new_out()
                    break
                self.cond.wait()
            self.next_claim += 1
            return self.next_claim - 1, buf

    def _finish(self, i: int, buf) -> None:
        with self.cond:
            self.finished[i] = buf
            if self.committing:
                return  # the committing thread takes it when its turn comes
            self.committing = True
        while True:
            with self.cond:
                buf = self.finished.pop(self.next_commit, None)
                if buf is None or self.error is not None:
                    self.committing = False
                    return
                j = self.next_commit
            self.commit(self.items[j], buf)
            with self.cond:
                self.next_commit += 1
                self.free.append(buf)
                self.cond.notify_all()

    def work(self) -> None:
        try:
            with contextlib.ExitStack() as stack:
                if not self.modes.enter(stack):
                    with self.cond:
                        self.uncarried = True
                        self.cond.notify_all()  # as for an error: no worker claims more
                    return
                scratch = self.make_scratch()
                while True:
                    i, buf = self._claim()
                    if i is None:
                        break
                    self.compute(self.items[i], scratch, buf)
                    if self.commit is not None:
                        self._finish(i, buf)
        except BaseException as e:  # re-raised in the calling thread
            with self.cond:
                self.error = self.error or e
                self.cond.notify_all()  # a worker waiting for a buffer stops claiming


def run_experts(
    items: Sequence,
    compute: Callable,
    *,
    workers: int,
    make_scratch: Callable = dict,
    commit: Callable | None = None,
    new_out: Callable | None = None,
) -> bool:
    """compute(item, scratch, out_buf) for every item on `workers` threads; then, if
    given, commit(item, out_buf) in item order, one at a time. `scratch` is one object
    per thread (from make_scratch); out_buf comes from new_out() (None without commit) and
    is reused once its item is committed. False, with nothing run, for one worker, fewer
    than two items or modes the workers cannot carry (see above): the caller runs the
    items in its own thread."""
    if workers <= 1 or len(items) < 2 or python_modes_active():
        return False
    n = min(workers, len(items))
    run = _Run(items, compute, commit, new_out, make_scratch, max_out=2 * n + 1)
    done = threading.Semaphore(0)
    for w in _workers(n):
        w.tasks.put((run.work, done))
    for _ in range(n):
        done.acquire()
    if run.error is not None:
        raise run.error
    if run.uncarried:
        # every worker applies the same modes, so none claimed an item
        assert run.next_claim == 0, "expert items ran under different thread-local modes"
        return False
    assert commit is None or run.next_commit == len(items), "uncommitted expert results"
    return True
