"""What `--resume` may change. A checkpoint fixes the model's shape, its tokenizer, the
data it reads and the order it reads it in; everything else (steps, the learning-rate
schedule, logging, checkpoint cadence, the process count and expert parallelism, by
resharding) may differ from the run that wrote it."""

from __future__ import annotations

import math
from pathlib import Path

from .config import Config, load_config

#: keys a resumed run must keep: the checkpoint's tensors, tokens or sample order depend on them
FIXED_KEYS = (
    "model.path", "model.config", "model.hidden_size", "model.num_layers", "model.num_heads",
    "model.num_kv_heads", "model.head_dim", "model.num_experts", "model.top_k",
    "model.moe_intermediate_size", "model.vocab_size", "model.max_position_embeddings",
    "model.tie_embeddings", "data.path", "data.eval_path", "data.text_field", "data.eval_fraction",
    "data.max_bytes", "data.tokenizer", "data.bpe_vocab_size", "data.errors", "data.reverse_complement",
    "train.seq_len",
    "train.batch_size", "train.seed",
)  # fmt: skip


def _get(cfg: Config, key: str):
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def changed_fixed_keys(saved: Config, cfg: Config) -> list[str]:
    """'key: checkpoint A, now B' for each fixed key that differs (expert bias on/off too)."""
    out = [
        f"{k}: checkpoint {_get(saved, k)!r}, now {_get(cfg, k)!r}"
        for k in FIXED_KEYS
        if _get(saved, k) != _get(cfg, k)
    ]
    was, now = saved.train.expert_bias_rate > 0, cfg.train.expert_bias_rate > 0
    if was != now:  # the routers' expert_bias buffer exists only when the rate is > 0
        out.append(
            f"train.expert_bias_rate: checkpoint {saved.train.expert_bias_rate!r}, now {cfg.train.expert_bias_rate!r} (on/off changes the model's buffers)"
        )
    return out


def _fitting_ep(ep: int, world: int, dp_replicate: int) -> int:
    shard = world // dp_replicate if world % dp_replicate == 0 else world
    return math.gcd(ep, shard)


def check_resume(cfg: Config, ckpt_dir: Path, world: int) -> None:
    """Refuse a resumed config that cannot work with checkpoint `ckpt_dir`, naming each key."""
    saved_file = Path(ckpt_dir) / "config.toml"
    if not saved_file.is_file():
        return  # checkpoints written before configs were copied into them
    saved = load_config(saved_file)
    changed = changed_fixed_keys(saved, cfg)
    if changed:
        raise ValueError(
            f"--resume: the checkpoint {str(ckpt_dir)!r} cannot continue with a changed "
            + "; ".join(changed)
            + ". Drop those overrides (a bare --resume uses the run's own config), or start a new run with another --run-dir"
        )
    from ..parallel.mesh import resolve_sizes

    try:
        resolve_sizes(cfg.parallel, world, None)
    except ValueError as e:
        if cfg.parallel != saved.parallel:
            raise  # the user's own layout: the plain message says what is wrong
        p = cfg.parallel
        fix = f"--set parallel.ep={_fitting_ep(p.ep, world, p.dp_replicate)}"
        if world % p.dp_replicate or (p.dp_shard != -1 and p.dp_shard * p.dp_replicate != world):
            fix = f"--set parallel.dp_replicate=1 --set parallel.dp_shard=-1 --set parallel.ep={math.gcd(p.ep, world)}"
        raise ValueError(
            f"--resume: the run was saved with parallel.ep={p.ep}, dp_replicate={p.dp_replicate}, dp_shard={p.dp_shard}, "
            f"which does not fit {world} process{'es' if world != 1 else ''} ({e}); the checkpoint reshards, so add {fix}"
        ) from None


__all__ = ["FIXED_KEYS", "changed_fixed_keys", "check_resume"]
