"""TopKRouter: a linear gate, fp32 scores, top-k selection (see `dropless.ops.route`), and
the router losses' inputs from the same pass (`dropless.ops.routing.route_with_aux`)."""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.routing import route_with_aux
from ..ops.specs import RoutingConfig, as_routing

#: TopKRouter / MoE defaults: renormalised top-k weights (ops.route defaults to raw ones).
DEFAULT_ROUTING = RoutingConfig(renormalize=True)


@dataclass
class RouterOutput:
    weights_TK: torch.Tensor  # fp32 routing weights of the chosen experts
    ids_TK: torch.Tensor  # int64 expert ids
    logits_TE: torch.Tensor
    scores_TE: torch.Tensor  # fp32 softmax / sigmoid scores
    # the router losses' inputs from the routing pass (`ops.routing.route_with_aux`)
    probs_mean_E: torch.Tensor | None = None  # mean over tokens of the normalised scores
    z_loss: torch.Tensor | None = None  # mean over tokens of logsumexp(logits)^2


class TopKRouter(nn.Module):
    """Token-choice top-k router.

    Args:
        hidden_size: D. num_experts: E. top_k: K (1 <= K <= E).
        routing: a `RoutingConfig` (default: renormalize=True); or its fields as keywords
            (`routing_fields`: score_func, renormalize, ...; not both). expert_bias: keep an `expert_bias` buffer [E] (updated by
            `dropless.ops.update_expert_bias`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        routing: RoutingConfig | None = None,
        dtype: torch.dtype | None = None,
        device=None,
        **routing_fields,
    ):
        super().__init__()
        self.routing = as_routing(routing, DEFAULT_ROUTING, **routing_fields)
        self.routing.check(num_experts, top_k)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device)
        )
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        if self.routing.expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.expert_bias = None

    # the routing fields, read-only, as the keyword arguments named them
    score_func = property(lambda self: self.routing.score_func)
    renormalize = property(lambda self: self.routing.renormalize)
    scaling_factor = property(lambda self: self.routing.scaling_factor)
    n_group = property(lambda self: self.routing.n_group)
    topk_group = property(lambda self: self.routing.topk_group)

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = nn.functional.linear(x_TD, self.weight)
        weights_TK, ids_TK, scores_TE, probs_mean_E, z = route_with_aux(
            logits_TE, self.top_k, self.routing, expert_bias_E=self.expert_bias
        )
        return RouterOutput(weights_TK, ids_TK, logits_TE, scores_TE, probs_mean_E, z)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"routing={self.routing}"
        )
