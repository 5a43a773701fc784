"""LoRA factors owned by an experts module (`attach_expert_lora`, what `dropless train`
uses) under a low-precision recipe: the fused expert Function cannot run them as thin
GEMMs there, so they are folded into the weights, not dropped."""

import warnings

import pytest
import torch

tf = pytest.importorskip("transformers")

from dropless import hf  # noqa: E402
from dropless.hf.lora.expert_lora import attach_expert_lora  # noqa: E402
from dropless.quant import autocast, recipe_from_name  # noqa: E402
from harness import tiny_moe_config  # noqa: E402


def test_expert_owned_factors_apply_under_a_recipe():
    cfg = tiny_moe_config(
        vocab_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        norm_topk_prob=False, max_position_embeddings=32768, pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = hf.patch_model(tf.AutoModelForCausalLM.from_config(cfg))
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    recipe = recipe_from_name("current")
    with torch.no_grad(), autocast(recipe=recipe):
        base = model(input_ids=ids).logits
    for layer in hf.moe_layers(model):  # B random too: the update is not zero
        attach_expert_lora(layer.experts, 4, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    with torch.no_grad(), autocast(recipe=recipe), warnings.catch_warnings():
        warnings.simplefilter("ignore", hf.DroplessLoRAFallbackWarning)
        quantized = model(input_ids=ids).logits
    update = (adapted - base).abs().max()
    # FP8 (E4M3, per-tensor current scaling) moves these logits by ~4% of the update; a
    # dropped update would leave them where the base is, a whole update away
    assert update > 0.05
    assert (quantized - adapted).abs().max() < 0.2 * update
