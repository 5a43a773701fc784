"""Config values torch would reject later are refused up front, naming the key: resuming a
LoRA run with other adapters, AdamW betas, seeds and timeouts out of torch's ranges, and a
model too big for this machine's memory (refused before anything is built)."""

import shutil

import pytest
import torch

from dropless.cli.main import main

from .faults_util import args, snapshot


def _saved_model(path):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(
        vocab_size=264, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, intermediate_size=32,
        moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished 2-step LoRA (rank 4) run of a saved 1-layer Qwen3-MoE."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    src = _saved_model(root / "src")
    lora = (
        f"model.path={src}", "finetune.method=lora", "finetune.lora_rank=4", "train.steps=2",
        "train.seq_len=16", "train.batch_size=2", "checkpoint.every=2", "log.plots=false",
        "log.tensorboard=false",
    )  # fmt: skip
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--run-dir", str(root / "run"), *args(*lora)]) == 0
    finally:
        torch.set_num_threads(n)
    return root / "run"


@pytest.mark.parametrize(
    "override, named",
    [
        ("finetune.lora_rank=8", "finetune.lora_rank: checkpoint 4, now 8"),
        ("finetune.lora_targets=experts", "finetune.lora_targets: checkpoint ['experts', 'attention'], now ['experts']"),
        ("finetune.method=full", "finetune.method: checkpoint 'lora', now 'full'"),
    ],
)  # fmt: skip
def test_resume_with_other_adapters_is_refused_in_one_line(
    lora_run, tmp_path, override, named, capsys
):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    before = snapshot(run)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", override]) == 2
    err = capsys.readouterr().err
    assert "--resume: the checkpoint" in err and named in err and err.count("\n") == 1, err
    assert snapshot(run) == before
