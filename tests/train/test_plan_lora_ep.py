"""`dropless plan` of a LoRA run on 2 GPUs with expert parallelism traces what the
trainer runs: the adapters added before sharding (the experts' own factors sharded with
their experts), activation checkpointing on (the declared expert backward reads its saved
tensors once, as checkpointing requires), only the adapters holding optimizer state."""

import pytest

pytest.importorskip("peft")

from dropless.train.config.load import load_config  # noqa: E402
from dropless.train.plan import trace as P  # noqa: E402


def test_lora_plan_at_ep2_with_checkpointing(tmp_path):
    base = load_config("examples/tiny.toml", [])
    P.resolve_hf_config(base).save_pretrained(tmp_path)  # config.json only, no weights
    sets = [f"model.path={tmp_path}", "data.tokenizer=bytes", "parallel.ep=2"]
    on = ["train.activation_checkpointing=true"]
    full = P.make_plan(
        load_config("examples/tiny.toml", [*sets, *on]), 2, 80, compare_checkpointing=False
    )
    lora_cfg = load_config(
        "examples/tiny.toml", [*sets, *on, "finetune.method=lora", "finetune.lora_rank=1"]
    )
    lora = P.make_plan(lora_cfg, 2, 80, compare_checkpointing=False)
    f, lo = full.breakdown_gib, lora.breakdown_gib
    assert lora.layout["finetune"] == "lora"
    assert lo["parameters"] >= f["parameters"]  # the base plus the adapters
    assert 0 < lo["optimizer_states"] < 0.2 * f["optimizer_states"]
