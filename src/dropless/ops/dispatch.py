"""Backend registry for the grouped GEMM, and the active low-precision recipe.

A backend computes raw (non-autograd) grouped products; the single autograd Function
in `grouped_gemm.py` calls it for forward and both backward GEMMs. Backends register
under a name with a priority; `auto` picks the highest-priority one that supports the
operands. Naming a backend that cannot run raises; it never silently falls back.

The active recipe (FP8 / MXFP8, see `dropless.quant`) is a context variable here, so
every caller of the grouped GEMM gets it without importing `quant`: `quant` registers
its quantized GEMM under the recipe's `kind`.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

_LOG = logging.getLogger("dropless")


@dataclass(frozen=True)
class GemmBackend:
    """A grouped GEMM implementation.

    mm(a_SK, b_E.., counts, trans_b) -> [S, N]: rows of group e times b[e]^T (trans_b)
    or b[e]; wgrad(a_SM, b_SN, counts) -> [E, M, N]: per group a_e^T @ b_e.
    supports(a, b) says whether it can run on these operands (device, dtype, strides).
    device_counts: whether mm/wgrad take the counts as a device tensor (no host sync);
    otherwise they are handed a host list.
    """

    name: str
    mm: Callable
    wgrad: Callable
    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    priority: int = 0
    device_counts: bool = False


_BACKENDS: dict[str, GemmBackend] = {}


def register_gemm_backend(backend: GemmBackend) -> None:
    _BACKENDS[backend.name] = backend


def gemm_backends() -> list[str]:
    """Names of the registered grouped-GEMM backends, best first."""
    return [b.name for b in sorted(_BACKENDS.values(), key=lambda b: -b.priority)]


_TRITON_REGISTERED = False


def _register_lazy_backends(name: str | None, a: torch.Tensor) -> None:
    # the Triton backend registers on first use with CUDA operands (or when named), so
    # importing `ops` never imports `dropless.kernels`, and triton only when it can run
    global _TRITON_REGISTERED
    if not _TRITON_REGISTERED and (a.is_cuda or name == "triton"):
        _TRITON_REGISTERED = True
        from dropless.kernels import register_backend

        register_backend()


def pick_gemm_backend(
    name: str | None, a: torch.Tensor, b: torch.Tensor, *more: torch.Tensor
) -> GemmBackend:
    """The backend to use: `name` if given (error if it cannot run), else the best one.

    `more`: further weights multiplied with inputs like `a` (e.g. the down projection
    of an expert MLP), so one backend serves every GEMM of a layer: each must be
    supported (dtype, device, 16-byte alignment of every dimension read).
    """
    _register_lazy_backends(name, a)
    weights = (b, *more)
    if name not in (None, "auto"):
        if name not in _BACKENDS:
            raise ValueError(
                f"backend={name!r} is not a grouped-GEMM backend; known: {gemm_backends()}"
            )
        backend = _BACKENDS[name]
        if not all(backend.supports(a, w) for w in weights):
            shapes = [tuple(w.shape) for w in weights]
            raise ValueError(
                f"grouped-GEMM backend {name!r} cannot run on {a.dtype} tensors on "
                f"{a.device.type} with weights {shapes} (dtype, device or a dimension not a "
                f"multiple of 16 bytes); use backend='auto' or one of {gemm_backends()}"
            )
        return backend
    for cand in sorted(_BACKENDS.values(), key=lambda b: -b.priority):
        if all(cand.supports(a, w) for w in weights):
            return cand
        if cand.priority > 0 and _LOG.isEnabledFor(logging.DEBUG):
            _LOG.debug(
                "grouped-GEMM backend %r skipped for %s %s with weights %s",
                cand.name,
                a.dtype,
                a.device.type,
                [tuple(w.shape) for w in weights],
            )
    raise AssertionError("the 'loop' backend supports everything")


# --- the active low-precision recipe ------------------------------------------------

_ACTIVE_RECIPE: contextvars.ContextVar = contextvars.ContextVar("dropless_recipe", default=None)
_RECIPE_GEMMS: dict[str, Callable] = {}


def get_recipe():
    """The low-precision recipe active in this context (None: full precision)."""
    return _ACTIVE_RECIPE.get()


def set_recipe(recipe) -> contextvars.Token:
    return _ACTIVE_RECIPE.set(recipe)


def reset_recipe(token: contextvars.Token) -> None:
    _ACTIVE_RECIPE.reset(token)


def register_recipe_gemm(kind: str, fn: Callable) -> None:
    """Register fn(x_SD, w, counts, bias, trans_w, recipe) -> y for recipes of `kind`."""
    _RECIPE_GEMMS[kind] = fn


def recipe_gemm(recipe) -> Callable:
    kind = getattr(recipe, "kind", None)
    if kind not in _RECIPE_GEMMS:
        # quant registers its GEMMs on import; import it here so `ops` needs no import of it
        import dropless.quant  # noqa: F401
    if kind not in _RECIPE_GEMMS:
        raise ValueError(
            f"no grouped GEMM is registered for recipe kind {kind!r}; "
            f"known kinds: {sorted(_RECIPE_GEMMS)}"
        )
    return _RECIPE_GEMMS[kind]


_RECIPE_MLPS: dict[str, Callable] = {}


def register_recipe_mlp(kind: str, fn: Callable) -> None:
    """Register a fused expert MLP for recipes of `kind` (same signature as
    `ops.grouped_mlp` plus a trailing `recipe` keyword). Optional: without one, the
    MLP is composed from the recipe's grouped GEMMs."""
    _RECIPE_MLPS[kind] = fn


def recipe_mlp(recipe) -> Callable | None:
    recipe_gemm(recipe)  # imports quant and validates the kind
    return _RECIPE_MLPS.get(getattr(recipe, "kind", None))
