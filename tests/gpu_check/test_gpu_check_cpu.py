"""The GPU check (`python -m tools.gpu_check`, `scripts/gpu_check.py` where nothing
is installed) with `--cpu` runs its steps (pytest -m gpu, the layer and step tables
at tiny shapes on CPU) and ends with the JSON summary that outside checks read, so the
script CI cannot run on a GPU never rots."""

import json
import os
from pathlib import Path

import pytest
from tools import gpu_report as report
from tools.gpu_check import run as gpu_run
from tools.gpu_check import train as gpu_train

from harness import run_python

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
# the contract: these rows and fields (more may be added)
LAYER_ROWS = {
    "dense_bound", "dropless", "dropless_fp8_current_row", "dropless_fp8_delayed",
    "dropless_mxfp8_saved", "grouped_mm_plain", "hf_grouped_mm",
}  # fmt: skip
LAYER_FIELDS = {"ms", "peak_gib", "share_of_bound"}
E2E_ROWS = {"grouped_mm", "dropless", "dropless_fused_ce"}
E2E_FIELDS = {"ms", "peak_gib", "tokens_per_s", "speed_vs_grouped_mm", "memory_vs_grouped_mm"}
TRAIN_ROWS = {"single", "force_distributed", "resume", "bench_e2e", "gloo_ep2", "ep_rank_share"}
RUN_FIELDS = {
    "steps", "first_loss", "last_loss", "tokens_per_s", "max_memory_allocated_gib",
    "syncs_forward_per_layer", "syncs_recompute_per_layer",
}  # fmt: skip


def _run(*args, timeout=300):
    proc = run_python([SCRIPT, *args], env={"OMP_NUM_THREADS": "1"}, timeout=timeout)
    last = proc.stdout.strip().splitlines()[-1]
    return proc, json.loads(last)["gpu_check"]


# ~90-110 s on 2 cores (every step, its torchrun children included): opt-in with
# DROPLESS_SLOW_TESTS=1; the tests below check its parts on every run (the budget, the
# train checks, a failed part, a child's timeout, the summary tables and the report)
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("DROPLESS_SLOW_TESTS"), reason="set DROPLESS_SLOW_TESTS=1")
def test_cpu_smoke_passes_and_ends_with_the_contract_summary():
    proc, s = _run("--cpu", "--budget", "400", timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert s["ok"] and s["mode"] == "cpu" and s["failed"] == [] and s["argv"][0] == "--cpu"
    assert len(s["date"]) == len("2026-12-01 15:04 UTC") and s["date"].endswith(" UTC")
    assert list(s["groups"]) == ["pytest", "timing", "e2e", "train"]
    assert all(g["status"] == "ok" for g in s["groups"].values()), s["groups"]
    # on CPU every gpu-marked test is collected and skipped
    assert s["groups"]["pytest"]["counts"]["skipped"] > 0, s["groups"]["pytest"]
    layer = s["groups"]["timing"]["timing"]["rows"]
    assert LAYER_ROWS <= set(layer)
    for name in LAYER_ROWS:
        assert LAYER_FIELDS <= set(layer[name]) and layer[name]["ms"] > 0, (name, layer[name])
    assert layer["dense_bound"]["share_of_bound"] == 1.0
    # the share is dense ms / dropless ms; the summary rounds all three to 3 places, so the
    # share lies in the interval those roundings (+-0.0005 each) allow, however small the
    # times are (at the CPU smoke's tiny shape a relative tolerance failed at random)
    dense, mine, half = layer["dense_bound"]["ms"], layer["dropless"]["ms"], 5e-4
    lo, hi = (dense - half) / (mine + half), (dense + half) / max(mine - half, 1e-12)
    assert lo - half <= layer["dropless"]["share_of_bound"] <= hi + half, layer
    step = s["groups"]["e2e"]["e2e"]["rows"]
    assert set(step) == E2E_ROWS
    for name, row in step.items():
        assert E2E_FIELDS <= set(row) and row["tokens_per_s"] > 0, (name, row)
    assert step["grouped_mm"]["speed_vs_grouped_mm"] == 1.0
    # the same seed and weights: the three rows start from the same loss
    losses = {row["first_loss"] for row in step.values()}
    assert max(losses) - min(losses) < 1e-3, losses
    _check_train_group(s["groups"]["train"])


def _check_train_group(g):
    """The smoke's train step: the forced (1-process gloo group), resumed and 2-process runs
    equal the one-process run in fp32, the per-layer host syncs are counted in forward and
    in the recompute, one EP rank's share is timed."""
    assert g["status"] == "ok" and g["failed_checks"] == [], g
    t = g["train"]
    assert set(t["rows"]) == TRAIN_ROWS and t["tolerance"] == 1e-4
    rows = t["rows"]
    for name in ("single", "force_distributed"):
        assert RUN_FIELDS <= set(rows[name]) and rows[name]["steps"] == 6, rows[name]
    f = rows["force_distributed"]
    assert f["max_rel_loss_diff"] <= 1e-4 and f["first_loss"] == rows["single"]["first_loss"]
    # the dispatcher's counts exchange is seen in forward; routing replay: none in recompute
    assert any("parallel/dispatcher.py" in w for w in f["sync_sites"]), f["sync_sites"]
    assert f["syncs_forward_per_layer"] >= 1 and f["syncs_recompute_per_layer"] == 0, f
    assert rows["single"]["syncs_recompute_per_layer"] is None  # no checkpointing there
    r = rows["resume"]
    assert r["from_step"] == 3 and r["steps"] == 3 and r["max_rel_loss_diff"] <= 1e-4, r
    assert rows["gloo_ep2"]["status"] == "ok" and rows["gloo_ep2"]["max_rel_loss_diff"] <= 1e-4
    assert rows["bench_e2e"]["status"] == "skipped" and "--cpu" in rows["bench_e2e"]["reason"]
    ep = rows["ep_rank_share"]
    assert ep["experts"] == 4 and ep["rows"] == 64 and ep["ms"] > 0 and ep["dense_ms"] > 0
    assert set(t["checks"]) == {"losses_equal", "resume_reproduces", "gloo_ep2_equal"}


def test_budget_skips_what_does_not_fit_and_says_so():
    proc, s = _run("--cpu", "--only", "timing,e2e", "--budget", "0", timeout=30)
    assert proc.returncode == 0 and list(s["groups"]) == ["timing", "e2e"]
    for g in s["groups"].values():
        assert g["status"] == "skipped" and "budget" in g["reason"] and "--only" in g["reason"]


def _train_results(forward_syncs=1, recompute_syncs=0, resumed_loss=9.0, ep2=None, cuda=(1, 0)):
    """What the train step's children write, at made-up figures: losses of steps 1-4."""
    run = dict(losses={"1": 10.0, "2": 9.5, "3": 9.2, "4": 9.0}, steps=4, first_loss=10.0,
               last_loss=9.0, tokens_per_s=50000, wall_s=30.0, max_memory_allocated_gib=20.0,
               sync_sites=[], syncs_forward_per_layer=forward_syncs,
               syncs_recompute_per_layer=None, cuda_syncs_forward_per_layer=None,
               cuda_syncs_recompute_per_layer=None)  # fmt: skip
    forced = run | dict(tokens_per_s=48000, syncs_recompute_per_layer=recompute_syncs,
                        cuda_syncs_forward_per_layer=cuda[0],
                        cuda_syncs_recompute_per_layer=cuda[1])  # fmt: skip
    resumed = dict(run, losses={"3": 9.2, "4": resumed_loss})
    main = dict(single=run, force_distributed=forced, resume=resumed, checkpoint_gib=13.5,
                gloo_ep2_reference=dict(run, losses={"1": 6.0, "2": 5.9}),
                ep_rank_share=dict(experts=16, rows=32768, ms=2.0))  # fmt: skip
    ep2 = ep2 or dict(status="ok", losses={"1": 6.0, "2": 5.9})
    return main, ep2


def test_train_checks_pass_and_fail_on_the_figures():
    """GPU mode: equal losses, <= 1 host sync per layer in forward, none in the recompute,
    the resume within bf16 tolerance, gloo_ep2 skipped (not failed) where gloo refuses CUDA
    tensors, and dropless train within 10% of bench e2e; each check fails on its own."""
    main, ep2 = _train_results()
    t = gpu_train.train_table(main, ep2, dict(status="ok", tokens_per_s=52000), cpu=False)
    assert all(t["checks"].values()) and len(t["checks"]) == 6, t["checks"]
    rows = t["rows"]
    resume = dict(from_step=2, steps=2, checkpoint_gib=13.5, wall_s=30.0, max_rel_loss_diff=0.0)
    assert rows["resume"].items() >= resume.items(), rows["resume"]
    assert rows["bench_e2e"]["train_vs_bench"] == round(50000 / 52000, 3)
    assert rows["force_distributed"]["syncs_recompute_per_layer"] == 0
    assert rows["force_distributed"]["cuda_syncs_forward_per_layer"] == 1
    assert rows["single"]["syncs_recompute_per_layer"] is None
    failing = [
        ("forward_syncs_le_1_per_layer", _train_results(forward_syncs=2)),
        ("recompute_syncs_0", _train_results(recompute_syncs=1)),
        # the device's own count (sync debug mode) sees a sync dropless's count does not
        ("forward_syncs_le_1_per_layer", _train_results(cuda=(2, 0))),
        ("recompute_syncs_0", _train_results(cuda=(1, 1))),
        ("resume_reproduces", _train_results(resumed_loss=9.0 * 1.03)),  # over 2e-2
        ("gloo_ep2_equal", _train_results(ep2=dict(status="ok", losses={"1": 6.0, "2": 6.2}))),
    ]
    for name, (m, e) in failing:
        checks = gpu_train.train_table(m, e, dict(status="ok", tokens_per_s=52000), cpu=False)[
            "checks"
        ]
        assert [k for k, ok in checks.items() if not ok] == [name], (name, checks)
    slow = gpu_train.train_table(main, ep2, dict(status="ok", tokens_per_s=60000), cpu=False)[
        "checks"
    ]
    assert [k for k, ok in slow.items() if not ok] == ["train_within_10pct_of_bench"]
    refused = dict(status="skipped", reason="RuntimeError: gloo does not support CUDA tensors")
    t = gpu_train.train_table(main, refused, dict(status="ok", tokens_per_s=52000), cpu=False)
    assert t["checks"]["gloo_ep2_equal"] and t["rows"]["gloo_ep2"] == refused


def test_a_failed_part_of_the_train_step_is_a_row_with_its_error():
    """The forced run raised (e.g. on NCCL): its row and the resume's say so, the checks
    that need them fail, and the parts that ran keep their figures."""
    main, ep2 = _train_results()
    main["force_distributed"] = {"error": "DistBackendError: NCCL error", "traceback": "..."}
    del main["resume"], main["checkpoint_gib"]
    t = gpu_train.train_table(main, ep2, dict(status="ok", tokens_per_s=52000), cpu=False)
    rows = t["rows"]
    assert rows["force_distributed"]["error"] == "DistBackendError: NCCL error"
    assert rows["resume"]["status"] == "fail" and rows["resume"]["steps"] == 0
    assert rows["single"]["tokens_per_s"] == 50000 and rows["ep_rank_share"]["ms"] == 2.0
    failed = sorted(k for k, ok in t["checks"].items() if not ok)
    assert failed == sorted(["losses_equal", "resume_reproduces", "forward_syncs_le_1_per_layer",
                             "recompute_syncs_0"])  # fmt: skip


def test_train_step_on_a_gpu_machine_runs_its_children_and_the_bench(tmp_path):
    """The GPU branch of the step without a GPU: the torchrun children's command lines,
    their results read back, bench e2e at the same model (qwen3-30b-2l, the fused-loss row)
    and the ratio of the trainer's tokens/s to it."""
    main, ep2 = _train_results()
    cmds, benches = [], []

    def run_child(cmd, cpu, timeout):
        cmds.append(cmd)
        mode, out = cmd[cmd.index(gpu_train.MODULE) + 1], Path(cmd[cmd.index(gpu_train.MODULE) + 2])
        (out / f"{mode}.json").write_text(json.dumps(main if mode == "main" else ep2))
        return "ok", 0, "", ""

    def bench_step(bench, args, cpu, timeout):
        benches.append((bench, args))
        rows = {"dropless-fused-ce": dict(tokens_per_s=52000.0)}
        return dict(status="ok", exit=0), {"figures": {"rows": rows}}

    res = gpu_train.run(False, 100.0, run_child, bench_step)
    assert res["status"] == "ok" and res["failed_checks"] == [], res
    assert [c[c.index("--nproc-per-node") + 1] for c in cmds] == ["1", "2"]
    assert all("--cpu" not in c and "torch.distributed.run" in c for c in cmds)
    ((bench, args),) = benches
    assert bench == "e2e" and args[args.index("--shape") + 1] == "qwen3-30b-2l"
    assert args[args.index("--impls") + 1] == "dropless-fused-ce" and "cuda" in args
    b = res["train"]["rows"]["bench_e2e"]
    assert b["tokens_per_s"] == 52000 and b["train_vs_bench"] == round(50000 / 52000, 3)


def test_a_child_stopped_at_its_timeout_keeps_the_parts_it_finished():
    """The 1-process child wrote `single` and was stopped (a slow disk under the
    checkpoint, say): the step is a timeout with that run's figures, the rest not run."""
    main, _ = _train_results()

    def run_child(cmd, cpu, timeout):
        out = Path(cmd[cmd.index(gpu_train.MODULE) + 2])
        if "main" in cmd:
            (out / "main.json").write_text(json.dumps({"single": main["single"]}))
        return "timeout", None, "", "stopped"

    bench = lambda *a: (dict(status="ok"), {"figures": {"rows": {}}})  # noqa: E731
    res = gpu_train.run(False, 100.0, run_child, bench)
    rows = res["train"]["rows"]
    assert res["status"] == "timeout" and res["stderr_tail"] == "stopped"
    assert rows["single"]["steps"] == 4 and rows["force_distributed"]["status"] == "fail"
    assert "not run" in rows["ep_rank_share"]["error"] and rows["gloo_ep2"]["status"] == "fail"


@pytest.mark.parametrize(
    "entry", [["-m", "tools.gpu_check"], [str(SCRIPT)]], ids=["module", "script"]
)
def test_unknown_step_is_a_usage_error(entry):
    proc = run_python([*entry, "--only", "nope"], timeout=60)
    assert proc.returncode == 2 and "unknown step" in proc.stderr


def test_bench_records_become_the_summary_tables():
    """A GPU run's records (memory measured) in the summary's units and names."""
    gc = gpu_run
    row = dict(routing="uniform", T=16384, gflops=5e5, max_rel_diff=None)
    layer = {
        "argv": ["python", "-m", "dropless", "bench", "layer", "--device", "cuda"],
        "figures": {
            "dims": dict(E=128, K=8, D=2048, F=768, dtype="bfloat16"),
            "rows": [
                row | dict(impl="dense", ms=6.0, vs_bound=1.0, peak_mib=1024.0),
                row | dict(impl="dropless", ms=8.0, vs_bound=0.75, peak_mib=3072.0),
                row | dict(impl="dropless", ms=9.0, vs_bound=0.7, peak_mib=1.0, routing="skewed"),
            ],
        },
    }
    t = gc.layer_table(layer)
    assert t["shape"] == dict(E=128, K=8, D=2048, F=768, T=16384) and t["dtype"] == "bf16"
    assert t["rows"]["dense_bound"] == dict(
        ms=6.0, peak_gib=1.0, share_of_bound=1.0, tflops=500.0, max_rel_diff=None
    )
    assert t["rows"]["dropless"]["peak_gib"] == 3.0  # the uniform row, not the skewed one
    e2e = {"figures": {"shape": {}, "dtype": "bfloat16", "rows": {
        "grouped_mm": dict(step_s=0.07, tokens_per_s=200000.0, peak_step_mib=12 * 1024.0, first_loss=10.4),
        "dropless": dict(step_s=0.05, tokens_per_s=300000.0, peak_step_mib=9 * 1024.0, first_loss=10.4),
    }}}  # fmt: skip
    rows = gc.e2e_table(e2e)["rows"]
    assert rows["dropless"] == dict(
        ms=50.0, tokens_per_s=300000, peak_gib=9.0, peak_step_gib=9.0, first_loss=10.4,
        speed_vs_grouped_mm=1.5, memory_vs_grouped_mm=0.75,
    )  # fmt: skip


def test_gpu_report_renders_a_summary_of_this_runner(tmp_path):
    """BENCHMARKS.md's GPU section from this runner's summary: pytest counts, both tables,
    and the six-GEMM bound named (the note for the earlier 5-GEMM bound left out)."""
    info = dict(torch="2.11.0+cu130", device="NVIDIA H200", commit="abc")
    summary = dict(argv=["--budget", "240"], date="2026-12-01 16:00 UTC", elapsed_s=200.0, ok=True, groups={
        "pytest": dict(status="ok", counts={"passed": 40, "deselected": 900}, seconds=60.0),
        "timing": dict(status="ok", info=info, seconds=70.0, timing=dict(
            shape={}, dtype="bf16", bound="six", rows={"dense_bound": dict(ms=6.5, share_of_bound=1.0, peak_gib=1.8)})),
        "e2e": dict(status="ok", info=info, seconds=70.0, e2e=dict(
            shape={}, dtype="bfloat16", rows={"dropless": dict(ms=50.0, tokens_per_s=300000)})),
    })  # fmt: skip
    log = report.ROOT / "benchmarks" / "gpu" / "x.log"
    text = "\n".join(report.render_run(summary, log, "abc1234"))
    assert "### `python scripts/gpu_check.py --budget 240` on commit abc1234" in text
    assert "NVIDIA H200, torch 2.11.0+cu130; run 2026-12-01 16:00 UTC" in text
    assert "| pytest | ok | 40 passed, 900 deselected | 60.0 |" in text
    assert "| dense_bound | 6.5 | 1.0 | 1.8 |" in text and "| dropless | 50.0 | 300000 |" in text
    assert "six GEMMs" in text and "5 of the" not in text
    # the train step: its two runs as a table, the other rows and the checks as lines
    main, ep2 = _train_results()
    train = gpu_train.train_table(main, ep2, None, cpu=False)
    summary["groups"]["train"] = dict(status="ok", seconds=180.0, train=train)
    text = "\n".join(report.render_run(summary, log, "abc1234"))
    assert "| train | ok | - | 180.0 |" in text
    assert "| force_distributed | 4 | 10.0 | 9.0 | 0.0 | 48000 | 20.0 | 1 | 0 |" in text
    resume_line = next(ln for ln in text.splitlines() if ln.startswith("- resume: "))
    assert "from_step=2" in resume_line and "recompute_syncs_0 ok" in text


def test_gpu_report_adds_a_run_and_keeps_the_others(tmp_path, monkeypatch):
    """A run's block replaces the block of the same log; the other runs' blocks stay."""
    monkeypatch.setattr(report, "ROOT", tmp_path)
    (tmp_path / "benchmarks" / "gpu").mkdir(parents=True)
    section = tmp_path / "benchmarks" / "sections" / "gpu.md"
    section.parent.mkdir()
    section.write_text(report.TITLE + "\n\n<!-- gpu:old.log -->\nOLD\n<!-- /gpu:old.log -->\n")
    summary = dict(argv=["--only", "e2e"], date="2026-12-01 16:00 UTC", elapsed_s=9.0, ok=True,
                   groups={"e2e": dict(status="ok", seconds=9.0)})  # fmt: skip
    log = tmp_path / "benchmarks" / "gpu" / "new.log"
    for _ in range(2):  # the second run of the same log replaces its block
        log.write_text("output\n" + json.dumps({"gpu_check": summary}) + "\n")
        assert report.main(["--run", str(log), "abc1234"]) == 0
    text = section.read_text()
    assert text.count("<!-- gpu:new.log -->") == 1 and "OLD" in text
    assert "### `python scripts/gpu_check.py --only e2e` on commit abc1234" in text
    history = (tmp_path / "benchmarks" / "history.jsonl").read_text().splitlines()
    assert len(history) == 2 and json.loads(history[0])["log"] == "benchmarks/gpu/new.log"
