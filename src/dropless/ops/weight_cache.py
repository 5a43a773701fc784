"""Weights converted once per optimizer step: `cached_cast(param, dtype, fn=None)`.

Under autocast an activation checkpoint's recompute and every micro-batch would cast the
fp32 weights again. The cache keeps one detached derived tensor per (weight, dtype,
conversion) while the weight's `_version`, its storage address and the count of optimizer
steps are unchanged (FSDP2 re-gathers into the same tensor and restores its version, so
the version alone cannot see a new step). A call that needs the weight's gradient gets
the cast attached by a small autograd node, so a cached cast never keeps a deleted weight
alive. Only leaf tensors are cached; after a write through `.data` call `clear()`.
`fn` (the FP8 weight and its scale) is part of the key: pass the same function object.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_CACHE: WeakIdKeyDictionary = WeakIdKeyDictionary()
_GENERATION = [0]
_HOOK = []


def generation() -> int:
    """How many optimizer steps (of any optimizer) this process has seen."""
    return _GENERATION[0]


def clear() -> None:
    """Forget every cached conversion."""
    _CACHE.clear()


def _after_step(optimizer, args, kwargs) -> None:
    _GENERATION[0] += 1
    _CACHE.clear()


def _cacheable(t: torch.Tensor) -> bool:
    """A plain leaf tensor with real storage (no fake, meta or wrapper tensor), outside
    torch.compile (a compiled graph casts inside itself)."""
    if t.grad_fn is not None or type(t) not in (torch.Tensor, torch.nn.Parameter):
        return False
    if t.device.type == "meta" or torch.compiler.is_compiling():
        return False
    if t.is_inference():  # made under inference_mode: it has no version counter
        return False
    try:
        t.data_ptr()
    except RuntimeError:  # a parameter wrapping a fake tensor (the planner's trace)
        return False
    return True


def _state(t: torch.Tensor) -> tuple:
    """What must be unchanged for a cached conversion of t to be served."""
    return (t._version, _GENERATION[0], t.data_ptr())


class _Attach(torch.autograd.Function):
    """The cached cast as the output of `param`: its gradient goes back to `param` in
    param's dtype. The cache keeps only the detached cast (a graph from the cached tensor
    to the parameter would keep a deleted parameter alive), and each call gets a node."""

    @staticmethod
    def forward(ctx, param, cast):
        ctx.dtype = param.dtype
        return cast.view_as(cast)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.dtype), None


def cached_cast(
    param: torch.Tensor, dtype: torch.dtype, fn: Callable[[torch.Tensor], object] | None = None
):
    """fn(param) (default: `param.to(dtype)`, differentiable), made once while `param` is
    unchanged and no optimizer step ran. Without fn, a tensor already in `dtype` is
    returned as it is. fn's result is stored and returned as it is: make it from
    `param.detach()` (a graph back to `param` would keep the parameter alive until the
    next optimizer step)."""
    if fn is None and param.dtype == dtype:
        return param
    if not _cacheable(param):
        return fn(param) if fn is not None else param.to(dtype)
    if not _HOOK:  # on first use: `import dropless` does not load torch.optim
        from torch.optim.optimizer import register_optimizer_step_post_hook

        _HOOK.append(register_optimizer_step_post_hook(_after_step))
    inference = torch.is_inference_mode_enabled()
    key = (dtype, fn)
    entries = _CACHE.get(param)
    hit = entries.get(key) if entries is not None else None
    if hit is not None and hit[0] == _state(param) and (inference or not hit[1]):
        value = hit[2]
    else:
        value = fn(param) if fn is not None else param.detach().to(dtype)
        if entries is None:
            entries = _CACHE[param] = {}
        entries[key] = (_state(param), inference, value)
    if fn is None and param.requires_grad and torch.is_grad_enabled():
        return _Attach.apply(param, value)
    return value
