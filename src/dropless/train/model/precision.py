"""The run's numerics: the compute dtype of the `precision` section (bf16 autocast or
fp32) and the one place precision recipes (FP8, MXFP8) plug in."""

from __future__ import annotations

import contextlib

import torch


def autocast_dtype(pcfg, on_gpu: bool) -> torch.dtype:
    """The compute dtype of the `precision` section: bf16 (autocast) or fp32; "auto" is
    bf16 on a GPU."""
    bf16 = pcfg.dtype == "bf16" or (pcfg.dtype == "auto" and on_gpu)
    return torch.bfloat16 if bf16 else torch.float32


class Precision:
    """The compute dtype (bf16 autocast or fp32) and the low-precision recipe context."""

    def __init__(self, pcfg, device: torch.device, autocast_device: str | None = None):
        """`autocast_device`: the device type autocast runs on when not `device`'s (the
        planner: a GPU's compute dtype, CPU autocast over its fake CPU tensors)."""
        self.dtype = autocast_dtype(pcfg, device.type == "cuda")
        self.device_type = autocast_device or device.type
        self.recipe = recipe_context(pcfg)

    @contextlib.contextmanager
    def forward(self):
        """The context a forward runs in: autocast to the compute dtype and the recipe."""
        bf16 = self.dtype != torch.float32
        autocast = torch.autocast(self.device_type, dtype=self.dtype) if bf16 else None
        with autocast or contextlib.nullcontext(), self.recipe():
            yield


def recipe_context(precision):
    """A factory of the context to run forward in for the `precision` section (the FP8
    hook): `precision.recipe` with the options of the section (`recipe_options()`).

    "none" needs nothing; the others are `dropless.quant` recipes, built once here (at
    startup, before any long work) so a bad option is reported early. A bare recipe name
    is accepted too (no options).
    """
    name = precision if isinstance(precision, str) else precision.recipe
    options = {} if isinstance(precision, str) else precision.recipe_options()
    if name == "none":
        return contextlib.nullcontext
    from ...quant import autocast, recipe_from_name

    try:
        recipe = recipe_from_name(name, **options)  # one object: delayed scaling keeps state
    except (TypeError, ValueError) as e:
        raise ValueError(f"precision: {e}") from None
    return lambda: autocast(recipe=recipe)
