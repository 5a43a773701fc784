"""examples/genomics.toml: it loads, and it trains on a generated FASTA at a small seq_len."""

from __future__ import annotations

import gzip
import math
import random
from pathlib import Path

from dropless.cli.main import main
from dropless.train.config.load import load_config
from harness import read_metrics

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "genomics.toml"


def test_example_is_the_dna_recipe():
    cfg = load_config(EXAMPLE)
    assert cfg.data.tokenizer == "dna" and cfg.data.reverse_complement
    assert cfg.train.seq_len == 8192 and cfg.train.activation_checkpointing
    assert cfg.model.max_position_embeddings >= cfg.train.seq_len
    assert cfg.data.max_bytes == 0  # a genome is read whole


def test_example_trains_two_steps_on_a_generated_fasta(tmp_path):
    rng = random.Random(3)
    fa = tmp_path / "genome.fa.gz"
    with gzip.open(fa, "wt") as f:
        for i in range(2):
            seq = "".join(rng.choice("ACGT") for _ in range(3000))
            f.write(
                f">chr{i}\n" + "\n".join(seq[j : j + 60] for j in range(0, len(seq), 60)) + "\n"
            )
    run = tmp_path / "run"
    overrides = [
        f"data.path={fa}", "train.seq_len=64", "train.steps=2", "data.eval_tokens=256",
        "log.every=1", "log.progress=none", "log.tensorboard=false", "log.plots=false",
    ]  # fmt: skip
    args = [a for item in overrides for a in ("--set", item)]
    assert main(["train", str(EXAMPLE), "--run-dir", str(run), *args]) == 0
    lines = read_metrics(run)
    steps = [r for r in lines if "eval_bpb" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]  # step 0: before training
    assert all(math.isfinite(r["eval_bpb"]) and r["eval_bpb"] > 1.0 for r in steps)
    resolved = load_config(run / "config.toml")
    assert resolved.train.activation_checkpointing and resolved.data.tokenizer == "dna"
    assert resolved.model.num_experts == load_config(EXAMPLE).model.num_experts
