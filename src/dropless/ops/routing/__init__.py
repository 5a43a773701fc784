"""Top-k routing: everything about the op in one folder.

- `reference.py`: `route_reference`, the specification (vectorised torch);
- `route.py`: `route`, `route_with_aux` (argument checks, the torch path, the routing
  replay of a checkpointed recompute), the capacity rule, and the registry `ROUTING`
  of faster implementations, which `route` and `permute.sort_by_expert` pick from;
- `routing_kernels.py`: the Triton kernels (scores, groups, bias, top-k and weights,
  forward and backward; the counting sort of the routing metadata) with their autograd;
- `gpu.py`: their registration as "triton", done on the first pick for a CUDA tensor.
"""

from .gpu import register_gpu
from .route import (
    ROUTE_DTYPES,
    ROUTING,
    RoutingKernels,
    capacity_keep_mask,
    check_expert_bias,
    expert_capacity,
    pick_routing_kernels,
    register_routing_kernels,
    route,
    route_with_aux,
    routing_kernel_names,
)

ROUTING.on_first_cuda(register_gpu)

__all__ = [
    "ROUTE_DTYPES",
    "ROUTING",
    "RoutingKernels",
    "capacity_keep_mask",
    "check_expert_bias",
    "expert_capacity",
    "pick_routing_kernels",
    "register_routing_kernels",
    "route",
    "route_with_aux",
    "routing_kernel_names",
]
