"""The implementations `dropless bench layer` times beside `dropless.MoE`, each given the
same inputs, router weight and expert weights: Hugging Face v5's `Qwen3MoeSparseMoeBlock`,
and the dropless layer under a low-precision recipe or with the eager row ops in place of
the Triton ones (GPU rows). The experts-path variants are tools/layer_paths.py's, run from
a checkout."""

# D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import contextlib

import torch

# dropless under a recipe: E4M3 gradients too, since torch's FP8 grouped GEMM takes no
# E5M2 operand (HYBRID's dgrad would run emulated, see docs/fp8.md)
RECIPES = {
    "dropless-fp8-current-row": lambda d: d.Float8CurrentScaling(
        granularity="row", fp8_format="E4M3"
    ),
    "dropless-fp8-delayed": lambda d: d.DelayedScaling(fp8_format="E4M3"),
    "dropless-mxfp8-saved": lambda d: d.MXFP8BlockScaling(fp8_saved_activations=True),
}
EAGER_ROWS = "dropless-eager-row-ops"
DROPLESS_VARIANTS = (*RECIPES, EAGER_ROWS)


def variant_context(name: str):
    """The context a dropless row runs in: its recipe's autocast, the eager row ops, or
    nothing for plain `dropless` / `dropless-grouped`."""
    import dropless

    if name in RECIPES:
        return dropless.autocast(recipe=RECIPES[name](dropless))
    if name == EAGER_ROWS:
        return _eager_row_ops()
    return contextlib.nullcontext()


@contextlib.contextmanager
def _eager_row_ops():
    """The Triton row ops unregistered for the block, so the pick falls to the eager ones."""
    from dropless.ops.permute import row_ops

    row_ops.ROW_OPS.load_gpu()  # registered on the first CUDA pick: register it, then hide it
    saved = row_ops.ROW_OPS.entries.pop("triton", None)
    try:
        yield
    finally:
        if saved is not None:
            row_ops.register_row_ops(saved)


def hf_block(cfg, impl, w_router, gate_up, down):
    try:
        from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    except ModuleNotFoundError:  # the command line says this one line (cli/messages.py)
        raise ModuleNotFoundError(
            "the Hugging Face rows (hf-*) need transformers: pip install 'dropless[hf]'",
            name="transformers",
        ) from None
    conf = Qwen3MoeConfig(
        hidden_size=cfg["D"],
        moe_intermediate_size=cfg["F"],
        num_experts=cfg["E"],
        num_experts_per_tok=cfg["K"],
        norm_topk_prob=True,
        experts_implementation=impl,
    )
    with torch.device(w_router.device):  # its own initialization on the device: fast on a GPU
        block = Qwen3MoeSparseMoeBlock(conf).to(dtype=w_router.dtype)
    assert block.experts.config._experts_implementation == impl
    with torch.no_grad():
        block.gate.weight.copy_(w_router)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
    return block
