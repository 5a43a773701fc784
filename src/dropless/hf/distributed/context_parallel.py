"""Context parallelism inside trainers that feed whole sequences (Transformers' `Trainer`,
TRL, accelerate's prepared data loader, a loop of one's own). `dropless.parallelize(model,
cp=N)` calls `install(model, mesh)`: accelerate's data loaders get the layout's mesh (the
ranks of a cp group read the same samples), a forward pre-hook (`CPInputs`) gives each rank
its part of the whole sequences (labels shifted first), and the first forward checks the
cp ranks hold the same batch. What holds and what is refused: docs/hf.md.
"""

# B batch, L whole sequence length, S this rank's length (L / cp)

from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ...parallel.context import local_positions, shard_sequence
from ..lora.peft_lora import base_model

IGNORE = -100
_INPUTS = "_dropless_cp_inputs"
#: the layout (ParallelMesh) of the last `parallelize(cp > 1)` in this process: the data
#: loaders accelerate prepares shard over its dp groups
_LAYOUT = None


def _hash(t: torch.Tensor) -> torch.Tensor:
    """An int64 hash of a tensor's shape and values (the same on every rank for equal
    tensors; int64 products wrap)."""
    x = t.detach().reshape(-1)
    x = x.float().view(torch.int32).long() if x.is_floating_point() else x.long()
    w = torch.arange(x.numel(), dtype=torch.int64, device=x.device)
    w = w * 6364136223846793005 + 1442695040888963407
    h = ((x + 1) * w).sum()
    for n in t.shape:
        h = h * 1000003 + n
    return h


class CPInputs:
    """The forward pre-hook `install` registers: whole sequences in, this rank's part out."""

    def __init__(self, mesh):
        self.mesh, self.cp, self.checked = mesh, mesh.config.cp, False

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        if args:  # input_ids given by position
            kwargs = {"input_ids": args[0], **kwargs}
            args = args[1:]
        ref = kwargs.get("input_ids")
        ref = kwargs.get("inputs_embeds") if ref is None else ref
        if ref is None:
            return None
        if kwargs.get("past_key_values") is not None:
            raise ValueError(
                "dropless.parallelize(cp>1): generation with a cache is not supported under context "
                "parallelism (each rank holds part of every sequence); generate with a model laid out "
                "with cp=1"
            )
        r, pos = self.mesh.cp_rank, kwargs.get("position_ids")
        # position_ids [B, S] that are this rank's load-balanced chunks of a cp x S sequence:
        # the loop split the batch already (shard_batch)
        if pos is not None and pos.dim() == 2 and pos.shape[-1] % 2 == 0:
            want = local_positions(pos.shape[-1] * self.cp, self.cp, r, device=pos.device)
            if bool((pos == want).all()):
                return (args, kwargs) if args else None
        if not self.checked:
            self._check_same_batch(kwargs, ref)
            self.checked = True
        self._refuse(module, kwargs, ref, pos)
        L = ref.shape[1]
        labels, shift = kwargs.get("labels"), kwargs.get("shift_labels")
        if labels is not None and shift is None:  # shifted over the whole sequence
            shift = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
        batch = {
            k: kwargs[k]
            for k in ("input_ids", "inputs_embeds", "attention_mask", "position_ids", "labels")
            if kwargs.get(k) is not None
        }
        if shift is not None:
            batch["shift_labels"] = shift
            if kwargs.get("num_items_in_batch") is None:
                kwargs["num_items_in_batch"] = (shift != IGNORE).sum() / self.cp
        if "position_ids" not in batch:  # global positions, split with the rest
            B = ref.shape[0]
            batch["position_ids"] = torch.arange(L, device=ref.device).expand(B, L)
        local = {k: shard_sequence(v, self.cp, r, dim=1) for k, v in batch.items()}
        kwargs.update(local)
        return args, kwargs

    def _check_same_batch(self, kwargs: dict, ref: torch.Tensor) -> None:
        h = _hash(ref)
        if kwargs.get("labels") is not None:
            h = h * 31 + _hash(kwargs["labels"])
        v = torch.stack([h, -h])
        dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self.mesh.cp_group)
        if int(v[0]) != -int(v[1]):
            raise ValueError(
                f"dropless.parallelize(cp={self.cp}): the ranks of a context-parallel group hold "
                "different batches (their hashes differ); each rank of a cp group must get the same "
                "whole sequences, which it splits itself. Transformers' Trainer, TRL's trainers and "
                "accelerate's prepared data loaders do when they are created after "
                "dropless.parallelize(cp=...) (their data-parallel size is then world / cp); a loop of "
                "your own gives each cp group its share of the batch by "
                "dropless.hf.parallel_mesh(model).dp_rank, or splits the sequences itself with "
                "dropless.parallel.context.shard_batch"
            )

    def _refuse(self, module: nn.Module, kwargs: dict, ref: torch.Tensor, pos) -> None:
        cp, L = self.cp, ref.shape[1]
        if pos is not None and not bool(
            (pos == torch.arange(L, device=pos.device)).all()
        ):  # several documents in one row
            raise ValueError(
                f"dropless.parallelize(cp={cp}): packed rows (position_ids restarting inside a row, "
                "as TRL's packing=True or padding_free=True give) are not supported under context "
                "parallelism: the cp attention is causal over the whole row. Set packing=False and "
                "padding_free=False (pad each sample instead)"
            )
        if L % (2 * cp):
            raise ValueError(
                f"dropless.parallelize(cp={cp}): the batch's sequence length {L} is not divisible by "
                f"2 x cp = {2 * cp} (each rank holds two equal chunks): pad the batches to a multiple "
                f"of {2 * cp} (pad_to_multiple_of={2 * cp} in the data collator or TRL's config), "
                "the padding's labels -100"
            )
        config = getattr(base_model(module), "config", None)
        routed = kwargs.get("output_router_logits")
        routed = getattr(config, "output_router_logits", False) if routed is None else routed
        if routed and (getattr(config, "router_aux_loss_coef", 0) or 0) > 0:
            raise ValueError(
                f"dropless.parallelize(cp={cp}): the model's own balancing loss "
                f"(output_router_logits with router_aux_loss_coef={config.router_aux_loss_coef}) "
                "would be computed over each rank's tokens only, not the whole sequences'. Set "
                "output_router_logits=False (for TRL, in the model's config), or compute the "
                "balancing loss with dropless.hf.experts.router_losses.RouterLosses "
                "(rl.stats(..., cp_group=...), docs/hf.md)"
            )


def cp_inputs(model: nn.Module) -> CPInputs | None:
    """The hook `install` gave `model` (None without context parallelism)."""
    return base_model(model).__dict__.get(_INPUTS)


def install(model: nn.Module, mesh) -> None:
    """Make `model` (laid out with cp > 1 on `mesh`) take whole sequences in any loop (see
    the module docstring)."""
    global _LAYOUT
    hook = CPInputs(mesh)
    model.register_forward_pre_hook(hook, with_kwargs=True)
    base_model(model).__dict__[_INPUTS] = hook
    _LAYOUT = mesh
    _wrap("accelerate", "Accelerator", "_prepare_device_mesh", _prepare_device_mesh)
    _wrap("transformers", "Trainer", "get_cp_size", _get_cp_size)


def forget() -> None:
    """No cp layout for the data loaders accelerate prepares (a `parallelize` with cp=1)."""
    global _LAYOUT
    _LAYOUT = None


def _wrap(module: str, cls: str, method: str, make) -> None:
    """cls.method = make(original), once; nothing when the library or the method is absent."""
    try:
        owner = getattr(importlib.import_module(module), cls)
    except ImportError:
        return
    original = getattr(owner, method, None)
    if original is None or getattr(original, "_dropless", False):
        return
    wrapped = make(original)
    wrapped._dropless = True
    setattr(owner, method, wrapped)


def _prepare_device_mesh(original):
    def wrapped(self):
        mesh = original(self)
        if mesh is None and _LAYOUT is not None and _LAYOUT.config.cp > 1:
            return _LAYOUT.mesh  # ("dp_replicate", "dp_shard", "cp"): same batch per cp group
        return mesh

    return wrapped


def _get_cp_size(original):
    def wrapped(self) -> int:
        n = original(self)
        hook = cp_inputs(self.model) if n == 1 and self.model is not None else None
        return hook.cp if hook is not None else n

    return wrapped
