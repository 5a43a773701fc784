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
    if family in MORE or family in BLOCK_BIAS:
        return _more(family)
    raise KeyError(family)


_MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8)

#: families once on the stock fallback: model type -> config overrides on top of COMMON
#: (sizes small; hybrid families get one attention/full layer so a cache has one)
MORE = {
    "nemotron_h": dict(
        layers_block_type=["mamba", "moe", "attention", "moe"],
        head_dim=8,
        intermediate_size=24,
        moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        ssm_state_size=8,
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=2,
        chunk_size=8,
        num_hidden_layers=None,
    ),
    "deepseek_v2": dict(
        **{**_MLA, "q_lora_rank": None},
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        num_key_value_heads=4,
        n_group=2,
        topk_group=1,
        topk_method="group_limited_greedy",
    ),
    "qwen3_next": dict(
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "qwen3_5_moe_text": dict(
        head_dim=8,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    "qwen3_vl_moe": dict(
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
    ),
    "phimoe": dict(head_dim=8, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(intermediate_size=16, num_local_experts=6, num_experts_per_tok=2),
    "jamba": dict(
        intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=1,
        expert_layer_offset=0,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_dt_rank=4,
    ),
    "minimax": dict(
        head_dim=8,
        intermediate_size=16,
        num_local_experts=6,
        num_experts_per_tok=2,
        layer_types=["linear_attention", "full_attention"],
        block_size=4,
    ),
    "dots1": dict(
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
    ),
    "ernie4_5_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        moe_num_experts=6,
        moe_k=2,
        moe_layer_start_index=0,
        moe_num_shared_experts=1,
    ),
    "hunyuan_v1_moe": dict(
        head_dim=8,
        intermediate_size=16,
        num_experts=6,
        moe_topk=2,
        num_shared_expert=1,
    ),
    "flex_olmo": dict(intermediate_size=16, num_experts=6, num_experts_per_tok=2),
}


#: families whose expert score bias lives on the MoE block, not on its router (AFMoE's
#: router has no `weight`, so `moe_layers` finds none): model type -> config overrides
BLOCK_BIAS = {
    "afmoe": dict(
        head_dim=8,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        num_shared_experts=1,
        num_dense_layers=0,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        global_attn_every_n_layers=2,
    ),
    "lfm2_moe": dict(
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        num_dense_layers=0,
        layer_types=["conv", "full_attention"],
    ),
}

_TINY_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
    deepstack_visual_indexes=[0], num_position_embeddings=16, patch_size=4,
)  # fmt: skip


def _more(family: str):
    import transformers as tf

    if family == "qwen3_vl_moe":  # the text experts of a vision-language model
        text = {**COMMON, **MORE[family]}
        top = {k: text.pop(k) for k in ("tie_word_embeddings", "pad_token_id", "bos_token_id")}
        text.pop("eos_token_id")
        return tf.Qwen3VLMoeConfig(text_config=text, vision_config=_TINY_VISION, **top)
    cls = type(tf.AutoConfig.for_model(family))
    return cls(**{**COMMON, **{**MORE, **BLOCK_BIAS}[family]})


FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "glm4_moe"]
MORE_FAMILIES = list(MORE)


def auto_class(cfg):
    """AutoModelForCausalLM, or the image-text-to-text one for a vision-language config."""
    import transformers as tf

    if type(cfg) in tf.AutoModelForCausalLM._model_mapping:
        return tf.AutoModelForCausalLM
    return tf.AutoModelForImageTextToText


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
            named = (getattr(layer.block, n, None) for n in ("gate", "router"))
            router = layer.router or next((m for m in named if m is not None), None)
            for w in [] if router is None else router.parameters():  # hunyuan: gate.wg
                w.copy_(torch.randn(w.shape, generator=g) * 0.5)
            bias = layer.expert_bias
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=g) * 0.05)
            for p in layer.experts.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def build(family: str, implementation: str | None = "eager", seed: int = 0, **overrides):
    """A tiny CausalLM of `family` in fp32 with routing spread; implementation None = default."""

    torch.manual_seed(seed)
    kwargs = {"attn_implementation": "eager"}
    if implementation is not None:
        kwargs["experts_implementation"] = implementation
    model = auto_class(cfg := config(family, **overrides)).from_config(cfg, **kwargs)
    spread_routing(model, seed)
    return model.float()


def clone_into(src, implementation: str | None):
    """A second model of the same family and weights, built with `implementation`."""

    cfg = src.config.__class__.from_dict(src.config.to_dict())
    kwargs = {"attn_implementation": "eager"}
    if implementation is not None:
        kwargs["experts_implementation"] = implementation
    model = auto_class(cfg).from_config(cfg, **kwargs).float()
    model.load_state_dict(src.state_dict())
    return model


def labelled_batch(seed=1, B=2, L=9):
    """Token ids and labels with ignored positions: right padding in row 0, a masked
    prompt in row 1."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, 96, (B, L), generator=g)
    labels = ids.clone()
    labels[0, -3:] = -100  # right padding
    labels[1, :2] = -100  # a masked prompt
    return ids, labels


def loss_step(model, **kw):
    """model(**kw) and its loss's backward from zeroed gradients -> (output, gradients)."""
    model.zero_grad(set_to_none=True)
    out = model(**kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads
