"""A tiny CLI run end to end: metrics, plots, checkpoints; bit-exact resume; generate; convert."""

import json
import shutil

import pytest
import torch

from dropless.cli.main import main
from dropless.train.checkpoint import store as ckpt
from harness import read_metrics, tiny_args

FIELDS = (
    "loss", "eval_loss", "eval_bpb", "lr", "grad_norm", "tokens_per_s", "tokens_per_s_per_process",
    "tflops_per_process", "mfu", "peak_memory_mib", "tokens_per_expert", "max_mean_load", "dropped",
    "starved_experts",
)  # fmt: skip


def test_run_writes_everything_and_learns(finished_run):
    recs = read_metrics(finished_run)
    assert [r["step"] for r in recs] == [0, 2, 4, 6, 8]
    assert "unigram_bpb" in recs[0] and recs[0]["eval_bpb"] > 7.5  # uniform over 257 bytes is 8.0
    for r in recs[1:]:
        for f in FIELDS:
            assert f in r, f
        assert r["dropped"] == 0 and 0 < r["mfu"] < 1
        counts = torch.tensor(r["tokens_per_expert"])  # [layers, experts] summed over 2 steps
        assert (
            counts.shape == (2, 4) and (counts.sum(1) == 2 * 4 * 32 * 2).all()
        )  # steps*B*L*K pairs
    assert all(r["peak_tflops"] == 0.1 for r in recs[1:])  # the recipe's stated peak
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"] - 0.5
    assert recs[-1]["loss_avg"] < recs[1]["loss_avg"]
    for name in ("loss.png", "expert_load.png", "config.toml", "summary.json"):
        assert (finished_run / name).stat().st_size > 0, name
    assert list((finished_run / "tensorboard").glob("events.out.tfevents.*"))
    assert [s for s, _ in ckpt.list_checkpoints(finished_run)] == [
        4,
        8,
    ]  # checkpoint.every=4, keep=2
    summary = json.loads((finished_run / "summary.json").read_text())
    assert (
        summary["final_bpb"] == recs[-1]["eval_bpb"]
        and summary["initial_bpb"] == recs[0]["eval_bpb"]
    )
    assert summary["starved_experts"] == recs[-1]["starved_experts"]
    assert summary["balancing"] == "per_layer aux loss x0.01"  # the default balancing


def test_mfu_without_a_stated_peak_measures_this_cpu():
    from dropless.train.report.run_log import peak_tflops

    peak, source = peak_tflops(torch.device("cpu"), torch.float32, 0.0)
    assert source == "measured fp32 matmul on this CPU" and 1e-4 < peak < 1e3
    assert peak_tflops(torch.device("cpu"), torch.float32, 2.5) == (2.5, "log.peak_tflops")


def test_resume_is_bit_exact(finished_run, tmp_path):
    half = tmp_path / "half"
    shutil.copytree(finished_run, half)
    shutil.rmtree(half / "checkpoints" / "step_00000008")  # as if it had stopped after step 4
    assert main(["train", "--run-dir", str(half), "--resume"]) == 0  # config comes from the run dir
    straight, resumed = read_metrics(finished_run), read_metrics(half)
    assert [r["step"] for r in resumed] == [0, 2, 4, 6, 8]
    for a, b in zip(straight[3:], resumed[3:]):
        for f in ("loss", "eval_loss", "grad_norm", "lr", "tokens_per_expert"):
            assert a[f] == b[f], (a["step"], f)


def test_resume_refuses_finished_and_fresh_runs(finished_run, tmp_path, capsys):
    assert main(["train", "--run-dir", str(finished_run), "--resume"]) == 2
    assert "already at step 8 of train.steps=8; raise train.steps" in capsys.readouterr().err
    assert main(["train", "--run-dir", str(finished_run), *tiny_args()]) == 2
    assert "already holds checkpoints: pass --resume" in capsys.readouterr().err
    (tmp_path / "new").mkdir()  # a run folder without checkpoints (a missing one: tests/faults)
    assert main(["train", "--run-dir", str(tmp_path / "new"), "--resume"]) == 2
    assert "has no complete checkpoint to resume from" in capsys.readouterr().err


def test_generate_returns_text(finished_run, capsys):
    assert (
        main(["generate", str(finished_run), "--prompt", "import ", "--max-new-tokens", "24"]) == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("import ") and len(out.rstrip("\n")) > len("import ")
    assert main(["generate", str(finished_run / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_convert_loads_in_stock_transformers(finished_run, tmp_path):
    from transformers import AutoModelForCausalLM

    from dropless import hf
    from dropless.train.generate import load_run

    out = tmp_path / "hf"
    assert main(["convert", str(finished_run), str(out)]) == 0
    stock = AutoModelForCausalLM.from_pretrained(out)
    assert (
        not hf.patching.patch.is_patched()
        and "dropless" not in stock.get_experts_implementation().values()
    )
    _, _, ours, _ = load_run(finished_run)  # patched: the dropless experts path
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(input_ids=x).logits
        got = stock(input_ids=x).logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        hf.unpatch_model(ours)  # same weights, same stock code: identical bits
        assert torch.equal(stock(input_ids=x).logits, ours(input_ids=x).logits)
    with pytest.raises(SystemExit):
        main(["convert", str(finished_run)])


def test_fine_tune_with_every_option(finished_run, tmp_path):
    """Fine-tune the converted tiny model on .jsonl data with activation checkpointing,
    aux-loss-free expert bias, z-loss, WSD, gradient accumulation and (when dropless.quant
    is there) the MXFP8 recipe."""
    from dropless import hf
    from dropless.train.generate import load_run

    try:
        from dropless.quant import recipe_from_name  # noqa: F401

        recipe = "mxfp8"
    except ImportError:
        recipe = "none"
    hf_dir, data = tmp_path / "hf", tmp_path / "d.jsonl"
    assert main(["convert", str(finished_run), str(hf_dir)]) == 0
    docs = [
        json.dumps({"body": f"def f{i}(x):\n    return x * {i} + {i % 7}\n" * 8}) for i in range(60)
    ]
    data.write_text("\n".join(docs))
    run = tmp_path / "ft"
    extra = (
        f"model.path={hf_dir}", f"data.path={data}", "data.text_field=body", "train.steps=3",
        "train.activation_checkpointing=true", "train.expert_bias_rate=0.05", "train.z_loss_coef=1e-3",
        "optim.schedule=wsd", "train.grad_accum=2", f"precision.recipe={recipe}", "log.plots=false", "log.every=1",
    )  # fmt: skip
    assert main(["train", "--run-dir", str(run), *tiny_args(*extra)]) == 0
    recs = read_metrics(run)
    assert recs[0]["eval_bpb"] < 7.5  # started from the trained weights, not a random init (~8.2)
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"] and recs[-1]["z_loss"] > 0
    _, _, model, _ = load_run(run)
    bias_ME = torch.stack([layer.expert_bias for layer in hf.moe_layers(model)])
    # aux-loss-free rule, replayed from the per-step counts: b += rate * sign(mean - load)
    want_ME = torch.zeros_like(bias_ME)
    for r in recs[1:]:
        c = torch.tensor(r["tokens_per_expert"], dtype=torch.float32)
        want_ME += 0.05 * torch.sign(c.mean(1, keepdim=True) - c)
    assert want_ME.abs().sum() > 0
    torch.testing.assert_close(bias_ME, want_ME, rtol=0, atol=1e-6)


def test_stock_path_one_log_point(tmp_path, capsys):
    """The stock experts path records no counts: `dropped` is null, not 0. A single log
    point still draws a visible load heatmap, without matplotlib warnings."""
    import warnings

    import matplotlib.image

    run = tmp_path / "stock"
    extra = ("model.implementation=stock", "train.steps=1", "log.every=1", "log.tensorboard=false")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["train", "--run-dir", str(run), *tiny_args(*extra)]) == 0
    assert not [w for w in caught if "lim" in str(w.message)], [str(w.message) for w in caught]
    recs = read_metrics(run)
    assert recs[1]["dropped"] is None and "tokens_per_expert" in recs[1]  # router-implied counts
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dropped"] is None
    assert "dropped: not measured" in capsys.readouterr().out
    img = matplotlib.image.imread(run / "expert_load.png")[..., :3]
    assert len({tuple(px) for px in img.reshape(-1, 3)[::7].tolist()}) > 50  # not blank


def test_header_and_summary_say_what_they_count(finished_run, tmp_path, capsys):
    half = tmp_path / "half"
    shutil.copytree(finished_run, half)
    shutil.rmtree(half / "checkpoints" / "step_00000008")
    assert main(["train", "--run-dir", str(half), "--resume"]) == 0
    out = capsys.readouterr().out
    assert "Qwen3MoeForCausalLM" in out and "1 process on cpu" in out
    assert "MFU against a peak of" in out and "(training steps since the last log)" in out
    summary = json.loads((half / "summary.json").read_text())
    assert 0 < summary["tokens_per_s_wall"] < summary["tokens_per_s"]  # wall counts evaluations


def test_a_run_without_data_path_says_what_it_reads(tmp_path, capsys):
    """With no data.path (a fine-tune of a local checkpoint too) the run reads the standard
    library: it says so, with how many files and bytes, before tokenizing and the header."""
    import re

    extra = ("data.max_bytes=20000", "train.steps=1", "log.every=1", "optim.warmup_steps=0")
    extra += ("log.tensorboard=false", "log.plots=false")
    assert main(["train", "--run-dir", str(tmp_path / "r"), *tiny_args(*extra)]) == 0
    out = capsys.readouterr().out
    said = re.search(
        r"data.path is unset, so the run reads this Python's standard library \((.+)\): "
        r"(\d+) .py files, [\d.]+ MiB \(([\d,]+) bytes for training, ([\d,]+) held out; "
        r"data.max_bytes=20000\)",
        out,
    )
    assert said, out
    assert said.start() < out.index("dropless train: Qwen3MoeForCausalLM")  # before the header
    assert int(said[2]) >= 2 and 20000 <= int(said[3].replace(",", "")) < 200_000


def test_cli_debug_and_bench_help(tmp_path, capsys):
    bad = ["train", "--run-dir", str(tmp_path / "r"), "--set", "train.stepz=1"]
    assert main(bad) == 2 and "Traceback" not in capsys.readouterr().err
    with pytest.raises(ValueError, match="did you mean 'train.steps'"):
        main(["--debug", *bad])
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "ep" in capsys.readouterr().out.split()


def test_converted_files_have_the_usual_mode(finished_run, tmp_path):
    import os

    out = tmp_path / "hf"
    assert main(["convert", str(finished_run), str(out)]) == 0
    mask = os.umask(0)
    os.umask(mask)
    for f in out.iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f.name
