"""RMSNorm by its definition (torch's op): the specification of the torch and Triton
`rms_norm`.
"""

# D normalised dim

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_reference(
    x: torch.Tensor,
    weight_D: torch.Tensor,
    eps: float = 1e-6,
    residual: torch.Tensor | None = None,
):
    """RMSNorm over the last dim (torch's op); with `residual`, of `x + residual`, returning
    `(normed, x + residual)`."""
    s = x if residual is None else x + residual
    y = F.rms_norm(s, (s.shape[-1],), weight_D, eps)
    return y if residual is None else (y, s)
