"""The active low-precision recipe (the grouped-GEMM backends are registered in
`grouped_gemm/backends.py`).

The active recipe (FP8 / MXFP8, see `dropless.quant`) is a context variable here, so
every caller of the grouped GEMM gets it without importing `quant`: the recipe object
carries its quantized GEMM and MLP as methods.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import torch

# --- the active low-precision recipe ------------------------------------------------
#
# A recipe object carries its own GEMM and MLP: `recipe.grouped_gemm(x_SD, w, counts,
# bias, trans_w)` and, optionally, `recipe.grouped_mlp(x, counts, prob_S, gate_up, down,
# **mlp_kwargs)` (the recipes of `dropless.quant` do: it runs the expert engine with the
# recipe's slot). A recipe object without a GEMM method uses the GEMM registered for its
# `kind`, and its MLP is composed from that GEMM. Either way ops never imports the package
# that defines the recipe.

_ACTIVE_RECIPE: contextvars.ContextVar = contextvars.ContextVar("dropless_recipe", default=None)
_RECIPE_GEMMS: dict[str, Callable] = {}
# Dynamo cannot trace ContextVar.get: a compiled region reads the recipe from this plain
# attribute instead (it guards on its identity, so a graph is remade only when a recipe
# is entered or left). It holds the recipe of the context that set it last: a compiled
# region sees the recipe of the thread that compiles it.
_COMPILED_RECIPE = [None]


def get_recipe():
    """The low-precision recipe active in this context (None: full precision)."""
    if torch.compiler.is_compiling():
        return _COMPILED_RECIPE[0]
    return _ACTIVE_RECIPE.get()


def set_recipe(recipe) -> contextvars.Token:
    """Make `recipe` the active one in this context (undo with `reset_recipe(token)`)."""
    token = _ACTIVE_RECIPE.set(recipe)
    _COMPILED_RECIPE[0] = recipe
    return token


def reset_recipe(token: contextvars.Token) -> None:
    """Restore the recipe active before `set_recipe` returned `token`."""
    _ACTIVE_RECIPE.reset(token)
    _COMPILED_RECIPE[0] = _ACTIVE_RECIPE.get()


@contextlib.contextmanager
def recipe_active(recipe):
    """`recipe` the active one inside the block (None: full precision), the one before it
    again after (`dropless.autocast` is this with its checks)."""
    token = set_recipe(recipe)
    try:
        yield
    finally:
        reset_recipe(token)


def register_recipe_gemm(kind: str, fn: Callable) -> None:
    """Register fn(x_SD, w, counts, bias, trans_w, recipe) -> y for recipe objects of
    `kind` that have no `grouped_gemm` method."""
    _RECIPE_GEMMS[kind] = fn


def recipe_gemm(recipe) -> Callable:
    """fn(x_SD, w, counts, bias, trans_w) -> y computing the grouped GEMM under `recipe`."""
    method = getattr(recipe, "grouped_gemm", None)
    if callable(method):
        return method
    kind = getattr(recipe, "kind", None)
    if kind not in _RECIPE_GEMMS:
        raise ValueError(
            f"recipe {type(recipe).__name__} (kind {kind!r}) has no grouped_gemm method and no "
            f"GEMM is registered for its kind (registered kinds: {sorted(_RECIPE_GEMMS)}); "
            "use a dropless.quant recipe or register_recipe_gemm"
        )
    return functools.partial(_RECIPE_GEMMS[kind], recipe=recipe)


def recipe_mlp(recipe) -> Callable | None:
    """The recipe's fused expert MLP (called like `ops.grouped_mlp`), or None to compose
    it from the recipe's grouped GEMMs. Its `takes_tokens` attribute says it also takes
    x_TD with token_S / slot_TK / num_out."""
    recipe_gemm(recipe)  # a recipe without a GEMM is an error, fused MLP or not
    method = getattr(recipe, "grouped_mlp", None)
    return method if callable(method) else None
