"""The precision section reaches every option of the FP8 recipes' Python API."""

import dataclasses
import re

import pytest

from dropless import quant
from dropless.quant import formats
from dropless.quant import recipe as qrecipe
from dropless.train.config import load as tc
from dropless.train.config.load import load_config
from dropless.train.model.precision import recipe_context


@pytest.mark.parametrize("name", ["delayed", "current", "mxfp8"])
def test_every_recipe_option_has_a_key(name):
    cls = qrecipe.RECIPES[name]
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    keys = {k for k, recipes in tc.RECIPE_OPTIONS.items() if name in recipes}
    assert keys == fields
    assert all(f"precision.{k}" in tc.known_keys() for k in keys)


def test_the_section_is_generated_from_the_recipe_classes():
    fields = {f.name: f.default for f in dataclasses.fields(tc.PrecisionConfig)}
    # a default the recipes share is the key's; where they differ (fp8_format), "": each its own
    assert fields == {
        "dtype": "auto", "recipe": "none", "margin": 0, "fp8_format": "", "amax_history_len": 1024,
        "amax_compute_algo": "max", "fp8_saved_activations": False, "backend": "auto",
        "granularity": "tensor", "scale_rule": "floor",
    }  # fmt: skip
    # the values are the recipe classes' to check, named under the section
    for bad, words in [
        (dict(recipe="current", granularity="col"), "precision.granularity='col'; allowed: ('tensor', 'row')"),
        (dict(recipe="mxfp8", scale_rule="up"), f"precision.scale_rule='up'; allowed: {formats.SCALE_RULES}"),
        (dict(recipe="delayed", amax_compute_algo="mean"), "precision.amax_compute_algo='mean'; allowed:"),
        (dict(recipe="delayed", fp8_format="e3m4"), "precision.fp8_format='e3m4'; allowed:"),
        (dict(recipe="current", backend="cuda"), "precision.backend='cuda'; allowed:"),
        (dict(recipe="delayed", amax_history_len=0), "precision.amax_history_len=0 must be an int >= 1"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(words)):
            tc.PrecisionConfig(**bad)


def _recipe(*overrides):
    cfg = load_config(None, list(overrides))
    with recipe_context(cfg.precision)() as r:
        assert quant.active_recipe() is r
        return r


def test_keys_reach_the_recipe():
    r = _recipe(
        "precision.recipe=mxfp8", "precision.scale_rule=rceil", "precision.fp8_format=hybrid",
        "precision.fp8_saved_activations=true", "precision.backend=emulated",
    )  # fmt: skip
    assert isinstance(r, quant.MXFP8BlockScaling)
    assert (r.scale_rule, r.fp8_format, r.fp8_saved_activations, r.backend) == (
        "rceil", qrecipe.Format.HYBRID, True, "emulated",
    )  # fmt: skip
    r = _recipe(
        "precision.recipe=delayed", "precision.margin=2", "precision.amax_history_len=16",
        "precision.amax_compute_algo=most_recent", "precision.fp8_format=E4M3",
    )  # fmt: skip
    assert isinstance(r, quant.DelayedScaling)
    assert (r.margin, r.amax_history_len, r.amax_compute_algo, r.fp8_format) == (
        2, 16, "most_recent", qrecipe.Format.E4M3,
    )  # fmt: skip
    r = _recipe("precision.recipe=current", "precision.granularity=row")
    assert isinstance(r, quant.Float8CurrentScaling) and r.granularity == "row"
    # unset keys keep each class's own defaults (mxfp8: E4M3; the others: HYBRID)
    assert _recipe("precision.recipe=mxfp8").fp8_format == qrecipe.Format.E4M3
    assert _recipe("precision.recipe=current").fp8_format == qrecipe.Format.HYBRID


def test_one_recipe_object_per_run():
    cfg = load_config(None, ["precision.recipe=delayed"])
    factory = recipe_context(cfg.precision)
    with factory() as a, factory() as b:
        assert a is b  # delayed scaling keeps its amax history across steps


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision.recipe=delayed", "precision.scale_rule=rceil"],
         "precision.scale_rule='rceil' has no effect with precision.recipe='delayed': it is an option of 'mxfp8'"),
        (["precision.fp8_saved_activations=true"],
         "precision.fp8_saved_activations=True has no effect with precision.recipe='none'"),
        (["precision.recipe=mxfp8", "precision.granularity=row"], "it is an option of 'current'"),
        (["precision.recipe=current", "precision.amax_history_len=8"], "it is an option of 'delayed'"),
        (["precision.fp8_format=E3M4"], "precision.fp8_format='E3M4'; allowed: ['E4M3', 'E5M2', 'HYBRID']"),
        (["precision.backend=cuda"], "precision.backend='cuda'; allowed: ('auto', 'emulated', 'torch')"),
        (["precision.scale_rule=ceil"], "precision.scale_rule='ceil'; allowed:"),
        (["precision.amax_history_len=0"], "precision.amax_history_len=0 must be an int >= 1"),
        (["precision.margin=-1"], "precision.margin=-1 must be an int >= 0"),
        (["precision.amax_compute_algo=mean"], "allowed: ('max', 'most_recent')"),
    ],
)  # fmt: skip
def test_bad_precision_options(overrides, message):
    with pytest.raises(ValueError) as e:
        load_config(None, overrides)
    assert message in str(e.value)
