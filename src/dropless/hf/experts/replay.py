"""Routing replay on Transformers MoE models (see `dropless.ops.replay`).

`install_routing_replay(model)` puts a forward pre-hook and a forward hook on the router
module of every MoE block (`gate` / `router`, where each supported family selects its
experts): inside a checkpointed forward the router's top-k choices are recorded, and the
recompute of that region in backward replays them, so it sends every token to the experts
the forward chose. Outside activation checkpointing the hooks do nothing. `patch()` and
`patch_model()` install it; `unpatch_model()` removes it.

Inside a compiled region the hooks return at once (nothing traced, nothing written): the
compiler traces a checkpointed region as one graph whose recompute runs the same ops on
the same saved inputs, so the recompute routes as the forward did without a record
(tests/hf/test_compile_like_stock.py checks a compiled checkpointed step against eager).
"""

from __future__ import annotations

import torch
from torch import nn

from ...ops.replay import routing_replay
from ..layers import moe_layers

_HANDLES = "_dropless_replay_handles"
_OPEN = "_dropless_replay_open"


def _pre_hook(router: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    replay = routing_replay(router)
    replay.__enter__()
    router.__dict__.setdefault(_OPEN, []).append(replay)


def _post_hook(router: nn.Module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    stack = router.__dict__.get(_OPEN)
    if stack:
        stack.pop().__exit__(None, None, None)


def install_routing_replay(model: nn.Module) -> int:
    """Hook every MoE router of `model` for routing replay (idempotent); returns how many
    routers carry the hooks."""
    n = 0
    for layer in moe_layers(model):
        router = layer.router
        if router is None:
            continue
        if _HANDLES not in router.__dict__:
            router.__dict__[_HANDLES] = (
                router.register_forward_pre_hook(_pre_hook),
                router.register_forward_hook(_post_hook, always_call=True),
            )
        n += 1
    return n


def remove_routing_replay(model: nn.Module) -> None:
    """Take the routing-replay hooks off every router of `model`."""
    for layer in moe_layers(model):
        if layer.router is None:
            continue
        for handle in layer.router.__dict__.pop(_HANDLES, ()):
            handle.remove()
        layer.router.__dict__.pop(_OPEN, None)


def has_routing_replay(model: nn.Module) -> bool:
    """True when every MoE router of `model` carries the routing-replay hooks."""
    routers = [layer.router for layer in moe_layers(model) if layer.router is not None]
    return bool(routers) and all(_HANDLES in r.__dict__ for r in routers)
