"""The attention the planner traces in place of `sdpa` / FlashAttention.

On fake CPU tensors `scaled_dot_product_attention` dispatches as on a CPU: where its CPU
flash kernel does not apply (query/key and value head dims differ, as in DeepSeek-V3's
MLA: 192 and 128) it falls back to the math path, which materializes the [B, H, L, L]
scores; on a GPU the flash / memory-efficient kernels never do. So for `sdpa` and the
FlashAttention implementations the planner's traced copy of the model (never a training
model) runs one autograd Function with what those kernels declare: the output
[B, H, L, Dv] and the fp32 log-sum-exp [B, H, L] kept for backward (with the inputs), and
in backward the input gradients plus an fp32 accumulator of the query gradient.
"""

# B batch, H heads, L query length, Dq query/key head dim, Dv value head dim

from __future__ import annotations

import torch

NAME = "dropless_plan_flash"  # registered with Transformers' attention and mask interfaces
NAME_CP = "dropless_plan_cp_flash"  # the same, for context-parallel attention
DECLARED = ("sdpa", "flash_attention_2", "flash_attention_3", "flash_attention_4")


class _DeclaredAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        B, H, L, _ = q.shape
        out = q.new_empty(B, H, L, v.shape[-1])
        lse = q.new_empty(B, H, L, dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):
        q, k, v, _, _ = ctx.saved_tensors
        dq_accum = q.new_empty(q.shape, dtype=torch.float32)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        del dq_accum
        return dq, dk, dv


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    out = _DeclaredAttention.apply(query, key, value)
    return out.transpose(1, 2).contiguous(), None


def _cp_attention(module, query, key, value, attention_mask, *args, **kwargs):
    """Context parallelism as the GPU runs it: the keys and values all-gathered over the cp
    group (`dropless.parallel.context`: its autograd Function, so the gathered copies are
    what backward keeps) at their own heads (the attention does not repeat them to the
    query heads), then the declared kernel's output and log-sum-exp for this rank's
    queries."""
    from ...parallel.context.attention import all_gather_sequence
    from ...parallel.context.hf import cp_group

    group = cp_group(module)
    k = all_gather_sequence(key, group, 2)
    v = all_gather_sequence(value, group, 2)
    out = _DeclaredAttention.apply(query, k, v)
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs) -> None:
    """The mask function of the declared attentions: none. They are causal inside, and the
    planner's batch has no padding, where the GPU run's SDPA gets no mask either; on fake
    tensors Transformers' `sdpa_mask` builds an [L, L] mask the run never holds (for the
    tiny model at 16,384 tokens it put 0.75 GiB into a plan of a 54 MiB step)."""
    return None


def declare_attention(model) -> bool:
    """Switch `model` (the planner's copy) to the declared attention when it runs one of
    `DECLARED`, or context-parallel attention (`NAME_CP`); returns whether it did."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from ...parallel.context import ATTENTION_NAME

    impl = getattr(model.config, "_attn_implementation", None)
    if impl == ATTENTION_NAME:
        name = NAME_CP
        AttentionInterface.register(NAME_CP, _cp_attention)
        AttentionMaskInterface.register(NAME_CP, _no_mask)
    elif impl in DECLARED:
        name = NAME
        AttentionInterface.register(NAME, _attention)
        AttentionMaskInterface.register(NAME, _no_mask)
    else:
        return False
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = name
    return True
