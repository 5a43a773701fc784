"""What `--resume` may change. A checkpoint fixes the model's shape, its tokenizer, the
data it reads and the order it reads it in, and the fine-tuning method with its adapters'
shape; everything else (steps, the learning-rate schedule, logging, checkpoint cadence,
the process count and expert parallelism, by resharding) may differ from the run that
wrote it."""

from __future__ import annotations

import math
from pathlib import Path

from ..config.load import Config, load_config
from .manifest import latest_checkpoint

#: keys a resumed run must keep: the checkpoint's tensors, tokens or sample order depend on them
FIXED_KEYS = (
    "model.path", "model.config", "model.hidden_size", "model.num_layers", "model.num_heads",
    "model.num_kv_heads", "model.head_dim", "model.num_experts", "model.top_k",
    "model.moe_intermediate_size", "model.vocab_size", "model.max_position_embeddings",
    "model.tie_embeddings", "model.dtype", "optim.master_weights", "data.path", "data.eval_path", "data.text_field", "data.eval_fraction",
    "data.max_bytes", "data.tokenizer", "data.bpe_vocab_size", "data.errors", "data.reverse_complement",
    "data.loss_on",  # supervised rows left without a loss token are dropped: the sample set
    "train.seq_len", "train.batch_size", "train.seed",
    # full vs LoRA and the adapters' shape and scale: what the checkpoint's tensors are
    "finetune.method", "finetune.lora_rank", "finetune.lora_alpha", "finetune.lora_targets",
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


def check_resume(cfg: Config, ckpt_dir: Path, world: int) -> None:
    """Refuse a resumed config that cannot work with checkpoint `ckpt_dir`, naming each key."""
    saved_file = Path(ckpt_dir) / "config.toml"
    if not saved_file.is_file():
        return  # checkpoints written before configs were copied into them
    from ..data.tokenizer import with_spec_resolved

    saved = load_config(saved_file)  # data.tokenizer as the run resolved it
    changed = changed_fixed_keys(saved, with_spec_resolved(cfg))
    if changed:
        raise ValueError(
            f"--resume: the checkpoint {str(ckpt_dir)!r} cannot continue with a changed "
            + "; ".join(changed)
            + ". Drop those overrides (a bare --resume uses the run's own config), or start a new run with another --run-dir"
        )
    from ...parallel.mesh import resolve_sizes

    try:
        resolve_sizes(cfg.parallel, world, None)
    except ValueError as e:
        if cfg.parallel != saved.parallel:
            raise  # the user's own layout: the plain message says what is wrong
        p = cfg.parallel
        if world % p.dp_replicate or (p.dp_shard != -1 and p.dp_shard * p.dp_replicate != world):
            fix = f"--set parallel.dp_replicate=1 --set parallel.dp_shard=-1 --set parallel.ep={math.gcd(p.ep, world)}"
        else:
            fix = f"--set parallel.ep={math.gcd(p.ep, world // p.dp_replicate)}"
        raise ValueError(
            f"--resume: the run was saved with parallel.ep={p.ep}, dp_replicate={p.dp_replicate}, dp_shard={p.dp_shard}, "
            f"which does not fit {world} process{'es' if world != 1 else ''} ({e}); the checkpoint reshards, so add {fix}"
        ) from None


def resume_config_file(run_dir: str | Path) -> Path | None:
    """The config a bare --resume continues with: the copy inside the newest checkpoint
    that verifies (written with it, covered by its manifest), never the run directory's
    config.toml, which a start cut short may have left stale or half written."""
    import warnings

    from . import store as ckpt

    with warnings.catch_warnings():  # the checks of the resume itself say what was skipped
        warnings.simplefilter("ignore")
        ck = ckpt.latest_checkpoint(run_dir)
    if ck is not None and (ck / "config.toml").is_file():
        return ck / "config.toml"
    return None


def _damaged(run_dir: Path) -> str:
    from . import store as ckpt

    bad = ckpt.damaged_checkpoints(run_dir)
    return "; ".join(bad[-3:]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")


def no_resume_point(run_dir: Path) -> ValueError:
    """Why --resume cannot start in `run_dir` (an existing folder: `claim` refuses a
    missing one), with the one action that works."""
    from . import store as ckpt

    if not ckpt.list_checkpoints(run_dir):
        return ValueError(
            f"--resume: {str(run_dir)!r} has no complete checkpoint to resume from; run without --resume to start it"
        )
    return ValueError(
        f"--resume: no checkpoint of {str(run_dir)!r} verifies ({_damaged(run_dir)}), so the run cannot "
        "continue; start a new run with another --run-dir (the damaged checkpoints are left for inspection)"
    )


def check_fresh_start(run_dir: Path) -> None:
    """A run without --resume must not start over a run that has checkpoints."""
    from . import store as ckpt

    if not ckpt.list_checkpoints(run_dir):
        return
    if ckpt.latest_checkpoint(run_dir) is None:
        raise ValueError(
            f"{str(run_dir)!r} holds checkpoints but none verifies ({_damaged(run_dir)}); "
            "start the run in another --run-dir"
        )
    raise ValueError(
        f"{str(run_dir)!r} already holds checkpoints: pass --resume to continue that run, or another --run-dir"
    )


def check_run_dir(cfg: Config, run_dir: Path, resume: bool, world: int) -> Path | None:
    """The checks of what the run directory holds, run while holding its lock (`claim`):
    with --resume its newest checkpoint that verifies (returned) and `check_resume`;
    otherwise `check_fresh_start` (None returned)."""
    if not resume:
        check_fresh_start(run_dir)
        return None
    resume_from = latest_checkpoint(run_dir)
    if resume_from is None:
        raise no_resume_point(run_dir)
    check_resume(cfg, resume_from, world)
    return resume_from


def nonfinite_fix(
    run_dir: Path, resumed_from: Path | None, all_nonfinite: bool, policy: str
) -> str:
    """What to do after a non-finite loss or gradient: resume from the newest checkpoint;
    from an older one when the newest is the one this run resumed from and every step
    since was non-finite (`all_nonfinite`); start again when there is no checkpoint."""
    from . import store as ckpt

    lower = "lower optim.lr" + (" or raise train.max_skipped_steps" if policy == "skip" else "")
    newest = ckpt.latest_checkpoint(run_dir)
    if newest is None:
        return f"no checkpoint was written yet, so there is nothing to resume: {lower} and run the same command again"
    at_once = all_nonfinite and resumed_from is not None and Path(resumed_from) == newest
    if at_once:
        older = [ck for _, ck in ckpt.list_checkpoints(run_dir) if ck != newest]
        older = [ck for ck in older if ckpt.verify_checkpoint(ck) is None]
        if older:
            aside = run_dir / f"{newest.name}.nonfinite"
            return (
                f"the newest checkpoint {newest.name} gave it at once: set it aside "
                f"(mv {newest} {aside}) and --resume from {older[-1].name} with a lower optim.lr "
                "(--resume --set optim.lr=...)"
            )
        return (
            f"the newest checkpoint {newest.name} gave it at once and there is no older one: "
            "start a new run with a lower optim.lr and another --run-dir"
        )
    if policy == "stop":
        return "resume from the last checkpoint with a lower optim.lr (--resume --set optim.lr=...)"
    return f"{lower}, then --resume"


def with_nonfinite_fix(e: Exception, run_dir: Path, resumed_from, all_nonfinite: bool, policy: str):
    """`e` (a NonFiniteError from the step) with its advice replaced by `nonfinite_fix`."""
    head = str(e).rsplit("; ", 1)[0]  # the step's own advice is its last clause
    return type(e)(f"{head}; {nonfinite_fix(run_dir, resumed_from, all_nonfinite, policy)}")


def latest_run(root: str | Path = "runs") -> Path:
    """The run under `root` whose newest checkpoint was written last."""
    found = [(p, latest_checkpoint(p, verify=False)) for p in Path(root).glob("*") if p.is_dir()]
    found = [(p, c) for p, c in found if c is not None]
    if not found:
        raise ValueError(
            f"--resume without --run-dir: no run with a checkpoint under ./{root}; pass --run-dir RUN_DIR"
        )
    return max(found, key=lambda pc: pc[1].stat().st_mtime)[0]
