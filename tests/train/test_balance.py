"""What a run shows of its experts' balance (the log line, the summary, the load plot's
title) and the default balancing loss of `dropless train` (per MoE layer; the golden run
pins "family", the pooled loss Transformers computes)."""

import json

import pytest
import torch

from dropless.train.config.load import load_config
from dropless.train.report.metrics import balancing, load_stats
from dropless.train.report.run_log import RunLog
from dropless.train.report.summary import summary_rows
from dropless.train.step import MicroStep
from harness import finished_run


def test_load_stats_counts_starved_experts_per_layer():
    # layer 0: mean 25, one expert at 2 (< 2.5); layer 1: mean 100, 9 is < 10 and 10 is not
    counts = torch.tensor([[2, 30, 34, 34], [9, 10, 190, 191]])
    s = load_stats(counts)
    assert s["starved_experts"] == 2
    assert s["max_mean_load_per_layer"] == [34 / 25, 191 / 100.0]
    assert s["max_mean_load"] == 1.91
    # pooled over layers these are [11, 40, 224, 225]: the count is each layer's own
    assert load_stats(torch.tensor([[30, 30, 30, 30]]))["starved_experts"] == 0


def test_log_line_and_summary_name_the_worst_layer_and_starved_experts():
    rec = {"step": 420, "loss": 4.0, "eval_loss": 4.1, "eval_bpb": 2.0, "lr": 3e-4,
           "tokens_per_s": 1000.0, "tflops_per_process": 1e-3, "mfu": 0.1,
           "max_mean_load": 1.42, "starved_experts": 3}  # fmt: skip
    line = RunLog.line(rec)
    assert "max/mean load 1.42 (worst layer), 3 experts < 10% of mean" in line
    s = {"max_mean_load": 1.42, "starved_experts": 0, "balancing": "per_layer aux loss x0.01",
         "dropped": 0, "steps": 420, "wall_s": 1.0, "train_s": 1.0, "cpu_s": 1.0,
         "tokens_per_s": 1.0, "tokens_per_s_wall": 1.0, "tflops_per_process": 1e-3, "mfu": 0.1,
         "peak_tflops": 0.1, "peak_source": "log.peak_tflops", "final_bpb": 2.0, "initial_bpb": 8.0,
         "unigram_bpb": 5.0, "final_loss": 4.0, "final_eval_loss": 4.1, "peak_memory_mib": 1.0}  # fmt: skip
    load = dict(summary_rows(s))["expert load"]
    assert load == (
        "worst layer max/mean 1.42, 0 experts below 10% of their layer's mean "
        "(balancing: per_layer aux loss x0.01), dropped 0"
    )


def test_balancing_in_words():
    def tc(*overrides):
        return load_config(None, list(overrides)).train

    assert balancing(tc()) == "per_layer aux loss x0.01"
    assert balancing(tc("train.balance_loss=family")) == "family aux loss x0.01"
    assert (
        balancing(tc("train.aux_loss_coef=0", "train.expert_bias_rate=0.001"))
        == "expert bias rate 0.001"
    )
    assert balancing(tc("train.aux_loss_coef=0")) == "none"


def test_default_run_balances_per_layer(finished_run, monkeypatch):
    """The tiny run of the shared fixture ran the default: MicroStep takes the per-layer
    loss, and its load plot's title says so."""
    import matplotlib.figure

    from dropless.train.report.metrics import read_metrics
    from dropless.train.report.plots import plot_expert_load

    cfg = load_config(None, [])
    assert cfg.train.balance_loss == "per_layer"
    assert MicroStep.for_run(cfg, None, None, None, None).balance_loss == "per_layer"
    summary = json.loads((finished_run / "summary.json").read_text())
    titles, real = [], matplotlib.figure.Figure.suptitle

    def suptitle(self, t, *a, **k):
        titles.append(t)
        return real(self, t, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "suptitle", suptitle)
    out = plot_expert_load(
        read_metrics(finished_run), finished_run / "again.png", summary["balancing"]
    )
    assert out.stat().st_size > 0
    assert titles == ["tokens per expert (1.0 = balanced); balancing: per_layer aux loss x0.01"]


def test_convert_refuses_a_bias_the_stock_family_cannot_hold(tmp_path):
    """A Qwen3-MoE run trained with the aux-loss-free expert bias (its routers have no score
    bias of their own; dropless added one): `dropless convert` refuses to write a stock
    model that would choose other experts; with --drop-expert-bias it writes the run's
    weights without the bias, which stock Transformers computes exactly as the run's model
    with the bias taken off."""
    from transformers import AutoModelForCausalLM

    from dropless import hf
    from dropless.cli.main import main
    from dropless.train.generate import convert, load_run

    run = finished_run(tmp_path, "train.expert_bias_rate=0.003")
    _, _, ours, _ = load_run(run)
    bias = [layer.expert_bias for layer in hf.moe_layers(ours)]
    assert any(bool(b.ne(0).any()) for b in bias)  # trained, not zero
    with pytest.raises(ValueError, match="trained with the aux-loss-free expert bias") as e:
        convert(run, tmp_path / "refused")
    assert "--drop-expert-bias" in str(e.value) and not (tmp_path / "refused").exists()
    out = tmp_path / "hf"
    assert main(["convert", str(run), str(out), "--drop-expert-bias"]) == 0
    stock = AutoModelForCausalLM.from_pretrained(out)
    x = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with_bias = ours(input_ids=x).logits
        hf.unpatch_model(ours)  # the bias off, the stock code: what the flag writes
        assert torch.equal(stock(input_ids=x).logits, ours(input_ids=x).logits)
        assert not torch.equal(with_bias, ours(input_ids=x).logits)  # it routed otherwise
