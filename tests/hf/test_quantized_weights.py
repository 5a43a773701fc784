"""Dequantising published checkpoints' FP8 and MXFP4 weights equals Transformers' own
dequantisation of the same tensors (fp32 exactly; bf16 as the fp32 result rounded once)."""

import pytest
import torch
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from dropless.hf.quantized_weights import (
    dequantize_block_fp8,
    dequantize_mxfp4,
    dequantize_state_dict,
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


def test_a_state_dict_keeps_plain_tensors_and_drops_the_scales():
    gen = torch.Generator().manual_seed(4)
    w, s = _fp8_weight((64, 64), (32, 32), gen)
    blocks = torch.randint(0, 256, (2, 4, 1, 16), generator=gen, dtype=torch.uint8)
    scales = torch.full((2, 4, 1), 127, dtype=torch.uint8)
    norm = torch.ones(64)
    sd = {
        "a.weight": w,
        "a.weight_scale_inv": s,
        "e.gate_up_proj_blocks": blocks,
        "e.gate_up_proj_scales": scales,
        "n.weight": norm,
    }
    out = dequantize_state_dict(sd, torch.float32, (32, 32))
    assert sorted(out) == ["a.weight", "e.gate_up_proj", "n.weight"]
    assert out["n.weight"] is norm
    assert out["e.gate_up_proj"].shape == (2, 32, 4)
    assert quantized_sources("a.weight", sd) == ("fp8", ["a.weight", "a.weight_scale_inv"])
    assert quantized_sources("n.weight", sd) is None


def test_block_size_from_the_config():
    class C:
        quantization_config = {"quant_method": "fp8", "weight_block_size": [64, 32]}

    assert fp8_block_size(C()) == (64, 32)
    C.quantization_config = {"weight_block_size": [0, 1]}
    with pytest.raises(ValueError, match="weight_block_size"):
        fp8_block_size(C())
