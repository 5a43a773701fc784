"""Recognise what an experts module computes between its two projections.

Support is decided from the module's behaviour, never from its family name:

1. `act_fn` is mapped to an activation kind of `dropless.ops.activation.eager` by what it
   is (SiLU, exact GELU, tanh GELU, ReLU^2); any other parameter-free elementwise
   `act_fn` is registered as a kind of its own (derivative by autograd in backward).
2. Candidate fused forms (each kind, concatenated or interleaved, the clamped SwiGLU
   and GPT-OSS's clamped GLU with the module's own alpha/limit attributes) are run on
   a float64 probe next to the module's own `_apply_gate` (or `act_fn` when non-gated);
   the first that agrees to float64 rounding is the fused form.
3. No candidate agrees: the module's gate runs as is between dropless's grouped GEMMs.
"""

# n probe rows, F expert hidden dim

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.activation.eager import REGISTERED, register_elementwise
from ...ops.reference import activation_reference

_PROBE_ROWS, _PROBE_F = 6, 8
_RTOL, _ATOL = 1e-10, 1e-12


def _known_kind(act) -> str | None:
    from transformers import activations as A

    if act is F.silu or isinstance(act, (nn.SiLU, A.SiLUActivation)):
        return "swiglu"
    if isinstance(act, A.ReLUSquaredActivation):
        return "relu2"
    if isinstance(act, (A.GELUTanh, A.NewGELUActivation)):
        return "gelu_tanh"
    if isinstance(act, A.GELUActivation) or (
        isinstance(act, nn.GELU) and act.approximate == "none"
    ):
        return "gelu"
    if isinstance(act, nn.GELU) and act.approximate == "tanh":
        return "gelu_tanh"
    return None


def _is_elementwise(act, x: torch.Tensor) -> bool:
    """act is a function of each value alone: same values for a shuffled or sliced input."""
    try:
        y = act(x)
        perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(1))
        y_perm = act(x.reshape(-1)[perm]).reshape(-1)
        y_row = act(x[:1])
    except Exception:
        return False
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return False
    return _agrees(y_perm, y.reshape(-1)[perm]) and _agrees(y_row, y[:1])


def _elementwise_key(act) -> str:
    cls = type(act) if isinstance(act, nn.Module) else act
    name = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', repr(cls))}"
    if isinstance(act, nn.Module):
        state = {k: v for k, v in vars(act).items() if isinstance(v, (int, float, bool, str))}
        state.pop("training", None)
        if state:
            name += "(" + ", ".join(f"{k}={v!r}" for k, v in sorted(state.items())) + ")"
    return name


def act_kind(act, probe: torch.Tensor) -> str | None:
    """The activation kind of `act` (registering a new elementwise one), else None."""
    if act is None:
        return None
    kind = _known_kind(act)
    if kind is not None:
        return kind
    if isinstance(act, nn.Module) and (list(act.parameters()) or list(act.buffers())):
        return None  # learnable or stateful: not one function of the values
    if not callable(act) or not _is_elementwise(act, probe):
        return None
    kind = _elementwise_key(act)
    if kind not in REGISTERED:
        register_elementwise(kind, act, f"{kind}(gate) * up (non-gated: {kind}(h))")
    return kind


def _float_attrs(module: nn.Module, word: str) -> list[float]:
    values = []
    for key, v in vars(module).items():
        if word in key.lower() and isinstance(v, (int, float)) and not isinstance(v, bool):
            if float(v) not in values:
                values.append(float(v))
    return values


def _candidates(kinds: list[str], limits: list[float], alphas: list[float]):
    for interleaved in (False, True):
        for kind in kinds:
            yield dict(activation=kind, interleaved=interleaved)
        for limit in (v for v in limits if v > 0):
            yield dict(activation="swiglu_clamp", interleaved=interleaved, limit=limit)
            for alpha in alphas:
                yield dict(activation="gpt_oss", interleaved=interleaved, alpha=alpha, limit=limit)


def _probe(limits: list[float], width: int) -> torch.Tensor:
    # values well past every clamp limit, so a clamp that differs shows
    scale = 1.5 * max(limits, default=4.0)
    g = torch.Generator().manual_seed(0)
    return torch.randn(_PROBE_ROWS, width, generator=g, dtype=torch.float64) * scale


def _agrees(got, want) -> bool:
    return (
        isinstance(got, torch.Tensor)
        and got.shape == want.shape
        and got.dtype == want.dtype
        and bool(torch.allclose(got, want, rtol=_RTOL, atol=_ATOL))
    )


def fused_form(module: nn.Module) -> dict | str:
    """The fused activation of `module` as keyword fields of `ExpertsSpec`, or a string
    saying why its gate has no fused form."""
    gated = bool(module.has_gate)
    limits, alphas = _float_attrs(module, "limit"), _float_attrs(module, "alpha")
    h = _probe(limits, 2 * _PROBE_F if gated else _PROBE_F)
    kind = act_kind(getattr(module, "act_fn", None), h[:, :_PROBE_F].clone())
    try:
        own = module._apply_gate(h.clone()) if gated else module.act_fn(h.clone())
    except Exception as e:
        return f"its gate raised {type(e).__name__} on a float64 probe"
    if not gated:
        if kind is None:
            return f"act_fn {type(module.act_fn).__name__} is not a known elementwise function"
        cands = [dict(activation=kind, interleaved=False)]
    else:
        kinds = [k for k in (kind, "swiglu") if k is not None]
        cands = list(_candidates(list(dict.fromkeys(kinds)), limits, alphas))
    for cand in cands:
        fn = REGISTERED.get(cand["activation"])
        kw = {("kind" if k == "activation" else k): v for k, v in cand.items()}
        want = activation_reference(h, gated=gated, fn=fn, **kw)
        if _agrees(own, want):
            return cand
    gate = type(module)._apply_gate
    return f"gate {getattr(gate, '__qualname__', gate)} matches no fused form"
