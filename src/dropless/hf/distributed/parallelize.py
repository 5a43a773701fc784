"""`dropless.parallelize`: what `dropless train` applies to a model on several processes, for
any training loop (a plain torch loop, accelerate, Transformers' `Trainer`, TRL); usage in
docs/hf.md. In order: checks; activation checkpointing where asked (routing replay keeps
the recompute's routing); expert parallelism (`shard_hf_experts`); FSDP2 with a
mixed-precision policy, every decoder layer a unit; then, for a meta-device model and a
`checkpoint`, each rank allocates and reads its own shards (`load_sharded_hf`).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from ...parallel.fsdp import apply_fsdp, clip_grad_norm_
from ...parallel.mesh import ParallelConfig, ParallelMesh, build_mesh, resolve_sizes
from ..lora.peft_lora import base_model
from .expert_parallel import hf_dispatchers, shard_hf_experts
from .peft_save import route_peft_save
from .trainer_checkpoint import accept_full_state_dicts

_MESH = "_dropless_parallel_mesh"


def _not_suboptimal(record: logging.LogRecord) -> bool:
    """DTensor warns on every rank that a redistribution over the (dp, ep) mesh takes two
    collectives; the layout is deliberate and the warning says nothing a user can act on."""
    return "suboptimal" not in record.getMessage()


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers (the first ModuleList named `...layers`), FSDP2's units."""
    for name, m in model.named_modules():
        if name.endswith("layers") and isinstance(m, nn.ModuleList):
            return list(m)
    return []


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Non-reentrant activation checkpointing under the name the installed Transformers has
    (`activation_checkpointing_enable`; the deprecated `gradient_checkpointing_enable` before)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def check_sizes(ep: int, dp_replicate: int, world: int, num_experts: int, cp: int = 1) -> None:
    """`dropless train`'s check of the layout (`parallel.mesh.resolve_sizes`), its messages
    in `parallelize`'s keywords (its dp_shard is world / (dp_replicate x cp): the data
    ranks of each replica; expert parallelism borrows its ranks from dp_shard x cp)."""
    try:
        layout = ParallelConfig(dp_replicate=dp_replicate, cp=cp, ep=ep)
        resolve_sizes(layout, world, num_experts)
    except ValueError as e:
        msg = str(e).replace(
            "parallel.dp_shard=", "the processes of each replica (world size / dp_replicate) = "
        )
        msg = msg.replace("parallel.", "")
        raise ValueError(f"dropless.parallelize: {msg}") from None


def _check_model(model: nn.Module) -> int:
    """The model's experts per layer, after checking nothing stands in the way."""
    from torch.distributed.tensor import DTensor

    from ..layers import moe_layers

    base = base_model(model)
    layers = moe_layers(base)
    if not layers:
        raise ValueError(
            f"dropless.parallelize: {type(base).__name__} has no Mixture-of-Experts layers "
            "(no experts module Transformers decorates with @use_experts_implementation)"
        )
    _check_not_deepspeed(base)
    get = getattr(base, "get_experts_implementation", None)
    impls = set(get().values()) if get is not None else set()
    if "dropless" not in impls:
        raise ValueError(
            f"dropless.parallelize: {type(base).__name__} runs the experts implementation "
            f"{sorted(impls)}, not dropless's: call dropless.patch() before building or loading "
            "the model, or dropless.patch_model(model) on it"
        )
    tp = (
        getattr(base, "_device_mesh", None) is not None
        or (getattr(base, "_tp_size", None) or 1) > 1
    )
    if tp or any(getattr(layer.experts, "_is_expert_parallel", False) for layer in layers):
        raise ValueError(
            "dropless.parallelize: the model was loaded with Transformers' own tensor or expert "
            "parallelism (from_pretrained(tp_plan=...) or distributed_config=...); load it "
            "without tp_plan and distributed_config, and let dropless.parallelize(ep=...) shard it"
        )
    _check_no_peft_experts(model, layers)
    if any(isinstance(p, DTensor) for p in base.parameters()):
        raise ValueError(
            "dropless.parallelize: the model's parameters are already distributed (DTensors: "
            "another fully_shard / tensor-parallel plan, or parallelize called twice); "
            "call it once, on a model no other wrapper has sharded"
        )
    return int(layers[0].num_experts)


def _check_no_peft_experts(model: nn.Module, layers) -> None:
    """PEFT's `target_parameters` LoRA wraps an experts module in a ParamWrapper whose B
    factor [out, r*E] has the expert index fastest: it cannot be split by expert."""
    import sys

    peft_layer = sys.modules.get("peft.tuners.lora.layer")  # never imported here
    wrapper = getattr(peft_layer, "ParamWrapper", None)
    if wrapper is None:
        return
    wrapped = [n for n, m in model.named_modules() if isinstance(m, wrapper)]
    if wrapped:
        raise ValueError(
            f"dropless.parallelize: {wrapped[0]} is PEFT's target_parameters LoRA on the experts, "
            "whose factors cannot be split by expert (PEFT's B [out, r*E] has the expert index "
            "fastest). Give the experts their own factors instead, which shard with them: "
            "dropless.hf.attach_expert_lora(experts, rank, alpha) on each experts module (what "
            "dropless train's LoRA and examples/moe_example_common.py do), keep PEFT's "
            "target_modules for the attention, and save with dropless.hf.save_lora_adapter"
        )


def _check_not_deepspeed(model: nn.Module) -> None:
    zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
    if not zero3:
        try:
            from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

            zero3 = bool(is_deepspeed_zero3_enabled())
        except ImportError:
            zero3 = False
    if zero3:
        raise ValueError(
            "dropless.parallelize cannot shard a model that DeepSpeed ZeRO-3 partitions: ZeRO-3 "
            "gathers every expert onto each rank in its own hooks. Remove the DeepSpeed config "
            "(TrainingArguments(deepspeed=None), no `deepspeed` in the accelerate config); "
            "dropless.parallelize applies FSDP2 itself (ZeRO-3's sharding)"
        )


def parallel_mesh(model: nn.Module) -> ParallelMesh | None:
    """The `ParallelMesh` `parallelize` laid `model` out on (None if it did not)."""
    return base_model(model).__dict__.get(_MESH)


def parallelize(
    model: nn.Module,
    *,
    ep: int = 1,
    fsdp: bool = True,
    dp_replicate: int = 1,
    cp: int = 1,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    checkpoint=None,
    device=None,
    overlap_chunks: int = 1,
    reshard_after_forward: bool = True,
    rename=None,
) -> nn.Module:
    """Lay a `dropless.patch()`ed Transformers MoE model out over the processes of the
    default process group, in place (returns it), as `dropless train` does; every keyword
    is described in docs/hf.md, "Many GPUs with your own trainer".

    ep: experts per layer split over ep ranks (all-to-all); fsdp: FSDP2 (HSDP over
    dp_replicate replicas), refused False on several processes since nothing else would
    average the gradients; cp: each sequence split over cp ranks (`context_parallel`);
    mixed_precision: a dtype or a `MixedPrecisionPolicy`; checkpoint: a safetensors
    directory each rank reads only its shards of into a meta-device model (on `device`;
    `rename` maps a state key to its checkpoint key, None: not in it).

    Raises ValueError, saying what to change, for sizes that do not fit, a model not
    patched, and what cannot compose (DeepSpeed ZeRO-3, Transformers' own tensor/expert
    parallelism, an already sharded model). Afterwards Transformers' `Trainer` and TRL train
    the model without wrapping it again, and a PeftModel saves in PEFT's format.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "dropless.parallelize needs torch.distributed initialised: start the script with "
            "`torchrun --nproc-per-node N script.py` and call torch.distributed.init_process_group() "
            "(or create Transformers' TrainingArguments / accelerate's Accelerator, which do) "
            "before dropless.parallelize"
        )
    world = dist.get_world_size()
    num_experts = _check_model(model)
    check_sizes(ep, dp_replicate, world, num_experts, cp)
    if not fsdp and world > 1:
        raise ValueError(
            f"dropless.parallelize(fsdp=False) on {world} processes: without FSDP2 nothing would "
            "average the gradients (DDP cannot take the DTensor experts); use fsdp=True"
        )
    # one process takes the path a node takes (as parallel.force_distributed does)
    cfg = ParallelConfig(
        dp_replicate=dp_replicate,
        cp=cp,
        ep=ep,
        overlap_chunks=overlap_chunks,
        force_distributed=world == 1,
    )
    _apply(
        model, cfg, fsdp=fsdp, mixed_precision=mixed_precision,
        activation_checkpointing=activation_checkpointing, checkpoint=checkpoint,
        device=device, reshard_after_forward=reshard_after_forward, rename=rename,
    )  # fmt: skip
    _ready_for_trainers(model, fsdp, cp)
    return model


def _ready_for_trainers(model: nn.Module, fsdp: bool, cp: int = 1) -> None:
    """What Transformers' Trainer, TRL and PEFT need of a model `parallelize` laid out."""
    from . import context_parallel

    if cp > 1:  # whole sequences in, each rank's part out; the cp ranks read the same data
        context_parallel.install(model, parallel_mesh(model))
    else:  # the data loaders accelerate prepares from now on follow this model's layout
        context_parallel.forget()
    base = base_model(model)
    if fsdp and hasattr(base, "is_distributed_loading_by_transformers"):
        _mark_sharded(base, parallel_mesh(model))
    if fsdp and hasattr(model, "generate"):
        # `generate` is not `forward`: without this the FSDP2 root's own parameters (the
        # embedding, the head) stay sharded when a PeftModel's generate calls the base
        # model's forward ("got mixed torch.Tensor and DTensor"; Trainer does the same
        # under its own FSDP2 plugin)
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")
    if fsdp:
        accept_full_state_dicts(model)  # Trainer's resume loads full tensors
    route_peft_save(model)


class ModelLayout:
    """A model laid out by `parallelize_config`, as a training loop asks it: its mesh
    (`pmesh`), gradient clipping over the meshes its parameters live on, and the
    expert-parallel figures of the steps since the last ask."""

    def __init__(self, model: nn.Module, pmesh: ParallelMesh):
        self.model, self.pmesh = model, pmesh

    def clip_grad_norm_(self, params, max_norm: float) -> float:
        return float(clip_grad_norm_(list(params), max_norm))

    def ep_sums(self) -> torch.Tensor | None:
        """float64 [4]: this rank's dispatch, expert and combine seconds and the bytes its
        all-to-alls sent (forward + backward) since the last call, over every MoE layer;
        None without expert parallelism."""
        ds = hf_dispatchers(self.model)
        if not ds:
            return None
        t = torch.zeros(4, dtype=torch.float64)
        for d in ds:
            s = d.pop_stats()
            t += torch.tensor(
                [s["dispatch_s"], s["expert_s"], s["combine_s"], 2.0 * s["bytes_sent"]],
                dtype=torch.float64,
            )
        return t


def parallelize_config(model: nn.Module, cfg, *, mixed_precision=None) -> ModelLayout:
    """What `parallelize` does, from a `ParallelConfig` (the `[parallel]` section of
    `dropless train`, already checked against the world): the mesh, expert parallelism,
    FSDP2 and, with cp > 1, the context-parallel attention. Returns the layout, the one
    thing `dropless train` asks of this layer."""
    _apply(model, cfg, fsdp=True, mixed_precision=mixed_precision)
    return ModelLayout(model, parallel_mesh(model))


def _apply(
    model, cfg, *, fsdp: bool, mixed_precision=None, activation_checkpointing: bool = False,
    checkpoint=None, device=None, reshard_after_forward: bool = True, rename=None,
) -> nn.Module:  # fmt: skip
    from ..layers import moe_layers

    base = base_model(model)
    if activation_checkpointing:
        enable_activation_checkpointing(base)
    layers = moe_layers(base)
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    if _not_suboptimal not in log.filters:
        log.addFilter(_not_suboptimal)
    pm = build_mesh(cfg, layers[0].num_experts if layers else None)
    shard_hf_experts(model, pm)
    if fsdp:
        mp = None if mixed_precision == torch.float32 else mixed_precision
        if isinstance(mp, torch.dtype):  # used in that dtype, gradients reduced in fp32
            from torch.distributed.fsdp import MixedPrecisionPolicy

            mp = MixedPrecisionPolicy(param_dtype=mp, reduce_dtype=torch.float32)
        apply_fsdp(
            model, pm, blocks=decoder_layers(model), mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
        )  # fmt: skip
    base.__dict__[_MESH] = pm
    if pm.config.cp > 1:  # attention across the cp ranks of each sequence
        from ...parallel.context import enable

        enable(base, pm.cp_group)
    if checkpoint is not None:
        _load(model, checkpoint, device, rename)
    return model


def _mark_sharded(base: nn.Module, pm: ParallelMesh) -> None:
    """Transformers' mark of a model that owns its placement and gradient reduction (as
    `from_pretrained(distributed_config=...)` leaves one): its Trainer then neither moves it
    nor has accelerate wrap it in DDP (which refuses DTensors), and saves from every rank
    (the gathers are collectives). The DistributedConfig is not saved."""
    from transformers import DistributedConfig

    if getattr(base.config, "distributed_config", None) is None:
        base.config.distributed_config = DistributedConfig(
            fsdp_size=pm.config.dp_shard * pm.config.cp, dp_replicate_size=pm.config.dp_replicate
        )
    base._is_distributed_loading_by_transformers = True
    # Transformers' own FSDP2 mark (`distributed.fsdp.apply_fsdp2`): `generate` keeps every
    # rank stepping until all are done (synced_gpus; under ep each step's forward is
    # collective), and Trainer defers FSDP2's reduction to the last micro-batch
    base._is_fsdp_managed_module = True


def _load(model: nn.Module, checkpoint, device, rename) -> None:
    from .sharded_load import load_sharded_hf

    if device is None:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    if any(t.is_meta for t in model.parameters()):
        model.to_empty(device=device)
    load_sharded_hf(base_model(model), checkpoint, rename=rename)
