"""Plain-Python descriptions of routing and of the expert activation.

`RoutingConfig` (score function, renormalisation, scaling, expert groups, expert bias)
and `ActivationConfig` (kind, gated, interleaved, alpha/limit) are small frozen
dataclasses that travel through ops, nn, hf, parallel and jax instead of repeated
keyword lists. This module imports nothing but the standard library: it is the one
module of ours that `dropless.jax` may import.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

SCORE_FUNCS = ("softmax", "sigmoid")

#: The activation kinds, the one table: name -> the function of (gate, up) it computes
#: (non-gated: of h). The reference and the eager math (`activation/`) implement these;
#: a new elementwise kind is added by `activation.eager.register_elementwise` (here by
#: `register_activation_kind`).
ACTIVATION_KINDS: dict[str, str] = {
    "swiglu": "silu(gate) * up (non-gated: silu(h))",
    "gelu": "gelu(gate) * up, exact erf GELU (non-gated: gelu(h))",
    "gelu_tanh": "gelu_tanh(gate) * up, tanh-approximated GELU (non-gated: gelu_tanh(h))",
    "relu2": "relu(gate)^2 * up (non-gated: relu(h)^2)",
    "swiglu_clamp": "silu(min(gate, limit)) * clamp(up, -limit, limit)",
    "gpt_oss": "g * sigmoid(alpha * g) * (u + 1), g = min(gate, limit), u = clamp(up, -limit, limit)",
}
#: the kinds of the table the Triton kernels compute (`activation/activation_kernels.py`,
#: gated; the row-gathering GEMMs' epilogues too): all but the ones registered at run time
KERNEL_KINDS = tuple(ACTIVATION_KINDS)


def register_activation_kind(kind: str, formula: str) -> None:
    """Make `kind` a valid `ActivationConfig.kind`; `formula` says what it computes."""
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"activation kind must be a non-empty string, got {kind!r}")
    ACTIVATION_KINDS[kind] = formula


def _is_real(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class RoutingConfig:
    """How token-choice top-k routing turns router logits into expert weights.

    score_func: "softmax" or "sigmoid" (scores in fp32). renormalize: rescale the
    top-k weights to sum to 1. scaling_factor: multiplies the weights (DeepSeek-V3's
    routed_scaling_factor). n_group, topk_group: group-limited selection (DeepSeek-V3),
    both set or both None. expert_bias: an expert score bias [E] shifts which experts
    are chosen but not their weights (aux-loss-free balancing).
    """

    score_func: str = "softmax"
    renormalize: bool = False
    scaling_factor: float = 1.0
    n_group: int | None = None
    topk_group: int | None = None
    expert_bias: bool = False

    def __post_init__(self):
        if self.score_func not in SCORE_FUNCS:
            raise ValueError(f"routing.score_func={self.score_func!r}; allowed: {SCORE_FUNCS}")
        for name in ("renormalize", "expert_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"routing.{name}={getattr(self, name)!r}; allowed: True or False")
        if not _is_real(self.scaling_factor):
            raise ValueError(
                f"routing.scaling_factor={self.scaling_factor!r} must be a finite number"
            )
        if (self.n_group is None) != (self.topk_group is None):
            raise ValueError(
                f"routing.n_group={self.n_group!r} and routing.topk_group={self.topk_group!r} "
                "go together: set both or neither"
            )
        for name in ("n_group", "topk_group"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"routing.{name}={v!r} must be None or an int >= 1")
        if self.n_group is not None and self.topk_group > self.n_group:
            raise ValueError(
                f"routing.topk_group={self.topk_group} must be in [1, n_group={self.n_group}]"
            )

    def check_bias(self, has_bias: bool) -> None:
        """Raise ValueError when an expert bias is given without `expert_bias`, or missing."""
        if self.expert_bias and not has_bias:
            raise ValueError("routing.expert_bias=True needs expert_bias_E [E]; pass the bias")
        if has_bias and not self.expert_bias:
            raise ValueError(
                "expert_bias_E was given but routing.expert_bias=False; set expert_bias=True"
            )

    def check(self, num_experts: int, top_k: int) -> None:
        """Raise ValueError when this routing cannot pick `top_k` of `num_experts` experts."""
        if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k!r} must be an int in [1, num_experts={num_experts}]")
        if self.n_group is None:
            return
        if num_experts % self.n_group:
            raise ValueError(
                f"routing.n_group={self.n_group} must divide num_experts={num_experts}"
            )
        per = num_experts // self.n_group
        if self.topk_group * per < top_k:
            raise ValueError(
                f"routing.topk_group={self.topk_group} groups of {per} experts "
                f"hold fewer than top_k={top_k} experts"
            )


@dataclass(frozen=True)
class ActivationConfig:
    """What each expert computes between its two projections.

    kind: a name in `ACTIVATION_KINDS` ("swiglu": silu(gate) * up; "gpt_oss": the
    clamped GLU of GPT-OSS). gated: the first projection yields gate and up (True), or
    one up projection goes through the activation (False). interleaved: gate/up
    columns alternate (gate even, up odd) instead of [gate | up]. alpha, limit: the
    sigmoid scale and the clamp of "gpt_oss" (ignored by other kinds).
    """

    kind: str = "swiglu"
    gated: bool = True
    interleaved: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self):
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"activation.kind={self.kind!r}; allowed: {sorted(ACTIVATION_KINDS)}")
        for name in ("gated", "interleaved"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"activation.{name}={getattr(self, name)!r}; allowed: True or False"
                )
        if not _is_real(self.alpha):
            raise ValueError(f"activation.alpha={self.alpha!r} must be a finite number")
        if not _is_real(self.limit) or self.limit <= 0:
            raise ValueError(f"activation.limit={self.limit!r} must be a finite number > 0")
        if self.interleaved and not self.gated:
            raise ValueError(
                "activation.interleaved=True needs gated=True (only gate/up columns interleave)"
            )
        if self.kind in ("gpt_oss", "swiglu_clamp") and not self.gated:
            raise ValueError(
                f"activation.kind={self.kind!r} needs gated=True (it uses gate and up)"
            )


def as_routing(
    routing: RoutingConfig | None = None, base: RoutingConfig | None = None, **fields
) -> RoutingConfig:
    """The RoutingConfig of a call that takes `routing=` or the keyword form.

    `fields` are the keyword arguments (None: not given), applied on top of `base`
    (default `RoutingConfig()`). Giving both `routing` and a keyword is a TypeError.
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if routing is not None:
        if not isinstance(routing, RoutingConfig):
            raise TypeError(f"routing must be a RoutingConfig, got {type(routing).__name__}")
        if given:
            raise TypeError(
                f"pass routing=RoutingConfig(...) or the keywords {sorted(given)}, not both"
            )
        return routing
    return dataclasses.replace(base or RoutingConfig(), **given)


def as_activation(activation: ActivationConfig | str | None = None, **fields) -> ActivationConfig:
    """The ActivationConfig of a call that takes `activation=` as a config or a kind name.

    `fields` (interleaved, alpha, limit, gated; None: not given) complete a kind name;
    with an ActivationConfig they must not be given (TypeError).
    """
    given = {k: v for k, v in fields.items() if v is not None}
    if isinstance(activation, ActivationConfig):
        if given:
            raise TypeError(
                f"pass activation=ActivationConfig(...) or the keywords {sorted(given)}, not both"
            )
        return activation
    if activation is not None and not isinstance(activation, str):
        raise TypeError(
            f"activation must be an ActivationConfig or a kind name, got {type(activation).__name__}"
        )
    if activation is not None:
        given["kind"] = activation
    try:
        return ActivationConfig(**given)
    except ValueError as e:
        # keep the old keyword form's message: it names the argument the caller passed
        if activation is not None and activation not in ACTIVATION_KINDS:
            raise ValueError(
                f"activation={activation!r}; allowed: {sorted(ACTIVATION_KINDS)}"
            ) from None
        raise e
