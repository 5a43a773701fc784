"""`patch()` / `patch_model()` / `unpatch()`: make Transformers v5 MoE models use dropless.

`patch()` wraps `PreTrainedModel.get_correct_experts_implementation` (the one place that
makes "dropless" the default: `_install_default`), `PreTrainedModel.post_init` (a new
model's experts wired, its routing-replay hooks and the options, once its layers exist)
and the `PretrainedConfig._experts_implementation` setter (explicit requests marked:
`dropless.hf.patching.configs`), and replaces PEFT's `ParamWrapper._activate_lora`
(`dropless.hf.lora.peft_lora`). `unpatch()` puts the original objects back and switches
every live model dropless changed back to the implementation it had. Why and how:
docs/hf.md, "How `patch()` becomes the default".

These are process-wide class attributes: `patch()`, `patch_model()`, `unpatch()` and
`unpatch_model()` change them under one lock, so calls from several threads install each
wrapper once and `unpatch()` always finds the stock methods to put back.
"""

from __future__ import annotations

import threading
import warnings
import weakref

from torch import nn

from ...ops.expert_mlp import set_expert_path
from .._compat import require_transformers
from ..experts.forward import SPEC_ATTR, dropless_experts_forward, wire_experts
from ..experts.replay import install_routing_replay, remove_routing_replay
from ..fusions.causal_lm_loss import disable_lean_cross_entropy, enable_lean_cross_entropy
from ..fusions.fused_loss import disable_fused_cross_entropy, enable_fused_cross_entropy
from ..fusions.rmsnorm import disable_fused_rmsnorm, enable_fused_rmsnorm
from ..layers import moe_layers
from ..lora.peft_lora import install_lean_activation, uninstall_lean_activation
from .configs import give_own_config, install_request_marker, is_leftover, uninstall_request_marker
from .report import PatchReport, model_report
from .routers import add_expert_bias, remove_expert_bias

IMPLEMENTATION = "dropless"

# held while the class attributes and the state below change (re-entrant: patch_model and
# unpatch call helpers that take it too)
_LOCK = threading.RLock()

_state: dict = {
    "registered": False,
    "prior": None,
    "original_get_correct": None,
    "original_post_init": None,
    # options of the latest patch() call, applied to models built or loaded afterwards
    "options": {"fused_cross_entropy": False, "fused_rmsnorm": False, "lean_cross_entropy": True},
}
# models whose fused cross-entropy dropless turned on (turned off again on unpatch)
_fused_ce: weakref.WeakSet = weakref.WeakSet()
# model -> experts implementation to restore on unpatch (get_experts_implementation() form)
_models: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# configs whose "dropless" came from our default (not asked for): id -> config. A model's
# submodules share its config, so post_init sees the already resolved value again.
_defaulted: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
# MoE models built since patch() that run a stock implementation (asked for explicitly)
_stock: weakref.WeakSet = weakref.WeakSet()


def _register() -> None:
    # the public registration point: ALL_EXPERTS_FUNCTIONS[name] = fn, undone with del
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    install_lean_activation()  # PEFT's LoRA on our experts never folds
    if _state["registered"]:
        return
    had = IMPLEMENTATION in ALL_EXPERTS_FUNCTIONS
    _state["prior"] = (had, ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] if had else None)
    ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = dropless_experts_forward
    _state["registered"] = True


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
            and not type(self)._can_set_experts_implementation()
        ):
            family = getattr(self.config, "model_type", None)
            raise ValueError(
                f"experts_implementation='dropless' asked for {type(self).__name__} ({family}), "
                "which has no Mixture-of-Experts layers using Transformers' experts interface; "
                "dropless only changes MoE models. Leave experts_implementation unset for it."
            )
        chosen = original(self, requested_experts)
        if chosen == IMPLEMENTATION:
            if self not in _models:
                _models[self] = None  # restore to the stock default on unpatch
            wire_experts(self)  # a live model's experts (none yet while it is built)
        return chosen

    get_correct_experts_implementation.__wrapped__ = original
    get_correct_experts_implementation.__doc__ = original.__doc__
    _state["original_get_correct"] = original
    PreTrainedModel.get_correct_experts_implementation = get_correct_experts_implementation
    _install_post_init(PreTrainedModel)
    install_request_marker()


def _install_post_init(PreTrainedModel) -> None:
    # the experts implementation is resolved in __init__, before the layers exist; the
    # routers get their replay hooks once the model is built (post_init)
    original = PreTrainedModel.__dict__["post_init"]

    def post_init(self):
        original(self)
        # a MoE model built from a config that holds the stock default no one asked for
        # since patch() (a stock model was built from the same config object before)
        if (
            self not in _models
            and type(self)._can_set_experts_implementation()
            and is_leftover(self.config, _state["original_get_correct"](self, None))
        ):
            give_own_config(self)  # the models built from the config before keep their path
            _switch(self)
        if self in _models:
            wire_experts(self)  # the layers exist now
            install_routing_replay(self)
            _apply_options(self, **_state["options"])
        elif type(self)._can_set_experts_implementation():
            _stock.add(self)

    post_init.__wrapped__ = original
    post_init.__doc__ = original.__doc__
    _state["original_post_init"] = original
    PreTrainedModel.post_init = post_init


def _is_causal_lm_head(model) -> bool:
    get_head = getattr(model, "get_output_embeddings", None)
    return callable(get_head) and isinstance(get_head(), nn.Linear)


def _apply_options(
    model, *, fused_cross_entropy: bool, fused_rmsnorm: bool, lean_cross_entropy: bool = True
) -> None:
    if fused_rmsnorm:
        enable_fused_rmsnorm(model)
    if lean_cross_entropy:  # under the fused one, for its calls without labels
        enable_lean_cross_entropy(model)
    if fused_cross_entropy and _is_causal_lm_head(model):
        try:
            enable_fused_cross_entropy(model)
        except (TypeError, ValueError) as e:
            warnings.warn(
                f"dropless: fused_cross_entropy is not applied to {type(model).__name__}: {e}",
                UserWarning,
                stacklevel=4,
            )
            return
        _fused_ce.add(model)


def is_patched() -> bool:
    """True between `patch()` and `unpatch()`."""
    return _state["original_get_correct"] is not None


def patch(
    *,
    fused_cross_entropy: bool = False,
    fused_rmsnorm: bool = False,
    expert_path: str = "auto",
    lean_cross_entropy: bool = True,
) -> PatchReport:
    """Register the "dropless" experts implementation and make it the default.

    Models built or loaded afterwards (`from_config`, `from_pretrained`) run their experts
    through dropless; an explicit `experts_implementation=` still wins. Returns a
    `PatchReport`, a live view of the patched models: print it (or read `.families`,
    `.modules_ours`, `.generic`, `.fallbacks`) after building or loading them.
    Idempotent (the options of the latest call apply to models built afterwards); undone
    exactly by `unpatch()`.

    fused_cross_entropy: a causal LM given `labels` computes its loss from the hidden
        states in chunks (`dropless.hf.fusions.fused_loss`) and returns `logits=None`; off by
        default because code may read the logits.
    lean_cross_entropy: a model whose loss is Transformers' `ForCausalLMLoss` gets the same
        loss computed by `dropless.hf.fusions.causal_lm_loss`, which keeps the logits (still
        returned) instead of their log-probabilities for backward and writes the gradient
        over them when the caller has let them go; on by default.
    fused_rmsnorm: RMSNorm modules run dropless's RMSNorm (`dropless.hf.fusions.rmsnorm`): the
        Triton kernel for CUDA tensors, a torch op that keeps less for backward elsewhere.
    expert_path: the expert engine's schedule in this process: "auto" (the per-expert loop
        on CPU, the grouped path on CUDA), "loop", "grouped", or "gathered" (opt-in, not yet
        run on a GPU: docs/performance.md); `unpatch()` puts "auto" back.
    Every model on the dropless path also gets routing replay for activation
    checkpointing (`dropless.hf.experts.replay`).
    """
    _check_options(
        fused_cross_entropy=fused_cross_entropy, fused_rmsnorm=fused_rmsnorm,
        lean_cross_entropy=lean_cross_entropy,
    )  # fmt: skip
    require_transformers()
    set_expert_path(expert_path)
    with _LOCK:
        _register()
        _install_default()
        _state["options"] = {
            "fused_cross_entropy": fused_cross_entropy,
            "fused_rmsnorm": fused_rmsnorm,
            "lean_cross_entropy": lean_cross_entropy,
        }
    return report()


def _check_options(**options) -> None:
    for name, value in options.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name}={value!r}: expected True or False")


def report(model: nn.Module | None = None) -> PatchReport:
    """What dropless runs in `model`, or in every model it switched (live view)."""
    if model is not None:
        return model_report(model)
    return PatchReport(
        "'dropless' is the default experts implementation of MoE models built or loaded",
        lambda: list(_models.keys()),
        lambda: list(_stock),
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


def patch_model(
    model: nn.Module,
    expert_bias: bool = False,
    *,
    fused_cross_entropy: bool = False,
    fused_rmsnorm: bool = False,
    expert_path: str | None = None,
    lean_cross_entropy: bool = True,
) -> nn.Module:
    """Switch an already built MoE model to the dropless experts path (in place; returns it).

    expert_bias=True also gives every router without a score bias an fp32 `expert_bias`
    buffer [E] (zeros) that shifts which experts are chosen, not their weights, for
    aux-loss-free balancing (`dropless.ops.update_expert_bias`); DeepSeek-V3 and GLM-4-MoE
    routers keep using their `e_score_correction_bias`, AFMoE and LFM2-MoE blocks their
    `expert_bias`. `fused_cross_entropy`, `fused_rmsnorm`, `lean_cross_entropy` and
    `expert_path` (None: unchanged) as in `patch()`. Raises
    TypeError/ValueError for a model that is not a supported MoE model.
    """
    options = dict(
        fused_cross_entropy=fused_cross_entropy, fused_rmsnorm=fused_rmsnorm,
        lean_cross_entropy=lean_cross_entropy,
    )  # fmt: skip
    _check_options(**options)
    layers = _require_moe(model)
    if expert_path is not None:
        set_expert_path(expert_path)
    if fused_cross_entropy and not _is_causal_lm_head(model):
        raise TypeError(
            f"fused_cross_entropy=True needs a causal LM with an nn.Linear output head; "
            f"{type(model).__name__} has none"
        )
    with _LOCK:
        _register()
        _switch(model)
        wire_experts(model)
        for layer in layers if expert_bias else ():
            if layer.expert_bias is not None:  # the router's own, or the block's (AFMoE, LFM2-MoE)
                continue
            if layer.router is None:
                raise ValueError(
                    f"expert_bias=True: MoE block {layer.name!r} has no router (no `gate`/`router` "
                    "child with a weight) to add a score bias to; call patch_model without it"
                )
            add_expert_bias(layer.router, layer.family, layer.num_experts, layer.block)
        install_routing_replay(model)
        _apply_options(model, **options)
    return model


def _switch(model) -> None:
    """Put `model` on dropless, remembering the implementation to restore on unpatch."""
    previous = model.get_experts_implementation()
    model.set_experts_implementation(IMPLEMENTATION)
    _stock.discard(model)
    if IMPLEMENTATION not in previous.values():
        _models[model] = previous
    elif model not in _models:
        _models[model] = None


def unpatch_model(model: nn.Module) -> nn.Module:
    """Put one model back on the implementation it had and remove buffers dropless added."""
    with _LOCK:
        _restore_model(model)
    return model


def _restore_model(model: nn.Module) -> None:
    previous = _models.pop(model, None)
    if previous is None:  # the stock default, asked of the stock method
        from transformers import PreTrainedModel

        original = (
            _state["original_get_correct"] or PreTrainedModel.get_correct_experts_implementation
        )
        previous = original(model, None)
    remove_routing_replay(model)
    disable_fused_rmsnorm(model)
    if model in _fused_ce:
        _fused_ce.discard(model)
        disable_fused_cross_entropy(model)
    disable_lean_cross_entropy(model)
    for layer in moe_layers(model):
        if layer.router is not None:
            remove_expert_bias(layer.router)
        layer.experts.__dict__.pop(SPEC_ATTR, None)
    if "dropless" in model.get_experts_implementation().values():
        # validated through get_correct_...: the stock names it may get here are valid
        model.set_experts_implementation(previous)


def unpatch() -> None:
    """Undo `patch()` and every `patch_model()`: stock Transformers behaviour, exactly.

    A no-op when nothing is patched (so it never needs a supported transformers)."""
    with _LOCK:
        if not (_state["registered"] or _state["original_get_correct"] or len(_models)):
            return
        for model in list(_models.keys()):
            _restore_model(model)
        from transformers import PreTrainedModel
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        if _state["original_get_correct"] is not None:
            PreTrainedModel.get_correct_experts_implementation = _state["original_get_correct"]
        if _state["original_post_init"] is not None:
            PreTrainedModel.post_init = _state["original_post_init"]
        _state["original_get_correct"] = _state["original_post_init"] = None
        uninstall_request_marker()
        _stock.clear()
        if _state["registered"]:
            had, value = _state["prior"]
            if had:
                ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION] = value
            else:
                del ALL_EXPERTS_FUNCTIONS[IMPLEMENTATION]
        _state["registered"], _state["prior"] = False, None
        uninstall_lean_activation()
        set_expert_path("auto")
        _state["options"] = {
            "fused_cross_entropy": False, "fused_rmsnorm": False, "lean_cross_entropy": True,
        }  # fmt: skip
