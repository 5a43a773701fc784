"""Whether a run can fit this machine's memory, checked before anything is built.

The parameter count comes from the model built on the meta device (exact for every
family, no memory used). The figures are lower bounds, so a refusal is never wrong:

- every process builds the whole model in `model.dtype` on the host (4 bytes per parameter
  in fp32, 2 in bf16), except a checkpoint fine-tuned on several processes, which each
  rank reads only in its shards;
- training holds weights, gradients and AdamW's two fp32 moments: 16 bytes per trained
  parameter in fp32 and in bf16 with an fp32 master, 12 in bf16 without one
  (`optim.master_weights=false`); the frozen base of a LoRA run holds its weights only.
  All of it is sharded over the processes (FSDP2/EP), on the host for a CPU run (a GPU's
  memory is checked by the traced plan instead, `preflight.check_plan_fits`);
- a micro-batch keeps at least one [tokens, hidden] activation per decoder layer for
  backward (4 bytes per value: a CPU run computes in fp32); under context parallelism
  (`parallel.cp`) a process holds 1/cp of its cp group's micro-batch.

A run that would not fit is refused with the keys to change, where it would otherwise
be killed by the operating system's out-of-memory killer with no message.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..data.corpus import micro_batch_size
from ..model.build import require_transformers

GIB = 2**30
MOMENTS_BYTES = 8  # AdamW's exp_avg + exp_avg_sq, fp32 whatever the parameters' dtype


def state_bytes(cfg) -> tuple[int, int, str]:
    """(bytes per trained parameter, bytes per stored weight, what they are) for the
    parameter dtype and master copy the config asks for."""
    weight = 2 if cfg.model.dtype == "bf16" else 4
    master = 4 if weight == 2 and cfg.optim.master_weights else 0
    what = (
        "bf16 weights and gradients, an fp32 master and AdamW state"
        if master
        else f"{'bf16' if weight == 2 else 'fp32'} weights and gradients and fp32 AdamW state"
    )
    return 2 * weight + master + MOMENTS_BYTES, weight, what


#: parameter groups (by name) and the built-in model's keys that size each
GROUPS = {
    "embeddings": (("embed_tokens", "lm_head"), ("vocab_size", "hidden_size")),
    "experts": (("experts",), ("num_experts", "moe_intermediate_size", "hidden_size", "num_layers")),
    "attention": (("self_attn",), ("num_heads", "num_kv_heads", "head_dim", "hidden_size", "num_layers")),
    "other": ((), ("hidden_size", "num_layers")),
}  # fmt: skip


def _group(name: str) -> str:
    return next((g for g, (parts, _) in GROUPS.items() if any(p in name for p in parts)), "other")


def parameter_counts(hf_config) -> dict[str, int]:
    """Parameters of the causal LM `hf_config` describes, per group of `GROUPS` (tied
    weights once)."""
    transformers = require_transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    counts = dict.fromkeys(GROUPS, 0)
    for name, p in model.named_parameters():
        counts[_group(name)] += p.numel()
    return counts


def _meminfo_kib(name: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key == name:
                return int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup v2 memory limit (containers), None if unlimited."""
    try:
        root = Path("/sys/fs/cgroup")
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return int(limit) - int((root / "memory.current").read_text())
    except (OSError, ValueError):
        return None


def available_host_bytes() -> int | None:
    """Memory a new allocation can still get on this host: MemAvailable plus free swap
    (capped by a cgroup limit), or None where the system does not say."""
    avail = _meminfo_kib("MemAvailable")
    if avail is not None:
        total = (avail + (_meminfo_kib("SwapFree") or 0)) * 1024
    else:
        try:
            total = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    room = _cgroup_room()
    return total if room is None else min(total, room)


def _model_keys(mcfg, counts: dict[str, int]) -> str:
    """The keys that size the largest group of parameters."""
    group = max(counts, key=counts.get)
    share = f" ({group}: {counts[group] / max(sum(counts.values()), 1):.0%} of the parameters)"
    if mcfg.path:
        return f"model.path={mcfg.path!r}{share} (a smaller checkpoint, or finetune.method='lora')"
    if mcfg.config:
        return f"model.config={mcfg.config!r}{share} (a smaller model)"
    return ", ".join(f"model.{n}={getattr(mcfg, n)}" for n in GROUPS[group][1]) + share


def _activation_bytes(cfg, hf_config, world: int, value_bytes: int) -> int:
    tc, cp = cfg.train, cfg.parallel.cp
    # parallel.cp: a group of cp processes reads one micro-batch, each keeps 1/cp of its tokens
    tokens = micro_batch_size(tc.batch_size, world // cp, tc.grad_accum) * tc.seq_len // cp
    hidden = getattr(hf_config, "hidden_size", 0) or 0
    layers = getattr(hf_config, "num_hidden_layers", 1) or 1
    return tokens * hidden * layers * value_bytes


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def _check(where: str, have: int | None, counts: dict, each: str, state: int, acts: int, cfg):
    """Raise when `state` (the parameters' bytes, `each` says why) plus `acts` exceeds `have`."""
    if have is None or state + acts <= have:
        return
    params = sum(counts.values())
    tc = cfg.train
    keys = (
        f"train.batch_size={tc.batch_size}, train.seq_len={tc.seq_len} (or raise "
        f"train.grad_accum={tc.grad_accum})"
        if acts > state
        else _model_keys(cfg.model, counts)
    )
    raise ValueError(
        f"the run needs at least {(state + acts) / GIB:.1f} GiB of {where} memory but {have / GIB:.1f} GiB "
        f"is available: the model has {_count(params)} parameters ({each}: {state / GIB:.1f} GiB) and "
        f"a micro-batch's activations take {acts / GIB:.1f} GiB; lower {keys}, or use more processes "
        "or a machine with more memory"
    )


def check_fits_memory(cfg, hf_config, world: int, device: torch.device) -> None:
    """Refuse (ValueError naming the keys) a run this machine's host memory cannot hold
    (a CPU run's state and activations; the model's build on the host). A GPU's memory is
    checked by the traced plan (`preflight.check_plan_fits`)."""
    try:
        counts = parameter_counts(hf_config)
    except (ValueError, TypeError, RuntimeError, NotImplementedError, ImportError):
        return  # a model the meta device cannot build: its real build reports the problem
    params = sum(counts.values())
    trained, weight, what = state_bytes(cfg)
    dtype = "bf16" if weight == 2 else "fp32"
    lora = cfg.finetune.method == "lora"
    per = weight if lora else trained
    each = (
        f"{weight} bytes each for LoRA's frozen {dtype} base"
        if lora
        else f"{trained} bytes each for {what}"
    ) + (f", over {world} processes" if world > 1 else "")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes on this host (torchrun)
    state = per * params // world
    acts = _activation_bytes(cfg, hf_config, world, 4)
    host = available_host_bytes()
    if device.type != "cuda":  # training on the host: its state is the larger need, checked first
        _check("host", host, counts, each, local * state, local * acts, cfg)
    if not (world > 1 and cfg.model.path):  # each process builds the whole model on the host
        build = f"{weight} bytes each while it is built in {dtype}"
        build += f", x {local} processes" if local > 1 else ""
        _check("host", host, counts, build, local * weight * params, 0, cfg)
    # the GPU's own memory: the traced plan (preflight.check_plan_fits), not a formula
