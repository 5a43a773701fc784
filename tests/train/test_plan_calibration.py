"""The plan against a real run on CPU: measured <= plan <= 1.10 x measured, where
measured is the peak of live tensor bytes of a real training step (the second: the
optimizer state exists, as in every later step), read by torch's MemTracker (a
TorchDispatchMode following every storage), with one intra-op thread. The expert path's
worker threads run the items of a Python dispatch mode in the calling thread
(`ops/expert_threads.py`), so the tracker sees the experts' tensors too. fp32, as a CPU
run computes; one process (the plan's fake process group is the part CPU cannot
measure against a real allocator; the world-8..256 layouts are checked in
tests/parallel/test_plan_fake_pg.py)."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from dropless.train import plan as P  # noqa: E402
from dropless.train.config import load_config  # noqa: E402


def _measured_peak(cfg) -> int:
    from torch.distributed._tools.mem_tracker import MemTracker

    from dropless.train.model import build_training_model
    from dropless.train.state import build_optimizer
    from dropless.train.step import fuse_cross_entropy

    tc = cfg.train
    model, _ = build_training_model(
        cfg.model, P.resolve_hf_config(cfg), cfg.parallel, 1, expert_bias=False, seed=0,
        device=torch.device("cpu"), activation_checkpointing=tc.activation_checkpointing,
        fused_rmsnorm=tc.fused_rmsnorm,
    )  # fmt: skip
    seen = fuse_cross_entropy(model) if tc.fused_cross_entropy else None
    opt = build_optimizer([p for p in model.parameters() if p.requires_grad], cfg.optim)
    B, L, V = P.micro_batch(cfg, 1), tc.seq_len, model.config.vocab_size

    def step():
        ids = torch.randint(0, V, (B, L))
        kw = {"use_cache": False}
        if seen is not None:
            kw.update(labels=ids, shift_labels=ids)
        out = model(input_ids=ids, **kw)
        if seen is not None:
            loss = seen.pop()
        else:
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, V), ids.reshape(-1))
        del out
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        tracker.track_external(model, opt)
        with tracker:
            step()
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values())


@pytest.mark.parametrize(
    ("config", "sets"),
    [
        ("examples/tiny.toml", []),
        ("examples/tiny.toml", ["train.activation_checkpointing=true"]),
        (None, ["data.tokenizer=bytes"]),  # dropless train's default model
    ],
    ids=["tiny", "tiny-checkpointing", "default"],
)
def test_plan_brackets_the_measured_peak(config, sets):
    cfg = load_config(config, ["precision.dtype=fp32", *sets])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        measured = _measured_peak(cfg)
    finally:
        torch.set_num_threads(threads)
    planned = P.make_plan(cfg, 1, 80, compare_checkpointing=False).peak_gib_per_gpu * 2**30
    assert measured <= planned <= 1.10 * measured, (measured, planned, planned / measured)
