"""Dequantising published checkpoints' FP8 and MXFP4 weights equals Transformers' own
dequantisation of the same tensors (fp32 exactly; bf16 as the fp32 result rounded once)."""

import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dropless.hf.distributed.quantized_weights import (
    dequantize_block_fp8,
    dequantize_mxfp4,
    fp8_block_size,
    quantized_sources,
)


def _fp8_weight(shape, block, gen):
    w = (torch.randn(shape, generator=gen) * 3).to(torch.float8_e4m3fn)
    n, k = shape[-2:]
    grid = (*shape[:-2], -(-n // block[0]), -(-k // block[1]))
    return w, torch.rand(grid, generator=gen) * 0.1 + 1e-3


@pytest.mark.parametrize(
    "shape, block",
    [
        pytest.param((256, 384), (128, 128), id="2d_whole_blocks"),
        pytest.param((200, 130), (128, 128), id="2d_ragged_edges"),
        pytest.param((3, 96, 64), (32, 16), id="experts_3d"),
    ],
)
def test_block_fp8_equals_transformers(shape, block):
    gen = torch.Generator().manual_seed(0)
    w, s = _fp8_weight(shape, block, gen)
    want = _dequantize_fp8_weight(w, s, list(block), torch.float32)
    assert torch.equal(dequantize_block_fp8(w, s, block, torch.float32), want)
    assert torch.equal(dequantize_block_fp8(w, s, block, torch.bfloat16), want.bfloat16())


def test_block_fp8_region_equals_the_slice_of_the_whole():
    gen = torch.Generator().manual_seed(1)
    w, s = _fp8_weight((4, 200, 130), (32, 16), gen)
    whole = dequantize_block_fp8(w, s, (32, 16), torch.float32)
    part = dequantize_block_fp8(w[1:3, 45:170, 7:99], s[1:3], (32, 16), torch.float32, 45, 7)
    assert torch.equal(part, whole[1:3, 45:170, 7:99])


def test_block_fp8_refuses_scales_that_do_not_cover_the_weight():
    w, s = _fp8_weight((256, 256), (128, 128), torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="cover fewer blocks"):
        dequantize_block_fp8(w, s[:1], (128, 128))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        dequantize_block_fp8(w.float(), s)


@pytest.mark.parametrize("shape", [(2, 12, 3), (1, 4, 1)], ids=["experts", "one_group"])
def test_mxfp4_equals_transformers(shape):
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(120, 134, shape, generator=gen, dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.shape == (shape[0], shape[2] * 32, shape[1])
        assert torch.equal(got, want), dtype


def test_mxfp4_refuses_wrong_shapes():
    with pytest.raises(ValueError, match="expected blocks"):
        dequantize_mxfp4(
            torch.zeros(2, 3, 8, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8)
        )


def test_quantized_sources_names_the_parts_a_weight_is_stored_in():
    sd = dict.fromkeys(["a.weight", "a.weight_scale_inv", "e.gate_up_proj_blocks", "e.gate_up_proj_scales", "n.weight"])  # fmt: skip
    assert quantized_sources("a.weight", sd) == ("fp8", ["a.weight", "a.weight_scale_inv"])
    assert quantized_sources("e.gate_up_proj", sd) == (
        "mxfp4",
        ["e.gate_up_proj_blocks", "e.gate_up_proj_scales"],
    )
    assert quantized_sources("n.weight", sd) is None


def test_block_size_from_the_config():
    class C:
        quantization_config = {"quant_method": "fp8", "weight_block_size": [64, 32]}

    assert fp8_block_size(C()) == (64, 32)
    C.quantization_config = {"weight_block_size": [0, 1]}
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size(C())


# ---- loading checkpoints written in those formats ------------------------------------

FP8_BLOCK = (8, 8)


def _tiny_qwen3(tmp_path):
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=32,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "plain")
    return tmp_path / "plain"


def _write_fp8(plain, out, reference):
    """`out`: the checkpoint with every projection in block-FP8 (as Qwen3-*-FP8 ships it);
    `reference`: the same tensors dequantised by Transformers, as a plain checkpoint."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    sd = load_file(plain / "model.safetensors")
    quant, deq = {}, {}
    for k, w in sd.items():
        if k.endswith("proj.weight") and "mlp.gate" not in k:
            bn, bk = FP8_BLOCK
            blocks = w.unflatten(0, (-1, bn)).unflatten(-1, (-1, bk)).abs().amax((1, 3))
            scale = (blocks / 448.0).clamp_min(1e-12)
            full = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            wq = (w / full).to(torch.float8_e4m3fn)
            quant[k], quant[k + "_scale_inv"] = wq, scale
            deq[k] = _dequantize_fp8_weight(wq, scale, list(FP8_BLOCK), torch.float32)
        else:
            quant[k] = deq[k] = w
    for d, tensors in ((out, quant), (reference, deq)):
        shutil.copytree(plain, d)
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
        "weight_block_size": list(FP8_BLOCK),
    }  # fmt: skip
    (out / "config.json").write_text(json.dumps(cfg))


def test_a_block_fp8_checkpoint_loads_as_transformers_dequantises_it(tmp_path):
    import transformers

    from dropless.hf.distributed.sharded_load import is_quantized_checkpoint
    from dropless.train.config.load import ModelConfig, ParallelConfig
    from dropless.train.model.build import build_training_model, hf_config

    plain = _tiny_qwen3(tmp_path)
    _write_fp8(plain, tmp_path / "fp8", tmp_path / "deq")
    assert is_quantized_checkpoint(tmp_path / "fp8") and not is_quantized_checkpoint(plain)
    mcfg = ModelConfig(path=str(tmp_path / "fp8"))
    model, par = build_training_model(
        mcfg, hf_config(mcfg, 64), ParallelConfig(), 1, expert_bias=False, seed=0,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert par is None
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # plain modules, no FP8
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32)
    got, want = model.state_dict(), ref.state_dict()
    assert set(want) <= set(got)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    ids = torch.randint(0, 64, (2, 8))
    torch.testing.assert_close(  # the dropless experts path against stock's
        model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-5, atol=1e-6
    )


def test_an_mxfp4_checkpoint_loads_as_transformers_dequantises_it(tmp_path):
    """GPT-OSS ships its experts as MXFP4 `_blocks` / `_scales` ([E, out, G, 16], [E, out, G])."""
    import json
    import shutil

    import transformers
    from safetensors.torch import load_file, save_file

    from dropless.train.config.load import ModelConfig, ParallelConfig
    from dropless.train.model.build import build_training_model, hf_config

    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).save_pretrained(tmp_path / "plain")
    sd = load_file(tmp_path / "plain" / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    quant, deq = {}, {}
    for k, w in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = w.shape  # stored [E, in, out]; packed along `in`
            blocks = torch.randint(
                0, 256, (e, n_out, n_in // 32, 16), generator=gen, dtype=torch.uint8
            )
            scales = torch.randint(
                122, 128, (e, n_out, n_in // 32), generator=gen, dtype=torch.uint8
            )
            quant[k + "_blocks"], quant[k + "_scales"] = blocks, scales
            deq[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quant[k] = deq[k] = w
    for d, tensors in (("mxfp4", quant), ("deq", deq)):
        shutil.copytree(tmp_path / "plain", tmp_path / d)
        save_file(tensors, tmp_path / d / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((tmp_path / "mxfp4" / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps(meta))
    mcfg = ModelConfig(path=str(tmp_path / "mxfp4"), attn_implementation="eager")
    model, _ = build_training_model(
        mcfg, hf_config(mcfg, 64), ParallelConfig(), 1, expert_bias=False, seed=0,
        device=torch.device("cpu"),
    )  # fmt: skip
    ref = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "deq", dtype=torch.float32)
    got = model.state_dict()
    for k, v in ref.state_dict().items():
        assert torch.equal(got[k], v), k
