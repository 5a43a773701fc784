"""The routed expert MLP: permute -> gate/up GEMM -> SwiGLU x prob -> down GEMM ->
combine. `grouped_mlp` works on tokens already in expert order (the expert-parallel
dispatcher calls it after its all-to-all); `expert_mlp` adds the local permute and
combine around it.

At full precision both run the memory-lean fused Function of `fused_mlp.py` (one
autograd node that saves only h [S, 2F] and recomputes the rest). Under a
low-precision recipe (`dropless.autocast`) they run the recipe's fused MLP if it
registered one, else the MLP composed from the recipe's grouped GEMMs (`composed_mlp`,
also the specification the fused path is tested against). Which of these runs, with
which backend, is decided once per call by `mlp_plan.plan_expert_mlp`. Under
`torch.autocast` both first cast their operands to the autocast dtype
(`compute_dtype.py`: tokens per call, weights once per optimizer step), so the plan is
made for, and the GEMMs run in, the dtype the user asked for.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import torch

from ..activation.swiglu import check_supported, swiglu
from ..compute_dtype import to_compute_dtype
from ..dispatch import get_recipe
from ..grouped_gemm import grouped_gemm
from ..grouped_gemm.eager import check_counts, expand_bias
from ..lora import LowRank
from ..permute.eager import SortedPairs, permute, sort_by_expert, unpermute
from ..specs import ActivationConfig, as_activation
from . import custom_op
from .fused_mlp import fused_mlp
from .mlp_plan import plan_expert_mlp


def composed_mlp(
    x_SD,
    counts,
    prob_S,
    gate_up,
    down,
    *,
    gate_up_bias,
    down_bias,
    activation=None,
    interleaved=None,
    trans_w=True,
    alpha=None,
    limit=None,
    backend=None,
):
    h = grouped_gemm(x_SD, gate_up, counts, gate_up_bias, trans_w=trans_w, backend=backend)
    a = swiglu(h, prob_S, activation=activation, interleaved=interleaved, alpha=alpha, limit=limit)
    y = grouped_gemm(a, down, counts, None, trans_w=trans_w, backend=backend)
    if down_bias is not None:
        b_SD = expand_bias(down_bias, counts)
        y = y + (b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1).to(b_SD.dtype))
    return y


def _activation(kw: dict) -> ActivationConfig:
    """Replace the activation keywords in `kw` by one checked ActivationConfig."""
    act = as_activation(
        kw.pop("activation", None),
        interleaved=kw.pop("interleaved", None),
        alpha=kw.pop("alpha", None),
        limit=kw.pop("limit", None),
    )
    kw["activation"] = check_supported(act)
    return kw["activation"]


def grouped_mlp(
    x_SD: torch.Tensor,
    counts,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    backend: str | None = None,
    lora: tuple[LowRank | None, LowRank | None] | None = None,
    offsets_E: torch.Tensor | None = None,
) -> torch.Tensor:
    """Expert MLP on rows sorted by expert (`counts` rows each), scaled by prob_S.

    gate_up [E, 2F, D] and down [E, D, F] when trans_w (nn.Linear layout), else
    [E, D, 2F] and [E, F, D]. The prob scales the whole expert output, the down bias
    included: y = prob * (act @ down^T + b) = (prob * act) @ down^T + prob * b.
    counts: host list, or a device tensor (kept on the device, no sync, when the
    grouped path's backend takes device counts: `GemmBackend.device_counts`). activation: an ActivationConfig (default
    swiglu), or a kind name with the `interleaved`, `alpha`, `limit` keywords.
    lora: optional low-rank updates (gate_up, down), each a `LowRank` or None: computed
    as thin GEMMs beside the base ones, never folded into the weights (full precision only).
    offsets_E: the int32 cumulative ends of counts on x's device (`SortedPairs.offsets_E`),
    shared by every GEMM of the layer; None: computed once here where a GEMM reads them.
    """
    kw = dict(
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        activation=activation,
        interleaved=interleaved,
        alpha=alpha,
        limit=limit,
        trans_w=trans_w,
        backend=backend,
    )
    act = _activation(kw)
    if get_recipe() is None:  # a recipe quantizes its operands itself
        x_SD, gate_up, down, lora = to_compute_dtype(x_SD, gate_up, down, kw, lora)
    has_bias = gate_up_bias is not None or down_bias is not None
    plan = plan_expert_mlp(
        x_SD, gate_up, down, act, backend=backend, lora=lora, trans_w=trans_w, bias=has_bias
    )
    if plan.path == "recipe":
        counts = check_counts(x_SD, gate_up, counts)
        if plan.recipe_mlp is not None:
            return plan.recipe_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
        return composed_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
    if plan.path == "grouped" and isinstance(counts, torch.Tensor) and plan.device_counts:
        _check_device_counts(counts, gate_up.shape[0])
    else:
        counts = check_counts(x_SD, gate_up, counts)
    return fused_mlp(
        x_SD, prob_S, gate_up, down, counts, plan=plan, lora=lora, offsets_E=offsets_E, **kw
    )


def _check_device_counts(counts: torch.Tensor, num_experts: int) -> None:
    if counts.dim() != 1 or counts.numel() != num_experts or counts.dtype.is_floating_point:
        raise ValueError(
            f"counts must be a 1-D integer tensor with one entry per expert ({num_experts}), "
            f"got {counts.dtype} of shape {tuple(counts.shape)}"
        )


def expert_mlp(
    x_TD: torch.Tensor,
    ids_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    keep_TK: torch.Tensor | None = None,
    **mlp_kwargs,
) -> tuple[torch.Tensor, SortedPairs]:
    """out[t] = sum_k w[t,k] * expert_{ids[t,k]}(x[t]); returns (out_TD, sorted pairs).

    Every pair is computed unless keep_TK (capacity mode) marks it dropped. On the
    grouped path without keep_TK, with a backend that takes device counts (grouped_mm,
    triton: CUDA, or under torch.compile) nothing is read
    on the host and the returned SortedPairs has `counts=None`; elsewhere the counts
    are read on the host once, in `sort_by_expert`. `mlp_kwargs` are those of
    `grouped_mlp` (biases, activation, trans_w, backend, lora).
    """
    return _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, eager=False)


def _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, *, eager: bool):
    """expert_mlp; `eager`: already outside the compiled graph (never break it again:
    under non-strict torch.export `is_compiling()` stays true inside compiler.disable)."""
    mlp_kwargs = dict(mlp_kwargs)
    act = _activation(mlp_kwargs)
    lora = mlp_kwargs.pop("lora", None)  # only the fused Functions take it
    recipe = get_recipe()
    if recipe is None:  # a recipe quantizes its operands itself
        x_TD, gate_up, down, lora = to_compute_dtype(x_TD, gate_up, down, mlp_kwargs, lora)
    compiling = torch.compiler.is_compiling() and not eager
    if compiling and custom_op.takes(recipe, lora, keep_TK, mlp_kwargs.get("backend")):
        return _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, act, mlp_kwargs)
    if compiling:  # what the op does not take runs outside the graph: one break, no guards
        return _expert_mlp_eager(
            x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, {**mlp_kwargs, "lora": lora}
        )
    plan = plan_expert_mlp(
        x_TD, gate_up, down, act, backend=mlp_kwargs.get("backend"), lora=lora,
        capacity=keep_TK is not None, rows=ids_TK.numel(), trans_w=mlp_kwargs.get("trans_w", True),
        bias=any(mlp_kwargs.get(b) is not None for b in ("gate_up_bias", "down_bias")),
    )  # fmt: skip
    sp = sort_by_expert(ids_TK, gate_up.shape[0], keep_TK, host_counts=not plan.device_counts)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
    counts = sp.counts_E if plan.device_counts else sp.counts
    if plan.path == "recipe" and not plan.takes_tokens:
        y_SD = grouped_mlp(permute(x_TD, sp), counts, prob_S, gate_up, down, **mlp_kwargs)
        return unpermute(y_SD, sp), sp
    tokens = dict(token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=x_TD.shape[0])
    if plan.path == "recipe":
        # the recipe's MLP gathers rows itself and keeps only x_TD (plus its quantized
        # saved activations) for backward, instead of a permuted [S, D] copy
        out_TD = plan.recipe_mlp(x_TD, counts, prob_S, gate_up, down, **mlp_kwargs, **tokens)
        return out_TD, sp
    out_TD = fused_mlp(
        x_TD, prob_S, gate_up, down, counts, plan=plan, lora=lora, offsets_E=sp.offsets_E,
        **tokens, **mlp_kwargs,
    )  # fmt: skip
    return out_TD, sp


def _through_custom_op(x_TD, ids_TK, weights_TK, gate_up, down, act, mlp_kwargs):
    """The call as one `dropless::expert_mlp` node (torch.compile, torch.export)."""
    out_TD, pair_S, slot_TK, counts_E = custom_op.run(
        x_TD, ids_TK, weights_TK, gate_up, down, mlp_kwargs.get("gate_up_bias"),
        mlp_kwargs.get("down_bias"), act, mlp_kwargs.get("trans_w", True),
    )  # fmt: skip
    sp = SortedPairs(
        token_S=pair_S // ids_TK.shape[1], pair_S=pair_S, slot_TK=slot_TK, counts_E=counts_E,
        counts=None, offsets_E=counts_E.cumsum(0, dtype=torch.int32),
    )  # fmt: skip
    return out_TD, sp


# torch._disable_dynamo is torch.compiler.disable that imports torch._dynamo (and triton)
# on its first call, not at `import dropless`; made here, not inside the compiled region,
# where creating the wrapper would itself break the graph
@torch._disable_dynamo
def _expert_mlp_eager(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs):
    """expert_mlp run outside the compiled graph (what the custom op does not take)."""
    return _expert_mlp(x_TD, ids_TK, weights_TK, gate_up, down, keep_TK, mlp_kwargs, eager=True)
