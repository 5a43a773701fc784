"""`dropless bench memory --tiny` stays a smoke run: the tiny model at short lengths,
every row in one child process; without --tiny the run measures what it always did (the
pinned model at 8192 and 32768, one child per row). No child is started here."""

from __future__ import annotations

import json
import signal

from dropless.bench import memory
from dropless.bench.child import ChildRun
from dropless.bench.e2e import QUICK, SHAPE
from dropless.cli.main import main


def _ok(row: dict) -> dict:
    return {
        "impl": row["impl"], "seq": row["seq"], "status": "ok", "threads": 1,
        "peak_step_mib": 1.0, "peak_fwd_bwd_mib": 1.0, "peak_optimizer_mib": 1.0,
        "process_peak_mib": 400.0, "step_s": 0.01, "loss": 5.0,
    }  # fmt: skip


def _children(monkeypatch) -> list:
    """Record the children the run would start (one list of rows per child)."""
    started: list = []

    def one_child(rows, timeout):
        started.append(rows)
        return [_ok(r) for r in rows]

    monkeypatch.setattr(memory, "run_rows", one_child)
    return started


def test_tiny_is_one_child_of_short_rows_on_the_tiny_model(monkeypatch, capsys):
    started = _children(monkeypatch)
    assert main(["bench", "memory", "--tiny"]) == 0
    (rows,) = started  # one child for every row
    assert [(r["seq"], r["impl"]) for r in rows] == [
        (seq, impl) for seq in (32, 64) for impl in memory.DEFAULT_IMPLS
    ]
    for r in rows:
        assert r["shape"] == QUICK
    model = {k: QUICK[k] for k in memory.MODEL_KEYS}
    assert model["hidden_size"] <= 64 and model["num_hidden_layers"] <= 2
    assert model["vocab_size"] <= 256 and model["num_experts"] <= 8
    assert "--tiny: 6 rows in one process" in capsys.readouterr().err


def test_without_tiny_each_row_measures_the_pinned_model_in_its_own_child(monkeypatch):
    started = _children(monkeypatch)
    assert main(["bench", "memory"]) == 0
    assert [len(rows) for rows in started] == [1] * 6
    assert [(r["seq"], r["impl"]) for (r,) in started] == [
        (seq, impl) for seq in (8192, 32768) for impl in memory.DEFAULT_IMPLS
    ]
    assert all(r["shape"] == SHAPE for (r,) in started)


def test_a_shared_child_that_dies_leaves_the_later_rows_to_their_own_children(monkeypatch):
    rows = [{"impl": impl, "seq": 32} for impl in memory.DEFAULT_IMPLS]
    printed = '{"impl": "grouped_mm", "seq": 32, "status": "ok"}\n'

    alone = []

    def child(cmd, **kwargs):  # the shared child is killed; the later rows alone run through
        job = json.loads(cmd[-1])["rows"]
        if len(job) > 1:
            return ChildRun("fail", -signal.SIGKILL, printed, "")
        alone.extend(job)
        return ChildRun("ok", 0, json.dumps(_ok(job[0])) + "\n", "")

    monkeypatch.setattr(memory, "run_child_process", child)
    out = memory.run_rows(rows, 10)
    assert [r["status"] for r in out] == ["ok", "oom", "ok"]
    assert out[1]["impl"] == "grouped_mm-ckpt" and out[1]["error"] == "killed by SIGKILL"
    assert alone == rows[2:]


def test_a_shared_child_past_its_time_records_the_rest_as_timeouts(monkeypatch):
    rows = [{"impl": impl, "seq": 32} for impl in memory.DEFAULT_IMPLS]

    def late(cmd, **kwargs):
        return ChildRun("timeout", None, '{"impl": "grouped_mm", "seq": 32}\n', "", "past 1 s")

    monkeypatch.setattr(memory, "run_child_process", late)
    out = memory.run_rows(rows, 1)
    assert [r.get("status") for r in out] == [None, "timeout", "timeout"]


def test_lengths_given_with_tiny_are_kept(monkeypatch):
    started = _children(monkeypatch)
    assert main(["bench", "memory", "--tiny", "--seq-len", "128"]) == 0
    assert [r["seq"] for rows in started for r in rows] == [128] * len(memory.DEFAULT_IMPLS)
