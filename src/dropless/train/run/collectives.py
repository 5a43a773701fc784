"""Every collective the trainer issues, on the device its process group's backend takes.

NCCL takes only CUDA tensors; gloo takes CPU ones (and, for some collectives, CUDA).
The trainer keeps its small bookkeeping tensors (loss sums, stop flags, token
counts) on the CPU, so a collective issued on them directly passes every test on
gloo and stops on NCCL before the first step. The functions here move a tensor to
the backend's device when the backend does not take the tensor's own device, run
the collective there and hand the result back on the caller's device.

Nothing under `train/` calls a `torch.distributed` collective directly (a test
walks the sources); it calls these.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

#: backend -> the device types its collectives take
_TAKES: dict[str, tuple[str, ...]] = {
    "nccl": ("cuda",),
    "gloo": ("cpu", "cuda"),
    "mpi": ("cpu", "cuda"),
    "xccl": ("xpu",),
    "fake": ("cpu", "cuda", "meta"),
}

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def backend_device_types(backend: str) -> dict[str, str]:
    """device type -> backend name, for a backend string as `dist.get_backend` writes it:
    a plain name ("nccl") or per-device pairs ("cpu:gloo,cuda:nccl")."""
    backend = backend.lower()
    if ":" in backend:
        return dict(pair.split(":", 1) for pair in backend.split(","))
    return {kind: backend for kind in _TAKES.get(backend, ("cpu",))}


def collective_device(tensor: torch.Tensor, group=None) -> torch.device:
    """Where `tensor` must be for a collective over `group`: its own device when the
    backend takes it, else the backend's device (the current CUDA device for NCCL)."""
    kinds = backend_device_types(str(dist.get_backend(group)))
    if tensor.device.type in kinds:
        return tensor.device
    if "cuda" in kinds and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(next(iter(kinds)))


def all_reduce(tensor: torch.Tensor, op: str = "sum", group=None) -> torch.Tensor:
    """`tensor` reduced over `group` (op "sum", "max" or "min"), written back into
    `tensor` (on its own device) and returned."""
    if op not in _OPS:
        raise ValueError(f"all_reduce: op={op!r}; expected one of {sorted(_OPS)}")
    dev = collective_device(tensor, group)
    work = tensor if dev == tensor.device else tensor.to(dev)
    dist.all_reduce(work, op=_OPS[op], group=group)
    if work is not tensor:
        tensor.copy_(work)
    return tensor


def broadcast_object(obj, src: int = 0, group=None):
    """Rank `src`'s value of a picklable `obj` on every process of `group`."""
    box = [obj]
    kinds = backend_device_types(str(dist.get_backend(group)))
    device = None  # the backend's default: the CPU where it takes CPU tensors
    if "cpu" not in kinds and "cuda" in kinds and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())  # NCCL
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    return box[0]


def barrier(group=None) -> None:
    """Wait until every process of `group` gets here (no-op without a process group)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)
