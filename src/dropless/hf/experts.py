"""The "dropless" experts implementation for Transformers v5 experts modules.

Transformers v5 decorates each family's experts class with `@use_experts_implementation`,
which sets layout flags on the instance (`has_gate`, `has_bias`, `is_transposed`,
`is_concatenated`, `has_post_expert_norm`, `_is_expert_parallel`) and dispatches
`forward(hidden_states, top_k_index, top_k_weights)` through `ExpertsInterface` by
`config._experts_implementation`. `dropless_experts_forward` is registered there under
"dropless": it reads the flags and the gate function of the module, then runs
`dropless.ops.expert_mlp` (sort by expert -> grouped GEMM -> SwiGLU x prob -> grouped
GEMM -> combine), so every fast path and low-precision recipe registered in `ops`
applies. A module whose semantics we do not implement goes to the stock `grouped_mm`
forward with one warning naming the family and the reason.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import collections
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from ..ops import ActivationConfig, expert_mlp

#: Families whose routing and expert layout are implemented and tested exactly.
SUPPORTED_FAMILIES = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v3",
    "gpt_oss",
    "glm4_moe",
)

#: Calls of the dropless experts path per family (tests and users can read it).
CALLS: collections.Counter = collections.Counter()

_WARNED: set = set()


class DroplessFallbackWarning(UserWarning):
    """An experts module ran the stock implementation because dropless does not cover it."""


@dataclass(frozen=True)
class ExpertsSpec:
    """How one experts module computes, read from its v5 flags and gate function."""

    family: str
    activation: ActivationConfig  # kind, interleaved gate/up columns (gpt_oss), alpha/limit
    trans_w: bool  # weights [E, out, in] (nn.Linear layout); False: [E, in, out]
    has_bias: bool


def family_of(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    return str(getattr(config, "model_type", None) or type(module).__name__)


def is_experts_module(module: nn.Module) -> bool:
    """True for an instance of a class decorated with `@use_experts_implementation`."""
    return (
        hasattr(module, "has_gate")
        and hasattr(module, "is_transposed")
        and hasattr(module, "config")
    )


def experts_spec(module: nn.Module) -> ExpertsSpec | str:
    """The spec of `module`, or a string saying why dropless does not run it."""
    from transformers.activations import SiLUActivation
    from transformers.integrations.moe import _default_apply_gate

    family = family_of(module)
    if family not in SUPPORTED_FAMILIES:
        return f"family {family!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})"
    if getattr(module, "_is_expert_parallel", False):
        return "Transformers' own expert parallelism (tp_plan) is on; use dropless.parallel instead"
    if getattr(module, "has_post_expert_norm", False):
        return "a norm after each expert (has_post_expert_norm) is not implemented"
    if not module.has_gate:
        return "non-gated experts (has_gate=False) are not implemented"
    gate_fn = getattr(type(module), "_apply_gate", None)
    trans_w = not module.is_transposed
    if gate_fn is _default_apply_gate:
        # the stock gate splits with chunk(2): [gate | up] whatever is_concatenated says
        if not isinstance(getattr(module, "act_fn", None), (nn.SiLU, SiLUActivation)):
            return f"activation {type(getattr(module, 'act_fn', None)).__name__} is not SiLU"
        return ExpertsSpec(family, ActivationConfig(), trans_w, bool(module.has_bias))
    if family == "gpt_oss" and getattr(gate_fn, "__qualname__", "") == "GptOssExperts._apply_gate":
        act = ActivationConfig(
            "gpt_oss", interleaved=True, alpha=float(module.alpha), limit=float(module.limit)
        )
        return ExpertsSpec(family, act, trans_w, bool(module.has_bias))
    return f"its gate function {getattr(gate_fn, '__qualname__', gate_fn)} is not implemented"


def _spec(module: nn.Module) -> ExpertsSpec | str:
    # flags are fixed at construction except _is_expert_parallel, so cache by that
    key = bool(getattr(module, "_is_expert_parallel", False))
    cached = module.__dict__.get("_dropless_spec")
    if cached is None or cached[0] != key:
        cached = (key, experts_spec(module))
        module.__dict__["_dropless_spec"] = cached
    return cached[1]


def _warn_fallback(family: str, reason: str) -> None:
    if (family, reason) in _WARNED:
        return
    _WARNED.add((family, reason))
    warnings.warn(
        f"dropless: {family} experts run the stock Transformers implementation (grouped_mm): "
        f"{reason}.",
        DroplessFallbackWarning,
        stacklevel=3,
    )


def _in_backward() -> bool:
    # activation checkpointing re-runs the forward inside backward: count tokens once
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def _record_counts(module: nn.Module, counts_E: torch.Tensor) -> None:
    if _in_backward():
        return
    counts_E = counts_E.detach()
    module.__dict__["_dropless_last_counts_E"] = counts_E
    total = module.__dict__.get("_dropless_counts_E")
    module.__dict__["_dropless_counts_E"] = counts_E.clone() if total is None else total + counts_E


def dropless_experts_forward(
    self: nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    """out[t] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) for a v5 experts module, via dropless ops."""
    spec = _spec(self)
    if isinstance(spec, str):
        from transformers.integrations.moe import grouped_mm_experts_forward

        _warn_fallback(family_of(self), spec)
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    gate_up, down = self.gate_up_proj, self.down_proj
    x_TD = hidden_states.to(gate_up.dtype)
    out_TD, sp = expert_mlp(
        x_TD,
        top_k_index.long(),
        top_k_weights,
        gate_up,
        down,
        gate_up_bias=self.gate_up_proj_bias if spec.has_bias else None,
        down_bias=self.down_proj_bias if spec.has_bias else None,
        activation=spec.activation,
        trans_w=spec.trans_w,
    )
    _record_counts(self, sp.counts_E)
    CALLS[spec.family] += 1
    return out_TD.to(hidden_states.dtype)
