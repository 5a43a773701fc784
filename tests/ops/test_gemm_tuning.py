"""The GEMM tuning cache (ops/expert_mlp/plan.py) with a fake timer: where it lives, its
keys, what invalidates it, a corrupt file, atomic writes; and the gathered plan's
per-GEMM choice: tuned once, read from the cache with nothing allocated, and the same
whatever rows a rank received."""

import json
import os
import warnings

import pytest
import torch

from dropless.ops.expert_mlp import plan as gemm_tuning
from dropless.ops.expert_mlp.plan import FUSED, GatherKernels, GemmTuner, cache_path, shape_key
from dropless.ops.specs import ActivationConfig

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


def test_keys_separate_every_shape_parameter_and_no_row_count():
    base = ("up", torch.bfloat16, 128, 2048, 768, True, "swiglu")
    key = shape_key(*base)
    assert key == "up|bfloat16|E128|D2048|F768|nt|swiglu"
    for i, other in [(0, "down"), (1, torch.float16), (2, 64), (3, 1024), (4, 384), (5, False),
                     (6, "gpt_oss")]:  # fmt: skip
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


def _never(*args, **kwargs):
    raise AssertionError("a fake kernel ran")


@pytest.fixture
def gathered_plan(monkeypatch):
    """plan_expert_mlp with fake row-gathering kernels on CPU; each tuning candidate is
    (GEMM, implementation) for the fake timer instead of a run."""
    kernels = GatherKernels(_never, _never, _never, lambda x, w: True, ("swiglu",), "fake")
    monkeypatch.setattr(gemm_tuning.GATHER_KERNELS, "entries", {"fake": kernels})
    monkeypatch.setattr(gemm_tuning.GATHER_KERNELS, "_gpu_hook", None)
    monkeypatch.setattr(gemm_tuning, "_PLANS", {})

    def candidates(g, kernels, be, ops, args):
        return {be.name: lambda: (g, be.name), FUSED: lambda: (g, FUSED)}

    monkeypatch.setattr(gemm_tuning, "_candidates", candidates)

    def plan(x, tuner, tokens):
        gemm_tuning._PLANS.clear()  # a new process
        gu, dn = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
        return gemm_tuning.plan_expert_mlp(
            x, gu, dn, ActivationConfig(), path="gathered", tokens=tokens, tuner=tuner
        )

    return plan


def test_the_gathered_plan_fuses_the_gemms_the_timer_finds_faster(tmp_path, gathered_plan):
    fast = {("up", FUSED), ("down_dgrad", "x"), ("down_wgrad", FUSED), ("up_wgrad", "x")}
    timed = []

    def timer(fn):
        g, impl = fn()
        timed.append(g)
        return 1.0 if (g, FUSED if impl == FUSED else "x") in fast else 2.0

    plan = gathered_plan(torch.randn(6, 8), _tuner(tmp_path / "t.json", timer), tokens=12)
    assert plan.describe().split() == [
        f"up={FUSED}", f"down={plan.backend.name}", f"down_dgrad={plan.backend.name}",
        f"down_wgrad={FUSED}", f"up_wgrad={plan.backend.name}", f"up_dgrad={plan.backend.name}",
    ]  # fmt: skip
    assert sorted(timed) == sorted(["up", "down_dgrad", "down_wgrad", "up_wgrad"] * 2)
    keys = set(json.loads((tmp_path / "t.json").read_text())["choices"])
    assert "down_wgrad|float32|E3|D8|F4|nt|swiglu" in keys and len(keys) == 4


def test_a_cached_plan_allocates_nothing_for_tuning_and_every_rank_picks_the_same(
    tmp_path, gathered_plan, monkeypatch
):
    """Once the cache has the shape, a later process times nothing and makes no stand-in
    operand; the rows form (what an expert-parallel rank runs on the rows it received)
    never times and picks the same for any number of rows."""

    def timer(fn):
        g, impl = fn()
        return 1.0 if impl == FUSED else 2.0

    path = tmp_path / "t.json"
    first = gathered_plan(torch.randn(6, 8), _tuner(path, timer), tokens=12)

    def fail(*args, **kwargs):
        raise AssertionError("no stand-in operands for a cached choice")

    monkeypatch.setattr(gemm_tuning, "_stand_ins", fail)
    for rows, tokens in [(6, 12), (5, None), (17, None), (0, None)]:
        plan = gathered_plan(torch.randn(rows, 8), _tuner(path, fail), tokens=tokens)
        assert plan.gemms == first.gemms, (rows, tokens)


def test_the_rows_form_never_times_and_keeps_the_grouped_backend_untuned(tmp_path,
                                                                          gathered_plan):  # fmt: skip
    def timer(fn):
        raise AssertionError("nothing may be timed")

    plan = gathered_plan(torch.randn(6, 8), _tuner(tmp_path / "t.json", timer), tokens=None)
    assert None not in plan.gemms and not (tmp_path / "t.json").exists()


def test_bench_tune_writes_the_cache_a_run_reads(tmp_path, gathered_plan, capsys):
    """`dropless bench tune` (its tuning function, with the fake kernels and timer) writes
    the picks; a later run's plan over the same file reads them and times nothing."""
    from dropless.bench.tune import tune_shapes
    from dropless.cli.main import build_parser

    def timer(fn):
        g, impl = fn()
        return 1.0 if (impl == FUSED) == (g in ("up", "up_wgrad")) else 2.0

    path = tmp_path / "t.json"
    picks = tune_shapes([(3, 2, 8, 4)], 6, torch.float32, "cpu", ActivationConfig(),
                        _tuner(path, timer))  # fmt: skip
    assert picks[(3, 2, 8, 4)].split()[0] == f"up={FUSED}"

    def fail(fn):
        raise AssertionError("a run reads the cache, times nothing")

    plan = gathered_plan(torch.randn(6, 8), _tuner(path, fail), tokens=12)
    assert plan.describe() == picks[(3, 2, 8, 4)]
    args = build_parser().parse_args(["bench", "tune", "--shape", "3,2,8,4", "--cache", str(path)])
    assert args.shape == ["3,2,8,4"] and args.cache == path
