"""Ready-made run configurations (Python functions returning a `Config`).

`default()` is what `dropless train` runs with no arguments: a 4-layer Qwen3-MoE
(8 experts, top-2, hidden 256) trained from scratch on this Python's standard-library
sources with a byte-level BPE, sized to take about 5 minutes on 2 CPU cores in fp32.
`tiny()` is the smallest sensible run (tests, smoke checks): bytes, 2 layers, 4 experts.
"""

from __future__ import annotations

from .load import Config, load_config


def default() -> Config:
    """The `dropless train` demo run (every value is the dataclass default)."""
    return Config()


TINY = (
    "data.tokenizer=bytes", "data.max_bytes=300000", "data.eval_tokens=512",
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
    "model.head_dim=16", "model.num_experts=4", "model.moe_intermediate_size=32",
    "train.steps=8", "train.seq_len=32", "train.batch_size=4", "optim.warmup_steps=2", "optim.lr=1e-2",
    "log.every=2", "checkpoint.every=4", "log.progress=plain",
    "log.peak_tflops=0.1",  # MFU against a stated peak: no CPU matmul timed at each log step
)  # fmt: skip


def tiny(*overrides: str) -> Config:
    """A seconds-long run: byte tokenizer, hidden 32, 2 layers, 4 experts, 8 steps."""
    return load_config(None, [*TINY, *overrides])
