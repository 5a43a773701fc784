"""The trainer's AdamW over FSDP2 x EP DTensor parameters (several meshes): fused, one
group per mesh, and its step allocates no parameter-sized temporary."""

from __future__ import annotations

import torch
from _checks_hf import B, L, V, _model
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.parallel import ParallelConfig
from dropless.train.config.load import load_config
from dropless.train.model.parallelize import parallelize_for_training
from dropless.train.state import build_optimizer


class _FreshBytes(TorchDispatchMode):
    """Bytes of every tensor an op returns that is not one of its inputs (in-place
    updates return their input), local shards for DTensors."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {id(t) for t in torch.utils._pytree.tree_leaves((args, kwargs))}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t) not in ins:
                local = t.to_local() if isinstance(t, DTensor) else t
                n = local.numel() * local.element_size()
                self.largest, self.total = max(self.largest, n), self.total + n
        return out


def fsdp_fused_adamw(rank, world):
    model = _model()
    parallelize_for_training(model, ParallelConfig(ep=2), world)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, load_config().optim)
    assert all(g["fused"] for g in opt.param_groups)
    meshes = {
        len({str(getattr(p, "device_mesh", None)) for p in g["params"]}) for g in opt.param_groups
    }
    assert meshes == {1}, "a parameter group mixes device meshes"
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()  # the first step allocates the moment buffers
    model(input_ids=ids, labels=ids).loss.backward()
    spy = _FreshBytes()
    with spy:
        opt.step()
    smallest = min(p.to_local().numel() * p.element_size() for p in params if p.dim() >= 2)
    assert spy.largest < smallest, (spy.largest, smallest)
    assert torch.isfinite(torch.stack([p.to_local().sum() for p in params])).all()
