"""The registry of grouped-GEMM backends (`registry.Registry`): raw (non-autograd) grouped
products that the autograd Function of `eager.py` calls. `auto` picks the highest-priority
backend that supports the operands; naming one that cannot run raises.
"""

# S rows, N output features, E groups, M / N the dims of a weight gradient

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..registry import Registry


@dataclass(frozen=True)
class GemmBackend:
    """A grouped GEMM implementation.

    mm(a_SK, b_E.., counts, trans_b) -> [S, N]: rows of group e times b[e]^T (trans_b)
    or b[e]; wgrad(a_SM, b_SN, counts) -> [E, M, N]: per group a_e^T @ b_e.
    supports(a, b) says whether it can run on these operands (device, dtype, strides).
    device_counts: whether mm/wgrad take the counts as a device tensor (no host sync);
    otherwise they are handed a host list.
    offsets: whether mm/wgrad also take the groups' int32 end offsets as a keyword
    `offs` (a layer computes them once and binds them: `grouped_gemm.bind_offsets`);
    without it they compute them from the counts.
    """

    name: str
    mm: Callable
    wgrad: Callable
    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    priority: int = 0
    device_counts: bool = False
    offsets: bool = False


GEMM_BACKENDS = Registry("grouped-GEMM backend")
_BACKENDS: dict[str, GemmBackend] = GEMM_BACKENDS.entries


def register_gemm_backend(backend: GemmBackend) -> None:
    """Add (or replace) a grouped-GEMM backend under `backend.name`."""
    GEMM_BACKENDS.register(backend)


def gemm_backends() -> list[str]:
    """Names of the registered grouped-GEMM backends, best first."""
    return GEMM_BACKENDS.names()


def pick_gemm_backend(
    name: str | None, a: torch.Tensor, b: torch.Tensor, *more: torch.Tensor
) -> GemmBackend:
    """The backend to use: `name` if given (error if it cannot run), else the best one.

    `more`: further weights multiplied with inputs like `a` (e.g. the down projection
    of an expert MLP), so one backend serves every GEMM of a layer: each must be
    supported (dtype, device, 16-byte alignment of every dimension read).
    """
    weights = (b, *more)
    shapes = [tuple(w.shape) for w in weights]
    backend = GEMM_BACKENDS.pick(
        name,
        a,
        *weights,
        runs=lambda be: all(be.supports(a, w) for w in weights),
        detail=f" with weights {shapes} (dtype, device or a dimension not a multiple of 16 bytes)",
    )
    assert backend is not None, "the 'loop' backend supports everything"
    return backend
