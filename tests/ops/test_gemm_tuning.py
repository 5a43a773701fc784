"""The GEMM tuning cache (ops/gemm_tuning.py) with a fake timing function: where it lives,
its keys, what invalidates it, a corrupt file, atomic writes; and the per-GEMM choice of
the gathered path (`gathered_mlp.tune_gathered`) picking each GEMM's fastest candidate."""

import json
import os
import warnings

import pytest
import torch

from dropless.ops.expert_mlp import gemm_tuning
from dropless.ops.expert_mlp.gemm_tuning import GemmTuner, cache_path, shape_key

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0"}


class FakeTimer:
    """seconds[name] for the candidate fn whose name was registered; counts calls."""

    def __init__(self, seconds):
        self.seconds, self.calls = dict(seconds), []

    def candidates(self):
        return {name: (lambda n=name: n) for name in self.seconds}

    def __call__(self, fn):
        name = fn()
        self.calls.append(name)
        return self.seconds[name]


def _tuner(path, timer, env=ENV):
    return GemmTuner(path, timer=timer, env=lambda: dict(env))


def test_cache_path_honours_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_path() == tmp_path / "xdg" / "dropless" / "tuning.json"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_path() == tmp_path / "home" / ".cache" / "dropless" / "tuning.json"


def test_keys_bucket_rows_and_separate_every_shape_parameter():
    base = ("up", torch.bfloat16, 128, 131072, 2048, 768, True, "swiglu")
    key = shape_key(*base)
    assert key == "up|bfloat16|E128|S131072|D2048|F768|nt|swiglu"
    assert shape_key("up", torch.bfloat16, 128, 100000, 2048, 768, True, "swiglu") == key
    assert shape_key("up", torch.bfloat16, 128, 131073, 2048, 768, True, "swiglu") != key
    assert shape_key("up", torch.float32, 1, 1, 8, 4, True, "swiglu").startswith(
        "up|float32|E1|S1|"
    )
    for i, other in [(0, "down"), (1, torch.float16), (2, 64), (4, 1024), (5, 384), (6, False),
                     (7, "gpt_oss")]:  # fmt: skip
        changed = list(base)
        changed[i] = other
        assert shape_key(*changed) != key, (i, other)


def test_tunes_once_then_reads_the_file_in_a_new_process(tmp_path):
    path = tmp_path / "tuning.json"
    timer = FakeTimer({"gathered": 1e-3, "grouped_mm": 2e-3})
    assert _tuner(path, timer).choose("k1", timer.candidates()) == "gathered"
    assert sorted(timer.calls) == ["gathered", "grouped_mm"]
    data = json.loads(path.read_text())
    assert data["env"] == ENV and data["choices"]["k1"]["pick"] == "gathered"
    assert data["choices"]["k1"]["ms"] == {"gathered": 1.0, "grouped_mm": 2.0}
    timer.calls.clear()
    fresh = _tuner(path, timer)  # as a later process would
    assert fresh.choose("k1", timer.candidates()) == "gathered" and timer.calls == []
    timer.seconds = {"gathered": 3e-3, "grouped_mm": 2e-3}  # a new shape: tuned alone
    assert fresh.choose("k2", timer.candidates()) == "grouped_mm"
    assert sorted(timer.calls) == ["gathered", "grouped_mm"]
    assert set(json.loads(path.read_text())["choices"]) == {"k1", "k2"}


@pytest.mark.parametrize("field", ["gpu", "torch", "triton"])
def test_another_environment_invalidates_the_whole_file(tmp_path, field):
    path = tmp_path / "tuning.json"
    timer = FakeTimer({"gathered": 1e-3, "grouped_mm": 2e-3})
    _tuner(path, timer).choose("k1", timer.candidates())
    _tuner(path, timer).choose("k2", timer.candidates())
    timer.calls.clear()
    timer.seconds = {"gathered": 3e-3, "grouped_mm": 2e-3}
    env = {**ENV, field: "other"}
    assert _tuner(path, timer, env).choose("k1", timer.candidates()) == "grouped_mm"
    assert len(timer.calls) == 2
    data = json.loads(path.read_text())
    assert data["env"] == env and set(data["choices"]) == {"k1"}  # k2 was the old GPU's


def test_a_pick_no_longer_offered_is_retuned(tmp_path):
    path = tmp_path / "tuning.json"
    timer = FakeTimer({"gathered": 1e-3, "grouped_mm": 2e-3})
    _tuner(path, timer).choose("k", timer.candidates())
    timer.seconds = {"grouped_mm": 2e-3, "triton": 1e-3}
    timer.calls.clear()
    assert _tuner(path, timer).choose("k", timer.candidates()) == "triton"
    assert sorted(timer.calls) == ["grouped_mm", "triton"]


@pytest.mark.parametrize(
    "text", ["{not json", "[1, 2]", '{"version": 99, "env": {}, "choices": {}}', '{"version": 1}']
)
def test_a_corrupt_file_warns_and_is_retuned_and_rewritten(tmp_path, text):
    path = tmp_path / "tuning.json"
    path.write_text(text)
    timer = FakeTimer({"gathered": 2e-3, "grouped_mm": 1e-3})
    with pytest.warns(UserWarning, match="unreadable.*retuning"):
        assert _tuner(path, timer).choose("k", timer.candidates()) == "grouped_mm"
    assert len(timer.calls) == 2
    assert json.loads(path.read_text())["choices"]["k"]["pick"] == "grouped_mm"


def test_writes_are_atomic_and_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "tuning.json"
    timer = FakeTimer({"gathered": 1e-3, "grouped_mm": 2e-3})
    replaced = []
    real_replace = os.replace

    def spy(src, dst):
        # the whole new file is in a temporary file beside the cache when it replaces it
        assert os.path.dirname(src) == str(path.parent) and json.loads(open(src).read())
        replaced.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(gemm_tuning.os, "replace", spy)
    _tuner(path, timer).choose("k1", timer.candidates())  # creates the folder too
    assert replaced == [path]
    before = path.read_text()

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(gemm_tuning.os, "replace", fail)
    tuner = _tuner(path, timer)
    with pytest.warns(UserWarning, match="could not write.*disk full"):
        assert tuner.choose("k2", timer.candidates()) == "gathered"
    assert path.read_text() == before  # never half a file
    assert sorted(p.name for p in path.parent.iterdir()) == ["tuning.json"]  # no temp left
    timer.calls.clear()
    assert tuner.choose("k2", timer.candidates()) == "gathered" and timer.calls == []


def test_one_candidate_is_not_timed_and_none_is_an_error(tmp_path):
    timer = FakeTimer({"grouped_mm": 1.0})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _tuner(tmp_path / "t.json", timer).choose("k", timer.candidates()) == "grouped_mm"
    assert timer.calls == []
    with pytest.raises(ValueError, match="no candidates"):
        _tuner(tmp_path / "t.json", timer).choose("k", {})


def test_tune_gathered_picks_each_gemms_fastest_backend(tmp_path, monkeypatch):
    """Two spy backends: "fast_mm" wins the plain and gather+mm GEMMs, "fast_wgrad" the
    weight gradients; each candidate really runs its backend (the fake timer reads which
    one ran), and the choice is per GEMM."""
    from dropless.ops.expert_mlp.gathered_mlp import tune_gathered
    from dropless.ops.grouped_gemm import backends
    from dropless.ops.grouped_gemm.backends import GemmBackend
    from dropless.ops.permute.row_ops import EAGER
    from dropless.ops.specs import ActivationConfig

    loop, ran = backends._BACKENDS["loop"], []

    def spy(name):
        def mm(a, b, counts, trans_b, out=None):
            ran.append((name, "mm"))
            return loop.mm(a, b, counts.tolist(), trans_b)

        def wgrad(a, b, counts):
            ran.append((name, "wgrad"))
            return loop.wgrad(a, b, counts.tolist())

        return GemmBackend(name, mm, wgrad, lambda a, b: True, -1, device_counts=True)

    seconds = {("fast_mm", "mm"): 1, ("fast_mm", "wgrad"): 3, ("fast_wgrad", "mm"): 2,
               ("fast_wgrad", "wgrad"): 1}  # fmt: skip

    def timer(fn):
        ran.clear()
        fn()
        return sum(seconds[r] for r in ran)

    backends = {n: spy(n) for n in ("fast_mm", "fast_wgrad")}
    x, gu, dn = torch.randn(6, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    tuner = _tuner(tmp_path / "t.json", timer)
    choice = tune_gathered(x, gu, dn, ActivationConfig(), True, 12, None, backends, EAGER, None,
                           tuner)  # fmt: skip
    assert choice == {"up": "fast_mm", "down": "fast_mm", "down_dgrad": "fast_mm",
                      "down_wgrad": "fast_wgrad", "up_wgrad": "fast_wgrad", "up_dgrad": "fast_mm"}  # fmt: skip
    keys = set(json.loads((tmp_path / "t.json").read_text())["choices"])
    assert "down_wgrad|float32|E3|S16|D8|F4|nt|swiglu" in keys and len(keys) == 6


def test_without_timing_only_cached_picks_are_read(tmp_path):
    """What the plan does while compiling or under a Python mode (fake tensors, FLOP
    counters): no candidate runs; cached GEMMs keep their pick, the others get None."""
    from dropless.ops.expert_mlp.gathered_mlp import tune_gathered
    from dropless.ops.permute.row_ops import EAGER
    from dropless.ops.specs import ActivationConfig

    def timer(fn):
        raise AssertionError("nothing may be timed")

    path = tmp_path / "t.json"
    key = shape_key("down", torch.float32, 3, 12, 8, 4, True, "swiglu")
    _tuner(path, FakeTimer({"a": 2.0, "b": 1.0})).choose(
        key, FakeTimer({"a": 2, "b": 1}).candidates()
    )
    backends = {"a": None, "b": None}  # never called
    x, gu, dn = torch.randn(6, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    choice = tune_gathered(x, gu, dn, ActivationConfig(), True, 12, None, backends, EAGER, None,
                           _tuner(path, timer), timing=False)  # fmt: skip
    assert choice == {"up": None, "down": "b", "down_dgrad": None, "down_wgrad": None,
                      "up_wgrad": None, "up_dgrad": None}  # fmt: skip
