"""`dropless bench layer` at its tiny smoke shape: every row the GPU tables time runs
(on CPU here), the rows with the same routing agree, nothing is written by default."""

from __future__ import annotations

import json

import pytest
import torch

from dropless.cli.main import main

GPU_ROWS = [
    "dense",
    "dropless",
    "grouped_mm-plain",
    "dropless-fp8-current-row",
    "dropless-eager-row-ops",
]  # hf-grouped_mm: in the gpu_check --cpu smoke (tests/gpu_check)


def test_gpu_table_rows_run_at_the_tiny_shape(tmp_path, capsys, layer_in_process):
    hist = tmp_path / "h.jsonl"
    argv = ["bench", "layer", "--shape", "tiny", "--device", "cpu", "--no-skewed", "--no-memory"]
    argv += ["--rounds", "2", "--steps", "2", "--warmup", "0", "--impls", ",".join(GPU_ROWS)]
    assert main([*argv, "--history", str(hist)]) == 0
    out, err = capsys.readouterr()
    # progress on stderr; round 2 starts with the second row
    assert "T=48 uniform round 2/2: timing dropless (its own process)" in err
    assert err.index("round 2/2: timing dropless ") < err.index("round 2/2: timing dense ")
    assert "**Not a result**: a tiny smoke shape; 2 timed step(s)" in out
    record = json.loads(hist.read_text())
    rows = {r["impl"]: r for r in record["figures"]["rows"]}
    assert list(rows) == GPU_ROWS and len(record["load"]["during"]) == 1
    assert rows["dense"]["vs_bound"] == 1.0 and all(r["ms"] > 0 for r in rows.values())
    # the share of the bound: the median of the rounds' dense ms / row ms (two rounds)
    dense, mine = rows["dense"]["ms_all"], rows["dropless"]["ms_all"]
    ratios = sorted(d / m for d, m in zip(dense, mine))
    assert rows["dropless"]["share_of_bound"] == pytest.approx(sum(ratios) / 2)
    assert rows["dropless"]["paired"]["dense"]["min"] == pytest.approx(ratios[0])
    assert rows["dropless"]["paired"]["dense"]["best"] == pytest.approx(min(dense) / min(mine))
    # the same weights and routes: the plain grouped_mm write and the eager row ops give
    # dropless's output to fp32 rounding; the FP8 row differs by its quantization only
    for name in ("grouped_mm-plain", "dropless-eager-row-ops"):
        assert rows[name]["max_rel_diff"] < 1e-5, (name, rows[name]["max_rel_diff"])
    assert 1e-4 < rows["dropless-fp8-current-row"]["max_rel_diff"] < 0.1


def test_a_row_runs_in_a_child_that_measures_its_memory_first(tmp_path, capsys):
    hist = tmp_path / "h.jsonl"
    argv = ["bench", "layer", "--shape", "tiny", "--device", "cpu", "--no-skewed"]
    argv += ["--rounds", "1", "--steps", "1", "--warmup", "0", "--impls", "dropless"]
    assert main([*argv, "--history", str(hist)]) == 0
    assert "T=48 uniform round 1/1: timing dropless (its own process)" in capsys.readouterr().err
    (row,) = json.loads(hist.read_text())["figures"]["rows"]
    assert row["peak_mib"] > 0 and row["memory_how"].startswith("VmHWM") and row["ms"] > 0


def test_unknown_impl_is_refused_with_the_list(capsys):
    assert main(["bench", "layer", "--shape", "tiny", "--impls", "dense,fast"]) == 2
    err = capsys.readouterr().err
    assert "--impls: unknown ['fast']" in err and "dropless-mxfp8-saved" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_e2e_on_cuda_without_a_device_is_refused(capsys):
    assert main(["bench", "e2e", "--quick", "--device", "cuda"]) == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err


@pytest.mark.gpu
def test_e2e_cuda_child_measures_allocator_memory():
    from dropless.bench import e2e

    outs = {
        impl: e2e.child({"shape": e2e.QUICK, "impl": impl, "steps": 2, "device": "cuda"})
        for impl in ("grouped_mm", "dropless")
    }
    for o in outs.values():
        assert o["peak_step_mib"] > 0 and o["tokens_per_s"] > 0
    # bf16 logits: the first losses agree to bf16's rounding
    assert outs["dropless"]["first_loss"] == pytest.approx(
        outs["grouped_mm"]["first_loss"], rel=2e-2
    )
