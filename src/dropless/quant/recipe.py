"""Recipes (Transformer Engine's names) and `autocast`.

A recipe is a plain dataclass that carries its quantized GEMM and fused MLP as methods
(`grouped_gemm`, `grouped_mlp`), which `dropless.ops` calls while the recipe is active. Under `with dropless.autocast(recipe=...)` every grouped GEMM
(GroupedLinear, GroupedExperts / MoE, the Hugging Face "dropless" experts) and every
converted dense Linear (`dropless.quant.convert_linear`) computes in that format.
"""

from __future__ import annotations

import contextlib
import enum
from dataclasses import dataclass, field

from torch.utils.weak import WeakIdKeyDictionary

from ..ops.dispatch import get_recipe, recipe_active
from .formats import SCALE_RULES
from .gemm import quantized_grouped_gemm
from .mlp import quantized_grouped_mlp

# each recipe option's allowed values: the recipes check them, the run config's
# [precision] section (generated from these dataclasses) by building the recipe
BACKENDS = ("auto", "emulated", "torch")
GRANULARITIES = ("tensor", "row")
AMAX_ALGOS = ("max", "most_recent")


class Format(str, enum.Enum):
    """FP8 format choice: E4M3 everywhere, E5M2 everywhere, or HYBRID (E4M3 forward,
    E5M2 for gradients, whose range matters more than their precision)."""

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"


def _format(v) -> Format:
    try:
        return v if isinstance(v, Format) else Format(str(v).upper())
    except ValueError:
        raise ValueError(f"fp8_format={v!r}; allowed: {[f.value for f in Format]}") from None


class _Recipe:
    kind = ""
    choices = {}  # option -> its allowed values (backend: every recipe's)

    def __post_init__(self) -> None:
        self.fp8_format = _format(self.fp8_format)
        for name, allowed in {"backend": BACKENDS, **self.choices}.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}; allowed: {allowed}")
        if not isinstance(self.fp8_saved_activations, bool):
            raise TypeError("fp8_saved_activations must be a bool")
        margin = getattr(self, "margin", 0)
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin={margin!r} must be an int >= 0")

    @property
    def fwd_format(self) -> str:
        return "e5m2" if self.fp8_format == Format.E5M2 else "e4m3"

    @property
    def bwd_format(self) -> str:
        return "e4m3" if self.fp8_format == Format.E4M3 else "e5m2"

    def grouped_gemm(self, x_SD, w, counts, bias_EN, trans_w):
        """`ops.grouped_gemm` in this recipe's format (ops calls it under autocast)."""
        return quantized_grouped_gemm(x_SD, w, counts, bias_EN, trans_w, self)

    def grouped_mlp(self, x, counts, prob_S, gate_up, down, **mlp_kwargs):
        """`ops.grouped_mlp` under this recipe: the fused MLP step (see quant/mlp.py).

        Also takes x_TD with token_S / slot_TK / num_out (`takes_tokens`)."""
        return quantized_grouped_mlp(x, counts, prob_S, gate_up, down, recipe=self, **mlp_kwargs)

    grouped_mlp.takes_tokens = True


@dataclass
class DelayedScaling(_Recipe):
    """FP8 with per-tensor scales from a history of past amaxes.

    scale = fp8_max / A / 2**margin, A = max of the last `amax_history_len` amaxes
    (`amax_compute_algo="max"`) or the latest one ("most_recent"). The scale used at a
    call comes from earlier calls (the first call uses 1); the call's own amax is then
    pushed. State is kept per weight tensor (inputs, weights and gradients of each GEMM)
    inside this recipe object: reuse one recipe object across steps.
    fp8_saved_activations: keep tensors saved for backward in FP8.
    backend: "auto" (real FP8 GEMMs where the GPU has them, else emulated),
    "emulated" (quantize, dequantize, fp32 GEMM) or "torch" (torch._scaled_grouped_mm).
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    fp8_saved_activations: bool = False
    backend: str = "auto"
    kind = "delayed"
    choices = {"amax_compute_algo": AMAX_ALGOS}
    state: WeakIdKeyDictionary = field(
        default_factory=WeakIdKeyDictionary, init=False, repr=False, compare=False
    )

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len={self.amax_history_len!r} must be an int >= 1")


@dataclass
class Float8CurrentScaling(_Recipe):
    """FP8 with scales from each tensor's own amax at the time it is quantized.

    granularity "tensor": one scale per tensor (per expert for grouped weights);
    "row": one scale per row along the GEMM's reduction dimension (what
    torch._scaled_mm's row-wise mode takes).
    """

    fp8_format: Format = Format.HYBRID
    granularity: str = "tensor"
    margin: int = 0
    fp8_saved_activations: bool = False
    backend: str = "auto"
    kind = "current"
    choices = {"granularity": GRANULARITIES}


@dataclass
class MXFP8BlockScaling(_Recipe):
    """MXFP8 (OCP MX v1.0): blocks of 32 values along the reduction dimension share a
    power-of-two E8M0 scale; elements in E4M3 (fp8_format E4M3, the default) or E5M2
    gradients (HYBRID). scale_rule "floor" (the spec) or "rceil" (rounded up, nothing
    saturates). Column-wise (weight-gradient) blocks never straddle two experts."""

    fp8_format: Format = Format.E4M3
    scale_rule: str = "floor"
    fp8_saved_activations: bool = False
    backend: str = "auto"
    kind = "mxfp8"
    choices = {"scale_rule": SCALE_RULES}


RECIPES = {
    "none": None,
    "delayed": DelayedScaling,
    "current": Float8CurrentScaling,
    "mxfp8": MXFP8BlockScaling,
}


def recipe_from_name(name: str | None, **options):
    """'none' -> None; 'delayed' | 'current' | 'mxfp8' -> that recipe with `options`."""
    key = "none" if name is None else str(name).strip().lower()
    if key not in RECIPES:
        raise ValueError(f"precision recipe {name!r} is not known; allowed: {sorted(RECIPES)}")
    cls = RECIPES[key]
    return None if cls is None else cls(**options)


@contextlib.contextmanager
def autocast(enabled: bool = True, recipe=None):
    """Run grouped GEMMs (and converted Linears) in the recipe's low-precision format.

        with dropless.autocast(recipe=dropless.MXFP8BlockScaling()):
            loss = model(x).sum()
        loss.backward()          # backward uses the recipe captured in forward

    enabled=False (or recipe None with enabled=False) runs in full precision; recipe
    None with enabled=True uses `DelayedScaling()`, as Transformer Engine does.
    """
    if enabled and recipe is None:
        recipe = DelayedScaling()
    if recipe is not None and not isinstance(recipe, _Recipe):
        raise TypeError(
            f"recipe must be a dropless recipe (DelayedScaling, ...), got {type(recipe).__name__}"
        )
    with recipe_active(recipe if enabled else None):
        yield recipe if enabled else None


def active_recipe():
    """The recipe of the innermost `autocast` (None outside one)."""
    return get_recipe()
