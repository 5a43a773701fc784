"""GroupedLinear: one linear layer per group of rows, as in Transformer Engine."""

# S rows, D in features, N out features, E groups

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops.grouped_gemm import grouped_gemm


def check_sizes(**sizes) -> None:
    """ValueError naming the first of `sizes` that is not a positive int."""
    for name, v in sizes.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive int")


class GroupedLinear(nn.Module):
    """`num_gemms` linear layers applied to consecutive row groups of one input.

    weight [num_gemms, out_features, in_features], bias [num_gemms, out_features].
    `forward(x, m_splits)`: m_splits (list of ints or 1-D integer tensor) gives the rows
    of each group and sums to x.shape[0]. Under `dropless.autocast` the GEMM runs in
    the active recipe's format; under `torch.autocast`, in its dtype; under a compiler a
    tensor `m_splits` is read when the grouped-GEMM node runs (no recompile for new sizes).
    """

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        dtype: torch.dtype | None = None,
        device=None,
    ):
        super().__init__()
        check_sizes(num_gemms=num_gemms, in_features=in_features, out_features=out_features)
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        kw = dict(dtype=dtype, device=device)
        self.weight = nn.Parameter(torch.empty(num_gemms, out_features, in_features, **kw))
        self.bias = nn.Parameter(torch.empty(num_gemms, out_features, **kw)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        bound = 1 / math.sqrt(self.in_features)  # nn.Linear's default, per group
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, m_splits) -> torch.Tensor:
        if not torch.is_floating_point(x):
            raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"x must be [rows, in_features={self.in_features}], got {tuple(x.shape)}"
            )
        if isinstance(m_splits, torch.Tensor):
            if m_splits.dim() != 1 or torch.is_floating_point(m_splits):
                raise TypeError("m_splits must be a list of ints or a 1-D integer tensor")
            if torch.compiler.is_compiling():  # one graph node; the values checked there
                return grouped_gemm(x, self.weight, m_splits, self.bias)
            m_splits = m_splits.tolist()
        m_splits = list(m_splits)
        if len(m_splits) != self.num_gemms:
            raise ValueError(
                f"m_splits has {len(m_splits)} entries; expected num_gemms={self.num_gemms}"
            )
        if any((not isinstance(m, int)) or m < 0 for m in m_splits):
            raise ValueError(f"m_splits must be non-negative ints, got {m_splits}")
        if sum(m_splits) != x.shape[0]:
            raise ValueError(f"m_splits sum to {sum(m_splits)} but x has {x.shape[0]} rows")
        return grouped_gemm(x, self.weight, m_splits, self.bias)

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )
