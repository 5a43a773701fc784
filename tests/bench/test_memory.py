"""`dropless bench memory`: its records, table and section at a tiny model, and the
out-of-memory path of a real child under a tiny memory limit."""

from __future__ import annotations

import contextlib
import json
import signal

import pytest
from tools import bench_sections

from dropless.bench import memory
from dropless.cli.main import main


def _in_process(monkeypatch, limits: list) -> None:
    """Children run in this process: no address-space limit (recorded instead) and no
    allocator change for the rest of the test session."""

    @contextlib.contextmanager
    def no_limit(max_rss_gib):
        limits.append(max_rss_gib)
        yield 0

    monkeypatch.setattr(memory, "_address_space_limit", no_limit)
    monkeypatch.setattr(memory, "follow_live_memory", lambda: False)
    monkeypatch.setattr(memory, "_one_malloc_arena", lambda: False)
    monkeypatch.setattr(memory, "run_rows", lambda rows, timeout: [memory.child(r) for r in rows])


def test_records_table_and_section_of_every_row(tmp_path, monkeypatch):
    import dropless

    limits: list = []
    _in_process(monkeypatch, limits)
    history, section = tmp_path / "h.jsonl", tmp_path / "memory.md"
    argv = ["bench", "memory", "--tiny", "--seq-len", "32", "--impls", ",".join(memory.IMPLS)]
    argv += ["--max-rss-gib", "3", "--history", str(history), "--section", str(section)]
    try:
        assert main(argv) == 0
    finally:
        dropless.unpatch()  # the dropless rows patched Transformers in this process
    line = json.loads(history.read_text().splitlines()[-1])
    assert line["bench"] == "memory" and line["figures"]["tiny"] is True
    rows = line["figures"]["rows"]
    assert [(r["seq"], r["impl"]) for r in rows] == [(32, i) for i in memory.IMPLS]
    assert limits == [3.0] * len(rows)
    for r in rows:
        assert r["status"] == "ok"
        assert r["bytes_per_token"] == pytest.approx(r["peak_step_mib"] * 2**20 / r["seq"])
        assert r["process_peak_mib"] >= r["steady_rss_mib"] > 0
    by = {r["impl"]: r for r in rows}
    stock = by["grouped_mm"]["loss"]
    # the same model and tokens: checkpointing recomputes the same forward
    assert by["grouped_mm-ckpt"]["loss"] == stock
    assert by["dropless"]["loss"] == pytest.approx(stock, rel=1e-5)
    assert by["dropless-mxfp8"]["loss"] == pytest.approx(stock, rel=2e-2)
    assert by["dropless-mxfp8"]["loss"] != by["dropless"]["loss"]  # MXFP8 GEMMs ran
    text = section.read_text()
    assert text.startswith(bench_sections.MEMORY_TITLE) and "<!-- memory:tiny -->" in text
    assert "Command: `" in text and "Memory limit per child: 3 GiB" in text
    assert text.count("| 32 | ") == len(memory.IMPLS)
    assert "| 32 | HF v5 `grouped_mm` + activation checkpointing | " in text
    assert bench_sections.memory_summary(line["figures"]) in text


def test_a_child_over_its_memory_limit_is_recorded_out_of_memory(tmp_path):
    # a real child process: the limit leaves no room above what it holds before the step
    history, section = tmp_path / "h.jsonl", tmp_path / "memory.md"
    argv = ["bench", "memory", "--tiny", "--seq-len", "64", "--impls", "grouped_mm"]
    argv += ["--max-rss-gib", "0.01", "--history", str(history), "--section", str(section)]
    assert main(argv) == 0
    (row,) = json.loads(history.read_text().splitlines()[-1])["figures"]["rows"]
    assert row["status"] == "oom" and row["seq"] == 64
    assert "memory" in row["error"].lower() or row["error"].startswith("MemoryError")
    assert "peak_step_mib" not in row and "bytes_per_token" not in row
    assert "| 64 | HF v5 `grouped_mm` | **out of memory** |" in section.read_text()


def test_how_a_child_ended():
    args = {"impl": "dropless", "seq": 8}
    ok = memory.child_result(args, 0, 'log\n{"status": "ok", "seq": 8}\n', "")
    assert ok == {"status": "ok", "seq": 8}
    killed = memory.child_result(args, -signal.SIGKILL, "", "")
    assert killed["status"] == "oom" and killed["error"] == "killed by SIGKILL"
    aborted = "terminate called after throwing an instance of 'std::bad_alloc'\n"
    assert memory.child_result(args, -signal.SIGABRT, "", aborted)["status"] == "oom"
    with pytest.raises(RuntimeError, match="exit status 1:\nTraceback\nValueError: bad shape"):
        memory.child_result(args, 1, "", "Traceback\nValueError: bad shape\n")


def test_bytes_per_token_and_ratio_to_stock_with_checkpointing():
    ok = {"status": "ok", "peak_fwd_bwd_mib": 1.0, "peak_optimizer_mib": 1.0}
    ok |= {"process_peak_mib": 2048.0, "step_s": 1.0, "loss": 1.0}
    rows = [
        {**ok, "impl": "grouped_mm-ckpt", "seq": 1024, "peak_step_mib": 400.0},
        {**ok, "impl": "dropless", "seq": 1024, "peak_step_mib": 100.0},
        {"impl": "grouped_mm", "seq": 1024, "status": "oom"},
        {**ok, "impl": "dropless", "seq": 2048, "peak_step_mib": 300.0},
    ]
    memory._add_ratios(rows)
    assert rows[0]["vs_baseline"] == 1.0 and rows[1]["vs_baseline"] == 0.25
    assert rows[1]["bytes_per_token"] == 100 * 2**20 / 1024
    assert "bytes_per_token" not in rows[2]
    assert "vs_baseline" not in rows[3]  # no stock row at that length
    table = memory._table(rows)
    assert "| 1024 | HF v5 `grouped_mm` | **out of memory** |" in table
    assert (
        "| 2048 | dropless: checkpointing + fused linear-CE + RMSNorm | 300 | 153,600 | - |"
        in table
    )
    figures = {"dropless_vs_stock_ckpt": {"1024": 0.25, "2048": 0.5}}
    assert bench_sections.memory_summary(figures).endswith(
        ": **0.25x** at 1024, **0.50x** at 2048."
    )


def test_adamw_state_is_allocated_without_changing_a_weight():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-1, weight_decay=0.5, fused=True)
    memory._prime_adamw(model, opt)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert [g["lr"] for g in opt.param_groups] == [1e-1]
    assert all(opt.state[p]["exp_avg"].shape == p.shape for p in model.parameters())


def test_bad_arguments_are_refused(capsys):
    assert main(["bench", "memory", "--impls", "grouped_mm,foo", "--no-history"]) == 2
    assert "--impls: unknown ['foo']" in capsys.readouterr().err
    assert main(["bench", "memory", "--max-rss-gib", "0", "--no-history"]) == 2
    assert "--max-rss-gib 0.0: must be > 0" in capsys.readouterr().err
