"""Functional MoE ops with autograd, one folder per op, each with its pure-torch reference
(the specification; `reference.py` here gathers them), eager form, Triton kernels,
autograd and registration into the one registry of `registry.py`. Triton entries register
on the first pick for a CUDA tensor: importing `dropless.ops` imports no triton.
"""

from .activation.swiglu import expert_activation, swiglu
from .dispatch import (
    get_recipe,
    register_recipe_gemm,
    reset_recipe,
    set_recipe,
)
from .expert_mlp import expert_mlp, grouped_mlp
from .grouped_gemm import GemmBackend, gemm_backends, grouped_gemm, register_gemm_backend
from .linear_cross_entropy import linear_cross_entropy
from .lora import LowRank
from .losses import (
    load_balancing_loss,
    load_balancing_loss_global,
    sequence_aux_loss,
    update_expert_bias,
    z_loss,
)
from .permute import SortedPairs, gather_sum, permute, sort_by_expert, unpermute
from .replay import remember, routing_replay
from .routing import capacity_keep_mask, expert_capacity, route
from .specs import ActivationConfig, RoutingConfig

__all__ = [
    "ActivationConfig",
    "GemmBackend",
    "LowRank",
    "RoutingConfig",
    "SortedPairs",
    "capacity_keep_mask",
    "expert_activation",
    "expert_capacity",
    "expert_mlp",
    "gather_sum",
    "gemm_backends",
    "get_recipe",
    "grouped_gemm",
    "grouped_mlp",
    "linear_cross_entropy",
    "load_balancing_loss",
    "load_balancing_loss_global",
    "permute",
    "register_gemm_backend",
    "register_recipe_gemm",
    "remember",
    "reset_recipe",
    "route",
    "routing_replay",
    "sequence_aux_loss",
    "set_recipe",
    "sort_by_expert",
    "swiglu",
    "unpermute",
    "update_expert_bias",
    "z_loss",
]
