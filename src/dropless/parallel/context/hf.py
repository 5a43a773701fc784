"""Context-parallel attention as a Transformers attention implementation.

`register()` adds `ATTENTION_NAME` to Transformers' `AttentionInterface`, with a mask
function that hands the attention the 2-D padding mask only (the causal mask over global
positions is built inside); `enable(model, group)` registers it, switches the model to it
and tells its modules the cp group. Refused (ValueError): sliding-window attention,
attention sinks (`s_aux`), logit soft-capping and 4-D masks.
"""

# B batch, H heads, S local length, D head dim

from __future__ import annotations

import torch

from .attention import context_parallel_attention

ATTENTION_NAME = "dropless_context_parallel"
_GROUP_ATTR = "_dropless_cp_group"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """The Transformers attention function: [B, H, S, D] query (and key/value with their
    own head count) of this cp rank's tokens -> ([B, S, H, Dv], None)."""
    if sliding_window is not None:
        raise ValueError(
            f"context parallelism does not support sliding-window attention (this layer has "
            f"sliding_window={sliding_window}): set the config's sliding_window=None (or "
            "use_sliding_window=False), or train with parallel.cp=1"
        )
    for name in ("s_aux", "softcap"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"context parallelism does not support `{name}` in attention (attention sinks / "
                "soft-capping): train this family with parallel.cp=1"
            )
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"context parallelism takes a 2-D padding mask [B, S] or none; got a "
            f"{attention_mask.dim()}-D mask: pass the 2-D attention_mask (1 = attend) of "
            "this rank's tokens"
        )
    group = cp_group(module)
    out = context_parallel_attention(
        query,
        key,
        value,
        group,
        scale=scaling,
        dropout_p=dropout if module.training else 0.0,
        key_padding_BS=attention_mask,
    )
    return out.transpose(1, 2).contiguous(), None


def cp_group(module: torch.nn.Module):
    """The cp process group `enable` gave `module`; a RuntimeError saying what to call when
    it has none."""
    group = getattr(module, _GROUP_ATTR, None)
    if group is None:
        raise RuntimeError(
            f"attention implementation {ATTENTION_NAME!r} needs the cp process group: call "
            "dropless.parallel.context.enable(model, group) instead of setting "
            "attn_implementation alone"
        )
    return group


def _padding_mask(batch_size, q_length, kv_length, attention_mask=None, **kwargs):
    """The mask function: the 2-D padding mask (bool, True = attend), or None without padding."""
    if attention_mask is not None and bool(attention_mask.all()):
        return None
    return attention_mask


def register() -> None:
    """Register `ATTENTION_NAME` with Transformers' attention and mask interfaces (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, _padding_mask)


def enable(model: torch.nn.Module, group) -> torch.nn.Module:
    """Run `model`'s attention across the cp ranks of `group` (a ProcessGroup): registers the
    implementation, sets it on every config the model's modules hold, and gives each module
    the group. Inputs then are each rank's load-balanced part
    (`dropless.parallel.context.shard_batch`), with global `position_ids`. Returns `model`."""
    register()
    if getattr(model.config, "sliding_window", None) is not None and getattr(
        model.config, "use_sliding_window", True
    ):
        raise ValueError(
            f"context parallelism does not support sliding-window attention "
            f"(config.sliding_window={model.config.sliding_window}): set sliding_window=None "
            "in the model config, or train with parallel.cp=1"
        )
    for m in model.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = ATTENTION_NAME
        setattr(m, _GROUP_ATTR, group)
    return model
