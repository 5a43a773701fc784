"""`dropless train` dense-side defaults: the fused linear cross-entropy and the AdamW kernel.

The fused loss is the same cross-entropy as the logits path: the first step's loss and
gradient norm agree (fp32), with the same optimizer kernel on both sides.
"""

import pytest

from dropless.cli.main import main
from dropless.train.config.load import Config, load_config
from dropless.train.state import adamw_kernel
from harness import read_metrics, tiny_args


def _first_step(tmp_path, name, *extra):
    run = tmp_path / name
    args = tiny_args(
        "train.steps=2", "log.every=1", "log.tensorboard=false", "log.plots=false",
        "checkpoint.every=0", "optim.implementation=loop", "data.max_bytes=40000", *extra,
    )  # fmt: skip
    assert main(["train", "--run-dir", str(run), *args]) == 0
    recs = read_metrics(run)
    return next(r for r in recs if r["step"] == 1)


def test_fused_cross_entropy_trains_the_same_loss(tmp_path):
    assert Config().train.fused_cross_entropy is True  # on by default
    fused = _first_step(tmp_path, "fused")
    plain = _first_step(tmp_path, "plain", "train.fused_cross_entropy=false")
    assert fused["loss"] == pytest.approx(plain["loss"], rel=1e-5)
    assert fused["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-4)


def test_the_unfused_loss_writes_its_gradient_over_the_logits(tmp_path, monkeypatch):
    """train.fused_cross_entropy=false: the step lets go of the logits it handed to the lean
    loss, so its backward finds them on memory no one else holds and writes the gradient
    there (no second logits-sized buffer)."""
    import importlib

    rows = importlib.import_module("dropless.ops.linear_cross_entropy.rows")
    real, owned = rows._owns_memory, []
    monkeypatch.setattr(rows, "_owns_memory", lambda x: owned.append(real(x)) or owned[-1])
    _first_step(tmp_path, "plain", "train.fused_cross_entropy=false")
    assert owned and all(owned), owned


def test_adamw_kernel_choice():
    o = load_config().optim
    assert o.implementation == "auto"
    assert adamw_kernel(o) == {"fused": True}
    # DTensors too: build_optimizer keeps each mesh in its own groups (tests/parallel fsdp_fused_adamw)
    for name, kw in (
        ("fused", {"fused": True}),
        ("foreach", {"foreach": True}),
        ("loop", {"foreach": False}),
    ):
        assert adamw_kernel(load_config(None, [f"optim.implementation={name}"]).optim) == kw
    with pytest.raises(ValueError, match="optim.implementation='apex': allowed values are"):
        load_config(None, ["optim.implementation=apex"])


def test_training_model_has_replay_and_rmsnorm_on_cpu():
    import torch

    from dropless.hf.experts.replay import has_routing_replay
    from dropless.hf.fusions.rmsnorm import fused_rmsnorm_state, is_rmsnorm_module
    from dropless.train.config.recipes import tiny
    from dropless.train.model.build import build_training_model, hf_config

    cfg = tiny("train.activation_checkpointing=true")
    assert cfg.train.fused_rmsnorm is True  # on by default
    model, par = build_training_model(
        cfg.model, hf_config(cfg.model, 257), cfg.parallel, 1, expert_bias=False, seed=0,
        device=torch.device("cpu"), activation_checkpointing=True, fused_rmsnorm=True,
    )  # fmt: skip
    assert par is None and has_routing_replay(model) and model.is_gradient_checkpointing
    norms = [m for m in model.modules() if is_rmsnorm_module(m)]
    model.train()
    model(input_ids=torch.randint(0, 257, (2, 8))).logits.sum().backward()
    # probed inside the checkpointed forward, then dropless's RMSNorm (the torch op on CPU)
    assert norms and all(fused_rmsnorm_state(m) == "kernel" for m in norms)
