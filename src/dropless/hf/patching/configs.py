"""Config objects that carry an experts implementation from before `dropless.patch()`.

Transformers resolves a model's experts implementation onto its config, and the next model
built from that config object takes the value as if it had been asked for: after `patch()`,
a model rebuilt from a config that built a stock model would run the stock path (docs/hf.md,
"A config object that already built a model"). Two pieces tell such a leftover from a
request and move the new model off it: while patched, the
`PretrainedConfig._experts_implementation` setter (which every explicit request passes)
stores the value as `Asked`, a `str` that copies keep and pickles drop (Transformers' own
resolution writes the internal attribute directly, a plain `str`); `give_own_config(model)`
puts a model built from a leftover on a copy of its config (and of the sub-configs), so the
models built from the config before keep their own path.
"""

from __future__ import annotations

import copy
import weakref

from torch import nn


class Asked(str):
    """An experts implementation asked for while dropless is patched in (not one a model
    resolved from the default). Copies keep the mark; pickles are a plain `str`."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce_ex__(self, protocol):
        return (str, (str(self),))


_STATE: dict = {"property": None}
# copies give_own_config made: id -> copy, and id -> the config it was copied from
_copies: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_origins: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _asked(value):
    if isinstance(value, str):
        return Asked(value)
    if isinstance(value, dict):  # {"": top, sub_config_key: value}
        return {k: _asked(v) for k, v in value.items()}
    return value


def install_request_marker() -> None:
    """Mark requests made through the config setter as `Asked` (idempotent; the caller
    holds `dropless.hf.patching.patch`'s lock)."""
    from transformers import PretrainedConfig

    if _STATE["property"] is not None:
        return
    prop = PretrainedConfig.__dict__.get("_experts_implementation")
    if not isinstance(prop, property) or prop.fset is None:
        return  # another transformers layout: no leftover is told apart (is_leftover False)

    def mark(config, value):
        prop.fset(config, _asked(value))  # the sub-configs are set through this setter too

    _STATE["property"] = prop
    PretrainedConfig._experts_implementation = property(prop.fget, mark, prop.fdel, prop.__doc__)


def uninstall_request_marker() -> None:
    """Put Transformers' own setter back."""
    prop = _STATE["property"]
    if prop is None:
        return
    from transformers import PretrainedConfig

    PretrainedConfig._experts_implementation = prop
    _STATE["property"] = None


def is_leftover(config, stock_default: str) -> bool:
    """True when `config` holds the stock default that no one asked for while patched: a
    model built from this config resolved it (before `patch()`), or it was set then."""
    if _STATE["property"] is None:  # requests are not marked: none can be told apart
        return False
    value = config._experts_implementation
    return isinstance(value, str) and not isinstance(value, Asked) and value == stock_default


def _copies_in(model: nn.Module) -> dict[int, object]:
    """id(original config) -> the copy give_own_config made of it, for the copies that
    modules of `model` hold (an inner model finished building, and got one, first)."""
    found = {}
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is not None and _copies.get(id(config)) is config:
            origin = _origins.get(id(config))
            if origin is not None:
                found[id(origin)] = config
    return found


def give_own_config(model: nn.Module) -> None:
    """Replace `model.config` (and its sub-configs) by copies in every module of `model`."""
    old = model.config
    found = _copies_in(model)
    new = found.get(id(old))
    if new is None:
        new = copy.deepcopy(old)
        _copies[id(new)], _origins[id(new)] = new, old
    mapping = {id(old): new}
    for key in getattr(old, "sub_configs", {}) or {}:
        sub = getattr(old, key, None)
        if sub is None:
            continue
        if id(sub) in found:  # the inner model's copy: one config object per sub-model
            setattr(new, key, found[id(sub)])
        mapping[id(sub)] = getattr(new, key)
    for module in model.modules():
        config = module.__dict__.get("config")
        if config is not None and id(config) in mapping:
            module.config = mapping[id(config)]
