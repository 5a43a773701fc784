"""The numbers do not move: examples/tiny.toml on a small committed text file
(golden/corpus.txt, a copy of the Apache-2.0 text; not the standard library, which differs
between machines), seed 0, 8 steps, one log record per step, against golden/metrics.jsonl:
token counts exactly, losses, grad norms and the other trained figures to 1e-4 relative
(CPUs differ in fp32 summation order).

A change meant to move the numbers regenerates the file in the same commit, saying why:
    python tests/train/test_golden.py --record
"""

import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
GOLDEN = HERE / "golden" / "metrics.jsonl"
ARGS = [
    "train", str(ROOT / "examples" / "tiny.toml"),
    "--set", f"data.path={HERE / 'golden' / 'corpus.txt'}",
    "--set", "train.seed=0", "--set", "log.every=1", "--set", "checkpoint.every=0",
    "--set", "log.peak_tflops=0.1", "--set", "log.progress=plain", "--set", "log.tensorboard=false",
    # the pooled balancing loss of the file's runs: the numbers guard refactors, not the default
    "--set", "train.balance_loss=family",
]  # fmt: skip
EXACT = ("step", "tokens_seen", "dropped", "skipped_steps", "tokens_per_expert")
CLOSE = (
    "loss", "loss_avg", "eval_loss", "eval_bpb", "unigram_bpb", "grad_norm", "lb_loss", "z_loss",
    "lr", "max_mean_load",
)  # fmt: skip
RTOL = 1e-4


def kept(rec: dict) -> dict:
    """The fields of a record that do not depend on the machine's speed."""
    return {k: rec[k] for k in (*EXACT, *CLOSE) if k in rec}


def run_records(run_dir: Path) -> list[dict]:
    import torch

    from dropless.cli.main import main
    from dropless.train.report.metrics import read_metrics

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main([*ARGS, "--run-dir", str(run_dir)]) == 0
    finally:
        torch.set_num_threads(n)
    return [kept(r) for r in read_metrics(run_dir)]


def test_tiny_run_keeps_its_numbers(tmp_path):
    want = [json.loads(line) for line in GOLDEN.read_text().splitlines()]
    got = run_records(tmp_path / "run")
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert set(g) == set(w), f"step {w['step']}: fields {sorted(set(g) ^ set(w))}"
        for k in EXACT:
            if k in w:
                assert g[k] == w[k], f"step {w['step']} {k}: {g[k]} != {w[k]} (golden)"
        for k in CLOSE:
            if k in w:
                assert math.isclose(g[k], w[k], rel_tol=RTOL), (
                    f"step {w['step']} {k}: {g[k]!r} vs golden {w[k]!r} (rel tol {RTOL})"
                )


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        recs = run_records(Path(d) / "run")
    GOLDEN.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"wrote {len(recs)} records to {GOLDEN}")
