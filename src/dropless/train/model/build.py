"""Building the model: a local Hugging Face checkpoint, a local config, or the built-in
Qwen3-MoE from `ModelConfig`, switched to the dropless experts path (the FLOPs of a
step are `report/flops.py`'s, the precision recipes `model/precision.py`'s).
"""

# T tokens, L sequence length, E experts, K top-k

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..run.lazy import hf


def require_transformers():
    try:
        import transformers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "dropless train needs transformers: pip install 'dropless[train]'"
        ) from None
    return transformers


def hf_config(mcfg, vocab_size: int):
    """The Transformers config the model will be built from (weights are not read)."""
    transformers = require_transformers()
    if mcfg.path or mcfg.config:
        key, path = ("model.path", mcfg.path) if mcfg.path else ("model.config", mcfg.config)
        p = Path(path)
        if not (p.is_file() and p.name.endswith(".json")) and not (p / "config.json").is_file():
            raise ValueError(
                f"{key}={path!r}: expected a local Hugging Face directory with config.json (no downloads are made)"
            )
        if p.is_file():
            d = json.loads(p.read_text())
            return transformers.AutoConfig.for_model(d.pop("model_type"), **d)
        return transformers.AutoConfig.from_pretrained(p, local_files_only=True)
    v = mcfg.vocab_size or (-(-vocab_size // 64) * 64)  # pad to a multiple of 64
    return transformers.Qwen3MoeConfig(
        vocab_size=v, hidden_size=mcfg.hidden_size, intermediate_size=2 * mcfg.moe_intermediate_size,
        moe_intermediate_size=mcfg.moe_intermediate_size, num_hidden_layers=mcfg.num_layers,
        num_attention_heads=mcfg.num_heads, num_key_value_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
        num_experts=mcfg.num_experts, num_experts_per_tok=mcfg.top_k, norm_topk_prob=True,
        decoder_sparse_step=1, max_position_embeddings=mcfg.max_position_embeddings,
        tie_word_embeddings=mcfg.tie_embeddings, initializer_range=mcfg.init_std,
        router_aux_loss_coef=0.0, use_cache=False,
    )  # fmt: skip


def padding_rows(vocab_size: int) -> int:
    """How many embedding rows past a checkpoint's tokenizer are taken for padding: models
    round the table up (to 64..256 rows) or keep reserved ids, e.g. Qwen3 151,936 rows for
    151,669 tokens, DeepSeek-V3 129,280 for 128,815; a gap beyond this is another tokenizer."""
    return max(256, vocab_size // 100)


def model_config(mcfg, tok_vocab: int, seq_len: int):
    """The Transformers config of `hf_config`, checked against the tokenizer's vocabulary
    and the sequence length (`check_compatible`): what the preflight asks."""
    config = hf_config(mcfg, tok_vocab)
    check_compatible(config, tok_vocab, seq_len, pretrained=bool(mcfg.path))
    return config


def check_compatible(config, tok_vocab: int, seq_len: int, pretrained: bool = False) -> None:
    """Fail fast on a tokenizer the model cannot embed or a sequence it cannot position.
    pretrained: the embeddings are a checkpoint's (model.path), so the tokenizer must be
    the one they were trained with: not larger, and not much smaller either."""
    v = getattr(config, "vocab_size", None)
    if v is not None and tok_vocab > v:
        raise ValueError(
            f"tokenizer/model vocabulary mismatch: the tokenizer has {tok_vocab} tokens but the model's "
            f"vocab_size is {v}; use the tokenizer the model was trained with (data.tokenizer=DIR) or a model with vocab_size >= {tok_vocab}"
        )
    if pretrained and v is not None and v - tok_vocab > padding_rows(v):
        raise ValueError(
            f"tokenizer/model vocabulary mismatch: the tokenizer has {tok_vocab} tokens but model.path's "
            f"embeddings have {v} rows (more than {padding_rows(v)} padding rows): it is not the tokenizer "
            "the model was trained with; leave data.tokenizer unset (model.path's own tokenizer) or set "
            "it to the directory of the model's tokenizer"
        )
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and seq_len > max_pos:
        raise ValueError(
            f"train.seq_len={seq_len} is above the model's maximum sequence length (max_position_embeddings={max_pos}); lower train.seq_len"
        )


def param_dtype(mcfg) -> torch.dtype:
    """The dtype the parameters are stored in (`model.dtype`)."""
    return torch.bfloat16 if mcfg.dtype == "bf16" else torch.float32


def _from_pretrained_kwargs(mcfg) -> dict:
    # the weights load (or are created) straight in model.dtype: a bf16 run never holds an
    # fp32 copy of a checkpoint
    return dict(attn_implementation=mcfg.attn_implementation, dtype=param_dtype(mcfg))


def _switch_path(model: nn.Module, mcfg, expert_bias: bool) -> nn.Module:
    """Patch to dropless (or keep stock), check it is a MoE model, no KV cache."""
    layers = hf().moe_layers(model)
    if mcfg.implementation == "dropless":
        hf().patch_model(model, expert_bias=expert_bias, expert_path=mcfg.expert_path)
    elif expert_bias and not all(layer.expert_bias is not None for layer in layers):
        raise ValueError(
            "train.expert_bias_rate > 0 with model.implementation='stock' needs routers with their "
            "own score bias (e_score_correction_bias or equivalent); this model has none: use "
            "model.implementation='dropless', which adds one"
        )
    if not layers:
        raise ValueError(
            f"{type(model).__name__} has no Mixture-of-Experts layers; dropless train needs a MoE model"
        )
    model.config.use_cache = False
    return model


def build_model(mcfg, config, *, expert_bias: bool, seed: int, device) -> nn.Module:
    """The causal LM on `device` in `model.dtype`, patched to dropless unless
    implementation="stock"."""
    transformers = require_transformers()
    torch.manual_seed(seed)
    kw = _from_pretrained_kwargs(mcfg)
    if mcfg.path:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            mcfg.path, local_files_only=True, **kw
        )
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, **kw)
    model.to(device)
    return _switch_path(model, mcfg, expert_bias)


def build_training_model(
    mcfg,
    config,
    parallel_cfg,
    world: int,
    *,
    expert_bias: bool,
    seed: int,
    device,
    activation_checkpointing: bool = False,
    fused_rmsnorm: bool = False,
    compute_dtype: torch.dtype = torch.float32,
    finetune=None,
):
    """(model, parallel glue or None) for a run on `world` processes: built, then adapted
    and sharded by `adapt_and_shard` (compute_dtype: the run's autocast dtype, which FSDP2
    gathers parameters in).

    Fine-tuning a checkpoint (model.path) on several processes (or on one under
    parallel.force_distributed) builds the model on the meta device, shards it, then each
    rank reads only its own shards from the safetensors files (`dropless.hf.load_sharded_hf`),
    in the parameters' dtype: no rank ever holds the whole model. Otherwise every rank
    builds the full model (same seed) and shards it.
    """
    # several processes, or a quantised checkpoint (block-FP8, MXFP4): build on meta, then
    # each rank reads (and dequantises into model.dtype) only its own slices
    from ...hf.distributed.sharded_load import is_quantized_checkpoint
    from ...parallel.mesh import as_parallel_config

    forced = as_parallel_config(parallel_cfg).force_distributed  # the node's path on one process
    sharded = bool(mcfg.path) and (world > 1 or forced or is_quantized_checkpoint(mcfg.path))
    if sharded:
        torch.manual_seed(seed)
        model = meta_model(mcfg, config, expert_bias)
    else:
        model = build_model(mcfg, config, expert_bias=expert_bias, seed=seed, device=device)
    model, par = adapt_and_shard(
        model, mcfg, parallel_cfg, world, activation_checkpointing=activation_checkpointing,
        fused_rmsnorm=fused_rmsnorm, compute_dtype=compute_dtype, finetune=finetune,
    )  # fmt: skip
    lora = finetune is not None and finetune.method == "lora"
    if sharded:
        model.to_empty(device=device)
        from ...hf.distributed.sharded_load import load_sharded_hf
        from .lora import base_model, checkpoint_name

        load_sharded_hf(base_model(model), mcfg.path, rename=checkpoint_name if lora else None)
    if lora:
        from .lora import init_adapters

        init_adapters(model, seed)
    return model, par


def meta_model(mcfg, config, expert_bias: bool) -> nn.Module:
    """The model of `config` on the meta device, in model.dtype, on its expert path: what a
    sharded load fills and what the planner traces (a quantised checkpoint's config is
    built unquantised: its weights are dequantised while loading)."""
    transformers = require_transformers()
    if getattr(config, "quantization_config", None) is not None:
        config = copy.deepcopy(config)  # plain modules: the weights are dequantised while loading
        del config.quantization_config
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, **_from_pretrained_kwargs(mcfg)
        )
    return _switch_path(model, mcfg, expert_bias)


def adapt_and_shard(
    model, mcfg, parallel_cfg, world: int, *, activation_checkpointing: bool,
    fused_rmsnorm: bool, compute_dtype: torch.dtype, finetune=None, before_lora=None,
):  # fmt: skip
    """(model, parallel glue or None): checkpointing and the fused RMSNorm switched on,
    LoRA adapters added (before sharding: they shard with what they adapt), then sharded
    over `world` processes. before_lora(model) runs first where given (the planner's probes)."""
    from .parallelize import parallelize_for_training

    if activation_checkpointing:  # per decoder layer, non-reentrant
        from ...hf.distributed.parallelize import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    if fused_rmsnorm:
        from ...hf.fusions.rmsnorm import enable_fused_rmsnorm

        enable_fused_rmsnorm(model)
    if before_lora is not None:
        before_lora(model)
    if finetune is not None and finetune.method == "lora":
        from .lora import apply_lora

        model = apply_lora(model, finetune, mcfg.path, world)
    return model, parallelize_for_training(model, parallel_cfg, world, compute_dtype)
