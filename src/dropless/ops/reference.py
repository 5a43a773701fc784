"""Pure-torch references: the specification of every op in `dropless.ops`.

Written for clarity, not speed: plain loops and autograd through torch ops. Every
fast path (custom autograd Functions, grouped_mm, Triton kernels) is tested against
these, forward and backward, and these pass an fp64 gradcheck at tiny sizes. Each op's
reference lives in its folder (`ops/<op>/reference.py`); this module gathers them, and
holds the low-rank fold, the definition of the LoRA path.
"""

# E experts, R rank, I input features, O output features

from __future__ import annotations

import torch

from .activation.reference import activation_reference, swiglu_reference
from .expert_mlp.reference import expert_mlp_reference
from .grouped_gemm.reference import grouped_gemm_reference
from .linear_cross_entropy.reference import linear_cross_entropy_reference
from .permute.reference import permute_reference, unpermute_reference
from .rmsnorm.reference import rms_norm_reference
from .routing.reference import route_reference

__all__ = [
    "activation_reference",
    "expert_mlp_reference",
    "grouped_gemm_reference",
    "linear_cross_entropy_reference",
    "lowrank_fold_reference",
    "permute_reference",
    "rms_norm_reference",
    "route_reference",
    "swiglu_reference",
    "unpermute_reference",
]


def lowrank_fold_reference(
    w_E: torch.Tensor, a_ERI: torch.Tensor, b_EOR: torch.Tensor, scale: float, trans_w: bool = True
) -> torch.Tensor:
    """An expert weight with its low-rank (LoRA) update folded in, in its storage layout:
    W + scale * B_e A_e ([E, out, in] when trans_w, else [E, in, out]). Running the plain
    expert MLP on the folded weights is the definition of the low-rank path."""
    delta = torch.einsum("eor,eri->eoi", b_EOR, a_ERI) * scale
    return w_E + (delta if trans_w else delta.transpose(1, 2))
