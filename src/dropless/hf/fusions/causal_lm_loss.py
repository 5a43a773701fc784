"""Transformers' causal-LM loss, keeping less for backward (docs/hf.md, `lean_cross_entropy`,
on by default in `patch()`): `causal_lm_loss` is `ForCausalLMLoss` (labels shifted,
`ignore_index`, `num_items_in_batch` as a sum over that count, upcast) computed by
`dropless.ops.linear_cross_entropy.rows.cross_entropy`, which keeps only the logits the
model returns anyway instead of their log-probabilities, and writes the gradient over
them when the caller has let them go. The model still returns its logits. fp64 logits
give an fp64 loss (stock's `logits.float()` computes it in fp32). Inside a compiled
region the loss is stock's formula, which the compiler fuses.
"""

# B sequences, L positions, V vocabulary

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.linear_cross_entropy.rows import cross_entropy


def causal_lm_loss(
    logits, labels, vocab_size: int, num_items_in_batch=None, ignore_index: int = -100,
    shift_labels=None, **kwargs,
) -> torch.Tensor:  # fmt: skip
    """`transformers.loss.loss_utils.ForCausalLMLoss`, same arguments and numbers."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    reduction = "mean" if num_items_in_batch is None else "sum"
    if torch.compiler.is_compiling() or logits.shape[-1] != vocab_size:
        x = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, vocab_size)
        loss = F.cross_entropy(
            x, shift_labels.reshape(-1), ignore_index=ignore_index, reduction=reduction
        )
    else:
        loss = cross_entropy(logits, shift_labels, ignore_index=ignore_index, reduction=reduction)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def is_lean_cross_entropy_enabled(model: nn.Module) -> bool:
    """True when `model`'s loss function is `causal_lm_loss`."""
    return vars(model).get("_loss_function") is causal_lm_loss


def enable_lean_cross_entropy(model: nn.Module) -> bool:
    """Give a model whose loss is Transformers' `ForCausalLMLoss` `causal_lm_loss` instead
    (an instance attribute; the model's own loss function, if set, is left alone). True
    when the model has it (now or already)."""
    if "_loss_function" in vars(model) or getattr(model, "loss_type", None) is None:
        return is_lean_cross_entropy_enabled(model)  # a model without a loss: none
    from transformers.loss.loss_utils import LOSS_MAPPING

    if getattr(model, "loss_function", None) is not LOSS_MAPPING["ForCausalLM"]:
        return False
    model.loss_function = causal_lm_loss
    return True


def disable_lean_cross_entropy(model: nn.Module) -> nn.Module:
    """Give the model back Transformers' loss function (a no-op if it has not ours)."""
    if is_lean_cross_entropy_enabled(model):
        del vars(model)["_loss_function"]
    return model
