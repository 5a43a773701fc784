"""`patch()` / `patch_model()` / `unpatch()`: make Transformers v5 MoE models use dropless.

How "dropless" becomes the default (the one place that does it: `_install_default`):
Transformers resolves a model's experts implementation in
`PreTrainedModel.get_correct_experts_implementation(requested)`, called from `post_init`
for every model built (`from_config`, `__init__`) or loaded (`from_pretrained`), and from
`set_experts_implementation`; a `None` request becomes "grouped_mm" there. `patch()`
replaces that method on the `PreTrainedModel` class with a wrapper that turns a `None`
request into "dropless" for models whose experts use the interface and hands everything
else to the original. `unpatch()` puts the original function object back, removes
"dropless" from `ExpertsInterface`, and switches every live model dropless changed back
to the implementation it had (removing any expert bias buffers it added).
"""

from __future__ import annotations

import weakref

from torch import nn

from ._compat import require_transformers
from .experts import dropless_experts_forward
from .layers import moe_layers
from .report import PatchReport, model_report
from .routers import add_expert_bias, remove_expert_bias

IMPLEMENTATION = "dropless"

_state: dict = {"registered": False, "prior": None, "original_get_correct": None}
# model -> experts implementation to restore on unpatch (get_experts_implementation() form)
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# configs whose "dropless" came from our default (not asked for): id -> config. A model's
# submodules share its config, so post_init sees the already resolved value again.
_defaulted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _register() -> None:
    # the public registration point: ALL_EXPERTS_FUNCTIONS[name] = fn, undone with del
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if _state["registered"]:
        return
    had = IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS
    _state["prior"] = (had, ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] if had else None)
    ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = dropless_experts_forward
    _state["registered"] = True


def _unregister() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if not _state["registered"]:
        return
    had, value = _state["prior"]
    if had:
        ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = value
    else:
        del ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION]
    _state["registered"] = False
    _state["prior"] = None


def _check_family(model) -> None:
    family = getattr(model.config, "model_type", None)
    if not type(model)._can_set_experts_implementation():
        raise ValueError(
            f"experts_implementation='dropless' asked for {type(model).__name__} ({family}), "
            "which has no Mixture-of-Experts layers using Transformers' experts interface; "
            "dropless only changes MoE models. Leave experts_implementation unset for it."
        )


def _install_default() -> None:
    """THE place where dropless becomes the default experts implementation (see module doc)."""
    from transformers import PreTrainedModel

    if _state["original_get_correct"] is not None:
        return
    original = PreTrainedModel.__dict__.get("get_correct_experts_implementation")
    if original is None:
        import transformers

        raise ImportError(
            f"transformers {transformers.__version__} has no "
            "PreTrainedModel.get_correct_experts_implementation, where dropless installs its "
            "default; install transformers>=5.17,<6 (pip install 'dropless[hf]')."
        )

    def get_correct_experts_implementation(self, requested_experts):
        if requested_experts is None and type(self)._can_set_experts_implementation():
            requested_experts = IMPLEMENTATION
            _defaulted[id(self.config)] = self.config
        elif (
            requested_experts == IMPLEMENTATION
            and _defaulted.get(id(self.config)) is not self.config
        ):
            _check_family(self)
        chosen = original(self, requested_experts)
        if chosen == IMPLEMENTATION and self not in _models:
            _models[self] = None  # restore to the stock default on unpatch
        return chosen

    get_correct_experts_implementation.__wrapped__ = original
    get_correct_experts_implementation.__doc__ = original.__doc__
    _state["original_get_correct"] = original
    PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation


def _uninstall_default() -> None:
    from transformers import PreTrainedModel

    original = _state["original_get_correct"]
    if original is not None:
        PreTrainedModel.get_correct_experts_implementation = original
        _state["original_get_correct"] = None


def is_patched() -> bool:
    """True between `patch()` and `unpatch()`."""
    return _state["original_get_correct"] is not None


def patch() -> PatchReport:
    """Register the "dropless" experts implementation and make it the default.

    Models built or loaded afterwards (`from_config`, `from_pretrained`) run their experts
    through dropless; an explicit `experts_implementation=` still wins. Returns a
    `PatchReport`, a live view of the patched models: print it (or read `.families`,
    `.modules_ours`, `.generic`, `.fallbacks`) after building or loading them.
    Idempotent; undone exactly by `unpatch()`.
    """
    require_transformers()
    _register()
    _install_default()
    return report()


def report(model: nn.Module | None = None) -> PatchReport:
    """What dropless runs in `model`, or in every model it switched (live view)."""
    if model is not None:
        return model_report(model)
    return PatchReport(
        "'dropless' is the default experts implementation of MoE models built or loaded",
        lambda: list(_models.keys()),
    )


def _require_moe(model) -> list:
    transformers = require_transformers()
    if not isinstance(model, transformers.PreTrainedModel):
        raise TypeError(
            f"patch_model expects a transformers PreTrainedModel, got {type(model).__name__}"
        )
    layers = moe_layers(model)
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no Mixture-of-Experts layers using Transformers' experts "
            "interface (no module decorated with @use_experts_implementation), so dropless has "
            "nothing to patch. Pass a MoE model (e.g. Qwen3-MoE, Mixtral, DeepSeek-V3)."
        )
    return layers


def patch_model(model: nn.Module, expert_bias: bool = False) -> nn.Module:
    """Switch an already built MoE model to the dropless experts path (in place; returns it).

    expert_bias=True also gives every router without a score bias an fp32 `expert_bias`
    buffer [E] (zeros) that shifts which experts are chosen, not their weights, for
    aux-loss-free balancing (`dropless.ops.update_expert_bias`); DeepSeek-V3 and GLM-4-MoE
    routers keep using their `e_score_correction_bias`. Raises TypeError/ValueError for a
    model that is not a supported MoE model.
    """
    layers = _require_moe(model)
    _register()
    previous = model.get_experts_implementation()
    model.set_experts_implementation(IMPLEMENTATION)
    if IMPLEMENTATION not in previous.values():
        _models[model] = previous
    elif model not in _models:
        _models[model] = None
    if expert_bias:
        for layer in layers:
            if layer.router is None:
                raise ValueError(f"expert_bias=True: MoE block {layer.name!r} has no router")
            add_expert_bias(layer.router, layer.family, layer.num_experts)
    return model


def unpatch_model(model: nn.Module) -> nn.Module:
    """Put one model back on the implementation it had and remove buffers dropless added."""
    previous = _models.pop(model, None)
    if previous is None:
        previous = _stock_default(model)
    for layer in moe_layers(model):
        if layer.router is not None:
            remove_expert_bias(layer.router)
        layer.experts.__dict__.pop("_dropless_spec", None)
    if "dropless" in model.get_experts_implementation().values():
        _set_implementation(model, previous)
    return model


def _stock_default(model) -> str:
    original = _state["original_get_correct"]
    if original is None:
        from transformers import PreTrainedModel

        original = PreTrainedModel.get_correct_experts_implementation
    return original(model, None)


def _set_implementation(model, implementation) -> None:
    # set_experts_implementation validates the request through get_correct_...;
    # the stock names it may get here are always valid.
    model.set_experts_implementation(implementation)


def unpatch() -> None:
    """Undo `patch()` and every `patch_model()`: stock Transformers behaviour, exactly.

    A no-op when nothing is patched (so it never needs a supported transformers)."""
    if not (_state["registered"] or _state["original_get_correct"] or len(_models)):
        return
    for model in list(_models.keys()):
        unpatch_model(model)
    _uninstall_default()
    _unregister()
