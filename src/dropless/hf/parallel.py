"""Expert parallelism for Transformers v5 MoE models patched with `dropless.patch`.

`shard_hf_experts(model, pmesh)` turns each experts module's weights into DTensors
`Shard(0)` over the "ep" axis (this rank keeps experts [r*L, (r+1)*L)) and gives the
module instance a forward that sends tokens through `ExpertParallelDispatcher`; the
grouped MLP on the local experts uses the same layout flags as the single-process
dropless path (`dropless.hf.experts_spec`). The stock router is untouched. Expert
parameters keep their names and global shapes, so DCP checkpoints reshard.

`load_sharded_hf(model, path)` fills a model built on the meta device and sharded (EP,
FSDP2) from a Transformers safetensors checkpoint, each rank reading only its shards.
"""

# T tokens, D model dim, E experts (global), L local experts, K top-k, S rows

from __future__ import annotations

import types

import torch
from torch import nn

from ..ops.compute_dtype import expert_input
from ..ops.dispatch import get_recipe
from ..ops.expert_mlp import grouped_mlp
from ..ops.grouped_gemm import grouped_gemm
from ..parallel.experts import _local
from .expert_lora import LORA_PARAMS, attached_lowrank, fold_attached
from .quantized_weights import (
    FP8_SCALE_SUFFIX,
    MXFP4_SUFFIXES,
    dequantize_block_fp8,
    dequantize_mxfp4,
    fp8_block_size,
)

#: the expert tensors of a v5 experts module, sharded over ep (gated experts: gate_up_proj;
#: non-gated ones, such as Nemotron-H's relu^2: up_proj)
EXPERT_PARAMS = (
    "gate_up_proj", "up_proj", "down_proj", "gate_up_proj_bias", "up_proj_bias", "down_proj_bias",
)  # fmt: skip


class _LocalExperts:
    """What the dispatcher calls: the local slice of one HF experts module.

    Every form the single-process dropless path runs (`hf.experts`) runs here on the rows
    this rank received: the fused MLP (gated or not), the fused MLP then the module's
    post-expert norm, or the generic gate between grouped GEMMs. The dispatcher applies
    the routing weight at home (prob_S is None), after any per-row norm, as one process
    does."""

    def __init__(self, module: nn.Module, spec, num_experts: int):
        self.module, self.spec, self.num_global_experts = module, spec, num_experts
        self.first = "gate_up_proj" if spec.gated else "up_proj"

    def weights(self):
        """(w1, w2, b1, b2): this rank's experts' weights and biases (None without)."""
        m, has_bias = self.module, self.spec.has_bias
        w1, w2 = _local(getattr(m, self.first)), _local(m.down_proj)
        if not has_bias:
            return w1, w2, None, None
        return w1, w2, _local(getattr(m, self.first + "_bias")), _local(m.down_proj_bias)

    def forward_sorted(self, x_SD, counts, prob_S):
        m, s = self.module, self.spec
        w1, w2, b1, b2 = self.weights()
        plain = s.path == "fused" and not s.post_norm
        lora = attached_lowrank(m)  # this rank's shards of the module's own factors
        if lora is not None and (not plain or get_recipe() is not None):
            # a path that cannot run them as thin GEMMs: folded, as one process does
            w1, w2 = (fold_attached(w, lr, s.trans_w) for w, lr in zip((w1, w2), lora))
            lora = None
        if s.path == "fused":
            y_SD = grouped_mlp(
                x_SD, counts, prob_S if plain else None, w1, w2, gate_up_bias=b1,
                down_bias=b2, activation=s.activation, trans_w=s.trans_w, lora=lora,
            )  # fmt: skip
        else:  # the module's own gate, under autograd (as `hf.experts._composed`)
            h_SN = grouped_gemm(x_SD, w1, counts, b1, trans_w=s.trans_w)
            a_SF = m._apply_gate(h_SN) if s.gated else m.act_fn(h_SN)
            y_SD = grouped_gemm(a_SF.to(w2.dtype), w2, counts, b2, trans_w=s.trans_w)
        if s.post_norm:
            y_SD = m.post_expert_norm(y_SD)
        if prob_S is not None and not plain:
            y_SD = y_SD * prob_S.to(y_SD.dtype)[:, None]
        return y_SD


def _ep_forward(self, hidden_states, top_k_index, top_k_weights):
    from .experts import _count_call, _record_counts

    local, disp = self.__dict__["_dropless_ep"]
    # under autocast its dtype, cast before the all-to-all (what crosses the wire)
    x_TD = expert_input(hidden_states, local.weights()[0])
    out_TD, tokens_per_expert_E, _, _ = disp(x_TD, top_k_index.long(), top_k_weights, local, None)
    _record_counts(self, tokens_per_expert_E)  # this rank's tokens; reduce across ranks
    _count_call(local.spec)
    return out_TD.to(hidden_states.dtype)


def _ep_refusal(layer, spec) -> str | None:
    """Why the experts of `layer` cannot run expert-parallel, or None."""
    if isinstance(spec, str):  # the stock forward would need every expert on each rank
        return (
            f"{layer.name} ({layer.family}): expert parallelism runs the dropless experts path, "
            f"and this module runs its own forward ({spec}). Train it with parallel.ep=1."
        )
    return None


def shard_hf_experts(model: nn.Module, pmesh) -> list[str]:
    """Expert-parallelise every experts module of a dropless-patched HF model in place.

    Every rank must hold the same full weights first (same seed or the same
    checkpoint), or the model is on the meta device: then, after FSDP and
    `to_empty`, `load_sharded_hf` reads each rank's shards from the checkpoint.
    Returns the names of the MoE blocks changed; no-op when ep == 1 (unless
    parallel.force_distributed: then the 1-rank expert-parallel path, the node's code).
    Every form of experts the dropless path runs is sharded (fused gated or non-gated,
    post-expert norm, generic gate). Raises ValueError, naming the module, its family and
    why, for an experts module on its own stock forward (it would need every expert on
    each rank). `attach_expert_lora` factors shard with their experts; on the generic or
    post-norm path (or under a low-precision recipe) they are folded into this rank's
    weights, as on one process.
    """
    from torch.distributed.tensor import DTensor, Shard

    from ..parallel.dispatcher import ExpertParallelDispatcher
    from .experts import experts_spec
    from .layers import moe_layers

    cfg = pmesh.config
    if cfg.ep == 1 and not cfg.force_distributed:
        return []
    P, r = pmesh.ep_mesh.size(), pmesh.ep_mesh.get_local_rank()
    done = []
    for layer in moe_layers(model):
        m = layer.experts
        if "_dropless_ep" in m.__dict__:
            continue
        spec = experts_spec(m)
        why = _ep_refusal(layer, spec)
        if why is not None:
            raise ValueError(why)
        E = int(m.num_experts)
        if E % P:
            raise ValueError(
                f"{layer.name} ({layer.family}): num_experts={E} is not divisible by "
                f"parallel.ep={P}; pick an ep that divides {E}"
            )
        L = E // P
        for name in (*EXPERT_PARAMS, *LORA_PARAMS):  # LoRA factors shard with their experts
            p = getattr(m, name, None)
            if not isinstance(p, nn.Parameter):
                continue
            local = p.detach()[r * L : (r + 1) * L].clone()
            d = DTensor.from_local(local, pmesh.ep_mesh, [Shard(0)], run_check=False)
            setattr(m, name, nn.Parameter(d, requires_grad=p.requires_grad))
        disp = ExpertParallelDispatcher(
            pmesh.ep_group,
            pmesh.dp_group,
            num_experts=E,
            num_chunks=cfg.overlap_chunks,
            overlap=cfg.overlap_chunks > 1,
        )
        m.__dict__["_dropless_ep"] = (_LocalExperts(m, spec, E), disp)
        m.forward = types.MethodType(_ep_forward, m)
        done.append(layer.name)
    return done


def hf_dispatchers(model: nn.Module) -> list:
    """The expert-parallel dispatchers of a model sharded by `shard_hf_experts`."""
    return [m.__dict__["_dropless_ep"][1] for m in model.modules() if "_dropless_ep" in m.__dict__]


# ---- loading a Transformers checkpoint into a sharded model, each rank its own part ------


def _checkpoint_files(path) -> dict[str, str]:
    """{checkpoint key: safetensors file} of a `save_pretrained` directory."""
    import json
    from pathlib import Path

    p = Path(path)
    index = p / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: str(p / f) for k, f in weight_map.items()}
    single = p / "model.safetensors"
    if not single.is_file():
        raise ValueError(
            f"{str(p)!r} has no model.safetensors or model.safetensors.index.json; sharded loading "
            "reads safetensors checkpoints (re-save the model with save_pretrained)"
        )
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {k: str(single) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def _plans(model: nn.Module, ckpt_keys, rename=None) -> dict[str, tuple]:
    """{model state key: ("direct", key) | ("merged", [[key per expert] per source], concat)}.

    Checkpoint keys are renamed with the model's own Transformers conversion mapping; per-
    expert tensors that it stacks (MergeModulelist) and concatenates (Concatenate, gate then
    up) are read expert by expert, so a rank touches only the experts it owns.
    """
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        apply_renamings,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    keys = model.state_dict().keys()
    known = dict.fromkeys((k for k in map(rename, keys) if k) if rename else keys, True)
    prefix = getattr(model, "base_model_prefix", None)
    plans: dict[str, tuple] = {}
    merged: dict[str, tuple] = {}
    for ck in ckpt_keys:
        if ck.endswith(FP8_SCALE_SUFFIX):  # read with its weight (_fill)
            continue
        if ck.endswith(MXFP4_SUFFIXES[0]):  # an MXFP4 weight: its _blocks and _scales
            base = ck.removesuffix(MXFP4_SUFFIXES[0])
            target = apply_renamings(base, renamings)
            target, _ = rename_source_key(target, [], [], prefix, known)
            plans[target] = ("mxfp4", base + MXFP4_SUFFIXES[0], base + MXFP4_SUFFIXES[1])
            continue
        if ck.endswith(MXFP4_SUFFIXES[1]):
            continue
        renamed = apply_renamings(ck, renamings)
        conv = pat = None
        for c in converters:
            target, pat = c.rename_source_key(renamed)
            if pat is not None:
                conv = c
                break
        if conv is None:
            target = renamed
        target, _ = rename_source_key(target, [], [], prefix, known)
        if conv is None:
            plans[target] = ("direct", ck)
            continue
        concat = _concatenates(conv, ck, target)
        m = re.search(re.escape(pat).replace(r"\*", r"(\d+)"), renamed)
        if m is None:
            raise ValueError(f"sharded loading: no expert index in {ck!r} for pattern {pat!r}")
        sources = merged.setdefault(target, ({}, conv, concat))[0]
        sources.setdefault(pat, {})[int(m.group(1))] = ck
    for target, (sources, conv, concat) in merged.items():
        plans[target] = ("merged", _keys_per_source(target, sources, conv), concat)
    return plans


def _concatenates(conv, ck: str, target: str) -> bool:
    """Whether the conversion of `ck` concatenates gate and up after stacking the experts
    (the two conversions sharded loading implements)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    ops = list(getattr(conv, "operations", []))
    kinds = [(type(o), getattr(o, "dim", None)) for o in ops]
    if kinds not in ([(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]):
        raise ValueError(
            f"sharded loading of {ck!r} -> {target!r}: the checkpoint conversion "
            f"{[type(o).__name__ for o in ops]} is not implemented (stacked experts with an "
            "optional gate/up concatenation are); train this model on one process"
        )
    return len(kinds) == 2


def _keys_per_source(target: str, sources: dict, conv) -> list[list[str]]:
    """[[checkpoint key of expert e for e in 0..E) per source pattern of `conv`]."""
    per_source = []
    for pat in conv.source_patterns:
        by_e = sources.get(pat, {})
        if sorted(by_e) != list(range(len(by_e))) or not by_e:
            raise ValueError(
                f"sharded loading of {target!r}: experts {sorted(by_e)} in the checkpoint"
            )
        per_source.append([by_e[e] for e in range(len(by_e))])
    return per_source


def _region(t) -> tuple[torch.Tensor, list[int]]:
    """(this rank's local tensor, its global offset) for a plain tensor or a DTensor."""
    if hasattr(t, "to_local"):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        assert tuple(local.shape) == tuple(shape), (tuple(local.shape), tuple(shape))
        return local, list(offset)
    return t, [0] * t.dim()


def _fill(
    local: torch.Tensor,
    plan,
    files: dict[str, str],
    offset: list[int],
    fp8_block: tuple[int, int] | None = None,
) -> None:
    """Copy the checkpoint's values of region [offset, offset + local.shape) of one model
    tensor into `local`, piece by piece (at most one expert's slice is held besides it).
    Quantised weights (block-FP8 beside their `_scale_inv`, MXFP4 `_blocks` / `_scales`)
    are dequantised region by region into `local`'s dtype."""
    import contextlib

    from safetensors import safe_open

    sl = [slice(o, o + s) for o, s in zip(offset, local.shape)]
    with contextlib.ExitStack() as stack:  # files are mapped only while this tensor is read
        handles = {}

        def handle(k):
            if files[k] not in handles:
                handles[files[k]] = stack.enter_context(safe_open(files[k], framework="pt"))
            return handles[files[k]]

        def part(k, idx):
            value = handle(k).get_slice(k)[tuple(idx)] if idx else handle(k).get_tensor(k)
            if fp8_block is None or k + FP8_SCALE_SUFFIX not in files:
                return value
            scale = handle(k + FP8_SCALE_SUFFIX).get_tensor(k + FP8_SCALE_SUFFIX)
            starts = [i.start or 0 for i in idx[-2:]] if idx else [0, 0]
            lead = tuple(idx[:-2]) if idx else ()
            return dequantize_block_fp8(value, scale[lead], fp8_block, local.dtype, *starts)

        if plan[0] == "mxfp4":  # experts [E, in, out] from [E, out, G, 16] + [E, out, G]
            blocks = part(plan[1], sl[:1])
            scales = part(plan[2], sl[:1])
            local.copy_(dequantize_mxfp4(blocks, scales, local.dtype)[(slice(None), *sl[1:])])
            return
        if plan[0] == "direct":
            local.copy_(part(plan[1], sl).reshape(local.shape))
            return
        per_source, concat = plan[1], plan[2]
        for i, e in enumerate(range(sl[0].start, sl[0].stop)):
            if not concat:
                local[i].copy_(part(per_source[0][e], sl[1:]))
                continue
            start = 0
            for src in per_source:  # gate rows, then up rows, along model dim 1
                n = handle(src[e]).get_slice(src[e]).get_shape()[0]
                lo, hi = max(sl[1].start, start), min(sl[1].stop, start + n)
                if lo < hi:
                    piece = part(src[e], [slice(lo - start, hi - start), *sl[2:]])
                    local[i, lo - sl[1].start : hi - sl[1].start].copy_(piece)
                start += n


@torch.no_grad()
def load_sharded_hf(model: nn.Module, path, rename=None) -> list[str]:
    """Fill a model built on the meta device and sharded (expert parallelism, FSDP2) with the
    weights of the Transformers checkpoint in `path`: each rank materializes only its own
    shards and reads only their slices from the safetensors files (`safe_open` +
    `get_slice`), cast to each parameter's dtype. Returns the state keys left unread (the
    expert biases dropless added, zeroed). Call after `model.to_empty(device=...)`.

    rename: maps a state key to its name in the checkpoint, None for a tensor the checkpoint
    does not hold (LoRA adapters: the caller sets them; PEFT's `base_layer` names).

    Raises ValueError for a checkpoint layout it cannot slice or a tensor it lacks.
    """
    from .layers import added_state_keys

    files = _checkpoint_files(path)
    plans = _plans(model, files, rename)
    fp8_block = _fp8_block(path) if _has_fp8(files) else None
    _retie(model)
    _init_non_persistent_buffers(model)  # first: Transformers' init may touch parameters too
    added = set(added_state_keys(model))
    done: set[int] = set()
    unread = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in done:  # tied weights: one tensor under two names
            continue
        key = name if rename is None else rename(name)
        if key is None:
            continue
        local, offset = _region(t)
        plan = plans.get(key)
        if plan is None:
            if name in added:
                local.zero_()
                unread.append(name)
                continue
            tied = getattr(model, "all_tied_weights_keys", None) or {}
            if name in tied:
                continue
            raise ValueError(
                f"the checkpoint in {str(path)!r} has no tensor for {name!r}; "
                "is it a checkpoint of this model family?"
            )
        if local.numel():
            _fill(local, plan, files, offset, fp8_block)
        done.add(id(t))
    return unread


def _fp8_block(path) -> tuple[int, int]:
    """The block size in the checkpoint's own config.json (the model may have been built
    from a copy without its quantization_config)."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(path) / "config.json").read_text())
    return fp8_block_size(types.SimpleNamespace(quantization_config=cfg.get("quantization_config")))


def _has_fp8(files: dict[str, str]) -> bool:
    return any(k.endswith(FP8_SCALE_SUFFIX) for k in files)


def is_quantized_checkpoint(path) -> bool:
    """Whether the safetensors checkpoint in `path` stores block-FP8 or MXFP4 weights."""
    files = _checkpoint_files(path)
    return _has_fp8(files) or any(k.endswith(MXFP4_SUFFIXES[0]) for k in files)


def _retie(model: nn.Module) -> None:
    # a plain `to_empty` gives tied parameters separate storage (FSDP2 keeps them shared)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    split = [t for t, src in tied.items() if t in params and params[t] is not params.get(src)]
    if split and hasattr(model, "tie_weights"):
        model.tie_weights()


def _init_non_persistent_buffers(model: nn.Module) -> None:
    # rotary inv_freq and the like are not in checkpoints: recompute them as Transformers does
    init = getattr(model, "_init_weights", None)
    for mod in model.modules():
        if mod._non_persistent_buffers_set and init is not None:
            init(mod)
