"""The JAX layer's row of gpu_check's layer table (`tools/jax_layer.py`, started
by the GPU check's timing step, `tools.gpu_check.run`): it runs the JAX layer at the table's shape in a
child of its own and reports ms and share of the table's dense bound, or says why it was
skipped. Wiring checked on CPU at the bench's tiny shape (no timing claim)."""

import importlib.util
import sys

import pytest
from tools import jax_layer
from tools.gpu_check import run as gpu_run

TINY = dict(E=6, K=2, D=64, F=32, T=48)  # `dropless bench layer --shape tiny`
ROW_FIELDS = {"status", "ms", "share_of_bound", "tflops", "peak_gib"}


def _table(bound_ms=2.0, bound_tflops=0.05):
    bound = dict(ms=bound_ms, peak_gib=None, share_of_bound=1.0, tflops=bound_tflops)
    return dict(shape=dict(TINY), dtype="fp32", rows={"dense_bound": bound})


def test_the_row_runs_the_jax_layer_at_the_tables_shape():
    """The timing step's child on CPU: the JAX layer at the table's shape, every pair
    computed, its share of the table's bound; without jax, the skip and its reason."""
    row = gpu_run.jax_row(_table(), cpu=True, timeout=120)
    assert ROW_FIELDS <= set(row), row
    if importlib.util.find_spec("jax") is None:
        assert row["status"] == "skipped: jax not importable" and "import jax" in row["reason"]
        return
    assert row["status"] == "ok", row
    assert row["device"].startswith("cpu") and row["dtype"] == "float32" and row["dropped"] == 0
    assert 0 < row["ms"] < 10_000
    # share = bound ms / this ms, tflops = the bound's FLOPs over this time (3 places each)
    assert row["share_of_bound"] == pytest.approx(2.0 / row["ms"], rel=2e-3, abs=1e-3)
    assert row["tflops"] == pytest.approx(0.05 * 2.0 / row["ms"], rel=2e-3, abs=1e-3)


def test_jax_without_a_cuda_backend_is_a_skip_with_its_reason(monkeypatch):
    pytest.importorskip("jax")
    import jax

    def no_gpu(platform=None):
        if platform == "gpu":
            raise RuntimeError("Unknown backend: 'gpu' requested")
        return [object()]

    monkeypatch.setattr(jax, "devices", no_gpu)
    res = jax_layer.measure(dict(TINY, dtype="bfloat16", device="cuda"))
    assert res["status"] == "skipped: jax[cuda] not importable"
    assert "no cuda backend" in res["reason"] and "Unknown backend" in res["reason"]
    row = jax_layer.summary_row(res, dict(ms=6.0, tflops=500.0))
    assert row["ms"] is None and row["share_of_bound"] is None and row["reason"] == res["reason"]


def test_jax_that_does_not_import_is_a_skip_with_its_reason(monkeypatch):
    monkeypatch.setitem(sys.modules, "jax", None)  # `import jax` raises ImportError
    res = jax_layer.measure(dict(TINY, dtype="bfloat16", device="cuda"))
    assert res["status"] == "skipped: jax[cuda] not importable"
    assert res["reason"].startswith("import jax failed") and "jax[cuda12]" in res["reason"]


def test_the_row_against_the_bound():
    res = dict(status="ok", ms=8.0, jax="0.11.0", device="cuda:0", dtype="bfloat16", dropped=0)
    row = jax_layer.summary_row(res, dict(ms=6.0, tflops=520.0))
    assert row == dict(status="ok", ms=8.0, share_of_bound=0.75, tflops=390.0, peak_gib=None,
                       jax="0.11.0", device="cuda:0", dtype="bfloat16", dropped=0)  # fmt: skip
    assert jax_layer.summary_row(res, None)["share_of_bound"] is None  # no bound measured


def test_a_child_that_hangs_is_a_row_with_its_status(monkeypatch):
    gc = gpu_run
    monkeypatch.setattr(gc, "run_child", lambda cmd, cpu, timeout: ("timeout", None, "", "tail"))
    row = gc.jax_row(_table(), cpu=False, timeout=1)
    assert row["status"] == "timeout" and row["ms"] is None and row["reason"] == "tail"
