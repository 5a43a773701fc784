"""`dropless train --set model.path=DIR` fine-tunes a local checkpoint of several families
(tiny models saved in the test), and `dropless convert` writes a directory stock
Transformers loads with the same weights and logits."""

import math

import pytest
import torch

from dropless.cli.main import main
from harness import read_metrics, tiny_args

VOCAB = 264  # the byte tokenizer's 257 ids fit
COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
)  # fmt: skip


def _config(family: str):
    import transformers as tf

    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4}, intermediate_size=48, moe_intermediate_size=16,
            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
            qk_nope_head_dim=8, v_head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        )  # fmt: skip
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON, intermediate_size=48, moe_intermediate_size=16,
            shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON, head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    if family == "nemotron_h":
        return tf.NemotronHConfig(
            **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
            layers_block_type=["mamba", "moe", "full_attention", "moe"], head_dim=8,
            intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16, ssm_state_size=8, mamba_num_heads=4,
            mamba_head_dim=16, n_groups=2, chunk_size=8,
        )  # fmt: skip
    raise KeyError(family)


def _saved(family: str, path):
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(_config(family), dtype=torch.float32)
    model.save_pretrained(path)
    return path


# Families whose experts run the stock path here (model.implementation=stock), with the
# same trainer, router losses and loading; the others run the dropless path.
STOCK_EXPERTS: set = set()
CASES = {
    "deepseek_v3": ("train.expert_bias_rate=0.001", "train.aux_loss_coef=0.01"),
    "qwen2_moe": ("train.aux_loss_coef=0.01",),
    "gpt_oss": ("train.aux_loss_coef=0.01", "model.attn_implementation=eager"),
    "nemotron_h": ("train.aux_loss_coef=0.01", "train.expert_bias_rate=0.001"),
}


@pytest.mark.parametrize("family", list(CASES))
def test_finetune_and_convert(family, tmp_path):
    import transformers as tf

    import dropless.hf as dh
    from dropless.hf.experts import CALLS
    from dropless.train.generate import load_run

    src = _saved(family, tmp_path / "src")
    impl = "stock" if family in STOCK_EXPERTS else "dropless"
    run = tmp_path / "run"
    calls = CALLS[family]
    args = tiny_args(
        f"model.path={src}", f"model.implementation={impl}", "train.steps=4", "train.seq_len=16",
        "train.batch_size=2", "optim.warmup_steps=1", "log.every=2", "checkpoint.every=4",
        "log.plots=false", "log.tensorboard=false", *CASES[family],
    )  # fmt: skip
    assert main(["train", "--run-dir", str(run), *args]) == 0
    if impl == "dropless":
        assert CALLS[family] > calls  # our experts path trained it
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [0, 2, 4]
    assert all(math.isfinite(r["loss"]) and r["lb_loss"] > 0 for r in recs[1:])
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"] - 0.1
    _, _, ours, _ = load_run(run)
    if family in ("deepseek_v3", "nemotron_h"):  # aux-loss-free balancing moved the bias
        assert any(layer.expert_bias.abs().sum() > 0 for layer in dh.moe_layers(ours))
    out = tmp_path / "hf"
    assert main(["convert", str(run), str(out)]) == 0
    stock = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    dh.unpatch_model(ours)
    want = ours.state_dict()
    for name, t in stock.state_dict().items():
        assert torch.equal(t, want[name]), name
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            stock(input_ids=ids).logits, ours(input_ids=ids).logits, rtol=0, atol=0
        )
