"""Routing replay: the recompute of a checkpointed forward routes exactly as the forward did.

    with routing_replay(router):     # around the code that selects experts
        weights, ids = router(x)

In a checkpointed forward (torch's non-reentrant checkpoint) every `torch.topk` inside the
block records its indices; in the recompute of that region each `torch.topk` returns the
recorded indices, with its values gathered from the tensor it is now given, so weights and
gradients come from the current scores at the experts the forward chose. `remember(key,
compute)` does the same for any value that must not be computed twice (the
expert-parallel counts exchange). Records live with the checkpoint region they belong to
(the `_CheckpointFrame` torch keeps for it), per key in call order, and are freed with
the graph; outside a checkpointed region nothing is recorded. Why, and what is not
covered (reentrant checkpointing): docs/performance.md, "Activation checkpointing with
routing replay".
"""

# T tokens, E experts, K top-k

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

# checkpoint frame -> {key: [records in forward order], ("cursor", gid, key): next index}
_STORE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

_TOPK = (torch.topk, torch.Tensor.topk)


def _frame_class():
    from torch.utils.checkpoint import _CheckpointFrame

    return _CheckpointFrame


def checkpoint_state() -> tuple[Any, Any] | None:
    """(checkpoint frame, None) inside a checkpointed forward, (frame, recompute id) inside
    its recompute, None elsewhere.

    Read from the innermost saved-tensors hooks: torch's checkpoint installs a pack hook
    that holds its frame (forward), or a weak reference to it and the id of the backward
    the recompute serves (recompute). torch offers no public query for this (only a
    `context_fn` the caller of checkpoint would have to pass), so the behaviour is pinned
    by tests/ops/test_torch_internals.py on every torch the project runs on."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling():
        # a compiled region traces checkpointing as one graph and recomputes the same
        # ops on the same inputs: nothing to record (and the hooks are not traceable)
        return None
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None:
        return None
    frame_cls = _frame_class()
    frame, ref_frame, gid = None, None, None
    for cell in getattr(inspect.unwrap(hooks[0]), "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if isinstance(value, frame_cls):
            frame = value
        elif isinstance(value, weakref.ReferenceType) and isinstance(value(), frame_cls):
            ref_frame = value()
        elif gid is None and not isinstance(value, weakref.ReferenceType):
            gid = value  # the graph task id (or exec group) torch recomputes for
    if frame is not None:
        return frame, None
    if ref_frame is not None:
        try:
            hash(gid)
        except TypeError:
            gid = None
        return ref_frame, (torch._C._current_graph_task_id() if gid is None else gid)
    return None


def _entries(frame, key) -> list:
    table = _STORE.get(frame)
    if table is None:
        table = _STORE[frame] = {}
    return table.setdefault(key, [])


def _next_recorded(frame, gid, key):
    table = _STORE.get(frame, {})
    entries = table.get(key, [])
    cursor = ("cursor", gid, key)
    i = table.get(cursor, 0)
    if i >= len(entries):
        raise RuntimeError(
            f"routing replay: the recompute asked for record {i + 1} of {key!r} but the forward "
            f"recorded {len(entries)}; the checkpointed region ran different code in its recompute"
        )
    table[cursor] = i + 1
    return entries[i]


def remember(key, compute: Callable[[], Any]):
    """`compute()` in a forward; in the recompute of a checkpointed forward, the value the
    forward computed for the same `key` (in call order), without calling `compute`."""
    state = checkpoint_state()
    if state is None:
        return compute()
    frame, gid = state
    if gid is None:
        value = compute()
        _entries(frame, key).append(value)
        return value
    return _next_recorded(frame, gid, key)


class _TopKMode(TorchFunctionMode):
    """Records (forward) or replays (recompute) the indices of every top-k in its scope."""

    def __init__(self, frame, gid, key):
        super().__init__()
        self.frame, self.gid, self.key = frame, gid, key

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _TOPK:
            return func(*args, **kwargs)
        if self.gid is None:
            out = func(*args, **kwargs)
            _entries(self.frame, self.key).append(out.indices.detach())
            return out
        return _replayed_topk(self.frame, self.gid, self.key, *args, **kwargs)


def _replayed_topk(frame, gid, key, x, k, dim=-1, largest=True, sorted=True):
    ids = _next_recorded(frame, gid, key)
    want = list(x.shape)
    want[dim] = k
    if list(ids.shape) != want:
        raise RuntimeError(
            f"routing replay: top-k of {key!r} recorded indices of shape {tuple(ids.shape)}, "
            f"the recompute asks for {tuple(want)}; the recompute saw other inputs"
        )
    return torch.return_types.topk((_Pick.apply(x, ids, dim), ids))


class _Pick(torch.autograd.Function):
    """values = x.gather(dim, ids) with top-k's backward, saving what top-k saves (the
    indices only), so the recompute saves the same tensors as the forward did."""

    @staticmethod
    def forward(ctx, x, ids, dim):
        ctx.save_for_backward(ids)
        ctx.dim, ctx.shape = dim, x.shape
        return x.gather(dim, ids)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        return g.new_zeros(ctx.shape).scatter(ctx.dim, ids, g), None, None


def routing_replay(owner) -> contextlib.AbstractContextManager:
    """The context that records the top-k choices made inside it (in a checkpointed forward)
    or replays them (in its recompute); a no-op context elsewhere. `owner`: the module that
    routes (one record list per owner and region). Entered by hand where a `with` cannot
    hold the region (a forward pre-hook enters it, the forward hook exits it)."""
    state = checkpoint_state()
    if state is None:
        return contextlib.nullcontext()
    return _TopKMode(state[0], state[1], (id(owner), "topk"))
