"""Parallel layout from a config: validate sizes, then build a named DeviceMesh.

World = dp_replicate x dp_shard x cp. Context parallelism (cp) splits each sequence over
cp ranks (`dropless.parallel.context`); the cp ranks of one sequence are consecutive
(innermost). Expert parallelism borrows its ranks from the data- and context-parallel
shard dimensions (as TorchTitan and Megatron-Core do: experts see tokens, not
sequences): dp_shard x cp = dp_shard_mod_ep x ep. With cp = 1 the root mesh is 2-D
("dp_replicate", "dp_shard"); with cp > 1 it is ("dp_replicate", "dp_shard_cp") and
`mesh` its unflattening ("dp_replicate", "dp_shard", "cp"). The root is unflattened into
("dp_replicate", "dp_shard_mod_ep", "ep") for the experts and flattened into "dp" for
reductions. What is placed over which mesh: docs/parallel.md, "Layout".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

DISPATCHERS = ("alltoall",)
#: dispatchers that are designed but not written; asking for one is a clear error
PLANNED_DISPATCHERS = ("deepep",)


@dataclass
class ParallelConfig:
    """How a run is laid out over processes (also the `[parallel]` section of
    `dropless train`'s config: each key in docs/train.md).

    World = dp_replicate x dp_shard x cp (dp_shard -1: world_size / (dp_replicate x cp));
    ep divides dp_shard x cp and the number of experts; dispatcher "alltoall" is the only
    one implemented ("deepep" is planned). The sizes are checked against the world by
    `resolve_sizes`, before any work.
    """

    dp_replicate: int = 1
    dp_shard: int = -1
    cp: int = 1
    ep: int = 1
    dispatcher: str = "alltoall"
    overlap_chunks: int = 1
    timeout_s: float = 1800.0
    force_distributed: bool = False

    def __post_init__(self):
        for name in ("dp_replicate", "cp", "ep", "overlap_chunks"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"parallel.{name}={v!r} must be an int >= 1")
        if not isinstance(self.dp_shard, int) or not (self.dp_shard == -1 or self.dp_shard >= 1):
            raise ValueError(
                f"parallel.dp_shard={self.dp_shard!r} must be an int >= 1, or -1 for "
                "world_size / dp_replicate"
            )
        if self.dispatcher in PLANNED_DISPATCHERS:
            raise ValueError(
                f"parallel.dispatcher={self.dispatcher!r} is not implemented (planned); "
                f"allowed: {DISPATCHERS}: use parallel.dispatcher='alltoall'"
            )
        if self.dispatcher not in DISPATCHERS:
            raise ValueError(f"parallel.dispatcher={self.dispatcher!r}; allowed: {DISPATCHERS}")
        _check_timeout(self.timeout_s)
        if not isinstance(self.force_distributed, bool):
            raise ValueError(
                f"parallel.force_distributed={self.force_distributed!r} must be true or false "
                "(true: take the parallel path on one process too)"
            )


#: torch.distributed holds a timeout in int64 nanoseconds (about 292 years): a larger one
#: wraps around into a negative timeout that fails the first connection
MAX_TIMEOUT_S = 1e9


def _check_timeout(t) -> None:
    if isinstance(t, bool) or not isinstance(t, int | float) or not t > 0:
        raise ValueError(f"parallel.timeout_s={t!r}: must be a number of seconds > 0")
    if not t <= MAX_TIMEOUT_S:
        raise ValueError(
            f"parallel.timeout_s={t!r}: must be at most {MAX_TIMEOUT_S:g} seconds (about 31 years; "
            "torch.distributed's limit is int64 nanoseconds); use e.g. 1800"
        )


def as_parallel_config(cfg) -> ParallelConfig:
    """Accept a ParallelConfig, a run config with a `.parallel` section, or a dict."""
    if cfg is None:
        return ParallelConfig()
    src = cfg if isinstance(cfg, ParallelConfig | dict) else getattr(cfg, "parallel", cfg)
    if isinstance(src, ParallelConfig):
        return src
    if isinstance(src, dict):
        return ParallelConfig(**src)
    names = [f.name for f in dataclasses.fields(ParallelConfig)]
    return ParallelConfig(**{n: getattr(src, n) for n in names if hasattr(src, n)})


def resolve_sizes(cfg, world_size: int, num_experts: int | None = None) -> ParallelConfig:
    """Check the layout against the world size and the experts; fill dp_shard=-1.

    Raises ValueError naming the field, the sizes and a fix, before any process
    group work is done.
    """
    cfg = as_parallel_config(cfg)
    R, S, cp, ep = cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.ep
    if world_size % R:
        raise ValueError(
            f"parallel.dp_replicate={R} does not divide the world size {world_size}; "
            f"pick a divisor of {world_size}"
        )
    if world_size % (R * cp):
        raise ValueError(
            f"parallel.dp_replicate x parallel.cp = {R} x {cp} = {R * cp} does not divide the "
            f"world size {world_size} (processes); pick cp from {_divisors(world_size // R)}"
        )
    if S == -1:
        S = world_size // (R * cp)
    if R * S * cp != world_size:
        if cp == 1:
            raise ValueError(
                f"parallel.dp_replicate x parallel.dp_shard = {R} x {S} = {R * S} must equal "
                f"the world size {world_size} (processes); set dp_shard={world_size // R} or -1"
            )
        raise ValueError(
            f"parallel.dp_replicate x parallel.dp_shard x parallel.cp = {R} x {S} x {cp} = "
            f"{R * S * cp} must equal the world size {world_size} (processes); set "
            f"dp_shard={world_size // (R * cp)} or -1"
        )
    shard = S * cp  # the ranks experts are split and sharded over
    where = f"parallel.dp_shard={S}" if cp == 1 else f"parallel.dp_shard x parallel.cp = {shard}"
    if shard % ep:
        raise ValueError(
            f"parallel.ep={ep} must divide {where} (expert parallelism borrows ranks from the "
            f"FSDP shard dimension); pick ep from {_divisors(shard)}"
        )
    if num_experts is not None and num_experts % ep:
        raise ValueError(
            f"num_experts={num_experts} is not divisible by parallel.ep={ep}; every EP rank "
            f"must own the same number of experts: pick ep from "
            f"{[d for d in _divisors(shard) if num_experts % d == 0]}"
        )
    return dataclasses.replace(cfg, dp_shard=S)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass
class ParallelMesh:
    """The built layout. `mesh` is the ("dp_replicate", "dp_shard") mesh (cp > 1:
    ("dp_replicate", "dp_shard", "cp")); `expert_mesh` the ("dp_replicate",
    "dp_shard_mod_ep", "ep") unflattening of the root; `dp` the flattened mesh of every
    rank; `shard_mesh` (cp > 1 only) the root ("dp_replicate", "dp_shard_cp") that dense
    parameters are sharded over. Sub-meshes for FSDP are given by the properties.
    """

    config: ParallelConfig
    mesh: object
    expert_mesh: object
    dp: object
    shard_mesh: object = None

    @property
    def world_size(self) -> int:
        return self.config.dp_replicate * self.config.dp_shard * self.config.cp

    @property
    def cp_mesh(self):
        """1-D mesh over the ranks that split one sequence (None when cp == 1)."""
        return self.mesh["cp"] if self.config.cp > 1 else None

    @property
    def cp_group(self):
        """The process group of this rank's sequence (None when cp == 1)."""
        return None if self.config.cp == 1 else self.cp_mesh.get_group()

    @property
    def cp_rank(self) -> int:
        """This rank's index among the cp ranks of its sequence (0 when cp == 1)."""
        return 0 if self.config.cp == 1 else self.cp_mesh.get_local_rank()

    @property
    def expert_shard_size(self) -> int:
        """How many ranks each expert's parameters are FSDP-sharded over (dp_shard_mod_ep)."""
        return self.config.dp_shard * self.config.cp // self.config.ep

    @property
    def ep_mesh(self):
        """1-D mesh over the ranks that split the experts between them."""
        return self.expert_mesh["ep"]

    @property
    def ep_group(self):
        return self.ep_mesh.get_group()

    @property
    def dp_group(self):
        return self.dp.get_group()

    @property
    def dense_fsdp_mesh(self):
        """FSDP mesh of dense parameters: 1-D dp_shard (dp_shard x cp flattened when cp > 1),
        or 2-D HSDP with dp_replicate."""
        root, name = (
            (self.mesh, "dp_shard") if self.shard_mesh is None else (self.shard_mesh, "dp_shard_cp")
        )
        if self.config.dp_replicate > 1:
            return root
        return root[name]

    @property
    def expert_fsdp_mesh(self):
        """FSDP mesh of expert parameters: dp_shard_mod_ep, HSDP with dp_replicate."""
        if self.config.dp_replicate > 1:
            return self.expert_mesh["dp_replicate", "dp_shard_mod_ep"]
        return self.expert_mesh["dp_shard_mod_ep"]

    @property
    def dp_rank(self) -> int:
        """This process's index in the global batch (0 .. world / cp - 1): the cp ranks of
        one sequence share it."""
        return self.dp.get_local_rank() // self.config.cp


def build_mesh(cfg, num_experts: int | None = None, device_type: str | None = None) -> ParallelMesh:
    """Validate `cfg` (see `resolve_sizes`) and build the DeviceMesh.

    Needs an initialised default process group (torchrun or init_process_group);
    device_type defaults to "cuda" when available, else "cpu" (gloo).
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "build_mesh needs torch.distributed initialised: run under torchrun or call "
            "torch.distributed.init_process_group first"
        )
    cfg = resolve_sizes(cfg, dist.get_world_size(), num_experts)
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    from torch.distributed.device_mesh import init_device_mesh

    R, S, cp, ep = cfg.dp_replicate, cfg.dp_shard, cfg.cp, cfg.ep
    if cp == 1:
        root = init_device_mesh(device_type, (R, S), mesh_dim_names=("dp_replicate", "dp_shard"))
        expert_mesh = root._unflatten("dp_shard", (S // ep, ep), ("dp_shard_mod_ep", "ep"))
        return ParallelMesh(cfg, root, expert_mesh, root._flatten("dp"))
    # one root over (replicas, shard x cp ranks), unflattened two ways: the data/context
    # view and the expert view (the EP group may span data- and context-parallel ranks)
    root = init_device_mesh(
        device_type, (R, S * cp), mesh_dim_names=("dp_replicate", "dp_shard_cp")
    )
    mesh = root._unflatten("dp_shard_cp", (S, cp), ("dp_shard", "cp"))
    expert_mesh = root._unflatten("dp_shard_cp", (S * cp // ep, ep), ("dp_shard_mod_ep", "ep"))
    return ParallelMesh(cfg, mesh, expert_mesh, root._flatten("dp"), shard_mesh=root)
