"""Count the host syncs a piece of code would make on CUDA, on CPU.

On a GPU, reading a device value on the host waits for the device. On CPU nothing
waits, so these calls are instrumented instead: `Tensor.item`, `.tolist`, `.cpu`,
`bool(t)` / `int(t)` / `float(t)` / `operator.index(t)`, `torch.tensor(data,
device=...)` (a host-to-device copy from pageable memory, synchronous on CUDA), and
`t[i] = <python number>` (the same copy of a host scalar).
Calls made by the instrumentation itself and by Python-level torch internals
(e.g. `Tensor.__repr__`) are not counted unless they come from dropless.
"""

from __future__ import annotations

import contextlib
import sys
import traceback

import torch

_METHODS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")


def _from_dropless() -> str | None:
    """The innermost dropless frame of the current stack (None if dropless is not on it)."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        f = frame.filename.replace("\\", "/")
        if "/dropless/" in f and "/tests/" not in f:
            return f"{f.rsplit('/dropless/', 1)[1]}:{frame.lineno} {frame.line}"
    return None


@contextlib.contextmanager
def count_syncs(monkeypatch=None):
    """Yields a list that collects one 'method at file:line code' entry per sync made
    by dropless code inside the block."""
    found: list[str] = []
    saved = {m: getattr(torch.Tensor, m) for m in _METHODS}
    real_tensor = torch.tensor

    def wrap(name, fn):
        def inner(self, *a, **k):
            where = _from_dropless()
            if where is not None:
                found.append(f"Tensor.{name} at {where}")
            return fn(self, *a, **k)

        return inner

    real_setitem = torch.Tensor.__setitem__

    def setitem(self, index, value):
        # `t[i] = 3` copies a host scalar to the device: a sync on CUDA (`fill_` is not)
        if isinstance(value, (int, float, bool)):
            where = _from_dropless()
            if where is not None:
                found.append(f"Tensor.__setitem__ (a host scalar) at {where}")
        return real_setitem(self, index, value)

    def tensor(data, *a, **k):
        if k.get("device") is not None and not isinstance(data, torch.Tensor):
            where = _from_dropless()
            if where is not None:
                found.append(f"torch.tensor(..., device=) at {where}")
        return real_tensor(data, *a, **k)

    try:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, wrap(m, fn))
        torch.tensor = tensor
        torch.Tensor.__setitem__ = setitem
        yield found
    finally:
        for m, fn in saved.items():
            setattr(torch.Tensor, m, fn)
        torch.tensor = real_tensor
        torch.Tensor.__setitem__ = real_setitem


if __name__ == "__main__":  # pragma: no cover - manual use
    sys.exit("import count_syncs from this module")
