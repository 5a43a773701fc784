"""MoE: router + grouped experts + optional shared expert, dropless by default."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..ops.compute_dtype import autocast_dtype
from ..ops.losses import load_balancing_loss_from_mean, load_balancing_loss_global, z_loss
from ..ops.replay import routing_replay
from ..ops.routing import capacity_keep_mask, expert_capacity
from ..ops.specs import ActivationConfig, RoutingConfig
from .dispatcher import LocalDispatcher
from .experts import GroupedExperts
from .grouped_linear import check_sizes
from .router import TopKRouter


@dataclass
class MoEAux:
    """What a MoE forward reports besides its output.

    lb_loss: Switch-style load-balancing loss (global when the dispatcher reduced the
    counts); z_loss: router z-loss; tokens_per_expert [E]: pairs each expert computed;
    dropped: pairs dropped by a capacity limit (0 when dropless).
    """

    lb_loss: torch.Tensor
    z_loss: torch.Tensor
    tokens_per_expert: torch.Tensor
    dropped: int
    router_logits: torch.Tensor | None = None


class SharedExpert(nn.Module):
    """A dense SwiGLU MLP every token goes through, with an optional sigmoid gate."""

    def __init__(
        self, hidden_size, intermediate_size, *, gate: bool = False, dtype=None, device=None
    ):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)
        self.gate = nn.Linear(hidden_size, 1, **kw) if gate else None

    def forward(self, x_TD):
        y = self.down_proj(nn.functional.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))
        if self.gate is not None:
            y = torch.sigmoid(self.gate(x_TD)) * y
        return y


class MoE(nn.Module):
    """A dropless Mixture-of-Experts layer: `out, aux = moe(x)` with x [..., D].

    routing: a `RoutingConfig`, or its fields as keywords (`routing_fields`; not both).
    shared_expert_intermediate_size: width of a shared expert (0: none), scaled by
    sigmoid(x @ w) with shared_expert_gate (Qwen2-MoE). bias: biases on the expert
    projections (the routing weight scales the down bias too). activation: an
    `ActivationConfig` or a kind name. capacity_factor: None is dropless; a float > 0 keeps
    ceil(cf * T * K / E) pairs per expert, dropping the lowest-weight overflow (for
    comparison runs; counted in `aux.dropped`). dispatcher: moves tokens to experts
    (default `LocalDispatcher`; the expert-parallel one comes from `dropless.parallel`).
    """

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        routing: RoutingConfig | None = None,
        shared_expert_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        bias: bool = False,
        activation: ActivationConfig | str = "swiglu",
        capacity_factor: float | None = None,
        dispatcher=None,
        backend: str | None = None,
        dtype: torch.dtype | None = None,
        device=None,
        **routing_fields,
    ):
        super().__init__()
        F = moe_intermediate_size
        check_sizes(hidden_size=hidden_size, moe_intermediate_size=F, num_experts=num_experts)
        if capacity_factor is not None and not (capacity_factor > 0):
            raise ValueError(f"capacity_factor={capacity_factor!r} must be None (dropless) or > 0")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.capacity_factor = capacity_factor
        kw = dict(dtype=dtype, device=device)
        self.router = TopKRouter(
            hidden_size, num_experts, top_k, routing=routing, **kw, **routing_fields
        )
        self.experts = GroupedExperts(
            num_experts, hidden_size, moe_intermediate_size, bias=bias, activation=activation,
            backend=backend, **kw,
        )  # fmt: skip
        self.shared_expert = None
        if shared_expert_intermediate_size:
            self.shared_expert = SharedExpert(
                hidden_size, shared_expert_intermediate_size, gate=shared_expert_gate, **kw
            )
        self.dispatcher = dispatcher if dispatcher is not None else LocalDispatcher()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, MoEAux]:
        if not isinstance(x, torch.Tensor) or not torch.is_floating_point(x):
            raise TypeError(
                f"x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}"
            )
        if x.dim() < 1 or x.shape[-1] != self.hidden_size:
            raise ValueError(
                f"x must be [..., hidden_size={self.hidden_size}], got {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x_TD = x.reshape(-1, self.hidden_size)
        # a checkpointed recompute routes as its forward did (dropless.ops.replay)
        with routing_replay(self.router):
            r = self.router(x_TD)
        keep_TK = None
        if self.capacity_factor is not None:
            cap = expert_capacity(x_TD.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            keep_TK = capacity_keep_mask(r.ids_TK, r.weights_TK, self.num_experts, cap)
        # under autocast the tokens enter the experts (and any all-to-all) in its dtype
        dt = autocast_dtype(x_TD, self.experts.gate_up_proj)
        x_e = x_TD if dt is None else x_TD.to(dt)
        weights_TK = (
            r.weights_TK.to(x_e.dtype) if x.dtype != torch.float64 else r.weights_TK.double()
        )
        out_TD, tokens_per_expert, counts_E, n_tokens = self.dispatcher(
            x_e, r.ids_TK, weights_TK, self.experts, keep_TK
        )
        if self.shared_expert is not None:
            out_TD = out_TD + self.shared_expert(x_TD)
        # the router's pass computed the mean scores (a routing kernel on CUDA) unless a
        # custom router returned only the scores
        if r.probs_mean_E is None:
            lb_loss = load_balancing_loss_global(r.scores_TE, counts_E, n_tokens)
        else:
            lb_loss = load_balancing_loss_from_mean(r.probs_mean_E, counts_E, n_tokens)
        aux = MoEAux(
            lb_loss=lb_loss,
            z_loss=z_loss(r.logits_TE) if r.z_loss is None else r.z_loss,
            tokens_per_expert=tokens_per_expert,
            # dropless needs no count (and no host sync); capacity mode counts the drops
            dropped=0 if keep_TK is None else int(r.ids_TK.numel() - int(tokens_per_expert.sum())),
            router_logits=r.logits_TE,
        )
        return out_TD.view(*lead, self.hidden_size), aux
