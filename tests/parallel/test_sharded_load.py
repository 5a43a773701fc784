"""`dropless.hf.load_sharded_hf` in one process, on every checkpoint layout the
families use: per-expert gate/up/down stacked and concatenated (qwen2_moe), renamed
(mixtral: block_sparse_moe, w1/w3/w2), stacked without a gate (nemotron_h), fused in the
file (gpt_oss). A model built on the meta device gets exactly `from_pretrained`'s tensors."""

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from dropless.hf import load_sharded_hf  # noqa: E402

COMMON = dict(
    vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
    num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False,
)  # fmt: skip


def _config(family):
    import transformers as tf

    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON, intermediate_size=24, moe_intermediate_size=8,
            shared_expert_intermediate_size=12, num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    if family == "mixtral":
        return tf.MixtralConfig(
            **{**COMMON, "tie_word_embeddings": True}, intermediate_size=8, num_local_experts=3,
            num_experts_per_tok=2,
        )  # fmt: skip
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON, head_dim=8, intermediate_size=8, num_local_experts=4, num_experts_per_tok=2,
            layer_types=["full_attention", "full_attention"],
        )  # fmt: skip
    if family == "nemotron_h":
        return tf.NemotronHConfig(
            **{k: v for k, v in COMMON.items() if k != "num_hidden_layers"},
            layers_block_type=["moe", "full_attention"], head_dim=8, intermediate_size=24,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
            moe_shared_expert_intermediate_size=8, ssm_state_size=8, mamba_num_heads=2,
            mamba_head_dim=8, n_groups=1, chunk_size=8,
        )  # fmt: skip
    raise KeyError(family)


def _meta(config):
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to_empty(device="cpu")


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "gpt_oss", "nemotron_h"])
def test_meta_model_gets_from_pretrained_tensors(family, tmp_path):
    import transformers as tf

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path)
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model = _meta(ref.config)
    assert load_sharded_hf(model, tmp_path) == []
    want = ref.state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(t, want[name]), name
    for name, buf in ref.named_buffers():  # non-persistent (rotary inv_freq) recomputed
        assert torch.equal(model.get_buffer(name), buf), name
    if ref.config.tie_word_embeddings:  # one tensor again after to_empty split it
        assert model.lm_head.weight is model.model.embed_tokens.weight


def test_missing_tensor_and_missing_files_are_clear_errors(tmp_path):
    import transformers as tf
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(_config("gpt_oss")).save_pretrained(tmp_path / "ok")
    tensors = load_file(tmp_path / "ok" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj"]
    (tmp_path / "cut").mkdir()
    save_file(tensors, tmp_path / "cut" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="no tensor for 'model.layers.1.mlp.experts.down_proj'"):
        load_sharded_hf(_meta(_config("gpt_oss")), tmp_path / "cut")
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_sharded_hf(_meta(_config("gpt_oss")), tmp_path)
