"""The "dropless" experts implementation for Transformers v5 experts modules.

Transformers v5's `@use_experts_implementation` sets layout flags on each experts module
(`has_gate`, `has_bias`, `is_transposed`, `has_post_expert_norm`, `_is_expert_parallel`)
and dispatches its forward by `config._experts_implementation`: "dropless" is
`dropless_experts_forward`. `experts_spec` reads the flags, the gate and `act_fn` (what
the module computes, `gates.py`, never its family name) and picks the fused path (the
engine with the module's `ActivationConfig`), the generic path (grouped GEMMs with the
module's own gate between them), or the class's own forward (weights not in the v5
layout).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from ...ops import (
    ActivationConfig,
    expert_mlp,
    get_recipe,
    grouped_mlp,
    permute,
    sort_by_expert,
    unpermute,
)
from ...ops.compute_dtype import expert_input
from ...ops.expert_mlp.plan import plan_expert_mlp
from ..layers import family_of, is_experts_module
from ..lora.expert_lora import LORA_SCALE, attached_lowrank, fold_attached
from ..lora.peft_lora import (
    DroplessLoRAFallbackWarning,
    experts_weights,
    raw_weight,
)

#: Eager calls of the dropless experts path per family and per (family, "fused" or
#: "generic"): which path ran.
CALLS: collections.Counter = collections.Counter()
PATH_CALLS: collections.Counter = collections.Counter()

_WARNED: set = set()
_HOOKS: dict = {}


class DroplessFallbackWarning(UserWarning):
    """An experts module ran the stock implementation because dropless does not cover it."""


class DroplessGenericGateWarning(UserWarning):
    """An experts module runs dropless's grouped GEMMs with its own gate function between
    them (under autograd), because that gate has no fused form."""


@dataclass(frozen=True)
class ExpertsSpec:
    """How one experts module computes, read from its v5 flags, gate and act_fn: path
    "fused" (the engine computing `activation`) or "generic" (the module's own gate
    between grouped GEMMs, `activation` None, `reason` saying why)."""

    family: str
    activation: ActivationConfig | None
    trans_w: bool  # weights [E, out, in] (nn.Linear layout); False: [E, in, out]
    has_bias: bool
    path: str = "fused"  # "fused" | "generic"
    gated: bool = True  # False: one up projection, then act_fn
    post_norm: bool = False  # a norm on each expert's output (has_post_expert_norm)
    reason: str = ""  # why the generic path

    def describe(self) -> str:
        """One line: the activation and layout (docs/hf.md lists these)."""
        act = self.activation
        if act is None:
            parts = [f"own gate ({self.reason})"]
        else:
            parts = [act.kind if len(act.kind) < 40 else act.kind.rsplit(".", 1)[-1]]
            if act.kind == "gpt_oss":
                parts.append(f"alpha={act.alpha:g} limit={act.limit:g}")
            elif act.kind == "swiglu_clamp":
                parts.append(f"limit={act.limit:g}")
            if act.interleaved:
                parts.append("interleaved")
        flags = {"non-gated": not self.gated, "[E, in, out] layout": not self.trans_w}
        flags.update({"biases": self.has_bias, "post-expert norm": self.post_norm})
        return ", ".join(parts + [name for name, on in flags.items() if on])


def experts_spec(module: nn.Module) -> ExpertsSpec | str:
    """The spec of `module`, or a string saying why dropless does not run it."""
    from .gates import fused_form

    family = family_of(module)
    missing = _missing_weights(module)
    if missing:
        return f"expected 3-D expert weights {missing} (the Transformers v5 layout) are missing"
    gated = bool(module.has_gate)
    base = dict(family=family, trans_w=not module.is_transposed, has_bias=bool(module.has_bias))
    base.update(gated=gated, post_norm=bool(getattr(module, "has_post_expert_norm", False)))
    form = fused_form(module)
    if isinstance(form, str):
        return ExpertsSpec(activation=None, path="generic", reason=form, **base)
    kind = form.pop("activation")
    return ExpertsSpec(activation=ActivationConfig(kind, gated=gated, **form), **base)


def _missing_weights(module: nn.Module) -> list[str]:
    names = ["gate_up_proj" if module.has_gate else "up_proj", "down_proj"]
    if module.has_bias:
        names += [names[0] + "_bias", "down_proj_bias"]
    # raw: reading a weight PEFT parametrizes would run its LoRA fold
    return [n for n in names if raw_weight(module, n) is None]


SPEC_ATTR = "_dropless_spec"  # per experts module: its ExpertsSpec (or why not), once computed


def module_spec(module: nn.Module) -> ExpertsSpec | str | None:
    """`experts_spec(module)`, computed once per module (by `wire_experts` or at its first
    eager call) and kept on it; inside a compiled region only read (None when not there
    yet: the gate probe reads values, which a graph cannot hold)."""
    spec = module.__dict__.get(SPEC_ATTR)
    if spec is None and not torch.compiler.is_compiling():
        # the probe runs on its own float64 CPU values (also under a meta default device)
        with torch.device("cpu"):
            spec = module.__dict__[SPEC_ATTR] = experts_spec(module)
        _plan_experts(module, spec)
    return spec


def _plan_experts(module: nn.Module, spec: ExpertsSpec | str) -> None:
    """Plan the module's expert MLP now for its weights' dtype and device (not for meta or
    sharded weights, which plan at their first call)."""
    if not isinstance(spec, ExpertsSpec) or spec.path != "fused" or spec.post_norm:
        return
    w1 = raw_weight(module, "gate_up_proj" if spec.gated else "up_proj")
    w2 = raw_weight(module, "down_proj")
    if any(type(w) not in (torch.Tensor, nn.Parameter) or w.is_meta for w in (w1, w2)):
        return
    D = w1.shape[2] if spec.trans_w else w1.shape[1]
    x = torch.empty(0, D, dtype=w1.dtype, device=w1.device)
    plan_expert_mlp(x, w1, w2, spec.activation, trans_w=spec.trans_w, bias=spec.has_bias)


def wire_experts(model: nn.Module) -> int:
    """Compute and keep the spec of every experts module of `model`; returns their number."""
    experts = [m for m in model.modules() if is_experts_module(m)]
    for module in experts:
        module_spec(module)
    return len(experts)


def _warn_once(category, family: str, message: str) -> None:
    if (family, message) not in _WARNED:
        _WARNED.add((family, message))
        warnings.warn(f"dropless: {family} experts {message}", category, stacklevel=4)


def in_backward() -> bool:
    # activation checkpointing re-runs the forward inside backward: count tokens once
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def record_counts(module: nn.Module, counts_E: torch.Tensor) -> None:
    # not inside a compiled region: a module attribute written per call would be a guard
    # that changes every call (a recompile each time); compiled runs record no counts
    if torch.compiler.is_compiling() or in_backward():
        return
    counts_E = counts_E.detach()
    module.__dict__["_dropless_last_counts_E"] = counts_E
    total = module.__dict__.get("_dropless_counts_E")
    module.__dict__["_dropless_counts_E"] = counts_E.clone() if total is None else total + counts_E


def register_experts_hook(fn) -> SimpleNamespace:
    """Call `fn(module, top_k_index, top_k_weights)` (the router's choice) on every
    dropless experts call; returns a handle whose `remove()` unregisters it."""
    if not callable(fn):
        raise TypeError(f"register_experts_hook needs a callable, got {type(fn).__name__}")
    key = max(_HOOKS, default=0) + 1
    _HOOKS[key] = fn
    return SimpleNamespace(remove=lambda: _HOOKS.pop(key, None))


def _weights(module: nn.Module, spec: ExpertsSpec):
    """(w1, w2, b1, b2, lora): the module's weights, and LoRA factors where it carries
    some (the scale `attach_expert_lora` leaves, or PEFT's parametrization)."""
    first = "gate_up_proj" if spec.gated else "up_proj"
    if LORA_SCALE in module.__dict__ or "parametrizations" in module._modules:
        w1, w2, lora = _lora_weights(module, spec, first)
    else:
        w1, w2, lora = getattr(module, first), module.down_proj, None
    if not spec.has_bias:
        return w1, w2, None, None, lora
    return w1, w2, getattr(module, first + "_bias"), module.down_proj_bias, lora


def _lora_weights(module: nn.Module, spec: ExpertsSpec, first: str):
    """(w1, w2, lora): the base weights and the factors when the engine runs them, else
    the weights with the update folded in."""
    w1, w2, lora, reason = experts_weights(module, (first, "down_proj"), spec.trans_w)
    own = lora is None and not reason
    if own:
        lora = attached_lowrank(module)  # factors owned by the module (attach_expert_lora)
    if lora is not None and not _runs_lora(spec):
        where = f"on the {spec.path} path" if get_recipe() is None else "under a recipe"
        reason = f"LoRA factors run in the fused expert MLP only, not {where}"
        if own:  # no parametrization folds the module's own factors: fold them here
            w1, w2 = _fold(w1, w2, lora, spec)
        else:
            w1, w2 = getattr(module, first), module.down_proj  # PEFT folds them as read
        lora = None
    if reason:
        _warn_once(DroplessLoRAFallbackWarning, spec.family, f"run PEFT's own LoRA fold: {reason}.")
    return w1, w2, lora


def _runs_lora(spec: ExpertsSpec) -> bool:
    """Whether the engine runs low-rank factors for this module (fused, no post norm, no
    recipe)."""
    return spec.path == "fused" and not spec.post_norm and get_recipe() is None


def _fold(w1, w2, lora, spec: ExpertsSpec):
    return tuple(fold_attached(w, lr, spec.trans_w) for w, lr in zip((w1, w2), lora))


def sorted_experts(
    module, spec: ExpertsSpec, x_SD, counts, prob_S, w1, w2, b1, b2, lora=None, offsets_E=None
):
    """The experts on rows sorted by expert (`counts` rows each), every form: the engine,
    then the module's post-expert norm if any, or its own gate between grouped GEMMs.
    prob_S (None: applied by the caller) scales each row after any norm. The local path
    and expert parallelism (`hf.distributed.expert_parallel`) both run it."""
    if lora is not None and not _runs_lora(spec):
        w1, w2 = _fold(w1, w2, lora, spec)
        lora = None
    plain = spec.path == "fused" and not spec.post_norm
    kw = dict(activation=spec.activation, trans_w=spec.trans_w, offsets_E=offsets_E, lora=lora)
    if spec.path != "fused":  # the module's own gate, under autograd
        kw["gate"] = module._apply_gate if spec.gated else module.act_fn
    p = prob_S if plain else None
    y_SD = grouped_mlp(x_SD, counts, p, w1, w2, gate_up_bias=b1, down_bias=b2, **kw)
    if spec.post_norm:
        y_SD = module.post_expert_norm(y_SD)
    if prob_S is not None and not plain:
        y_SD = y_SD * prob_S.to(y_SD.dtype)[:, None]
    return y_SD


def dropless_experts_forward(self, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) for a v5 experts module; one
    sharded over expert parallelism sends its tokens through its dispatcher."""
    ep = self.__dict__.get("_dropless_ep")
    if ep is not None:
        return _ep_forward(self, ep, hidden_states, top_k_index, top_k_weights)
    spec = module_spec(self)
    if spec is None:  # inside a compiled region, not wired: stock's default (a graph holds it)
        from transformers.integrations.moe import grouped_mm_experts_forward

        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    if isinstance(spec, str):
        _warn_once(DroplessFallbackWarning, family_of(self), f"run their own forward: {spec}.")
        eager = type(self).forward.__wrapped__  # the class's forward, under the decorator
        return eager(self, hidden_states, top_k_index, top_k_weights)
    if _HOOKS:
        for hook in list(_HOOKS.values()):
            hook(self, top_k_index, top_k_weights)
    w1, w2, b1, b2, lora = _weights(self, spec)
    x_TD = expert_input(hidden_states, w1)  # under autocast: its dtype, else the weights'
    ids_TK, keep_TK = top_k_index.long(), None
    if getattr(self, "_is_expert_parallel", False):
        # Transformers' own expert parallelism marks pairs of other ranks with ids >= E
        keep_TK = ids_TK < w1.shape[0]
    if spec.path == "fused" and not spec.post_norm:
        kw = dict(gate_up_bias=b1, down_bias=b2, activation=spec.activation, lora=lora)
        out_TD, sp = expert_mlp(
            x_TD, ids_TK, top_k_weights, w1, w2, keep_TK=keep_TK, trans_w=spec.trans_w, **kw
        )
    else:
        if spec.path == "generic":
            why = f"run dropless grouped GEMMs with their own gate between them ({spec.reason}); "
            why += "this keeps more activations for backward than the fused path."
            _warn_once(DroplessGenericGateWarning, spec.family, why)
        # sorted rows through `sorted_experts` (without the prob), then the weighted combine
        sp = sort_by_expert(ids_TK, w1.shape[0], keep_TK)
        x_SD, args = permute(x_TD, sp), (w1, w2, b1, b2)
        y_SD = sorted_experts(self, spec, x_SD, sp.counts, None, *args, offsets_E=sp.offsets_E)
        out_TD = unpermute(y_SD, sp, top_k_weights.to(y_SD.dtype))
    record_counts(self, sp.counts_E)
    count_call(spec)
    return out_TD.to(hidden_states.dtype)


def _ep_forward(self, ep, hidden_states, top_k_index, top_k_weights):
    """The dispatcher moves the tokens (cast first: the autocast dtype crosses the wire)."""
    local, disp = ep
    x_TD = expert_input(hidden_states, local.weights()[0])
    out_TD, tokens_per_expert_E, _, _ = disp(x_TD, top_k_index.long(), top_k_weights, local, None)
    record_counts(self, tokens_per_expert_E)  # this rank's tokens; reduce across ranks
    count_call(local.spec)
    return out_TD.to(hidden_states.dtype)


def count_call(spec: ExpertsSpec) -> None:
    # not while compiling: Dynamo guards on a counter's value, so a counter bumped inside
    # a compiled region would recompile the region on every call
    if not torch.compiler.is_compiling():
        CALLS[spec.family] += 1
        PATH_CALLS[(spec.family, spec.path)] += 1
