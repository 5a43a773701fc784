"""Dense nn.Linear layers that follow the active recipe (`convert_linear`)."""

# T tokens (all leading dims flattened), D in features, N out features

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..ops.dispatch import get_recipe
from .gemm import quantized_grouped_gemm


class Linear(nn.Linear):
    """nn.Linear that computes in the active `dropless.autocast` recipe's format (a
    one-group quantized GEMM) and exactly like nn.Linear outside autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        recipe = get_recipe()
        if recipe is None:
            return nn.functional.linear(x, self.weight, self.bias)
        x_TD = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.unsqueeze(0)
        y = quantized_grouped_gemm(
            x_TD, self.weight.unsqueeze(0), [x_TD.shape[0]], bias, True, recipe, key=self.weight
        )
        return y.view(*x.shape[:-1], self.out_features)


def convert_linear(
    model: nn.Module, filter_fn: Callable[[str, nn.Module], bool] | None = None
) -> nn.Module:
    """Make the model's nn.Linear layers recipe-aware, in place (weights untouched).

    filter_fn(name, module) -> bool picks which ones (default: every nn.Linear; pass
    e.g. `lambda n, m: "lm_head" not in n` to keep the output head in full precision).
    Outside `dropless.autocast` they compute exactly as before. Returns the model.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    for name, m in model.named_modules():
        if type(m) is nn.Linear and (filter_fn is None or filter_fn(name, m)):
            m.__class__ = Linear
    return model
