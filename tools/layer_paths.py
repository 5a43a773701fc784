"""The experts-path variants `dropless bench layer` times beside `dropless.MoE` when run
from a checkout (not in the wheel; `bench.common.from_checkout`), each with the router of
`route` on the same inputs and weights: `composed` (dropless's sort and permute around
`grouped_mm` autograd nodes), `grouped_mm-plain` (written plainly, no dropless op) and
`bmm-padded` (bmm over experts padded to the largest count); and the contexts of the
`dropless.MoE` rows the GPU table asks for by name (`VARIANTS`: under a low-precision
recipe, or with the eager row ops in place of the Triton ones)."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

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


def variant_context(name: str):
    """The context a `dropless.MoE` row of `VARIANTS` runs in: its recipe's autocast, or the
    Triton row ops unregistered, so the pick falls to the eager ones."""
    import dropless

    if name in RECIPES:
        return dropless.autocast(recipe=RECIPES[name](dropless))
    return _eager_row_ops()


@contextlib.contextmanager
def _eager_row_ops():
    from dropless.ops.permute import row_ops

    row_ops.ROW_OPS.load_gpu()  # registered on the first CUDA pick: register it, then hide it
    saved = row_ops.ROW_OPS.entries.pop("triton", None)
    try:
        yield
    finally:
        if saved is not None:
            row_ops.register_row_ops(saved)


VARIANTS = (*RECIPES, "dropless-eager-row-ops")


def route(x_TD, w_router_ED, K):
    probs = torch.softmax((x_TD @ w_router_ED.t()).float(), dim=-1)
    w_TK, ids_TK = probs.topk(K, dim=-1)
    return ids_TK, (w_TK / w_TK.sum(-1, keepdim=True)).to(x_TD.dtype)


def composed(x_TD, ids_TK, w_TK, gate_up, down):
    """argsort + grouped_mm autograd nodes + combine, through dropless's sort and permute."""
    from dropless import ops
    from dropless.ops.expert_mlp import composed_mlp

    sp = ops.sort_by_expert(ids_TK, gate_up.shape[0])
    prob_S = w_TK.reshape(-1).index_select(0, sp.pair_S)
    y = composed_mlp(
        ops.permute(x_TD, sp), sp.counts, prob_S, gate_up, down,
        gate_up_bias=None, down_bias=None, trans_w=True, backend=None,
    )  # fmt: skip
    return ops.unpermute(y, sp)


def grouped_mm_plain(x_TD, ids_TK, w_TK, gate_up, down):
    """argsort + `torch._grouped_mm` with autograd + index_add, as one writes it plainly
    (no dropless op): the counts stay on the device."""
    E, F = gate_up.shape[0], gate_up.shape[1] // 2
    K = ids_TK.shape[1]
    flat = ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok_S = order // K
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x_TD.index_select(0, tok_S), gate_up.transpose(1, 2), offs=offs)
    a = torch.nn.functional.silu(h[:, :F]) * h[:, F:]
    y = torch._grouped_mm(a, down.transpose(1, 2), offs=offs)
    y = y * w_TK.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, tok_S, y)


def bmm_padded(x_TD, ids_TK, w_TK, gate_up, down):
    """bmm over experts padded to the largest count (autograd through index ops)."""
    from dropless import ops

    E = gate_up.shape[0]
    sp = ops.sort_by_expert(ids_TK, E)
    C = max(sp.counts)
    starts = torch.tensor([0] + sp.counts[:-1]).cumsum(0)
    expert_S = torch.repeat_interleave(torch.arange(E), torch.tensor(sp.counts))
    row_S = (expert_S * C + torch.arange(sp.num_slots) - starts[expert_S]).to(x_TD.device)
    x_pad = x_TD.new_zeros(E * C, x_TD.shape[1]).index_copy(
        0, row_S, x_TD.index_select(0, sp.token_S)
    )
    h = torch.bmm(x_pad.view(E, C, -1), gate_up.transpose(1, 2))
    gate, up = h.chunk(2, dim=-1)
    y = torch.bmm(torch.nn.functional.silu(gate) * up, down.transpose(1, 2)).view(E * C, -1)
    y_SD = y.index_select(0, row_S)
    return ops.unpermute(y_SD, sp, w_TK)


EXPERT_PATHS = {
    "composed": composed,
    "grouped_mm-plain": grouped_mm_plain,
    "bmm-padded": bmm_padded,
}
