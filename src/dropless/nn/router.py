"""TopKRouter: a linear gate, fp32 scores, top-k selection (see `dropless.ops.route`)."""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.routing import check_routing_args, route


@dataclass
class RouterOutput:
    weights_TK: torch.Tensor  # fp32 routing weights of the chosen experts
    ids_TK: torch.Tensor  # int64 expert ids
    logits_TE: torch.Tensor
    scores_TE: torch.Tensor  # fp32 softmax / sigmoid scores


class TopKRouter(nn.Module):
    """Token-choice top-k router.

    Args:
        hidden_size: D. num_experts: E. top_k: K (1 <= K <= E).
        score_func: "softmax" or "sigmoid" (scores always fp32).
        renormalize: rescale the top-k weights to sum to 1.
        scaling_factor: multiplies the weights (DeepSeek-V3's routed_scaling_factor).
        n_group, topk_group: group-limited selection (DeepSeek-V3).
        expert_bias: keep an `expert_bias` buffer [E] that shifts which experts are
            chosen but not their weights (aux-loss-free balancing; updated by
            `dropless.ops.update_expert_bias`).
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        *,
        score_func: str = "softmax",
        renormalize: bool = True,
        scaling_factor: float = 1.0,
        n_group: int | None = None,
        topk_group: int | None = None,
        expert_bias: bool = False,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        super().__init__()
        check_routing_args(num_experts, top_k, score_func, n_group, topk_group)
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.score_func, self.renormalize, self.scaling_factor = (
            score_func,
            renormalize,
            scaling_factor,
        )
        self.n_group, self.topk_group = n_group, topk_group
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype, device=device)
        )
        nn.init.normal_(self.weight, std=hidden_size**-0.5)
        if expert_bias:
            self.register_buffer(
                "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
            )
        else:
            self.expert_bias = None

    def forward(self, x_TD: torch.Tensor) -> RouterOutput:
        logits_TE = nn.functional.linear(x_TD, self.weight)
        weights_TK, ids_TK, scores_TE = route(
            logits_TE,
            self.top_k,
            score_func=self.score_func,
            renormalize=self.renormalize,
            scaling_factor=self.scaling_factor,
            n_group=self.n_group,
            topk_group=self.topk_group,
            expert_bias_E=self.expert_bias,
        )
        return RouterOutput(weights_TK, ids_TK, logits_TE, scores_TE)

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.hidden_size}, num_experts={self.num_experts}, top_k={self.top_k}, "
            f"score_func={self.score_func}, renormalize={self.renormalize}"
        )
