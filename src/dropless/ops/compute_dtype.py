"""The dtype the expert path computes in: the user's request, not the weights' dtype.

Under `torch.autocast` the expert GEMMs run in the autocast dtype even when the weights
are fp32: `expert_mlp`, `grouped_mlp` and `grouped_gemm` cast the tokens once and the
weights once per optimizer step (`weight_cache.cached_cast`) at their entry, before the
plan picks a backend; callers that move tokens first (the all-to-all) cast them with
`expert_input`. Inside the fused autograd Functions autocast is off (`autocast_off`;
the expert engine turns it off on its device itself): their operands are already in the
compute dtype, and their `out=` buffers must not meet GEMMs that autocast would switch.
With any fp64 operand, or without autocast, nothing is cast (docs/performance.md, "Under
`torch.autocast`").
"""

from __future__ import annotations

import functools
from contextlib import ExitStack

import torch

from .lora import LowRank
from .weight_cache import cached_cast

_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def autocast_dtype(x: torch.Tensor, *weights: torch.Tensor | None) -> torch.dtype | None:
    """The autocast dtype active for x's device, or None (autocast off, or an fp64 operand)."""
    dev = x.device.type
    if dev not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(dev):
        return None
    if any(t is not None and t.dtype == torch.float64 for t in (x, *weights)):
        return None
    return torch.get_autocast_dtype(dev)


def expert_input(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Tokens as the expert path takes them: in the autocast dtype under autocast (cast
    before any all-to-all), else in the weights' dtype (what stock Transformers does)."""
    dt = autocast_dtype(x, weight)
    return x.to(dt if dt is not None else weight.dtype)


def _weight(w: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor | None:
    return None if w is None else cached_cast(w, dt)


def _lowrank(lr: LowRank | None, dt: torch.dtype) -> LowRank | None:
    if lr is None:
        return None
    return LowRank(cached_cast(lr.a_ERI, dt), cached_cast(lr.b_EOR, dt), lr.scale)


def to_compute_dtype(x, gate_up, down, kw: dict, lora=None):
    """(x, gate_up, down, lora) in the autocast dtype, the biases in `kw` too (in place);
    everything as given when autocast is off."""
    dt = autocast_dtype(x, gate_up, down)
    if dt is None:
        return x, gate_up, down, lora
    for name in ("gate_up_bias", "down_bias"):
        if kw.get(name) is not None:
            kw[name] = _weight(kw[name], dt)
    if lora is not None:
        lora = (_lowrank(lora[0], dt), _lowrank(lora[1], dt))
    return x.to(dt), _weight(gate_up, dt), _weight(down, dt), lora


def autocast_off(fn):
    """Run fn with autocast off on every device where it is on (forward and backward of
    the fused Functions: a backward may run inside the caller's autocast region)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.compiler.is_compiling():  # a compiled graph carries its own autocast state
            return fn(*args, **kwargs)
        with ExitStack() as stack:
            for dev in ("cpu", "cuda"):
                if torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, enabled=False))
            return fn(*args, **kwargs)

    return run
