"""The registry of RMSNorm implementations: "torch" (`eager.py`) always, "triton"
(`rmsnorm_kernels.py`) registered by `gpu.py` on the first pick for a CUDA tensor."""

# D normalised dim

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry
from .eager import rms_norm_bwd, rms_norm_fwd


@dataclass(frozen=True)
class RMSNormImpl:
    """supports(x): whether it runs x; forward / backward: its raw passes
    (`eager.rms_norm_fwd` and `rms_norm_bwd`'s signatures, on [..., D]), which the one
    autograd Function (`eager.RMSNormFunction`) and the custom op run."""

    name: str
    supports: Callable[[torch.Tensor], bool]
    forward: Callable
    backward: Callable
    priority: int = 0


RMSNORM = Registry(
    "rmsnorm backend", RMSNormImpl("torch", lambda x: True, rms_norm_fwd, rms_norm_bwd)
)
