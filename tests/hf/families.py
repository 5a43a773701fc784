"""Tiny random configs of every supported family (no download), and model builders."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=None,
)


def _cfg(family: str):
    import transformers as tf

    if family == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **COMMON,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
    if family == "qwen2_moe":
        return tf.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=48,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
        )
    if family == "mixtral":
        return tf.MixtralConfig(
            **COMMON, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
        )
    if family == "olmoe":
        return tf.OlmoeConfig(**COMMON, intermediate_size=16, num_experts=8, num_experts_per_tok=3)
    if family == "deepseek_v3":
        return tf.DeepseekV3Config(
            **{**COMMON, "num_key_value_heads": 4},
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            n_shared_experts=1,
            routed_scaling_factor=2.5,
            first_k_dense_replace=0,
            kv_lora_rank=16,
            q_lora_rank=24,
            qk_rope_head_dim=4,
            qk_nope_head_dim=8,
            v_head_dim=8,
        )
    if family == "gpt_oss":
        return tf.GptOssConfig(
            **COMMON,
            head_dim=8,
            intermediate_size=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=8,
            swiglu_limit=1.5,
            layer_types=["sliding_attention", "full_attention"],
        )
    if family == "glm4_moe":
        return tf.Glm4MoeConfig(
            **COMMON,
            head_dim=8,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.5,
            first_k_dense_replace=1,
        )
    raise KeyError(family)


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe"]


def config(family: str, **overrides):
    """A fresh config object each call (a config remembers the implementation it resolved)."""
    cfg = _cfg(family)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def spread_routing(model, seed: int = 0) -> None:
    """Give routers (and score biases) large random values so top-k margins are wide and
    the expert weights random: tiny-model inits route nearly at random ties."""
    import dropless.hf as dh

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in dh.moe_layers(model):
            w = layer.router.weight
            w.copy_(torch.randn(w.shape, generator=g) * 0.5)
            bias = layer.expert_bias
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
            for p in layer.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def build(family: str, implementation: str | None = "eager", seed: int = 0, **overrides):
    """A tiny CausalLM of `family` in fp32 with routing spread; implementation None = default."""
    import transformers as tf

    torch.manual_seed(seed)
    kwargs = {"attn_implementation": "eager"}
    if implementation is not None:
        kwargs["experts_implementation"] = implementation
    model = tf.AutoModelForCausalLM.from_config(config(family, **overrides), **kwargs)
    spread_routing(model, seed)
    return model.float()


def clone_into(src, implementation: str | None):
    """A second model of the same family and weights, built with `implementation`."""
    import transformers as tf

    cfg = src.config.__class__.from_dict(src.config.to_dict())
    kwargs = {"attn_implementation": "eager"}
    if implementation is not None:
        kwargs["experts_implementation"] = implementation
    model = tf.AutoModelForCausalLM.from_config(cfg, **kwargs).float()
    model.load_state_dict(src.state_dict())
    return model
