"""`torchrun ... dropless train --set model.path=DIR --set parallel.ep=2` on CPU (gloo):
a saved DeepSeek-V3 checkpoint is loaded shard by shard (meta device, each rank reads
its experts and FSDP rows from the safetensors file) and fine-tuned with the same losses,
sequence-wise aux loss and correction-bias updates as one process with 2 micro-batches."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from dropless.cli.main import main  # noqa: E402
from dropless.train.config.recipes import TINY  # noqa: E402
from harness import read_metrics, torchrun  # noqa: E402

RUN = (
    *TINY, "train.steps=2", "train.seq_len=16", "train.batch_size=4", "log.every=1",
    "checkpoint.every=2", "log.plots=false", "log.tensorboard=false", "optim.warmup_steps=1",
    "train.aux_loss_coef=0.01", "train.expert_bias_rate=0.001",
)  # fmt: skip


def _args(*extra):
    out = []
    for item in (*RUN, *extra):
        out += ["--set", item]
    return out


def _saved(path):
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=264, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def test_torchrun_finetune_sharded_load_equals_one_process(tmp_path):
    torch.set_num_threads(1)
    src = _saved(tmp_path / "src")
    ref, run = tmp_path / "ref", tmp_path / "ep"
    assert (
        main(["train", "--run-dir", str(ref), *_args(f"model.path={src}", "train.grad_accum=2")])
        == 0
    )
    env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    args = ["--run-dir", str(run), *_args(f"model.path={src}", "parallel.ep=2")]
    torchrun(2, ["-m", "dropless", "train", *args], env=env, timeout=300, check=True)
    want, got = read_metrics(ref), read_metrics(run)
    assert [r["step"] for r in got] == [0, 1, 2]
    for w, g in zip(want, got):
        for key in ("loss", "eval_loss", "lb_loss", "grad_norm"):
            if key in w:
                assert g[key] == pytest.approx(w[key], rel=1e-5), (g["step"], key)
        if "tokens_per_expert" in w:
            assert g["tokens_per_expert"] == w["tokens_per_expert"]
