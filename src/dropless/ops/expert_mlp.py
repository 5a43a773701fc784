"""The routed expert MLP: permute -> gate/up GEMM -> SwiGLU x prob -> down GEMM ->
combine. `grouped_mlp` works on tokens already in expert order (the expert-parallel
dispatcher calls it after its all-to-all); `expert_mlp` adds the local permute and
combine around it.

At full precision both run the memory-lean fused Function of `fused_mlp.py` (one
autograd node that saves only h [S, 2F] and recomputes the rest). Under a
low-precision recipe (`dropless.autocast`) they run the recipe's fused MLP if it
registered one, else the MLP composed from the recipe's grouped GEMMs (`_composed_mlp`,
also the specification the fused path is tested against).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import torch

from .dispatch import get_recipe, pick_gemm_backend, recipe_mlp
from .fused_mlp import fused_mlp, pick_mlp_path
from .grouped_gemm import _check_counts, _expand_bias, grouped_gemm
from .lora import LowRank
from .permute import SortedPairs, permute, sort_by_expert, unpermute
from .specs import ActivationConfig, as_activation
from .swiglu import check_supported, swiglu


def _composed_mlp(
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
        b_SD = _expand_bias(down_bias, counts)
        y = y + (b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1).to(b_SD.dtype))
    return y


def _check_no_recipe(recipe, lora) -> None:
    if recipe is not None and lora is not None:
        raise ValueError(
            "low-rank (LoRA) factors run at full precision only, but a low-precision recipe "
            f"({getattr(recipe, 'kind', recipe)!r}) is active: call outside dropless.autocast, "
            "or fold the update into the weights first"
        )


def _device_offsets_ok(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> bool:
    """Whether the grouped path can take the counts as a device tensor (no host sync)."""
    name = None if backend in (None, "auto") else backend
    return pick_gemm_backend(name, x, w).name == "grouped_mm"


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
) -> torch.Tensor:
    """Expert MLP on rows sorted by expert (`counts` rows each), scaled by prob_S.

    gate_up [E, 2F, D] and down [E, D, F] when trans_w (nn.Linear layout), else
    [E, D, 2F] and [E, F, D]. The prob scales the whole expert output, the down bias
    included: y = prob * (act @ down^T + b) = (prob * act) @ down^T + prob * b.
    counts: host list, or a device tensor (kept on the device, no sync, when the
    grouped_mm backend runs these operands). activation: an ActivationConfig (default
    swiglu), or a kind name with the `interleaved`, `alpha`, `limit` keywords.
    lora: optional low-rank updates (gate_up, down), each a `LowRank` or None: computed
    as thin GEMMs beside the base ones, never folded into the weights (full precision only).
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
    _activation(kw)
    recipe = get_recipe()
    _check_no_recipe(recipe, lora)
    if recipe is not None:
        counts = _check_counts(x_SD, gate_up, counts)
        fused = recipe_mlp(recipe)
        if fused is not None:
            return fused(x_SD, counts, prob_S, gate_up, down, **kw)
        return _composed_mlp(x_SD, counts, prob_S, gate_up, down, **kw)
    path = pick_mlp_path(x_SD, gate_up, backend)
    keep_on_device = (
        path == "grouped"
        and isinstance(counts, torch.Tensor)
        and _device_offsets_ok(x_SD, gate_up, backend)
    )
    if keep_on_device:
        if (
            counts.dim() != 1
            or counts.numel() != gate_up.shape[0]
            or counts.dtype.is_floating_point
        ):
            raise ValueError(
                f"counts must be a 1-D integer tensor with one entry per expert ({gate_up.shape[0]}), "
                f"got {counts.dtype} of shape {tuple(counts.shape)}"
            )
    else:
        counts = _check_counts(x_SD, gate_up, counts)
    return fused_mlp(x_SD, prob_S, gate_up, down, counts, path=path, lora=lora, **kw)


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
    grouped_mm path without keep_TK (CUDA, or under torch.compile) nothing is read
    on the host and the returned SortedPairs has `counts=None`; elsewhere the counts
    are read on the host once, in `sort_by_expert`. `mlp_kwargs` are those of
    `grouped_mlp` (biases, activation, trans_w, backend, lora).
    """
    num_experts = gate_up.shape[0]
    backend = mlp_kwargs.get("backend")
    mlp_kwargs = dict(mlp_kwargs)
    _activation(mlp_kwargs)
    lora = mlp_kwargs.pop("lora", None)  # only the fused Functions take it
    recipe = get_recipe()
    _check_no_recipe(recipe, lora)
    fused = recipe_mlp(recipe) if recipe is not None else None
    if fused is not None and getattr(fused, "takes_tokens", False):
        # the recipe's MLP gathers rows itself and keeps only x_TD (plus its quantized
        # saved activations) for backward, instead of a permuted [S, D] copy
        # dropless: the counts stay on the device (the recipe MLP takes them there)
        sp = sort_by_expert(ids_TK, num_experts, keep_TK, host_counts=keep_TK is not None)
        prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
        out_TD = fused(
            x_TD,
            sp.counts if keep_TK is not None else sp.counts_E,
            prob_S,
            gate_up,
            down,
            **mlp_kwargs,
            token_S=sp.token_S,
            slot_TK=sp.slot_TK,
            num_out=x_TD.shape[0],
        )
        return out_TD, sp
    path = None if recipe is not None else pick_mlp_path(x_TD, gate_up, backend)
    if path is None:
        sp = sort_by_expert(ids_TK, num_experts, keep_TK)
        x_SD = permute(x_TD, sp)
        prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
        y_SD = grouped_mlp(x_SD, sp.counts, prob_S, gate_up, down, **mlp_kwargs)
        return unpermute(y_SD, sp), sp
    sync_free = path == "grouped" and keep_TK is None and _device_offsets_ok(x_TD, gate_up, backend)
    if torch.compiler.is_compiling() and not sync_free:
        # the host-count paths run eagerly: one graph break around sort + MLP (see
        # docs/performance.md) instead of a graph specialised on every routing
        return _expert_mlp_eager(
            x_TD, ids_TK, weights_TK, gate_up, down, keep_TK=keep_TK, lora=lora, **mlp_kwargs
        )
    sp = sort_by_expert(ids_TK, num_experts, keep_TK, host_counts=not sync_free)
    prob_S = weights_TK.reshape(-1).index_select(0, sp.pair_S)
    counts = sp.counts_E if sync_free else sp.counts
    out_TD = fused_mlp(
        x_TD,
        prob_S,
        gate_up,
        down,
        counts,
        token_S=sp.token_S,
        slot_TK=sp.slot_TK,
        num_out=x_TD.shape[0],
        path=path,
        lora=lora,
        **mlp_kwargs,
    )
    return out_TD, sp


_EAGER_MLP = None


def _expert_mlp_eager(*args, **kwargs):
    # wrapped on first use, not at import: torch.compiler.disable imports torch._dynamo
    # (and triton), which `import dropless` should not pay for; only compiled callers
    # reach this, and they have loaded it already
    global _EAGER_MLP
    if _EAGER_MLP is None:
        _EAGER_MLP = torch.compiler.disable(expert_mlp)
    return _EAGER_MLP(*args, **kwargs)
