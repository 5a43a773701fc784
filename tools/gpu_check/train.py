"""The `train` step of the GPU check (`run.py`): `dropless train` on the path a node runs.

On CUDA, at the model of examples/qwen3-30b-a3b-2layers.toml (two Qwen3-30B-A3B layers:
128 experts top-8, hidden 2048, expert width 768; vocab 32,768; seq 4096, micro-batch 1;
model.dtype=bf16), in one child under `torchrun --nproc-per-node 1` (rows of the summary):

- single: 20 steps on one process (no process group, no activation checkpointing);
- force_distributed: the same 20 steps with parallel.force_distributed=true on NCCL (FSDP2,
  DTensor experts behind the all-to-all dispatcher) and activation checkpointing; host syncs
  counted per decoder layer in forward and in the recompute (tests/ops/sync_counter.py, the
  counter the host-sync tests use, and on CUDA the device's own count in sync debug mode),
  steps 2-3; an async DCP checkpoint at step 10;
- resume: the forced run resumed from that checkpoint: steps 11-20 against its losses;
- ep_rank_share: one 8-way expert-parallel rank's share of the 30B layer timed: 16 local
  experts receiving T*K/8 = 32,768 rows (T = 8 ranks x 4096 tokens), forward+backward,
  next to dense GEMMs of the same FLOPs;

then `dropless bench e2e --device cuda --shape qwen3-30b-2l` (bench_e2e: the same model,
seq and batch; its dropless-fused-ce row, as `dropless train` fuses the loss) next to the
single run's tokens/s, and 2 processes sharing the GPU over gloo with CUDA tensors (gloo_ep2:
ep=2 at a small shape, against one process with 2 micro-batches; skipped, saying why, where
gloo's collectives refuse CUDA tensors). `--cpu`: the same at tiny sizes on CPU (gloo, fp32),
bench_e2e skipped (no bench shape is the smoke's model).

Disk: one checkpoint at a time (step 10: bf16 weights and fp32 AdamW moments, ~14 GB);
each run's last, synchronous checkpoint is not written (a hook stops the run there).
Wall time on an H200: about 200 s (estimate, not yet measured).
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

from dropless.train.run.hooks import TrainHooks
from tools.gpu_check import CHECKOUT

ROOT = CHECKOUT
MODULE = "tools.gpu_check.train"  # what the torchrun children run
TOML = ROOT / "examples" / "qwen3-30b-a3b-2layers.toml"
STEPS, SAVE_AT, SYNC_STEPS = 20, 10, (2, 3)
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


def _sets(cpu: bool, *extra: str) -> list[str]:
    return [*(CPU_SETS if cpu else []), *extra]


def _steps(cpu: bool) -> tuple[int, int]:
    return (6, 3) if cpu else (STEPS, SAVE_AT)


# ---- in the children ---------------------------------------------------------------------


class FinalSaveSkipped(Exception):
    """Raised by the hook at the run's last checkpoint: the check needs no second one."""


@contextlib.contextmanager
def _cuda_syncs():
    """On CUDA: a list of the syncs the device reports in the block (its sync debug mode,
    as tests/gpu_check/test_gpu_check_paths.py counts them; torch's own ops included);
    None on CPU."""
    import torch

    if not torch.cuda.is_available():
        yield None
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _hooks(last_step: int, count_steps=()):
    return CheckHooks(last_step, count_steps)


class CheckHooks(TrainHooks):
    """Counts host syncs per decoder layer in `count_steps`: in forward (the layer's
    own hooks) and in the recompute of activation checkpointing (Transformers
    checkpoints the layer's `forward`, inside its hooks: its submodules' hooks fire
    again in backward); `sync_counter`'s count (the calls dropless makes that read the
    device) and, on CUDA, the device's own. Stops the run at its last checkpoint."""

    def __init__(self, last_step: int, count_steps=()):
        self.last_step, self.count_steps = last_step, tuple(count_steps)
        self.syncs: dict[str, list[int]] = {
            "forward": [], "recompute": [], "cuda_forward": [], "cuda_recompute": []
        }  # fmt: skip
        self.where: list[str] = []
        self._stack = contextlib.ExitStack()
        self._found = self._cuda = None
        self._hooked = False

    def _start(self):
        sys.path.insert(0, str(ROOT / "tests" / "ops"))  # the counter the host-sync tests use
        from sync_counter import count_syncs

        self._found = self._stack.enter_context(count_syncs())
        self._cuda = self._stack.enter_context(_cuda_syncs())
        self._open, self._done, self._rec = {}, set(), {}

    def _stop(self):
        if self._found is not None:
            self._stack.close()
            for n, c in self._rec.values():
                self.syncs["recompute"].append(n)
                if self._cuda is not None:
                    self.syncs["cuda_recompute"].append(c)
            self._found = self._cuda = None

    def _now(self) -> tuple[int, int]:
        cuda = self._cuda or []
        return len(self._found), sum("synchroniz" in str(w.message) for w in cuda)

    def _hook(self, model):
        from dropless.hf.distributed.parallelize import decoder_layers

        for i, layer in enumerate(decoder_layers(model)):
            layer.register_forward_pre_hook(lambda m, a, i=i: self._enter(i))
            layer.register_forward_hook(lambda m, a, o, i=i: self._leave(i, "forward"))
            for c in layer.children():
                c.register_forward_pre_hook(lambda m, a, i=i: self._enter((i, m)))
                c.register_forward_hook(lambda m, a, o, i=i: self._leave((i, m), "recompute"))
        self._hooked = True

    def _counting(self, key) -> bool:
        import torch

        if self._found is None or not torch.is_grad_enabled():
            return False  # outside the counted steps, or an evaluation forward
        # a submodule counts only once its layer's forward is done: in the recompute
        return not isinstance(key, tuple) or key[0] in self._done

    def _enter(self, key):
        if self._counting(key):
            self._open.setdefault(key, []).append(self._now())

    def _leave(self, key, phase):
        if not self._counting(key) or not self._open.get(key):
            return
        (n0, c0), (n1, c1) = self._open[key].pop(), self._now()
        self.where += self._found[n0:]
        if phase == "forward":
            self.syncs["forward"].append(n1 - n0)
            if self._cuda is not None:
                self.syncs["cuda_forward"].append(c1 - c0)
            self._done.add(key)
        else:
            n, c = self._rec.get(key[0], (0, 0))
            self._rec[key[0]] = (n + n1 - n0, c + c1 - c0)

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


def _train(
    sets: list[str], run_dir: Path, resume: bool = False, count_steps=(), after: int = 0
) -> dict:
    """One `dropless train` run in this process -> its figures and the losses of its
    steps after `after` (a resumed run's metrics.jsonl starts with the first run's)."""
    import torch

    from dropless.train.config.load import load_config
    from dropless.train.trainer import train

    cfg = load_config(TOML, sets)
    hooks = _hooks(cfg.train.steps, count_steps)
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
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "loss" in r and r["step"] > after]
    rates = [r["tokens_per_s"] for r in steps if r["step"] > max(SYNC_STEPS)] or [
        r["tokens_per_s"] for r in steps
    ]
    out = dict(
        wall_s=round(wall, 1),
        losses={r["step"]: r["loss"] for r in steps},
        tokens_per_s=statistics.median(rates),
        max_memory_allocated_gib=round(torch.cuda.max_memory_allocated() / 2**30, 3)
        if cuda
        else None,
        syncs=hooks.syncs,
        sync_sites=sorted(set(hooks.where)),
    )
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def _time(fn, rounds: int, warmup: int) -> float:
    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rounds):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ep_rank_share(cpu: bool) -> dict:
    """One EP rank's expert compute (the rows its local experts receive), fwd+bwd, timed
    against dense GEMMs of identical FLOPs."""
    import torch
    import torch.nn.functional as F

    from dropless.ops.expert_mlp import grouped_mlp

    L, S, D, Fh = EP_RANK[cpu]
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    counts = torch.bincount(torch.randint(0, L, (S,), generator=g), minlength=L).tolist()
    x = torch.randn(S, D, generator=g).to(dev, dt).requires_grad_()
    w1 = (torch.randn(L, 2 * Fh, D, generator=g) * 0.02).to(dev, dt).requires_grad_()
    w2 = (torch.randn(L, D, Fh, generator=g) * 0.02).to(dev, dt).requires_grad_()
    d1, d2 = w1[0].detach().clone().requires_grad_(), w2[0].detach().clone().requires_grad_()
    gy = torch.randn(S, D, generator=g).to(dev, dt)

    def experts():
        grouped_mlp(x, counts, None, w1, w2).backward(gy)

    def dense():  # the same six GEMMs (input gradient included) with M = S rows
        gu = x @ d1.T
        ((F.silu(gu[:, :Fh]) * gu[:, Fh:]) @ d2.T).backward(gy)

    rounds, warmup = (3, 1) if cpu else (10, 3)
    t, td = _time(experts, rounds, warmup), _time(dense, rounds, warmup)
    flops = 18 * S * D * Fh  # 6 S D F forward, twice that backward
    return dict(
        experts=L, rows=S, D=D, F=Fh, dtype=str(dt).removeprefix("torch."),
        counts_max_over_mean=round(max(counts) * L / S, 3), ms=round(t * 1e3, 3),
        tflops=round(flops / t / 1e12, 3), dense_ms=round(td * 1e3, 3),
        share_of_bound=round(td / t, 3),
    )  # fmt: skip


def _attempt(res: dict, name: str, fn, out: Path) -> bool:
    """res[name] = fn(), or the error that stopped it: one failing part (a GPU is lent for
    minutes) leaves the others' figures; OUT/main.json is rewritten after every part."""
    try:
        res[name] = fn()
    except Exception as e:  # reported in the summary; the other parts go on
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        res[name] = {"error": f"{type(e).__name__}: {e}"[:600], "traceback": tb[-2000:]}
    (out / "main.json").write_text(json.dumps(res))
    return "error" not in res[name]


def main_child(out: Path, cpu: bool) -> None:
    """single, force_distributed, resume, the gloo_ep2 reference and ep_rank_share."""
    _, save_at = _steps(cpu)
    res: dict = {}
    single = _sets(cpu, "checkpoint.every=0")
    _attempt(res, "single", lambda: _train(single, out / "single", count_steps=SYNC_STEPS), out)
    forced = _sets(cpu, "parallel.force_distributed=true", "train.activation_checkpointing=true")
    run = out / "forced"
    if _attempt(res, "force_distributed", lambda: _train(forced, run, count_steps=SYNC_STEPS), out):
        files = [f for f in (run / "checkpoints").rglob("*") if f.is_file()]
        res["checkpoint_gib"] = round(sum(f.stat().st_size for f in files) / 2**30, 3)
        _attempt(res, "resume", lambda: _train(forced, run, resume=True, after=save_at), out)
    ref = [*(EP2_CPU_SETS if cpu else EP2_SETS), "train.grad_accum=2"]
    _attempt(res, "gloo_ep2_reference", lambda: _train(ref, out / "ep2_ref"), out)
    _attempt(res, "ep_rank_share", lambda: ep_rank_share(cpu), out)


def ep2_child(out: Path, cpu: bool) -> None:
    """2 processes, ep=2: over gloo with CUDA tensors when CUDA is there (both ranks on
    GPU 0, so LOCAL_RANK is set to 0), gloo on CPU otherwise."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        os.environ["LOCAL_RANK"] = "0"  # two processes, one GPU
        dist.init_process_group("gloo")  # dropless train would pick NCCL (one GPU per rank)
    result = {"status": "ok"}
    try:
        sets = [*(EP2_CPU_SETS if cpu else EP2_SETS), "parallel.ep=2"]
        result |= _train(sets, out / "ep2")
    except (RuntimeError, NotImplementedError, ValueError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        refused = any(w in msg.lower() for w in ("gloo", "cuda", "device", "not supported"))
        result = {
            "status": "skipped" if refused else "fail",
            "reason": f"{type(e).__name__}: {msg}",
        }
    if rank == 0:
        (out / "ep2.json").write_text(json.dumps(result))


# ---- in run.py's process ------------------------------------------------------------


def _max_rel(got: dict, want: dict) -> float | None:
    both = [k for k in got if k in want]
    if not both:
        return None
    return max(abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in both)


def _run_row(r: dict) -> dict:
    losses = list(r["losses"].values())
    s = r["syncs"]
    return dict(
        steps=len(losses), first_loss=round(losses[0], 4), last_loss=round(losses[-1], 4),
        tokens_per_s=round(r["tokens_per_s"]), wall_s=r["wall_s"],
        max_memory_allocated_gib=r["max_memory_allocated_gib"],
        syncs_forward_per_layer=_max(s["forward"]),
        syncs_recompute_per_layer=_max(s["recompute"]),
        cuda_syncs_forward_per_layer=_max(s.get("cuda_forward")),
        cuda_syncs_recompute_per_layer=_max(s.get("cuda_recompute")),
        sync_sites=r["sync_sites"],
    )  # fmt: skip


def _max(v):
    return max(v) if v else None


def _keys(d: dict) -> dict:
    return {int(k): v for k, v in d.items()}


def _failed(r: dict | None) -> dict | None:
    """The row of a part that did not run through (None if it did)."""
    if r is None:
        return dict(status="fail", error="not run (an earlier part failed)")
    return dict(status="fail", error=r["error"]) if "error" in r else None


def train_table(main: dict, ep2: dict | None, bench: dict | None, cpu: bool) -> dict:
    """The summary's rows and checks from the children's results (a part that failed is a
    row with its error, and fails the checks that need it)."""
    tol = LOSS_REL[cpu]

    def losses(name: str) -> dict:
        return _keys((main.get(name) or {}).get("losses", {}))

    def run_row(name: str) -> dict:
        return _failed(main.get(name)) or _run_row(main[name])

    single, forced, resumed = losses("single"), losses("force_distributed"), losses("resume")
    rows = {"single": run_row("single"), "force_distributed": run_row("force_distributed")}
    rows["force_distributed"]["max_rel_loss_diff"] = _r(_max_rel(forced, single))
    rows["resume"] = dict(
        from_step=min(resumed) - 1 if resumed else None, steps=len(resumed),
        checkpoint_gib=main.get("checkpoint_gib"), wall_s=(main.get("resume") or {}).get("wall_s"),
        max_rel_loss_diff=_r(_max_rel(resumed, forced)),
    ) | (_failed(main.get("resume")) or {})  # fmt: skip
    rows["bench_e2e"] = dict(bench or dict(status="skipped", reason="--cpu: no bench shape is the smoke's model"))  # fmt: skip
    for run, key in (("single", "train_vs_bench"), ("force_distributed", "forced_vs_bench")):
        if rows["bench_e2e"].get("tokens_per_s") and rows[run].get("tokens_per_s"):
            rows["bench_e2e"][key] = _r(rows[run]["tokens_per_s"] / rows["bench_e2e"]["tokens_per_s"], 3)  # fmt: skip
    rows["gloo_ep2"] = dict(ep2 or {"status": "fail", "reason": "the 2-process child wrote no result"})  # fmt: skip
    if rows["gloo_ep2"].get("losses"):
        got, want = _keys(rows["gloo_ep2"].pop("losses")), losses("gloo_ep2_reference")
        rows["gloo_ep2"] = dict(status="ok", steps=len(got), max_rel_loss_diff=_r(_max_rel(got, want)))  # fmt: skip
    rows["ep_rank_share"] = _failed(main.get("ep_rank_share")) or main["ep_rank_share"]
    return dict(model=TOML.name if not cpu else f"{TOML.name} at tiny sizes", tolerance=tol,
                rows=rows, checks=checks(rows, tol, cpu))  # fmt: skip


def _within(v, tol) -> bool:
    return v is not None and v <= tol


def checks(rows: dict, tol: float, cpu: bool) -> dict[str, bool]:
    """Pass/fail of the step. The host-sync ones on CUDA only: on CPU the expert GEMMs read
    their counts on the host (a second sync per layer, reported; CUDA's grouped path takes
    them on the device)."""
    f, ep2 = rows["force_distributed"], rows["gloo_ep2"]
    out = {
        "losses_equal": _within(f["max_rel_loss_diff"], tol),
        "resume_reproduces": _within(rows["resume"]["max_rel_loss_diff"], tol),
        "gloo_ep2_equal": ep2["status"] == "skipped"
        or (ep2["status"] == "ok" and _within(ep2.get("max_rel_loss_diff"), tol)),
    }
    if not cpu:  # both counts: dropless's reads of the device, and the device's own
        cuda_fwd, cuda_rec = (f.get(f"cuda_syncs_{k}_per_layer") for k in ("forward", "recompute"))
        out["forward_syncs_le_1_per_layer"] = _within(f.get("syncs_forward_per_layer"), 1) and (
            cuda_fwd is None or cuda_fwd <= 1
        )
        out["recompute_syncs_0"] = f.get("syncs_recompute_per_layer") == 0 and cuda_rec in (None, 0)
    if "train_vs_bench" in rows["bench_e2e"]:
        out["train_within_10pct_of_bench"] = rows["bench_e2e"]["train_vs_bench"] >= 0.9
    return out


def _r(v, nd=6):
    return None if v is None else round(v, nd)


MIN_CHILD_S = 20  # a child's start-up: with less time left it is skipped, saying so


def _bench(bench_step, left) -> dict:
    """`dropless bench e2e` at the train step's model: its fused-loss row's tokens/s."""
    if left() < MIN_CHILD_S:
        return dict(status="skipped", reason=f"budget: {left():.0f} s left")
    args = ["--shape", "qwen3-30b-2l", "--device", "cuda", "--impls", "dropless-fused-ce",
            "--rounds", "1", "--steps", "10", "--no-memory"]  # fmt: skip
    res, record = bench_step("e2e", args, False, left())
    row = (record or {}).get("figures", {}).get("rows", {}).get("dropless-fused-ce")
    return dict(status=res["status"], tokens_per_s=round(row["tokens_per_s"]) if row else None)


def _ep2(torchrun: list[str], out: Path, flag: list[str], run_child, left) -> dict:
    if left() < MIN_CHILD_S:
        return dict(status="fail", reason=f"budget: {left():.0f} s left for the 2-process child")
    cmd = [*torchrun, "--nproc-per-node", "2", "-m", MODULE, "ep2", str(out), *flag]
    status, _, _, tail = run_child(cmd, flag == ["--cpu"], left())
    f = out / "ep2.json"
    return json.loads(f.read_text()) if f.exists() else dict(status="fail", reason=f"{status}: {tail[-300:]}")  # fmt: skip


def run(cpu: bool, timeout: float, run_child, bench_step) -> dict:
    """The step: the 1-process torchrun child, then (GPU) bench e2e, then the 2-process
    child; `run_child` and `bench_step` are run.py's (the output goes on to its log).
    The first child writes its results part by part: one stopped at its timeout still
    reports the parts it finished."""
    end = time.perf_counter() + timeout
    left = lambda: end - time.perf_counter()  # noqa: E731
    tmp_root = None if cpu else os.environ.get("TMPDIR")
    with tempfile.TemporaryDirectory(prefix="gpu-check-train-", dir=tmp_root) as tmp:
        out = Path(tmp)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        flag = ["--cpu"] if cpu else []
        cmd = [*torchrun, "--nproc-per-node", "1", "-m", MODULE, "main", tmp, *flag]
        status, code, _, tail = run_child(cmd, cpu, left())
        f = out / "main.json"
        main = json.loads(f.read_text()) if f.exists() else None
        if main is None:
            return dict(status=status if status != "ok" else "fail", exit=code, stderr_tail=tail)
        bench = None if cpu else _bench(bench_step, left)
        ep2 = _ep2(torchrun, out, flag, run_child, left)
    table = train_table(main, ep2, bench, cpu)
    failed = [k for k, ok in table["checks"].items() if not ok]
    res = dict(status="fail" if failed or status != "ok" else "ok", exit=code)
    if status != "ok":  # a timeout, or an exit after the parts were written
        res |= dict(status=status if status == "timeout" else "fail", stderr_tail=tail)
    return res | dict(failed_checks=failed, train=table)


if __name__ == "__main__":
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"main": main_child, "ep2": ep2_child}[mode](out_dir, "--cpu" in sys.argv[3:])
