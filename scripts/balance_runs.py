"""The README's default `dropless train` run under several balancing settings: each
layer's expert load at the end and the held-out loss.

    python scripts/balance_runs.py family:train.balance_loss=family per_layer \\
        per_layer+bias:train.expert_bias_rate=1e-3 --runs-root runs/balance \\
        --section benchmarks/sections/balance.md

Each SETTING is NAME or NAME:KEY=VALUE[,KEY=VALUE...]: `dropless train --set KEY=VALUE ...`
with no config file (the default run: 420 steps on this Python's standard library, seed
0) in a fresh run directory ROOT/NAME, trained from this checkout in a child process.
A directory that already holds a finished run with the same overrides is read, not
trained again; the commit it was trained on is the one written beside it
(`commit.txt`) when its training finished. These are quality figures (load, loss), not speed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STEPS_SHOWN = (60, 180, 300)  # the load of a few log windows before the last
SUM_SINCE = "bcd70c9"  # the commit from which `per_layer` sums the layers' losses


def _setting(text: str) -> tuple[str, list[str]]:
    name, _, sets = text.partition(":")
    return name, [s for s in sets.split(",") if s]


def _commit() -> str:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    sha = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return sha + (" + uncommitted changes" if git("status", "--porcelain", "--", "src") else "")


def _overrides(run: Path) -> list[str] | None:
    p = run / "overrides.json"
    return json.loads(p.read_text()) if p.is_file() else None


def _train(run: Path, sets: list[str]) -> None:
    if (run / "summary.json").is_file() and _overrides(run) == sets:
        print(f"{run}: finished run with these overrides, read as it is", flush=True)
        return
    if run.exists() and any(run.iterdir()):
        raise SystemExit(f"{run} holds another run: remove it or choose another --runs-root")
    run.parent.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    cmd = [sys.executable, "-m", "dropless", "train", "--run-dir", str(run)]
    cmd += [a for s in sets for a in ("--set", s)] + ["--set", "log.progress=plain"]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    print(" ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, env=env)
    # beside the run once it finished (`dropless train` takes only a new or empty directory)
    (run / "commit.txt").write_text(commit + "\n")
    # torch's threads change the summation order, so the trajectory: recorded with the run
    (run / "threads.txt").write_text(os.environ.get("OMP_NUM_THREADS", "torch's default") + "\n")
    (run / "overrides.json").write_text(json.dumps(sets) + "\n")


def _held_out(model, eval_BL1, batch: int) -> float:
    """Held-out loss in nats/token of `model` on the run's windows, as the trainer's
    `Evaluator` scores them (one process, fp32, the whole windows)."""
    import torch
    import torch.nn.functional as F

    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(eval_BL1), batch):
            xy = torch.from_numpy(eval_BL1[i : i + batch])
            logits = model(input_ids=xy[:, :-1], use_cache=False).logits.float()
            y = xy[:, 1:].reshape(-1)
            nll += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y, reduction="sum"))
            n += y.numel()
    return nll / n


def _without_bias(run: Path, eval_loss: float) -> float | None:
    """For a run trained with the aux-loss-free expert bias on a family without one of its
    own: the held-out loss of what `dropless convert --drop-expert-bias` writes (stock
    Transformers, routing without the bias). The same scoring of the run's own model (the
    bias kept) must give the run's last held-out loss. None for a run without the bias."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from dropless.train.config.load import load_config
    from dropless.train.data.corpus import text_data
    from dropless.train.generate import convert, load_run

    cfg = load_config(run / "config.toml")
    if cfg.train.expert_bias_rate <= 0:
        return None
    cache = run / "without_bias.json"  # measured once per finished run
    if cache.is_file():
        return json.loads(cache.read_text())["eval_loss_without_bias"]
    eval_BL1 = text_data(cfg, run, False).eval_BL1
    kept = _held_out(load_run(run)[2], eval_BL1, cfg.train.batch_size)
    if abs(kept / eval_loss - 1) > 1e-4:
        raise SystemExit(
            f"{run}: the run's model scores {kept:.6f} here, {eval_loss:.6f} in training"
        )
    with tempfile.TemporaryDirectory() as d:
        out = convert(run, Path(d) / "hf", drop_expert_bias=True)
        stock = AutoModelForCausalLM.from_pretrained(out).eval()
        loss = _held_out(stock, eval_BL1, cfg.train.batch_size)
    cache.write_text(json.dumps({"eval_loss_without_bias": loss, "eval_loss": kept}) + "\n")
    return loss


def _figures(run: Path, sets: list[str]) -> dict:
    import torch

    from dropless.train.report.metrics import STARVED, load_stats, read_metrics

    recs = [r for r in read_metrics(run) if r.get("tokens_per_expert")]
    last = recs[-1]
    stats = load_stats(torch.tensor(last["tokens_per_expert"]))
    by_step = {
        r["step"]: load_stats(torch.tensor(r["tokens_per_expert"]))["max_mean_load"] for r in recs
    }

    def note(name: str) -> str:
        return (run / name).read_text().strip() if (run / name).is_file() else "unknown"

    commit, threads = note("commit.txt"), note("threads.txt")
    return {
        "overrides": sets, "commit": commit, "threads": threads, "step": last["step"], "eval_loss": last["eval_loss"],
        "eval_bpb": last["eval_bpb"], "max_mean_load": stats["max_mean_load"],
        "max_mean_load_per_layer": stats["max_mean_load_per_layer"],
        # the load plot's other end: each layer's lightest expert against its layer's mean
        "min_mean_load_per_layer": [min(row) / (sum(row) / len(row)) for row in last["tokens_per_expert"]],
        "starved_experts": stats["starved_experts"], "starved_share": STARVED,
        "max_mean_by_step": {str(s): by_step[s] for s in STEPS_SHOWN if s in by_step},
        "eval_loss_without_bias": _without_bias(run, last["eval_loss"]),
        "run_dir": str(run),
    }  # fmt: skip


def _section(record: dict, names: list[str]) -> str:
    from tools.bench_sections import provenance

    fig = record["figures"]
    first = fig[names[0]]["eval_loss"]
    rows = []
    for name in names:
        f = fig[name]
        sets = ", ".join(f"`{s}`" for s in f["overrides"]) or "(none: the default at its commit)"
        kept = f.get("eval_loss_without_bias")
        dropped = "" if kept is None else f"{kept:.4f} ({kept / f['eval_loss'] - 1:+.2%})"
        layers = " / ".join(f"{r:.2f}" for r in f["max_mean_load_per_layer"])
        lightest = " / ".join(f"{r:.2f}" for r in f["min_mean_load_per_layer"])
        early = " / ".join(
            f"{f['max_mean_by_step'][s]:.2f}"
            for s in map(str, STEPS_SHOWN)
            if s in f["max_mean_by_step"]
        )
        rows.append(
            f"| {name} | {sets} | {f['commit']} | {f.get('threads', 'unknown')} | {f['eval_loss']:.4f} ({f['eval_loss'] / first - 1:+.2%}) "
            f"| {dropped} | {f['max_mean_load']:.3f} | {layers} | {lightest} | {f['starved_experts']} | {early} |"
        )  # fmt: skip
    last = fig[names[0]]["step"]
    return "\n".join(
        ["## Expert balance of the default `dropless train` run (`scripts/balance_runs.py`)", "",
         provenance(record), "",
         f"The README's default run (no config file: 4 MoE layers x 8 experts top-2, "
         f"`train.aux_loss_coef=0.01`, 420 steps on this Python's standard library, seed 0), "
         f"fp32 on CPU, one run per setting. Held-out loss in nats/token at step {last} (against "
         f"the first row). Load: each layer's max/mean pairs per expert over the last log window "
         f"(steps {last - 59}-{last}; 1.00 = balanced, 4.00 = the most top-2 of 8 allows); "
         f"starved: experts, all layers, below {fig[names[0]]['starved_share']:.0%} of their "
         f"layer's mean; lightest: each layer's min/mean in that window (the last column of "
         f"each layer's panel in the run's expert-load plot, `expert_load.png`, whose title "
         f"names the balancing, spans from it to the layer's max/mean); the worst layer's "
         f"max/mean at earlier log steps after it. Each run's "
         f"commit is the one it trained on; `family` is Transformers' pooled "
         f"`load_balancing_loss_func` (the loss of every commit before `train.balance_loss`); "
         f"`per_layer` averaged the layers' Switch losses before commit {SUM_SINCE} and sums "
         f"them from it (each layer at the full coefficient): the settings named `-mean` ran "
         f"before it. Bias dropped: for a run with the aux-loss-free expert bias, the held-out "
         f"loss of the stock model `dropless convert --drop-expert-bias` writes (against the "
         f"run's own).", "",
         "| setting | overrides | commit | torch threads (OMP_NUM_THREADS) | held-out loss | bias dropped | worst layer max/mean | per layer | lightest per layer | starved | worst at steps 60 / 180 / 300 |",
         "|---|---|---|---|---|---|---|---|---|---|---|", *rows, ""]
    )  # fmt: skip


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("settings", nargs="+", help="NAME or NAME:KEY=VALUE[,KEY=VALUE...]")
    p.add_argument("--runs-root", type=Path, default=Path("runs/balance"))
    p.add_argument("--section", type=Path, default=None, help="write the markdown table here")
    args = p.parse_args()
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout
    from dropless.bench.common import Recorder

    rec = Recorder.start(argparse.Namespace(no_history=True))
    settings = [_setting(s) for s in args.settings]
    figures = {}
    for name, sets in settings:
        run = args.runs_root / name
        _train(run, sets)
        figures[name] = _figures(run, sets)
        print(json.dumps({name: figures[name]}), flush=True)
    record = rec.finish("balance_runs", figures)
    if args.section:
        args.section.write_text(_section(record, [n for n, _ in settings]))


if __name__ == "__main__":
    main()
