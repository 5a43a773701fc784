"""The `train` step of the GPU check (`run.py`): `dropless train` on the path a node runs, at
the model of examples/qwen3-30b-a3b-2layers.toml (two Qwen3-30B-A3B layers, bf16; `--cpu`:
the same keys at tiny sizes, fp32, on gloo, no bench row).

One child under `torchrun --nproc-per-node 1` (`main_child`) runs the rows `single` (one
process), `force_distributed` (parallel.force_distributed=true with activation
checkpointing; host syncs counted per decoder layer in forward and in the recompute, steps
2-3; a checkpoint at step 10), `resume` (from that checkpoint), the reference of `gloo_ep2`
and `ep_rank_share` (one 8-way EP rank's expert compute against dense GEMMs of its FLOPs),
writing its results part by part; then `bench_e2e` (`dropless bench e2e` at the same model)
and `gloo_ep2` (2 processes, ep=2, over gloo with CUDA tensors where CUDA is there). Each
run's last checkpoint is not written (a hook stops the run there). The rows and checks:
docs/kernels.md, "The GPU check".
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

from dropless.bench.common import step_times
from dropless.train.report.metrics import read_metrics
from dropless.train.run.hooks import TrainHooks
from tools.gpu_check import CHECKOUT as ROOT
from tools.gpu_check.run import round_or_none

MODULE = "tools.gpu_check.train"  # what the torchrun children run
TOML = ROOT / "examples" / "qwen3-30b-a3b-2layers.toml"
SYNC_STEPS = (2, 3)
SAVE_AT = {False: 10, True: 3}  # the checkpoint the resume starts from (GPU, --cpu)
# the smoke's model: the same keys at tiny sizes, fp32 (bf16 matmul is ~80x slower on CPU)
CPU_SETS = [
    "model.hidden_size=32", "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
    "model.num_experts=8", "model.top_k=2", "model.moe_intermediate_size=32",
    "model.vocab_size=320", "model.max_position_embeddings=64", "model.dtype=fp32",
    "precision.dtype=fp32", "data.max_bytes=100000", "data.eval_tokens=64",
    "train.seq_len=32", "train.steps=6", "checkpoint.every=3",
    "log.peak_tflops=0.1",  # MFU's peak given: no CPU matmul measured at every log step
]  # fmt: skip
# gloo_ep2's model: small enough for gloo to move its tensors in seconds
EP2_SETS = [
    "model.hidden_size=256", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=64",
    "model.num_experts=16", "model.top_k=4", "model.moe_intermediate_size=128",
    "model.vocab_size=0", "model.max_position_embeddings=512", "model.dtype=fp32",
    "precision.dtype=fp32", "train.seq_len=512", "train.steps=4", "train.batch_size=2",
    "checkpoint.every=0", "parallel.timeout_s=120",
]  # fmt: skip
EP2_CPU_SETS = [*CPU_SETS, "train.steps=3", "train.batch_size=2", "checkpoint.every=0"]
# (local experts, rows, D, F): one rank of 8-way EP at the 30B layer; the smoke's tiny one
EP_RANK = {False: (16, 32768, 2048, 768), True: (4, 64, 32, 32)}
# bf16: 8 mantissa bits, rounded at every GEMM output, over 20 AdamW steps (the losses move
# by ~0.1 in that time); fp32: the same GEMMs in another order
LOSS_REL = {False: 2e-2, True: 1e-4}
MIN_CHILD_S = 20  # a child's start-up: with less time left it is skipped, saying so

# ---- in the children ---------------------------------------------------------------------


class FinalSaveSkipped(Exception):
    """Raised by the hook at the run's last checkpoint: the check needs no second one."""


class CheckHooks(TrainHooks):
    """Counts host syncs per decoder layer in `count_steps`, in forward and in the recompute
    (its submodules' hooks fire again in backward), by `sync_counter` (dropless's reads of
    the device) and, on CUDA, the sync debug mode. Stops the run at its last checkpoint."""

    def __init__(self, last_step: int, count_steps=()):
        self.last_step, self.count_steps = last_step, tuple(count_steps)
        # per counted layer call: dropless's reads of the device, and (CUDA) the device's own
        self.syncs = {f"{c}syncs_{p}": [] for c in ("", "cuda_") for p in ("forward", "recompute")}
        self.where: list[str] = []
        self._stack, self._found, self._hooked = contextlib.ExitStack(), None, False

    def _start(self):
        import torch

        sys.path.insert(0, str(ROOT / "tests" / "ops"))  # the counter the host-sync tests use
        from sync_counter import count_syncs

        self._found, self._cuda = self._stack.enter_context(count_syncs()), None
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            self._stack.callback(torch.cuda.set_sync_debug_mode, 0)
            self._cuda = self._stack.enter_context(warnings.catch_warnings(record=True))
            warnings.simplefilter("always")
        self._open, self._done, self._rec = {}, set(), {}

    def _stop(self):
        if self._found is not None:
            self._stack.close()
            for n, c in self._rec.values():
                self._add("recompute", n, c)
            self._found = None

    def _add(self, phase: str, n: int, c: int):
        self.syncs[f"syncs_{phase}"].append(n)
        if self._cuda is not None:
            self.syncs[f"cuda_syncs_{phase}"].append(c)

    def _now(self) -> tuple[int, int]:
        return len(self._found), sum("synchroniz" in str(w.message) for w in self._cuda or [])

    def _hook(self, model):
        from dropless.hf.distributed.parallelize import decoder_layers

        for i, layer in enumerate(decoder_layers(model)):
            for m, key in ((layer, i), *((c, (i, c)) for c in layer.children())):
                m.register_forward_pre_hook(lambda m, a, key=key: self._mark(key, False))
                m.register_forward_hook(lambda m, a, o, key=key: self._mark(key, True))
        self._hooked = True

    def _mark(self, key, leaving: bool):
        """Entering or leaving a layer's forward (key i) or, once that is done, one of its
        submodules in the recompute (key (i, submodule)); in the counted steps' training
        forwards only (not an evaluation's)."""
        import torch

        layer = key if isinstance(key, int) else key[0]
        if self._found is None or not torch.is_grad_enabled():
            return
        if key != layer and layer not in self._done:
            return  # a submodule in the layer's own forward
        if not leaving:
            self._open[key] = self._now()
        elif key in self._open:
            (n0, c0), (n1, c1) = self._open.pop(key), self._now()
            self.where += self._found[n0:]
            if key == layer:
                self._add("forward", n1 - n0, c1 - c0)
                self._done.add(layer)
            else:  # summed per layer
                n, c = self._rec.get(layer, (0, 0))
                self._rec[layer] = (n + n1 - n0, c + c1 - c0)

    def after_backward(self, step, model):
        if step in self.count_steps:
            self._stop()
        if not self._hooked and self.count_steps:
            self._hook(model)

    def after_step(self, step):
        if step + 1 in self.count_steps:
            self._start()

    def on_checkpoint(self, phase, step):
        if phase == "before_shards" and step == self.last_step:
            raise FinalSaveSkipped(step)


def _train(sets: list[str], run_dir: Path, resume=False, count_steps=(), after=0) -> dict:
    """One `dropless train` run in this process -> its figures and the losses of its
    steps after `after` (a resumed run's metrics.jsonl starts with the first run's)."""
    import torch

    from dropless.train.config.load import load_config
    from dropless.train.trainer import train

    cfg = load_config(TOML, sets)
    hooks = CheckHooks(cfg.train.steps, count_steps)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    try:
        train(cfg, str(run_dir), resume=resume, hooks=hooks)
    except FinalSaveSkipped:
        pass
    finally:
        hooks._stop()
    wall = time.perf_counter() - t0
    steps = [r for r in read_metrics(run_dir) if "loss" in r and r["step"] > after]
    rates = [r["tokens_per_s"] for r in steps if r["step"] > max(SYNC_STEPS)] or [
        r["tokens_per_s"] for r in steps
    ]
    peak = round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None
    losses = {r["step"]: r["loss"] for r in steps}
    out = dict(
        steps=len(losses), first_loss=round(steps[0]["loss"], 4),
        last_loss=round(steps[-1]["loss"], 4), tokens_per_s=round(statistics.median(rates)),
        wall_s=round(wall, 1), max_memory_allocated_gib=peak, losses=losses,
        sync_sites=sorted(set(hooks.where)),
    )  # fmt: skip
    for key, counts in hooks.syncs.items():  # the most in one decoder layer
        out[f"{key}_per_layer"] = max(counts or [None])
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def ep_rank_share(cpu: bool) -> dict:
    """One EP rank's expert compute (the rows its local experts receive), fwd+bwd, timed
    against the dense bound of `dropless bench layer` (its six GEMMs) at those rows."""
    import torch

    from dropless.bench.bound import dense_bound
    from dropless.ops.expert_mlp import grouped_mlp

    L, S, D, Fh = EP_RANK[cpu]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, L, (S,), generator=g), minlength=L).tolist()
    x = torch.randn(S, D, generator=g).to(dev, dt).requires_grad_()
    w1 = (torch.randn(L, 2 * Fh, D, generator=g) * 0.02).to(dev, dt).requires_grad_()
    w2 = (torch.randn(L, D, Fh, generator=g) * 0.02).to(dev, dt).requires_grad_()
    gy = torch.randn(S, D, generator=g).to(dev, dt)

    def experts():
        grouped_mlp(x, counts, None, w1, w2).backward(gy)

    dense = dense_bound(x, w1, w2, gy, 1)  # the six GEMMs with M = S rows as dense torch.mm
    rounds, warmup = (3, 1) if cpu else (10, 3)
    sync = torch.cuda.synchronize if dev == "cuda" else None
    t, td = (statistics.median(step_times(f, rounds, warmup, sync)) for f in (experts, dense))
    flops = 18 * S * D * Fh  # 6 S D F forward, twice that backward
    return dict(
        experts=L, rows=S, D=D, F=Fh, dtype=str(dt).removeprefix("torch."),
        counts_max_over_mean=round(max(counts) * L / S, 3), ms=round(t * 1e3, 3),
        tflops=round(flops / t / 1e12, 3), dense_ms=round(td * 1e3, 3),
        share_of_bound=round(td / t, 3),
    )  # fmt: skip


def main_child(out: Path, cpu: bool) -> None:
    """single, force_distributed, resume, the gloo_ep2 reference and ep_rank_share, each
    in turn: one failing part (a GPU is lent for minutes) is its error and leaves the
    others' figures; OUT/main.json is rewritten after every part."""
    res: dict = {}

    def part(name: str, fn) -> bool:
        try:
            res[name] = fn()
        except Exception as e:  # reported in the summary; the other parts go on
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            res[name] = {"error": f"{type(e).__name__}: {e}"[:600], "traceback": tb[-2000:]}
        (out / "main.json").write_text(json.dumps(res))
        return "error" not in res[name]

    tiny = CPU_SETS if cpu else []
    single = [*tiny, "checkpoint.every=0"]
    part("single", lambda: _train(single, out / "single", count_steps=SYNC_STEPS))
    forced = [*tiny, "parallel.force_distributed=true", "train.activation_checkpointing=true"]
    run = out / "forced"
    if part("force_distributed", lambda: _train(forced, run, count_steps=SYNC_STEPS)):
        files = [f for f in (run / "checkpoints").rglob("*") if f.is_file()]
        res["checkpoint_gib"] = round(sum(f.stat().st_size for f in files) / 2**30, 3)
        part("resume", lambda: _train(forced, run, resume=True, after=SAVE_AT[cpu]))
    ref = [*(EP2_CPU_SETS if cpu else EP2_SETS), "train.grad_accum=2"]
    part("gloo_ep2_reference", lambda: _train(ref, out / "ep2_ref"))
    part("ep_rank_share", lambda: ep_rank_share(cpu))


def ep2_child(out: Path, cpu: bool) -> None:
    """2 processes, ep=2: over gloo with CUDA tensors when CUDA is there (both ranks on
    GPU 0, so LOCAL_RANK is set to 0), gloo on CPU otherwise."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = "0"  # two processes, one GPU
        dist.init_process_group("gloo")  # dropless train would pick NCCL (one GPU per rank)
    result = {"status": "ok"}
    try:
        result |= _train([*(EP2_CPU_SETS if cpu else EP2_SETS), "parallel.ep=2"], out / "ep2")
    except (RuntimeError, NotImplementedError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        refused = any(w in msg.lower() for w in ("gloo", "cuda", "device", "not supported"))
        result = dict(status="skipped" if refused else "fail", reason=f"{type(e).__name__}: {msg}")
    if int(os.environ["RANK"]) == 0:
        (out / "ep2.json").write_text(json.dumps(result))


# ---- in run.py's process ------------------------------------------------------------


def _max_rel(got: dict | None, want: dict | None) -> float | None:
    """The largest relative difference of the losses of the steps both runs logged."""
    got, want = ({int(k): v for k, v in (r or {}).get("losses", {}).items()} for r in (got, want))
    both = [k for k in got if k in want]
    return max((abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in both), default=None)


def _run_row(r: dict | None) -> dict:
    """The row of a run (its losses left out), or of a part that did not run through (its
    error, or "not run")."""
    if r is None or "error" in r:
        return dict(status="fail", error=r["error"] if r else "not run (an earlier part failed)")
    return {k: v for k, v in r.items() if k != "losses"}


def train_table(main: dict, ep2: dict | None, bench: dict | None, cpu: bool) -> dict:
    """The summary's rows and checks from the children's results (a part that failed is a
    row with its error, and fails the checks that need it)."""
    tol = LOSS_REL[cpu]
    # the runs' rows, each against the run whose losses it must equal
    rows = {k: _run_row(main.get(k)) for k in ("single", "force_distributed", "resume")}
    for run, ref in (("force_distributed", "single"), ("resume", "force_distributed")):
        rows[run]["max_rel_loss_diff"] = round_or_none(_max_rel(main.get(run), main.get(ref)), 6)
    steps = [int(k) for k in (main.get("resume") or {}).get("losses", {})]
    rows["resume"] |= dict(from_step=min(steps) - 1 if steps else None, steps=len(steps))
    rows["resume"]["checkpoint_gib"] = main.get("checkpoint_gib")
    b = dict(bench or dict(status="skipped", reason="--cpu: no bench shape is the smoke's model"))
    for run, key in (("single", "train_vs_bench"), ("force_distributed", "forced_vs_bench")):
        if b.get("tokens_per_s") and rows[run].get("tokens_per_s"):
            b[key] = round_or_none(rows[run]["tokens_per_s"] / b["tokens_per_s"])
    ep2 = dict(ep2 or dict(status="fail", reason="the 2-process child wrote no result"))
    if ep2.get("losses"):  # its status "ok" and its row against the 1-process reference
        diff = round_or_none(_max_rel(ep2, main.get("gloo_ep2_reference")), 6)
        ep2 = _run_row(ep2) | dict(max_rel_loss_diff=diff)
    share = main.get("ep_rank_share")
    share = share if share and "error" not in share else _run_row(share)
    rows |= dict(bench_e2e=b, gloo_ep2=ep2, ep_rank_share=share)
    model = TOML.name if not cpu else f"{TOML.name} at tiny sizes"
    return dict(model=model, tolerance=tol, rows=rows, checks=checks(rows, tol, cpu))


def checks(rows: dict, tol: float, cpu: bool) -> dict[str, bool]:
    """Pass/fail of the step. The host-sync ones on CUDA only: on CPU the expert GEMMs read
    their counts on the host (a second sync per layer, reported; CUDA's grouped path takes
    them on the device)."""
    f, ep2 = rows["force_distributed"], rows["gloo_ep2"]
    within = lambda v, limit: v is not None and v <= limit  # noqa: E731
    out = {
        "losses_equal": within(f["max_rel_loss_diff"], tol),
        "resume_reproduces": within(rows["resume"]["max_rel_loss_diff"], tol),
        "gloo_ep2_equal": ep2["status"] == "skipped"
        or (ep2["status"] == "ok" and within(ep2.get("max_rel_loss_diff"), tol)),
    }
    if not cpu:  # both counts: dropless's reads of the device, and the device's own
        fwd, rec = (f.get(f"cuda_syncs_{k}_per_layer") for k in ("forward", "recompute"))
        out["forward_syncs_le_1_per_layer"] = within(f.get("syncs_forward_per_layer"), 1) and (
            fwd is None or fwd <= 1
        )
        out["recompute_syncs_0"] = f.get("syncs_recompute_per_layer") == 0 and rec in (None, 0)
    if "train_vs_bench" in rows["bench_e2e"]:
        out["train_within_10pct_of_bench"] = rows["bench_e2e"]["train_vs_bench"] >= 0.9
    return out


def _bench(bench_step, left) -> dict:
    """`dropless bench e2e` at the train step's model: its fused-loss row's tokens/s."""
    if left() < MIN_CHILD_S:
        return dict(status="skipped", reason=f"budget: {left():.0f} s left")
    args = ["--shape", "qwen3-30b-2l", "--device", "cuda", "--impls", "dropless-fused-ce",
            "--rounds", "1", "--steps", "10", "--no-memory", "--optimizer", "fused"]  # fmt: skip
    res, record = bench_step("e2e", args, False, left())
    row = (record or {}).get("figures", {}).get("rows", {}).get("dropless-fused-ce")
    return dict(status=res["status"], tokens_per_s=round(row["tokens_per_s"]) if row else None)


def _child(procs: str, mode: str, out: Path, cpu: bool, run_child, left) -> tuple:
    """A torchrun child of this module -> (status, exit code, stderr tail, its result)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd = [*torchrun, "--nproc-per-node", procs, "-m", MODULE, mode, str(out)]
    status, code, _, tail = run_child(cmd + (["--cpu"] if cpu else []), cpu, left())
    f = out / f"{mode}.json"
    return status, code, tail, json.loads(f.read_text()) if f.exists() else None


def run(cpu: bool, timeout: float, run_child, bench_step) -> dict:
    """The step: the 1-process torchrun child, then (GPU) bench e2e, then the 2-process
    child; `run_child` and `bench_step` are run.py's (the output goes on to its log).
    The first child writes its results part by part: one stopped at its timeout still
    reports the parts it finished."""
    end = time.perf_counter() + timeout
    left = lambda: end - time.perf_counter()  # noqa: E731
    tmp_root = None if cpu else os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-", dir=tmp_root) as tmp:
        status, code, tail, main = _child("1", "main", Path(tmp), cpu, run_child, left)
        if main is None:
            return dict(status=status if status != "ok" else "fail", exit=code, stderr_tail=tail)
        bench = None if cpu else _bench(bench_step, left)
        if left() < MIN_CHILD_S:
            ep2 = dict(status="fail", reason=f"budget: {left():.0f} s left for the 2-process child")
        else:
            ep2_status, _, ep2_tail, ep2 = _child("2", "ep2", Path(tmp), cpu, run_child, left)
            ep2 = ep2 or dict(status="fail", reason=f"{ep2_status}: {ep2_tail[-300:]}")
    table = train_table(main, ep2, bench, cpu)
    failed = [k for k, ok in table["checks"].items() if not ok]
    res = dict(status="fail" if failed or status != "ok" else "ok", exit=code)
    if status != "ok":  # a timeout, or an exit after the parts were written
        res |= dict(status=status if status == "timeout" else "fail", stderr_tail=tail)
    return res | dict(failed_checks=failed, train=table)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"main": main_child, "ep2": ep2_child}[mode](out_dir, "--cpu" in sys.argv[3:])
