"""Top-k routing: everything about the op in one folder.

- `reference.py`: `route_reference`, the specification (vectorised torch);
- `eager.py`: `route`, `route_with_aux` (argument checks, the torch path, the routing
  replay of a checkpointed recompute) and the capacity rule;
- `backends.py`: the registry `ROUTING` of faster implementations, which `route` and
  `permute.sort_by_expert` pick from;
- `custom_op.py`: `dropless::route` and its backward, what a compiled region or an
  exported program holds of `route` / `route_with_aux`;
- `routing_kernels.py`: the Triton kernels (scores, groups, bias, top-k and weights,
  forward and backward; the counting sort of the routing metadata) with their autograd;
- `gpu.py`: their registration as "triton", done on the first pick for a CUDA tensor.
"""

from .backends import (
    ROUTE_DTYPES,
    ROUTING,
    RoutingKernels,
    pick_routing_kernels,
    register_routing_kernels,
    routing_kernel_names,
)
from .eager import (
    capacity_keep_mask,
    check_expert_bias,
    expert_capacity,
    route,
    route_with_aux,
)
from .gpu import register_gpu

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
