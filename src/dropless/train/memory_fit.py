"""Whether a run can fit this machine's memory, checked before anything is built.

The parameter count comes from the model built on the meta device (exact for every
family, no memory used). The figures are lower bounds, so a refusal is never wrong:

- every process builds the whole model in fp32 on the host (4 bytes per parameter), except
  a checkpoint fine-tuned on several processes, which each rank reads only in its shards;
- training holds fp32 weights, gradients and AdamW's two moments, 16 bytes per trained
  parameter (4 for the frozen base of a LoRA run), sharded over the processes (FSDP2/EP):
  on the host for a CPU run, on each GPU for a CUDA run;
- a micro-batch keeps at least one [tokens, hidden] activation per decoder layer for
  backward (4 bytes per value in fp32, 2 under bf16 autocast on GPU).

A run that would not fit is refused with the keys to change, where it would otherwise
be killed by the operating system's out-of-memory killer with no message.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .model import require_transformers

GIB = 2**30
TRAINED_BYTES = 16  # fp32 weight + gradient + AdamW exp_avg + exp_avg_sq
FROZEN_BYTES = 4  # fp32 weight


def parameter_count(hf_config) -> int:
    """Parameters of the causal LM `hf_config` describes (tied weights once)."""
    transformers = require_transformers()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    return sum(p.numel() for p in model.parameters())


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


def device_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device (what one process may use at most), None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).total_memory


def _model_keys(mcfg) -> str:
    if mcfg.path:
        return f"model.path={mcfg.path!r} (a smaller checkpoint, or finetune.method='lora')"
    if mcfg.config:
        return f"model.config={mcfg.config!r} (a smaller model)"
    names = ("num_experts", "num_layers", "hidden_size", "moe_intermediate_size")
    return ", ".join(f"model.{n}={getattr(mcfg, n)}" for n in names)


def _batch_keys(tcfg) -> str:
    return (
        f"train.batch_size={tcfg.batch_size}, train.seq_len={tcfg.seq_len} (or raise "
        f"train.grad_accum={tcfg.grad_accum})"
    )


def _activation_bytes(cfg, hf_config, world: int, value_bytes: int) -> int:
    tokens = cfg.train.batch_size // max(world * cfg.train.grad_accum, 1) * cfg.train.seq_len
    hidden = getattr(hf_config, "hidden_size", 0) or 0
    layers = getattr(hf_config, "num_hidden_layers", 1) or 1
    return tokens * hidden * layers * value_bytes


def _refuse(where: str, params: int, state: int, acts: int, have: int, cfg) -> ValueError:
    keys = _batch_keys(cfg.train) if acts > state else _model_keys(cfg.model)
    per = FROZEN_BYTES if cfg.finetune.method == "lora" else TRAINED_BYTES
    return ValueError(
        f"the run needs at least {(state + acts) / GIB:.1f} GiB of {where} memory but {have / GIB:.1f} GiB "
        f"is available: the model has {params / 1e9:.3g}B parameters ({per} bytes each for weights"
        f"{', gradients and AdamW state' if per == TRAINED_BYTES else ''}: {state / GIB:.1f} GiB) and a "
        f"micro-batch's activations take {acts / GIB:.1f} GiB; lower {keys}, or use more processes "
        "or a machine with more memory"
    )


def check_fits_memory(cfg, hf_config, world: int, device: torch.device) -> None:
    """Refuse (ValueError naming the keys) a run this machine's memory cannot hold."""
    params = parameter_count(hf_config)
    per = FROZEN_BYTES if cfg.finetune.method == "lora" else TRAINED_BYTES
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # processes on this host (torchrun)
    cuda = device.type == "cuda"
    state = per * params // world
    acts = _activation_bytes(cfg, hf_config, world, 2 if cuda else 4)
    build = 0 if (world > 1 and cfg.model.path) else FROZEN_BYTES * params
    host = available_host_bytes()
    if host is not None:
        need = max(build, 0 if cuda else state + acts)
        if local * need > host:
            host_state = max(build, 0 if cuda else state)
            raise _refuse(
                "host", params, local * host_state, 0 if cuda else local * acts, host, cfg
            )
    have = device_bytes(device)
    if have is not None and state + acts > have:
        raise _refuse(f"{device} device", params, state, acts, have, cfg)
