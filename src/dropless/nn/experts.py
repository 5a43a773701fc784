"""GroupedExperts: the routed experts' weights in the Transformers v5 layout."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.activation.eager import check_supported
from ..ops.expert_mlp import expert_mlp, grouped_mlp
from ..ops.specs import ActivationConfig, as_activation


class GroupedExperts(nn.Module):
    """E gated experts: gate_up_proj [E, 2F, D] (rows [0, F) gate, [F, 2F) up),
    down_proj [E, D, F]; optional biases gate_up_proj_bias [E, 2F], down_proj_bias [E, D].
    `activation`: an `ActivationConfig` or a kind name ("swiglu", the default, or
    "gpt_oss"); kept as the ActivationConfig in `self.activation`.

    `forward(x_TD, ids_TK, weights_TK)` runs every (token, expert) pair (dropless) and
    returns (out_TD, SortedPairs); `forward_sorted` runs rows already in expert order.
    """

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        bias: bool = False,
        activation: ActivationConfig | str = "swiglu",
        backend: str | None = None,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        super().__init__()
        activation = check_supported(as_activation(activation))
        if not activation.gated:
            raise ValueError(
                "GroupedExperts: activation.gated=False (non-gated experts) is not "
                "implemented here (its weights are gate/up [E, 2F, D]); use gated=True"
            )
        E, D, F = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = E, D, F
        self.activation, self.backend = activation, backend
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * F, D, **kw))
        self.down_proj = nn.Parameter(torch.empty(E, D, F, **kw))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(E, 2 * F, **kw)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.zeros(E, D, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, std=1 / math.sqrt(self.hidden_size))
        nn.init.normal_(self.down_proj, std=1 / math.sqrt(self.intermediate_size))

    def _mlp_kwargs(self) -> dict:
        return dict(
            gate_up_bias=self.gate_up_proj_bias,
            down_bias=self.down_proj_bias,
            activation=self.activation,
            backend=self.backend,
        )

    def forward(self, x_TD, ids_TK, weights_TK, keep_TK=None):
        w = (self.gate_up_proj, self.down_proj)
        return expert_mlp(x_TD, ids_TK, weights_TK, *w, keep_TK=keep_TK, **self._mlp_kwargs())

    def forward_sorted(self, x_SD, counts, prob_S):
        """Rows already sorted by (local) expert, `counts` per expert, scaled by prob_S."""
        return grouped_mlp(
            x_SD, counts, prob_S, self.gate_up_proj, self.down_proj, **self._mlp_kwargs()
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, bias={self.down_proj_bias is not None}"
        )
