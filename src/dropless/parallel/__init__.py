"""Scale-out on torch.distributed: DeviceMesh from config, the expert-parallel
dispatcher (all-to-all over the "ep" axis), FSDP2/HSDP composition.

Imports of torch.distributed pieces stay inside the functions that need them, so
`import dropless.parallel` is cheap and works where distributed is unavailable.
"""

from .dispatcher import ExpertParallelDispatcher
from .experts import EPGroupedExperts, dispatchers, shard_moe_experts
from .fsdp import apply_fsdp, clip_grad_norm_
from .mesh import ParallelConfig, ParallelMesh, as_parallel_config, build_mesh, resolve_sizes

__all__ = [
    "EPGroupedExperts",
    "ExpertParallelDispatcher",
    "ParallelConfig",
    "ParallelMesh",
    "apply_fsdp",
    "as_parallel_config",
    "build_mesh",
    "clip_grad_norm_",
    "dispatchers",
    "resolve_sizes",
    "shard_moe_experts",
]
