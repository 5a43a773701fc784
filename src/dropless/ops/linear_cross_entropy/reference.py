"""A language-model head and its loss by their definition: the specification of
`linear_cross_entropy` and its row kernels.
"""

# T tokens, D model dim, V vocabulary

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(
    h_TD: torch.Tensor,
    weight_VD: torch.Tensor,
    labels_T: torch.Tensor,
    bias_V: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
):
    """A language-model head and its loss, as Transformers computes them: the logits in
    the input dtype, upcast to fp32 (fp64 stays fp64), then cross-entropy."""
    logits_TV = F.linear(h_TD, weight_VD, bias_V)
    logits_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    return F.cross_entropy(
        logits_TV.reshape(-1, weight_VD.shape[0]),
        labels_T.reshape(-1),
        ignore_index=ignore_index,
        label_smoothing=label_smoothing,
        reduction=reduction,
    ).reshape(labels_T.shape if reduction == "none" else ())
