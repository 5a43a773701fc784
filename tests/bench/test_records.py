"""History records of `dropless bench`: command line, commit and dirty flag, where the
file is (from any directory, refused outside a checkout), load figures, allocator."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tools import bench_sections

import dropless
from dropless.bench import common, e2e
from dropless.cli.main import main

GIT = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _fake_checkout(root: Path) -> Path:
    """A git checkout laid out as the project is: <root>/src/dropless, pyproject.toml."""
    (root / "src" / "dropless").mkdir(parents=True)
    (root / "src" / "dropless" / "x.py").write_text("x = 1\n")
    (root / "pyproject.toml").write_text("[project]\nname = 'dropless'\n")
    # git, not a Python child: the harness starts Python
    subprocess.run([*GIT, "init", "-q", str(root)], check=True)
    subprocess.run([*GIT, "-C", str(root), "add", "-A"], check=True)
    subprocess.run([*GIT, "-C", str(root), "commit", "-qm", "c"], check=True)
    return root / "src" / "dropless"


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"history": None, "no_history": False, "record": False} | kw))


def test_command_line_as_typed_and_exact_argv():
    py, script = "/venv/bin/python3.11", "/venv/bin/dropless"
    shown, argv = common.command_line([py, script, "bench", "layer", "--impls", "a b"])
    assert shown == "dropless bench layer --impls 'a b'"
    assert argv == [py, script, "bench", "layer", "--impls", "a b"]
    shown, _ = common.command_line([py, "-m", "dropless", "bench", "ep", "--world", "2"])
    assert shown == "python3.11 -m dropless bench ep --world 2"
    # this process: the exact argv of the running interpreter, not one rebuilt from sys.argv
    _, argv = common.command_line()
    tail = sys.argv[1:]  # empty in a pytest-xdist worker (`python -c ...`)
    assert Path(argv[0]).name.startswith("python") and argv[len(argv) - len(tail) :] == tail


def test_dirty_flag_ignores_benchmark_outputs(tmp_path):
    pkg = _fake_checkout(tmp_path / "repo")
    root = common.find_checkout(pkg)
    assert root == tmp_path / "repo"
    state = common.git_state(root)
    assert state["dirty"] is False and len(state["commit"]) == 12
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "history.jsonl").write_text("{}\n")
    (root / "BENCHMARKS.md").write_text("# b\n")
    assert common.git_state(root)["dirty"] is False  # a benchmark's own outputs
    (pkg / "x.py").write_text("x = 2\n")
    state = common.git_state(root)
    assert state["dirty"] is True and state["dirty_files"] == ["src/dropless/x.py"]


def test_history_goes_to_the_checkout_from_any_directory(tmp_path, monkeypatch):
    pkg = _fake_checkout(tmp_path / "repo")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rec = common.Recorder.start(_args(record=True), package_dir=pkg)
    assert rec.path == tmp_path / "repo" / "benchmarks" / "history.jsonl"
    record = rec.finish("unit", {"x": 1})
    line = json.loads(rec.path.read_text().splitlines()[-1])
    assert line == json.loads(json.dumps(record))
    assert line["bench"] == "unit" and line["cwd"] == str(elsewhere)
    assert line["dirty"] is False and line["commit"]
    assert not (elsewhere / "benchmarks").exists()
    assert (
        bench_sections.section_path(None, "unit", rec)
        == tmp_path / "repo/benchmarks/sections/unit.md"
    )
    # this package, imported from the checkout under test, resolves to that checkout
    real = common.find_checkout()
    assert real == Path(dropless.__file__).resolve().parents[2]


def test_load_figures_in_every_record(tmp_path):
    rec = common.Recorder.start(_args(history=str(tmp_path / "h.jsonl")))
    record = rec.finish("unit", {})
    for when in ("before", "after"):
        load = record["load"][when]
        assert len(load["loadavg"]) == 3 and all(v >= 0 for v in load["loadavg"])
        assert isinstance(load["busy_processes"], int) and load["busy_processes"] >= 0
    text = common.load_sentence(record["load"])
    assert f"{record['load']['before']['loadavg'][0]:.2f} before" in text
    assert bench_sections.provenance(record).endswith(text)


def test_load_sample_counts_a_busy_process_outside_its_own_tree(tmp_path):
    # a spinner named dlspin (its command name comes from the file it executes),
    # re-parented away from this process (the shell exits at once)
    spin = tmp_path / "dlspin"
    spin.symlink_to(sys.executable)
    # not through the harness: a detached busy process under another name is the fixture
    out = subprocess.run(
        ["sh", "-c", f"{spin} -c 'while True: pass' >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        check=True,
    )
    pid = int(out.stdout.strip())
    try:
        time.sleep(0.2)
        sample = common.load_sample(window_s=1.0, busy_share=0.05)
    finally:
        os.kill(pid, 9)
    assert sample["busy_processes"] >= 1
    assert any(b.startswith("dlspin ") for b in sample["busy"]), sample


def test_history_refused_outside_a_checkout(tmp_path, monkeypatch, capsys):
    installed = tmp_path / "site-packages" / "dropless"
    installed.mkdir(parents=True)
    assert common.find_checkout(installed) is None
    with pytest.raises(ValueError, match="not from a git checkout.*--history FILE"):
        common.history_path("", False, installed)
    with pytest.raises(ValueError, match="^--record: .*not from a git checkout"):
        common.history_path(None, False, installed, record=True)
    path, why = common.history_path(None, False, installed)  # not asked: a note, no line
    assert path is None and why == "not asked"
    assert common.history_path(str(tmp_path / "h.jsonl"), False, installed)[0] is not None
    # through the CLI: refused before anything is measured
    monkeypatch.setattr(common, "PACKAGE_DIR", installed)
    assert main(["bench", "fp8", "--T", "100000000", "--history"]) == 2
    assert "--history: this dropless runs from" in capsys.readouterr().err


def test_timed_children_get_no_malloc_settings(tmp_path, monkeypatch, capsys):
    (tmp_path / "envprobe.py").write_text(
        "import json, os\nprint(json.dumps(sorted(k for k in os.environ "
        "if k.startswith('MALLOC_') or k == 'GLIBC_TUNABLES')))\n"
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=0")
    assert common.run_child("envprobe", {}) == []
    # in-process timers refuse instead
    assert main(["bench", "ep", "--no-history"]) == 2
    assert "MALLOC_MMAP_THRESHOLD_" in capsys.readouterr().err


def test_e2e_times_and_measures_memory_in_separate_children(tmp_path, monkeypatch):
    calls = []

    def fake_child(module, args, timeout=1800):
        calls.append(args)
        out = {"impl": args["impl"], "first_loss": 5.0, "threads": 1}
        if args["mode"] == "memory":
            return out | {"peak_step_mib": 10.0, "peak_fwd_bwd_mib": 10.0,
                          "peak_optimizer_mib": 5.0, "memory_tracked": True}  # fmt: skip
        return out | {"step_s": 1.0, "best_step_s": 0.9, "tokens_per_s": 64.0}

    monkeypatch.setattr(e2e, "run_child", fake_child)
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    hist = tmp_path / "h.jsonl"
    section = tmp_path / "e2e.md"
    argv = ["--quick", "--impls", "grouped_mm,dropless", "--history", str(hist)]
    assert e2e.run(p.parse_args([*argv, "--section", str(section)])) == 0
    modes = [c["mode"] for c in calls]
    # 5 rounds x 2 implementations x 2 AdamW settings, then one memory child per row
    assert modes == ["time"] * 20 + ["memory"] * 4
    assert [c["optimizer"] for c in calls[:4]] == ["fused", "fused", "default", "default"]
    # round 2 rotated by one row: dropless, grouped_mm@default, dropless@default, grouped_mm
    assert [(c["impl"], c["optimizer"]) for c in calls[4:8]] == [
        ("dropless", "fused"), ("grouped_mm", "default"), ("dropless", "default"),
        ("grouped_mm", "fused"),
    ]  # fmt: skip
    line = json.loads(hist.read_text())
    assert line["figures"]["rows"]["dropless@default"]["peak_step_mib"] == 10.0
    assert line["figures"]["verdict"].startswith("**Not a result**: a tiny smoke shape")
    assert len(line["load"]["during"]) == 4  # sampled between the rounds
    text = section.read_text()  # the section says how the ratios are made, and the verdict
    assert "Ratios: the median of the per-round ratios against the stock row" in text
    assert "AdamW (fused,default)" in text and line["figures"]["verdict"] in text
    assert "| HF v5 + `dropless.patch()` | default | 64 (71) |" in text
    assert "load" in line and line["figures"]["allocator"].startswith("timing: default")


def test_busy_core_pins_a_spinner():
    from dropless.bench.layer import start_busy_core

    proc, core = start_busy_core(-1)
    try:
        assert core == max(os.sched_getaffinity(0))
        assert os.sched_getaffinity(proc.pid) == {core}
    finally:
        proc.kill()
        proc.wait()
    with pytest.raises(ValueError, match="--busy-core 4096"):
        start_busy_core(4096)


def test_every_bench_takes_the_history_and_section_options(capsys):
    from dropless.cli.bench import BENCHES
    from dropless.cli.main import build_parser

    parser = build_parser()
    for name in BENCHES:
        args = parser.parse_args(["bench", name, "--history", "h.jsonl", "--section", ""])
        assert args.history == "h.jsonl" and args.section == "" and not args.no_history
        assert parser.parse_args(["bench", name, "--history"]).history == ""
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    # the command list's help names every benchmark there is
    assert "benchmarks: " + ", ".join(BENCHES) in capsys.readouterr().out
    assert set(BENCHES) >= {"layer", "e2e", "lora", "memory", "fp8", "ep", "train", "jax"}


def test_section_blocks_replace_their_own_key_and_drop_prose(tmp_path):
    path = tmp_path / "layer.md"
    path.write_text(
        "## Old title\n\nHand-written notes.\n\n<!-- layer:a -->\nA1\n<!-- /layer:a -->\n"
        "\nMore notes.\n<!-- layer:b -->\nB1\n<!-- /layer:b -->\n"
    )
    bench_sections.replace_block(
        path, "a", "<!-- layer:a -->\nA2\n<!-- /layer:a -->\n", "layer", "## T"
    )
    assert path.read_text() == (
        "## T\n\n<!-- layer:a -->\nA2\n<!-- /layer:a -->\n\n<!-- layer:b -->\nB1\n<!-- /layer:b -->\n"
    )


def test_cli_main_and_bench_do_not_import_each_other():
    """`dropless bench` builds its table with the helper `dropless --help` uses, which
    lives in cli/subcommands.py: neither file imports the other back (lazy imports and
    module names in strings count)."""
    from test_layers import SRC, imports_of

    cli = SRC / "dropless" / "cli"
    of_bench = {m for _, m in imports_of(cli / "bench.py", SRC)}
    of_main = {m for _, m in imports_of(cli / "main.py", SRC)}
    assert "dropless.cli.bench" in of_main and "dropless.cli.main" not in of_bench
    assert "dropless.cli.subcommands" in of_bench & of_main


TINY_FP8 = ["--T", "64", "--D", "64", "--F", "32", "--E", "4", "--K", "2"]


def test_bench_writes_in_the_checkout_only_with_record(tmp_path, monkeypatch, capsys):
    """Without --record a run from a checkout writes nothing there (no history line, no
    section) and says so; with --record it writes both and names them."""
    root = _fake_checkout(tmp_path / "repo").parents[1]
    (root / "tools").symlink_to(Path(bench_sections.__file__).parent)  # the section writers
    monkeypatch.setattr(common, "PACKAGE_DIR", root / "src" / "dropless")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if ".git" not in p.parts)
    assert main(["bench", "fp8", *TINY_FP8]) == 0
    err = capsys.readouterr().err
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if ".git" not in p.parts)
    assert after == before  # nothing written, in the checkout or the current directory
    assert "history: not recorded (not asked; --record" in err
    assert "section: not written (--record writes benchmarks/sections/fp8.md" in err
    assert main(["bench", "fp8", *TINY_FP8, "--record"]) == 0
    err = capsys.readouterr().err
    history, section = root / "benchmarks" / "history.jsonl", root / "benchmarks/sections/fp8.md"
    assert json.loads(history.read_text())["bench"] == "fp8"
    assert "| bf16 | " in section.read_text()
    assert f"history: appended to {history}" in err and f"section: wrote {section}" in err


def test_e2e_profile_puts_the_stock_and_the_patched_step_side_by_side(tmp_path, monkeypatch):
    profiled = []

    def fake_child(module, args, timeout=1800):
        out = {"impl": args["impl"], "first_loss": 5.0, "threads": 1, "step_s": 1.0,
               "best_step_s": 0.9, "tokens_per_s": 64.0}  # fmt: skip
        if args.get("profile"):
            profiled.append((args["impl"], args["optimizer"]))
            ms = {"grouped_mm": 30.0, "dropless": 20.0}[args["impl"]]
            out["profile"] = {"what": "aten operators, self CPU time", "total_ms": ms,
                              "rows": [{"name": "aten::mm", "calls": 2, "total_ms": ms, "share": 1.0}]}  # fmt: skip
        return out

    monkeypatch.setattr(e2e, "run_child", fake_child)
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    section = tmp_path / "e2e.md"
    argv = ["--quick", "--impls", "grouped_mm,dropless", "--no-memory", "--profile"]
    assert e2e.run(p.parse_args([*argv, "--no-history", "--section", str(section)])) == 0
    # each implementation once, in round 1, with its first optimizer
    assert sorted(profiled) == [("dropless", "fused"), ("grouped_mm", "fused")]
    text = section.read_text()
    assert "training step, side by side" in text
    assert "| `aten::mm` | 30.0 (1.000) | 20.0 (1.000) |" in text
