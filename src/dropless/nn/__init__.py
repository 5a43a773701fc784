"""Modules: TopKRouter, GroupedLinear, GroupedExperts, MoE (no Triton, no GPU-only imports)."""

from .dispatcher import LocalDispatcher
from .experts import GroupedExperts
from .grouped_linear import GroupedLinear
from .moe import MoE, MoEAux, SharedExpert
from .router import RouterOutput, TopKRouter

__all__ = [
    "GroupedExperts",
    "GroupedLinear",
    "LocalDispatcher",
    "MoE",
    "MoEAux",
    "RouterOutput",
    "SharedExpert",
    "TopKRouter",
]
