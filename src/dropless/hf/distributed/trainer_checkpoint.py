"""Resuming Transformers' `Trainer` on a model laid out by `dropless.parallelize`.

Trainer cannot checkpoint the optimizer of a model sharded at load time, and its resume
loads full tensors, which cannot fill DTensor parameters. `trainer_checkpoints()` is a
callback that saves the optimizer and scheduler as a sharded DCP folder
`checkpoint-N/dropless_optimizer/` and, on resume, reads the weights with
`load_sharded_hf`; `accept_full_state_dicts` lets Trainer's own load get through
(docs/hf.md, "Resuming a Trainer run").
"""

from __future__ import annotations

import types
from pathlib import Path

import torch
from torch import nn

OPTIMIZER_DIR = "dropless_optimizer"


def _inner(optimizer):
    """The torch optimizer inside accelerate's `AcceleratedOptimizer`."""
    return getattr(optimizer, "optimizer", optimizer)


def _state(model, optimizer, scheduler) -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(model, _inner(optimizer))}
    if scheduler is not None:
        state["scheduler"] = scheduler.state_dict()
    return state


def save_optimizer(model: nn.Module, optimizer, scheduler, path) -> None:
    """The optimizer's state (sharded as the parameters are) and the scheduler's, as a DCP
    folder: every rank calls this and writes its own shards."""
    import torch.distributed.checkpoint as dcp

    dcp.save(_state(model, optimizer, scheduler), checkpoint_id=str(path))


def load_optimizer(model: nn.Module, optimizer, scheduler, path) -> None:
    """What `save_optimizer` wrote, into `optimizer` and `scheduler` (any number of ranks)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    if not Path(path).is_dir():
        raise ValueError(
            f"{str(path)!r} does not exist: the checkpoint was not written with "
            "dropless.hf.trainer_checkpoints() among the Trainer's callbacks, so it has no "
            "optimizer state to resume from"
        )
    state = _state(model, optimizer, scheduler)
    dcp.load(state, checkpoint_id=str(path))
    set_optimizer_state_dict(model, _inner(optimizer), state["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(state["scheduler"])


def trainer_checkpoints(resume_from_checkpoint=None):
    """A Transformers `TrainerCallback` that makes a Trainer run over a parallelized model
    resumable (see the module docstring). Give the same `resume_from_checkpoint` (a
    `checkpoint-N` directory) to it and to `trainer.train`; the Trainer needs
    `save_only_model=True`."""
    from transformers import TrainerCallback

    from ..lora.peft_lora import base_model
    from .sharded_load import load_sharded_hf

    class TrainerCheckpoints(TrainerCallback):
        def __init__(self, resume_from):
            self.resume_from = resume_from

        def on_save(self, args, state, control, model=None, optimizer=None, **kw):
            out = Path(args.output_dir) / f"checkpoint-{state.global_step}" / OPTIMIZER_DIR
            save_optimizer(model, optimizer, kw.get("lr_scheduler"), out)

        def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
            if self.resume_from is None:
                return
            if base_model(model) is not model:
                raise ValueError(
                    "dropless.hf.trainer_checkpoints: resuming a LoRA (PeftModel) run is not "
                    "supported; resume full fine-tuning runs only"
                )
            with torch.no_grad():
                load_sharded_hf(base_model(model), self.resume_from)
            path = Path(self.resume_from) / OPTIMIZER_DIR
            load_optimizer(model, optimizer, kw.get("lr_scheduler"), path)

    return TrainerCheckpoints(resume_from_checkpoint)


def _load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
    """`load_state_dict` of a parallelized model: full tensors for DTensor parameters go
    through `set_model_state_dict` (each rank keeps its shards); keys the model lacks are
    skipped unless strict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.tensor import DTensor

    own = self.state_dict()
    full = any(
        isinstance(own.get(k), DTensor) and not isinstance(v, DTensor)
        for k, v in state_dict.items()
    )
    if not full:
        return type(self).load_state_dict(self, state_dict, strict, assign)
    known = {k: v for k, v in state_dict.items() if k in own}
    if strict and len(known) != len(state_dict):
        extra = sorted(set(state_dict) - set(own))[:5]
        raise RuntimeError(f"load_state_dict: unexpected keys {extra}")
    options = StateDictOptions(full_state_dict=True, strict=strict)
    return set_model_state_dict(self, known, options=options)


def accept_full_state_dicts(model: nn.Module) -> None:
    """Give `model` (an FSDP2 root) the `load_state_dict` above."""
    model.load_state_dict = types.MethodType(_load_state_dict, model)
