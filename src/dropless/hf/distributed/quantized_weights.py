"""Dequantise the quantised weights that published checkpoints ship, one tensor (or one
rank's slice of it) at a time while loading; the product is formed in fp32 and rounded
once to the target dtype.

- Block-scaled FP8 (DeepSeek-V3, Qwen3-*-FP8; quant_method "fp8"): `W` [..., N, K] in
  float8_e4m3fn beside `W_scale_inv` [..., ceil(N/bn), ceil(K/bk)] fp32, one scale per
  `weight_block_size` block (128 x 128 by default).
- MXFP4 (GPT-OSS; quant_method "mxfp4"): `x_blocks` uint8 [..., N, G, 16], 32 E2M1 values
  per group, low nibble first; `x_scales` uint8 [..., N, G], the group's E8M0 exponent.
  Stored [..., out, in], transposed to GPT-OSS's experts layout [..., in, out].
"""

# N output rows, K input columns, G groups of 32 values, R/C a region's rows/columns

from __future__ import annotations

import torch

#: E2M1 code -> value (bit 3 the sign)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MX_GROUP = 32
E8M0_BIAS = 127
DEFAULT_FP8_BLOCK = (128, 128)

FP8_SCALE_SUFFIX = "_scale_inv"
MXFP4_SUFFIXES = ("_blocks", "_scales")


def fp8_block_size(config) -> tuple[int, int]:
    """(bn, bk) of a model config's `quantization_config.weight_block_size`."""
    qc = getattr(config, "quantization_config", None) or {}
    block = qc.get("weight_block_size") if isinstance(qc, dict) else qc.weight_block_size
    if block is None:
        return DEFAULT_FP8_BLOCK
    if len(block) != 2 or min(block) < 1:
        raise ValueError(
            f"quantization_config.weight_block_size={block!r}; expected two positive ints "
            "[rows, columns] (DeepSeek-V3 and Qwen3-FP8 use [128, 128])"
        )
    return int(block[0]), int(block[1])


def dequantize_block_fp8(
    weight_RC: torch.Tensor,
    scale_inv: torch.Tensor,
    block_size: tuple[int, int] = DEFAULT_FP8_BLOCK,
    dtype: torch.dtype = torch.bfloat16,
    row_start: int = 0,
    col_start: int = 0,
) -> torch.Tensor:
    """`weight_RC` [..., R, C], a region of an FP8 weight that starts at (row_start,
    col_start) of its last two dims, times the scale of each value's block. `scale_inv`
    holds the whole matrix's block scales [..., ceil(N/bn), ceil(K/bk)], its leading dims
    sliced like the weight's (a rank's experts)."""
    if weight_RC.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError(f"block-FP8 weight has dtype {weight_RC.dtype}; expected float8_e4m3fn")
    if scale_inv.shape[:-2] != weight_RC.shape[:-2]:
        raise ValueError(
            f"block-FP8 scales {tuple(scale_inv.shape)} do not match weight "
            f"{tuple(weight_RC.shape)} in their leading dims"
        )
    bn, bk = block_size
    rows, cols = weight_RC.shape[-2:]
    dev = weight_RC.device
    block_rows = torch.arange(row_start, row_start + rows, device=dev) // bn
    block_cols = torch.arange(col_start, col_start + cols, device=dev) // bk
    if (
        rows
        and int(block_rows[-1]) >= scale_inv.shape[-2]
        or cols
        and int(block_cols[-1]) >= scale_inv.shape[-1]
    ):
        raise ValueError(
            f"block-FP8 scales {tuple(scale_inv.shape)} cover fewer blocks of {bn}x{bk} than the "
            f"weight region at ({row_start}, {col_start}) of size {rows}x{cols} needs"
        )
    scale = scale_inv.to(device=dev, dtype=torch.float32)
    scale_RC = scale.index_select(-2, block_rows).index_select(-1, block_cols)
    return (weight_RC.to(torch.float32) * scale_RC).to(dtype)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """[..., N, G, 16] uint8 blocks and [..., N, G] uint8 E8M0 scales -> [..., G*32, N]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(
            f"MXFP4 blocks/scales have dtypes {blocks.dtype}/{scales.dtype}; expected uint8"
        )
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MX_GROUP // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)}: expected "
            f"blocks [..., N, G, {MX_GROUP // 2}] and scales [..., N, G]"
        )
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32, device=blocks.device)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values.flatten(-2), exponent.unsqueeze(-1))  # [..., N, G, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def quantized_sources(key: str, checkpoint_keys) -> tuple[str, list[str]] | None:
    """("fp8", [key, scale key]) or ("mxfp4", [blocks key, scales key]) when the
    checkpoint stores `key` quantised, else None."""
    keys = set(checkpoint_keys)
    if key in keys and key + FP8_SCALE_SUFFIX in keys:
        return "fp8", [key, key + FP8_SCALE_SUFFIX]
    base = key.removesuffix(".weight")
    packed = [base + s for s in MXFP4_SUFFIXES]
    if key not in keys and all(k in keys for k in packed):
        return "mxfp4", packed
    return None
