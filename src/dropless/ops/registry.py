"""One registry for the implementations of an op: the same register / pick code for every
op (grouped-GEMM backends, row ops, routing kernels, cross-entropy rows, row-gathering
GEMMs, RMSNorm).

An entry is any object with a `name`, a `priority` and a `supports(*operands)`
predicate. `pick(name, *operands)` takes the best entry that runs the operands, or the
named one (ValueError when it cannot: a named entry never falls back to another).

GPU entries register on first use on a CUDA tensor: an op gives its registry a hook
(`on_first_cuda`) that registers its Triton entries; the registry calls it once, the
first time it is asked to pick for a CUDA operand or for a name it does not hold. The
hook imports no triton (the entries load their kernel modules on first call), and on a
machine that never sees a CUDA tensor it never runs. Under `torch.compile` the hook is
not called (Dynamo would trace the registration). The ops a compiled region calls are
custom-op nodes that pick when they run, outside the trace (`custom_op.py` of
`expert_mlp`, `routing`, `rmsnorm`, `linear_cross_entropy`, `grouped_gemm`), so there the
hook runs on the first CUDA call as in eager code.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

_LOG = logging.getLogger("dropless")


_TRITON_OK: list[bool] = []  # the cached answer of triton_importable, once asked


def triton_importable() -> bool:
    """Whether `import triton` works here (checked once, on first call)."""
    if not _TRITON_OK:
        ok = importlib.util.find_spec("triton") is not None
        if ok:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401
            except Exception:  # a broken install is as good as none
                ok = False
        _TRITON_OK.append(ok)
    return _TRITON_OK[0]


def forget_triton() -> None:
    """Forget the cached answer of `triton_importable` (tests that hide triton)."""
    _TRITON_OK.clear()


def cuda_with_triton(t: torch.Tensor | None = None) -> bool:
    """Whether Triton kernels can run on tensor `t` (default: on this machine's GPU).

    True only for CUDA tensors (or, with t=None, when CUDA is available) and an
    importable triton. Always False for CPU tensors, even under TRITON_INTERPRET=1:
    the interpreter is for tests, never picked at run time.
    """
    on_cuda = torch.cuda.is_available() if t is None else t.is_cuda
    return bool(on_cuda) and triton_importable()


def lazy(module: str, fn: str) -> Callable:
    """`module.fn` (a Triton kernel module's), imported with triton on first call: what a
    GPU entry registers, so that registering it imports no triton. Without triton the
    call raises an ImportError naming the extra to install."""

    def call(*args, **kwargs):
        if not triton_importable():
            raise ImportError(
                f"{module}.{fn} needs Triton, which is not installed here; install it with "
                "`pip install 'dropless[triton]'` (GPU machines only)"
            )
        return getattr(importlib.import_module(module), fn)(*args, **kwargs)

    call.__name__ = fn
    return call


def _describe(operands: tuple) -> str:
    tensors = [t for t in operands if isinstance(t, torch.Tensor)]
    if not tensors:
        return "these operands"
    return f"on {tensors[0].dtype} tensors on {tensors[0].device.type}"


class Registry:
    """The named implementations of one op (`op` names it in messages)."""

    def __init__(self, op: str, *entries: Any) -> None:
        """`entries`: registered at once (more with `register`)."""
        self.op = op
        #: name -> entry; tests may add and remove entries here directly
        self.entries: dict[str, Any] = {}
        self._gpu_hook: Callable[[], None] | None = None
        self._gpu_lock = threading.Lock()
        for entry in entries:
            self.register(entry)

    def register(self, entry: Any) -> None:
        """Add (or replace) `entry` under `entry.name`."""
        self.entries[entry.name] = entry

    def on_first_cuda(self, hook: Callable[[], None]) -> None:
        """Call `hook` (it registers the op's GPU entries) before the first pick for a
        CUDA operand or for a name not registered yet."""
        self._gpu_hook = hook

    def ranked(self) -> list[Any]:
        """The entries, best (highest priority) first; ties keep registration order."""
        return sorted(self.entries.values(), key=lambda e: -e.priority)

    def names(self) -> list[str]:
        """The entries' names, best first."""
        return [e.name for e in self.ranked()]

    def load_gpu(self) -> None:
        """Register the GPU entries now (once; what the first CUDA pick does). A pick in
        another thread meanwhile waits: it never sees the hook gone and the entries not
        yet there."""
        with self._gpu_lock:
            if self._gpu_hook is not None:
                self._gpu_hook()
                self._gpu_hook = None

    def _maybe_load_gpu(self, name: str | None, operands: tuple) -> None:
        if self._gpu_hook is None or torch.compiler.is_compiling():
            return
        named_unknown = name not in (None, "auto") and name not in self.entries
        on_cuda = any(isinstance(t, torch.Tensor) and t.is_cuda for t in operands)
        if named_unknown or on_cuda:
            self.load_gpu()

    def pick(
        self,
        name: str | None,
        *operands: Any,
        runs: Callable[[Any], bool] | None = None,
        detail: str = "",
    ) -> Any | None:
        """The entry to use: `name` if given (ValueError when it is not registered or
        cannot run), else the best one that runs (None when none does).

        runs(entry): whether the entry runs this call (default: `entry.supports(*operands)`);
        detail: added to the message of a named entry that cannot run."""
        self._maybe_load_gpu(name, operands)
        if runs is None:

            def runs(entry):
                return entry.supports(*operands)

        if name not in (None, "auto"):
            entry = self.entries.get(name)
            if entry is None:
                raise ValueError(f"{self.op} {name!r} is not registered; known: {self.names()}")
            if not runs(entry):
                raise ValueError(
                    f"{self.op} {name!r} cannot run {_describe(operands)}{detail}; leave the "
                    f"choice to 'auto' or use one of {self.names()}"
                )
            return entry
        for entry in self.ranked():
            if runs(entry):
                return entry
            # no logging inside a compiled region (Dynamo cannot trace the logger)
            if (
                entry.priority > 0
                and not torch.compiler.is_compiling()
                and _LOG.isEnabledFor(logging.DEBUG)
            ):
                _LOG.debug("%s %r skipped %s", self.op, entry.name, _describe(operands))
        return None
