"""Modules: TopKRouter, GroupedLinear, GroupedExperts, MoE (no Triton, no GPU-only imports)."""

from .dispatcher import LocalDispatcher
from .experts import GroupedExperts
from .grouped_linear import GroupedLinear
from .moe import MoE, MoEAux
from .router import TopKRouter

__all__ = [
    "GroupedExperts",
    "GroupedLinear",
    "LocalDispatcher",
    "MoE",
    "MoEAux",
    "TopKRouter",
]
