"""Sharded loading: a Transformers safetensors checkpoint into a model built on the meta
device and sharded, each rank reading only its own regions: keys renamed with the model's
own conversion mapping, per-expert tensors read expert by expert, block-FP8 and MXFP4
weights dequantised region by region (`quantized_weights.py`).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import torch
from torch import nn

from .quantized_weights import (
    FP8_SCALE_SUFFIX,
    MXFP4_SUFFIXES,
    dequantize_block_fp8,
    dequantize_mxfp4,
    fp8_block_size,
)


def _checkpoint_files(path) -> dict[str, str]:
    """{checkpoint key: safetensors file} of a `save_pretrained` directory."""
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
    """Fill a model built on the meta device and sharded with the weights of the
    Transformers checkpoint in `path`, each rank reading only its shards' slices, after
    `model.to_empty(device=...)`. Returns the state keys left unread (the expert biases
    dropless added, zeroed). rename: a state key's checkpoint name, None for a tensor the
    checkpoint does not hold (LoRA adapters). ValueError for a layout it cannot slice or
    a tensor it lacks."""
    from ..layers import added_state_keys

    files = _checkpoint_files(path)
    plans = _plans(model, files, rename)
    fp8_block = None
    if _has_fp8(files):  # the block size in the checkpoint's own config.json (the model may
        # have been built from a copy without its quantization_config)
        quant = json.loads((Path(path) / "config.json").read_text()).get("quantization_config")
        fp8_block = fp8_block_size(types.SimpleNamespace(quantization_config=quant))
    retie(model)
    # rotary inv_freq and the like are not in checkpoints: recomputed as Transformers does,
    # first (Transformers' init may touch parameters too)
    init = getattr(model, "_init_weights", None)
    for mod in model.modules() if init is not None else ():
        if mod._non_persistent_buffers_set:
            init(mod)
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


def _has_fp8(files: dict[str, str]) -> bool:
    return any(k.endswith(FP8_SCALE_SUFFIX) for k in files)


def is_quantized_checkpoint(path) -> bool:
    """Whether the safetensors checkpoint in `path` stores block-FP8 or MXFP4 weights."""
    files = _checkpoint_files(path)
    return _has_fp8(files) or any(k.endswith(MXFP4_SUFFIXES[0]) for k in files)


def retie(model: nn.Module) -> None:
    # a plain `to_empty` gives tied parameters separate storage (FSDP2 keeps them shared)
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    split = [t for t, src in tied.items() if t in params and params[t] is not params.get(src)]
    if split and hasattr(model, "tie_weights"):
        model.tie_weights()
