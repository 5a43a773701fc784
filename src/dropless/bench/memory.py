"""`dropless bench memory`: peak step memory per token of the pinned Qwen3-MoE at long
sequence lengths (batch 1), stock Transformers v5 against dropless's long-sequence recipe
(`LABELS`; `dropless-mxfp8`, opt-in, raises the peak on CPU, where the MXFP8 GEMMs are
emulated and their temporaries outweigh the smaller saved tensors).

Every (length, row) runs in its own child, once (`--tiny`: every row in one child):
AdamW's state is allocated first, then ONE step; its peak is VmHWM above VmRSS before the
step, with RSS following live tensors (`follow_live_memory`). A child whose address space
would pass `--max-rss-gib` (RLIMIT_AS) fails its allocation; that, a memory error or a
SIGKILL (the OOM killer) is recorded as out of memory, not retried.
"""

# B batch (1), L sequence length

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import resource
import signal
import sys
import time

from .child import run_child_process
from .common import (
    Recorder,
    add_history_arguments,
    follow_live_memory,
    load_sentence,
    peak_rss_mib,
    progress,
    require_extra,
    reset_peak_rss,
    rss_mib,
    timing_env,
    vm_kib,
    write_section,
)
from .e2e import QUICK, SHAPE, build_row_model

IMPLS = ("grouped_mm", "grouped_mm-ckpt", "dropless", "dropless-mxfp8")
DEFAULT_IMPLS = ("grouped_mm", "grouped_mm-ckpt", "dropless")
BASELINE = "grouped_mm-ckpt"  # the ratio column: stock with its own checkpointing
LABELS = {
    "grouped_mm": "HF v5 `grouped_mm`",
    "grouped_mm-ckpt": "HF v5 `grouped_mm` + activation checkpointing",
    "dropless": "dropless: checkpointing + fused linear-CE + RMSNorm",
    "dropless-mxfp8": "dropless: checkpointing + fused linear-CE + RMSNorm + MXFP8 saved activations",
}
MODEL_KEYS = tuple(k for k in SHAPE if k not in ("batch", "seq"))
SEQ_LENS = (8192, 32768)  # the measured lengths
# --tiny: lengths whose step takes milliseconds on the tiny model (at 8192 and 32768 its
# step took 2 s and 27 s on 2 quiet CPU cores, each row in a child of its own)
TINY_SEQ_LENS = (32, 64)
_M_ARENA_MAX = -8  # mallopt parameter (glibc malloc.h)
_MEMORY_WORDS = re.compile(
    r"out of memory|can't allocate memory|cannot allocate memory|bad_alloc|memoryerror"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--seq-len", type=int, nargs="+", default=None, metavar="L",
        help=f"sequence lengths, batch 1 (default: {' '.join(map(str, SEQ_LENS))}; "
        f"--tiny: {' '.join(map(str, TINY_SEQ_LENS))})",
    )  # fmt: skip
    p.add_argument(
        "--impls", default=",".join(DEFAULT_IMPLS),
        help=f"comma list from {','.join(IMPLS)} (default: {','.join(DEFAULT_IMPLS)})",
    )  # fmt: skip
    p.add_argument(
        "--max-rss-gib", type=float, default=20.0,
        help="memory limit of each child, GiB (default 20): above it the run is recorded as "
        "out of memory",
    )  # fmt: skip
    p.add_argument(
        "--timeout-s", type=float, default=3600.0,
        help="wall-clock limit per child, seconds (default 3600): recorded as a timeout",
    )  # fmt: skip
    p.add_argument(
        "--threads", type=int, default=None,
        help="torch threads in each child (default: torch's default, all cores)",
    )  # fmt: skip
    p.add_argument(
        "--tiny", action="store_true",
        help="a smoke run (not a result): a tiny model, short lengths, every row in one child",
    )  # fmt: skip
    add_history_arguments(p, "memory")


# --- the child: one implementation at one length, one process ---------------------------


def _build(impl: str, shape: dict, seq: int):
    """`bench e2e`'s model of the row: stock, or dropless with the fused loss and RMSNorm."""
    row = "dropless-fused-ce" if impl.startswith("dropless") else "grouped_mm"
    return build_row_model(
        row, {**shape, "seq": seq}, checkpointing=impl != "grouped_mm", fused_rmsnorm=True
    )


def _recipe(impl: str):
    """The autocast context of a row: MXFP8 saved activations for `dropless-mxfp8`."""
    if impl != "dropless-mxfp8":
        return contextlib.nullcontext()
    import dropless

    return dropless.autocast(recipe=dropless.MXFP8BlockScaling(fp8_saved_activations=True))


def _prime_adamw(model, opt) -> None:
    """Allocate AdamW's state without training: one step at learning rate 0 on zero
    gradients leaves every weight as it was (decoupled decay is scaled by the rate)."""
    import torch

    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr


def _one_malloc_arena() -> bool:
    """Keep every thread's small allocations in glibc's main arena: a new arena maps
    64 MiB of address space it may never use, which would count against RLIMIT_AS."""
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1) == 1
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def _address_space_limit(max_rss_gib: float):
    """RLIMIT_AS = what is mapped now + (limit - resident now), so that allocations that
    would take RSS past `max_rss_gib` fail; the previous limit is restored on exit.
    Approximate by what is mapped but not yet resident (library pages, untouched stack),
    a few MiB. Yields the limit in bytes."""
    mapped, resident = vm_kib("VmSize") * 1024, vm_kib("VmRSS") * 1024
    limit = mapped + max(int(max_rss_gib * 2**30) - resident, 0)
    previous = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit, previous[1]))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_AS, previous)


def child(args: dict) -> dict:
    """One implementation at one length in this process: one step, its peak memory."""
    import torch

    shape, impl, seq = args["shape"], args["impl"], args["seq"]
    arena_capped = _one_malloc_arena()
    follow_live_memory()  # before the model's first allocation (see its docstring)
    if args.get("threads"):
        torch.set_num_threads(int(args["threads"]))
    model = _build(impl, shape, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    _prime_adamw(model, opt)
    g = torch.Generator().manual_seed(1)
    ids_BL = torch.randint(0, shape["vocab_size"], (1, seq), generator=g)
    out = {"impl": impl, "seq": seq, "threads": torch.get_num_threads()}
    out["malloc_arena_capped"] = arena_capped
    # start the thread pools (their stacks are mapped once) before the limit
    torch.ones(1 << 20).add_(1)
    torch.ones(256, 256) @ torch.ones(256, 256)
    gc.collect()
    out["memory_tracked"] = follow_live_memory()
    base = rss_mib()
    out["steady_rss_mib"] = base
    try:
        with _address_space_limit(args["max_rss_gib"]) as out["limit_bytes"]:
            out.update(_step(model, opt, ids_BL, impl, base), status="ok")
    except (MemoryError, RuntimeError) as e:  # the limit is lifted again here
        if isinstance(e, RuntimeError) and not _MEMORY_WORDS.search(str(e).lower()):
            raise
        # where the limit strikes decides the words (MemoryError, "can't allocate memory",
        # std::bad_alloc): the record says out of memory in every case
        out.update(status="oom", error=f"out of memory ({type(e).__name__}: {str(e)[:300]})")
        out["process_peak_mib"] = peak_rss_mib()
    return out


def _step(model, opt, ids_BL, impl: str, base: float) -> dict:
    reset_peak_rss()
    t0 = time.perf_counter()
    with _recipe(impl):
        loss = model(input_ids=ids_BL, labels=ids_BL, use_cache=False).loss
    with _recipe(impl):  # checkpointing recomputes the layers' forwards in backward
        loss.backward()
    t_fb = time.perf_counter() - t0
    peak_fb, process_fb = peak_rss_mib() - base, peak_rss_mib()
    reset_peak_rss()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t_opt = time.perf_counter() - t1
    peak_opt, process_opt = peak_rss_mib() - base, peak_rss_mib()
    return {
        "loss": float(loss.detach()),
        "step_s": t_fb + t_opt,
        "peak_step_mib": max(peak_fb, peak_opt),
        "peak_fwd_bwd_mib": peak_fb,
        "peak_optimizer_mib": peak_opt,
        "process_peak_mib": max(process_fb, process_opt),
    }


# --- the parent -------------------------------------------------------------------------


def run_rows(rows: list[dict], timeout: float) -> list[dict]:
    """The rows in one child under the default environment (malloc settings removed), in
    order: one row, or (--tiny) every row with one import of torch and Transformers. An
    out-of-memory end (exception, allocation abort, SIGKILL) or a timeout is the record of
    the row the child was on, the rows after it then run each in its own child (a timeout:
    they are timeouts too); any other failure raises RuntimeError with its error output."""
    cmd = [sys.executable, "-m", "dropless.bench.memory", json.dumps({"rows": rows})]
    run = run_child_process(cmd, timeout=timeout, env=timing_env())
    done = []  # the records the child printed, one JSON line per row
    for line in run.stdout.splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict) and "impl" in rec:
                done.append(rec)
    if run.status == "timeout":
        late = rows[len(done) :]
        return done + [{"impl": r["impl"], "seq": r["seq"], "status": "timeout"} for r in late]
    if run.ok and len(done) == len(rows):
        return done
    rest = rows[len(done) :]
    failed = child_result(rest[0], run.returncode or 1, "", run.stderr)
    return done + [failed] + [out for r in rest[1:] for out in run_rows([r], timeout)]


def child_result(args: dict, returncode: int, stdout: str, stderr: str) -> dict:
    """The record of a finished child: its JSON line; an out-of-memory record for a
    child killed by SIGKILL or one whose error output speaks of memory; else RuntimeError."""
    if returncode == 0:
        return json.loads(stdout.strip().splitlines()[-1])
    tail = stderr[-3000:]
    if returncode == -signal.SIGKILL or _MEMORY_WORDS.search(tail.lower()):
        lines = tail.strip().splitlines()
        why = "killed by SIGKILL" if returncode < 0 or not lines else lines[-1]
        return {"impl": args["impl"], "seq": args["seq"], "status": "oom", "error": why[:300]}
    raise RuntimeError(
        f"benchmark child ({args['impl']}, seq {args['seq']}) failed with exit status "
        f"{returncode}:\n{tail}"
    )


def _check_args(args) -> list[str]:
    impls = [s.strip() for s in args.impls.split(",") if s.strip()]
    bad = [i for i in impls if i not in IMPLS]
    if bad or not impls:
        raise ValueError(f"--impls: unknown {bad}; allowed: {','.join(IMPLS)}")
    if args.seq_len is None:
        args.seq_len = list(TINY_SEQ_LENS if args.tiny else SEQ_LENS)
    if any(s < 2 for s in args.seq_len):
        raise ValueError(f"--seq-len {args.seq_len}: every length must be >= 2")
    if not args.max_rss_gib > 0:
        raise ValueError(f"--max-rss-gib {args.max_rss_gib}: must be > 0 (GiB)")
    if not args.timeout_s > 0:
        raise ValueError(f"--timeout-s {args.timeout_s}: must be > 0 (seconds)")
    return impls


def _add_ratios(rows: list[dict]) -> None:
    """bytes/token and the ratio to stock with checkpointing at the same length."""
    base = {r["seq"]: r for r in rows if r["impl"] == BASELINE and r["status"] == "ok"}
    for r in rows:
        if r["status"] != "ok":
            continue
        r["bytes_per_token"] = r["peak_step_mib"] * 2**20 / r["seq"]
        b = base.get(r["seq"])
        if b and b["peak_step_mib"] > 0:
            r["vs_baseline"] = r["peak_step_mib"] / b["peak_step_mib"]


def _table(rows: list[dict]) -> str:
    lines = [
        "| seq len | implementation | peak step MiB | bytes/token | vs stock + checkpointing "
        "| fwd+bwd / AdamW MiB | process peak GiB | step s | loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        head = f"| {r['seq']} | {LABELS[r['impl']]} "
        if r["status"] != "ok":
            what = "**out of memory**" if r["status"] == "oom" else "**timed out**"
            lines.append(head + f"| {what} | - | - | - | - | - | - |")
            continue
        ratio = f"{r['vs_baseline']:.2f}x" if "vs_baseline" in r else "-"
        lines.append(
            head + f"| {r['peak_step_mib']:,.0f} | {r['bytes_per_token']:,.0f} | {ratio} "
            f"| {r['peak_fwd_bwd_mib']:,.0f} / {r['peak_optimizer_mib']:,.0f} "
            f"| {r['process_peak_mib'] / 1024:.2f} | {r['step_s']:.1f} | {r['loss']:.4f} |"
        )
    return "\n".join(lines)


def run(args) -> int:
    require_extra("memory", "hf", "transformers")
    impls = _check_args(args)
    rec = Recorder.start(args)
    shape = QUICK if args.tiny else SHAPE
    common = {"shape": shape, "max_rss_gib": args.max_rss_gib, "threads": args.threads}
    todo = [{**common, "impl": impl, "seq": seq} for seq in args.seq_len for impl in impls]
    if args.tiny:
        progress(f"--tiny: {len(todo)} rows in one process")
    rows = []
    for group in [todo] if args.tiny else [[r] for r in todo]:
        if not args.tiny:
            progress(f"seq {group[0]['seq']}: measuring {group[0]['impl']} (its own process)")
        rows += run_rows(group, args.timeout_s)
        for r in rows[-len(group) :]:
            shown = f"{r['peak_step_mib']:,.0f} MiB" if r["status"] == "ok" else r["status"]
            print(f"seq {r['seq']:6d} {r['impl']:16s} peak step {shown}", flush=True)
    _add_ratios(rows)
    table = _table(rows)
    print(table)
    figures = {
        "shape": {k: shape[k] for k in MODEL_KEYS}, "batch": 1, "seq_lens": args.seq_len,
        "impls": impls, "tiny": args.tiny, "max_rss_gib": args.max_rss_gib,
        "threads": next((r["threads"] for r in rows if "threads" in r), None),
        "allocator": "mallopt in each child: blocks >= 128 KiB by mmap, freed memory returned",
        "rows": rows,
    }  # fmt: skip
    figures["dropless_vs_stock_ckpt"] = {
        str(r["seq"]): r["vs_baseline"]
        for r in rows
        if r["impl"] == "dropless" and "vs_baseline" in r
    }
    record = rec.finish("memory", figures)
    print(load_sentence(record["load"]))
    write_section(args, rec, "memory", record, table)
    return 0


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    for row in job.get("rows", [job]):  # --tiny: every row in this process, in order
        print(json.dumps(child(row)), flush=True)
        gc.collect()
