"""The "triton" routing implementation (`routing_kernels.py`) as a `RoutingKernels`
entry, registered by `register_gpu` on the first pick for a CUDA tensor. Registering
imports no triton: the kernel module loads on the first call."""

from __future__ import annotations

import torch

from ..registry import lazy, triton_importable
from .backends import RoutingKernels, register_routing_kernels

_KERNELS = "dropless.ops.routing.routing_kernels"


def _supports(t: torch.Tensor) -> bool:
    if not (t.is_cuda and triton_importable()):
        return False
    from torch._subclasses.fake_tensor import is_fake

    # a fake CUDA tensor (a FakeTensorMode trace) holds no data for a kernel to read
    return not is_fake(t)


def register_gpu() -> None:
    """Register the Triton routing kernels (routing and the metadata sort) as "triton"."""
    register_routing_kernels(
        RoutingKernels(
            "triton",
            lazy(_KERNELS, "route"),
            lazy(_KERNELS, "sort_by_expert"),
            supports=_supports,
            priority=10,
            route_with_aux=lazy(_KERNELS, "route_with_aux"),
            route_fwd=lazy(_KERNELS, "route_fwd"),
            route_bwd=lazy(_KERNELS, "route_bwd"),
        )
    )
