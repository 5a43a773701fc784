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


def test_gpu_table_rows_run_at_the_tiny_shape(tmp_path, capsys):
    hist = tmp_path / "h.jsonl"
    argv = ["bench", "layer", "--shape", "tiny", "--device", "cpu", "--no-skewed"]
    argv += ["--no-memory", "--rounds", "3", "--warmup", "0", "--impls", ",".join(GPU_ROWS)]
    assert main([*argv, "--history", str(hist)]) == 0
    err = capsys.readouterr().err
    assert "T=48 uniform round 3/3: timing dropless-eager-row-ops" in err  # progress on stderr
    rows = {r["impl"]: r for r in json.loads(hist.read_text())["figures"]["rows"]}
    assert list(rows) == GPU_ROWS
    assert rows["dense"]["vs_bound"] == 1.0 and all(r["ms"] > 0 for r in rows.values())
    # the same weights and routes: the plain grouped_mm write and the eager row ops give
    # dropless's output to fp32 rounding; the FP8 row differs by its quantization only
    for name in ("grouped_mm-plain", "dropless-eager-row-ops"):
        assert rows[name]["max_rel_diff"] < 1e-5, (name, rows[name]["max_rel_diff"])
    assert 1e-4 < rows["dropless-fp8-current-row"]["max_rel_diff"] < 0.1


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
