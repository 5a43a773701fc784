"""Compile every Triton kernel ahead of time for NVIDIA targets, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, not whether they
compile: type errors in loops and branches, layouts, shared memory, software
pipelining only show in the real compiler. Triton ships ptxas, so `triton.compile` can
build cubins for any sm_XX here. The jobs below launch every `@triton.jit` kernel of the
package (`tests/triton/test_triton_aot_inventory.py` checks that none is missing) at the
configurations its wrapper uses on a GPU: tiles, num_warps, num_stages, constexprs,
pointer dtypes, the arguments the JIT specializes to 1 (unit strides) and those it sees
as multiples of 16. Each job's argument names are checked against the kernel's
signature before anything compiles (a misspelt name would silently become an i32).
It reports shared memory and whether the GEMM K loop is pipelined. It proves
compilation only; speed and results on a GPU stay unverified until run there.

    python -m tools.aot_check --arch 80 90 [--dtype bf16] [--only NAME] [--workers N]
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import NamedTuple

DTYPES = ("bf16", "fp32")

# integer arguments the JIT sees as multiples of 16 at real model shapes (it specializes
# on that): row strides of [rows, D / F / 2F] tensors, and these sizes; pointers are
# 16-byte aligned (fresh torch allocations) unless a job says otherwise
ALIGNED_STRIDES = (
    "stride_am",
    "stride_as",
    "stride_bs",
    "stride_be",
    "stride_bn",
    "stride_ym",
    "stride_oe",
    "stride_om",
    "stride_x",
    "stride_o",
    "stride_r",
    "stride_g",
    "stride_y",
    "stride_gh",
    "stride_q",
    # the row-gathering GEMMs (gather_gemm_kernels.py)
    "stride_xt",
    "stride_gt",
    "stride_we",
    "stride_wk",
    "stride_wn",
    "stride_h",
    "stride_dh",
    "stride_a",
    "stride_ar",
    "stride_br",
)
ALIGNED_NAMES = ("K", "N", "M", "F", "D")


class Job(NamedTuple):
    """One launch configuration of one kernel."""

    fn: object  # the kernel: a JITFunction (or an autotuner around one)
    types: dict  # pointer and float arguments; every other argument is an i32
    consts: dict  # the constexprs, and the integer arguments the JIT specializes to 1
    warps: int = 4  # the JIT's default, for wrappers that pass no num_warps
    stages: int | None = None  # None: the JIT's default (the wrapper passes none)
    unaligned: tuple = ()  # aligned-looking integer arguments that are not multiples of 16
    min_arch: int = 0  # the wrapper takes this path only from this sm_XX on (TMA: 90)


@functools.cache  # each compiling process lists them once
def _jobs(dtype: str) -> list[Job]:
    """Every launch configuration to compile for operands of `dtype` (bf16 or fp32),
    each checked against its kernel's signature."""
    d = f"*{dtype}"
    bk = 32 if dtype == "fp32" else 64  # the GEMM wrappers' BLOCK_K
    prec = "ieee" if dtype == "fp32" else "tf32"  # ignored for 16-bit operands
    jobs = (
        _gemm_jobs(d, bk, prec)
        + _gather_jobs(dtype, d, bk, prec)
        + _row_jobs(d)
        + _routing_jobs(d)
        + _quant_jobs(d)
    )
    for job in jobs:
        check_job(job)
    return jobs


def _jit(fn):
    """The JITFunction under an Autotuner / Heuristics wrapper (each holds the next in .fn)."""
    from triton.runtime.jit import JITFunction

    while not isinstance(fn, JITFunction):
        fn = fn.fn
    return fn


def kernel_name(fn) -> str:
    """The "module:function" name of a kernel, as the inventory test lists it from the source."""
    py = _jit(fn).fn
    return f"{py.__module__}:{py.__name__}"


def check_job(job: Job) -> None:
    """Raise ValueError when a job names an argument its kernel lacks, leaves a constexpr
    unset, or fixes a runtime integer to anything but 1 (the only value the JIT folds)."""
    fn = _jit(job.fn)
    names = fn.arg_names
    constexprs = {p.name for p in fn.params if p.is_constexpr}
    problems = [
        f"no argument {n!r}" for n in (*job.types, *job.consts, *job.unaligned) if n not in names
    ]
    problems += [f"constexpr {n} unset" for n in sorted(constexprs - set(job.consts))]
    problems += [
        f"{n}={v!r} is not a constexpr: the JIT folds only 1"
        for n, v in job.consts.items()
        if n in names and n not in constexprs and v != 1
    ]
    if problems:
        raise ValueError(f"aot_check job for {kernel_name(fn)}: {'; '.join(problems)}")


def planned_kernels() -> list[str]:
    """The "module:function" names of the kernels the jobs launch (no compile, no GPU)."""
    return sorted({kernel_name(job.fn) for dtype in DTYPES for job in _jobs(dtype)})


def _gemm_jobs(d: str, bk: int, prec: str) -> list[Job]:
    """The grouped GEMM (`_mm_config`: both weight layouts, both row tiles) and its weight
    gradient; y and the weight gradient are fresh contiguous tensors (unit last stride)."""
    from dropless.ops.grouped_gemm import gemm_kernels as G

    gmm = {"a_ptr": d, "b_ptr": d, "y_ptr": d, "cnt_ptr": "*i32"}
    tiles = dict(BLOCK_N=128, BLOCK_K=bk, BLOCK_E=128, PRECISION=prec)
    jobs = []
    for bm, warps in ((128, 8), (64, 4)):
        unit = dict(stride_ak=1, stride_yn=1, BLOCK_M=bm, **tiles)
        jobs.append(Job(G.gmm_kernel, gmm, {**unit, "stride_bk": 1}, warps, 3))  # w [E, N, K]
        jobs.append(Job(G.gmm_kernel, gmm, {**unit, "stride_bn": 1}, warps, 3))  # w [E, K, N]
    wg = {"a_ptr": d, "b_ptr": d, "out_ptr": d, "cnt_ptr": "*i32"}
    unit = dict(stride_am=1, stride_bn=1, stride_on=1, BLOCK_M=128, **tiles)
    return jobs + [Job(G.wgrad_kernel, wg, unit, 8, 3)]


def _gather_jobs(dtype: str, d: str, bk: int, prec: str) -> list[Job]:
    """The row-gathering GEMMs of the gathered expert path (`_blocks`: 128/64-row tiles,
    8 warps, 3 stages), weights in the Transformers layout (the only one that path
    takes: the other layout is gpt_oss's, whose biases keep it off the path), read with
    pointer loads or, on sm_90+, through TMA descriptors; the weight gradients gather
    either operand (down: dy, up: x). Indices are the counting sort's int32 token_S."""
    from dropless.ops.expert_mlp import gather_gemm_kernels as K

    tiles = dict(BLOCK_M=128, BLOCK_M_TAIL=64, BLOCK_N=64, BLOCK_K=bk, BLOCK_E=128)
    base = dict(HAS_INDEX=True, HAS_P=True, INTERLEAVED=False, KIND="swiglu", PRECISION=prec)
    up = {"x_ptr": d, "idx_ptr": "*i32", "p_ptr": "*fp32", "h_ptr": d, "a_ptr": d,
          "cnt_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    dact = {"g_ptr": d, "idx_ptr": "*i32", "h_ptr": d, "p_ptr": "*fp32", "dh_ptr": d,
            "gp_ptr": "*fp32", "a_ptr": d, "cnt_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    jobs = []
    for tma in (False, True):
        w_up = f"tensordesc<{dtype}[1,64,{bk}]>" if tma else d  # [1, BLOCK_N, BLOCK_K] blocks
        w_dn = f"tensordesc<{dtype}[1,{bk},64]>" if tma else d
        arch = 90 if tma else 0
        jobs.append(Job(K.up_act_kernel, {**up, "w": w_up}, {**tiles, **base, "stride_xd": 1,
                        "stride_wk": 1, "W_T": True, "USE_TMA": tma}, 8, 3, min_arch=arch))  # fmt: skip
        jobs.append(Job(K.dact_kernel, {**dact, "w": w_dn}, {**tiles, **base, "stride_gd": 1,
                        "stride_wn": 1, "W_T": False, "USE_TMA": tma, "NEED_GP": True,
                        "RECOMPUTE": True}, 8, 3, min_arch=arch))  # fmt: skip
    wg = {
        "a_ptr": d,
        "ia_ptr": "*i32",
        "b_ptr": d,
        "ib_ptr": "*i32",
        "out_ptr": d,
        "cnt_ptr": "*i32",
    }
    consts = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, BLOCK_E=128, PRECISION=prec,
                  stride_am=1, stride_bn=1, stride_on=1)  # fmt: skip
    for gather_a in (True, False):
        jobs.append(Job(K.wgrad_kernel, wg, {**consts, "GATHER_A": gather_a,
                        "GATHER_B": not gather_a}, 8, 3))  # fmt: skip
    return jobs


def _row_jobs(d: str) -> list[Job]:
    """Memory-bound row kernels at the tiles `ops/_triton.row_blocks` picks for 1,024+ columns
    (2 rows x 1,024 columns, 4 warps; SwiGLU backward: 4 x 512; the routing-weight dot:
    16 pairs x 256; the cross-entropy's own 1 x 4,096 at 8 warps): permute and combine
    (indices: the counting sort's int32), SwiGLU backward for every activation kind of
    `activations.KINDS` (each kind is its own code), cross-entropy, RMSNorm, the zeroing
    of empty groups."""
    from dropless.ops.activation import swiglu_kernels as W
    from dropless.ops.activation.activation_kernels import KINDS
    from dropless.ops.grouped_gemm import group_kernels as Z
    from dropless.ops.linear_cross_entropy import cross_entropy_kernels as X
    from dropless.ops.permute import permute_kernels as P
    from dropless.ops.rmsnorm import rmsnorm_kernels as R

    rows = dict(BLOCK_R=2, BLOCK_N=1024)
    jobs = [
        Job(P.gather_rows_kernel, {"x_ptr": d, "idx_ptr": "*i32", "scale_ptr": "*fp32",
            "sidx_ptr": "*i32", "out_ptr": d}, dict(HAS_SCALE=True, **rows)),
        Job(P.gather_sum_kernel, {"rows_ptr": d, "slot_ptr": "*i32", "w_ptr": "*fp32",
            "out_ptr": d}, dict(K=8, HAS_W=True, **rows)),
        Job(P.pair_dot_kernel, {"g_ptr": d, "y_ptr": d, "slot_ptr": "*i32", "out_ptr": "*fp32"},
            dict(K=8, BLOCK_P=16, BLOCK_N=256)),
        Job(W.swiglu_fwd_kernel, {"h_ptr": d, "p_ptr": "*fp32", "a_ptr": d, "alpha": "fp32",
            "limit": "fp32"}, dict(HAS_P=True, BLOCK_R=2, BLOCK_F=1024, INTERLEAVED=False,
            ACTIVATION="swiglu")),
    ]  # fmt: skip
    bwd = {"g_ptr": d, "h_ptr": d, "p_ptr": "*fp32", "gh_ptr": d, "gp_ptr": "*fp32", "a_ptr": d,
           "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    for kind in KINDS:  # gpt_oss's gate and up are interleaved
        jobs.append(Job(W.swiglu_bwd_kernel, bwd, dict(HAS_P=True, NEED_GP=True, RECOMPUTE=True,
                        BLOCK_R=4, BLOCK_F=512, INTERLEAVED=kind == "gpt_oss", ACTIVATION=kind)))  # fmt: skip
    norm = dict(BLOCK_R=2, BLOCK_D=1024)
    jobs += [
        Job(X.ce_rows_kernel, {"x_ptr": d, "labels_ptr": "*i64", "scale_ptr": "*fp32",
            "loss_ptr": "*fp32", "smoothing": "fp32"},
            dict(GRAD=True, SMOOTH=True, BLOCK_R=1, BLOCK_V=4096), 8),
        Job(R.rmsnorm_fwd_kernel, {"x_ptr": d, "r_ptr": d, "w_ptr": d, "y_ptr": d, "s_ptr": d,
            "rstd_ptr": "*fp32", "eps": "fp32"}, dict(HAS_RES=True, **norm)),
        Job(R.rmsnorm_bwd_kernel, {"gy_ptr": d, "gs_ptr": d, "s_ptr": d, "w_ptr": d,
            "rstd_ptr": "*fp32", "ds_ptr": d, "gw_ptr": "*fp32"}, dict(HAS_GS=True, **norm)),
        Job(Z.zero_groups_kernel, {"out_ptr": d, "empty_ptr": "*i8"}, dict(BLOCK=1024)),
    ]  # fmt: skip
    return jobs


def _routing_jobs(d: str) -> list[Job]:
    """Top-k routing at `_route_blocks`' GPU tiles (E=128: 32 tokens per program; E=256:
    16; 4 warps) and the counting sort at `_sort_blocks`' (128 pairs, 128 buckets, 64 rows
    per scan chunk). K (top-k, 8) is not a multiple of 16; without groups G and
    TOPK_GROUP are 1, which the JIT folds."""
    from dropless.ops.routing import routing_kernels as R

    fwd = {"logits_ptr": d, "bias_ptr": "*fp32", "given_ptr": "*i64", "w_ptr": "*fp32",
           "ids_ptr": "*i64", "scores_ptr": "*fp32", "psum_ptr": "*fp32", "zsum_ptr": "*fp32",
           "scale": "fp32"}  # fmt: skip
    flat = dict(GROUPED=False, PER=128, G=1, TOPK_GROUP=1, BLOCK_G=1, BLOCK_E=128, BLOCK_T=32)
    common = dict(RENORM=True, BLOCK_K=8, WRITE_SCORES=True)
    jobs = [  # softmax top-k with the loss sums (route_with_aux); the replayed choice
        Job(R.route_fwd_kernel, fwd, dict(SOFTMAX=True, HAS_BIAS=False, STATS=True,
            GIVEN=False, **flat, **common), unaligned=("K",)),
        Job(R.route_fwd_kernel, fwd, dict(SOFTMAX=True, HAS_BIAS=False, STATS=False,
            GIVEN=True, **flat, **common), unaligned=("K",)),
        # DeepSeek-V3: sigmoid, expert bias, 8 groups of 32 experts, the best 4 groups
        Job(R.route_fwd_kernel, fwd, dict(SOFTMAX=False, HAS_BIAS=True, STATS=True,
            GIVEN=False, GROUPED=True, PER=32, BLOCK_G=8, BLOCK_E=256, BLOCK_T=16, **common),
            unaligned=("K",)),
    ]  # fmt: skip
    bwd = {"logits_ptr": d, "ids_ptr": "*i64", "gw_ptr": "*fp32", "gs_ptr": "*fp32",
           "gp_ptr": "*fp32", "gz_ptr": "*fp32", "dl_ptr": d, "scale": "fp32"}  # fmt: skip
    grads = dict(HAS_GW=True, HAS_GS=True, HAS_GP=True, HAS_GZ=True, RENORM=True, BLOCK_K=8)
    for softmax, be, bt in ((True, 128, 32), (False, 256, 16)):
        jobs.append(Job(R.route_bwd_kernel, bwd, dict(SOFTMAX=softmax, BLOCK_E=be, BLOCK_T=bt,
                        **grads), unaligned=("K",)))  # fmt: skip
    jobs += [  # bucket ids: the int64 ids_TK, flattened
        Job(R.hist_kernel, {"ids_ptr": "*i64", "cnt_ptr": "*i32"}, dict(BLOCK_P=128, BLOCK_B=128)),
        Job(R.scan_kernel, {"cnt_ptr": "*i32", "start_ptr": "*i32", "counts_ptr": "*i64",
            "ends_ptr": "*i32"}, dict(BLOCK_NB=64, BLOCK_B=128)),
        Job(R.place_kernel, {"ids_ptr": "*i64", "start_ptr": "*i32", "pair_ptr": "*i32",
            "token_ptr": "*i32", "slot_ptr": "*i32"}, dict(BLOCK_P=128), unaligned=("K",)),
    ]  # fmt: skip
    return jobs


def _quant_jobs(d: str) -> list[Job]:
    """The FP8 casts (`ops/quantize/triton_quant.py`) and the fused SwiGLU + FP8 kernels, forward
    (`ops/activation/swiglu_quant_kernels.py`) and backward (`swiglu_bwd_quant_kernels.py`), at their
    wrappers' default tiles (num_warps and num_stages: the JIT's defaults). Their FP8 and
    E8M0 bytes are written and read through uint8 pointers (the E4M3 encoding is integer
    arithmetic, `triton_fp8.py`), so no fp8 type is involved and they compile for sm_80
    as for sm_90. The casts take 2-D contiguous tensors (unit column strides), except the
    MX quantization of grouped columns (`quantize_mx_groups`), which reads a transposed
    view (unit row stride); M (rows: tokens) is not a multiple of 16 there."""
    from dropless.ops.activation import swiglu_bwd_quant_kernels as B
    from dropless.ops.activation import swiglu_quant_kernels as S
    from dropless.ops.quantize import triton_quant as Q

    tile = dict(BLOCK_M=32, BLOCK_N=128)
    mx = {"x_ptr": d, "q_ptr": "*u8", "s_ptr": "*u8"}
    jobs = [
        Job(Q.scale_cast_kernel, {"x_ptr": d, "s_ptr": "*fp32", "q_ptr": "*u8"},
            dict(sx1=1, sq1=1, **tile), unaligned=("M",)),
        Job(Q.dequant_kernel, {"q_ptr": "*u8", "s_ptr": "*fp32", "o_ptr": d},
            dict(sq1=1, so1=1, MX=False, **tile), unaligned=("M",)),
        Job(Q.mx_quant_kernel, mx, dict(sx1=1, RCEIL=True, BLOCK_M=32), unaligned=("M",)),
        Job(Q.mx_quant_kernel, mx, dict(sx0=1, RCEIL=False, BLOCK_M=32)),  # x_SN.t()
        Job(Q.dequant_kernel, {"q_ptr": "*u8", "s_ptr": "*u8", "o_ptr": d},
            dict(sq1=1, ss1=1, so1=1, MX=True, **tile), unaligned=("M",)),
    ]  # fmt: skip
    act = dict(HAS_PROB=True, ACT=True)
    h = {"h_ptr": d, "prob_ptr": "*fp32"}
    jobs += [
        Job(S.mx_kernel, {**h, "q_ptr": "*u8", "s_ptr": "*u8"}, dict(RCEIL=True, BLOCK_S=32, **act)),
        Job(S.scaled_kernel, {**h, "scale_ptr": "*fp32", "q_ptr": "*u8", "amax_ptr": "*fp32"},
            dict(BLOCK_S=32, BLOCK_F=64, **act)),
        Job(S.amax_kernel, {**h, "amax_ptr": "*fp32"}, dict(BLOCK_S=32, BLOCK_F=64, **act)),
    ]  # fmt: skip
    for one_tile in (False, True):  # F > 1,024: two walks over F; F <= 1,024: one tile
        jobs.append(Job(S.row_kernel, {**h, "q_ptr": "*u8", "scale_ptr": "*fp32",
                        "max_over_margin": "fp32"}, dict(BLOCK_S=4, BLOCK_F=1024,
                        ONE_TILE=one_tile, **act)))  # fmt: skip
    jobs.append(Job(B.bwd_quant_kernel, {"g_ptr": d, "h_ptr": d, "p_ptr": "*fp32",
                    "scale_ptr": "*fp32", "gh_ptr": d, "gp_ptr": "*fp32", "q_ptr": "*u8"},
                    dict(HAS_P=True, NEED_GP=True, BLOCK_R=4, BLOCK_F=512)))  # fmt: skip
    return jobs


def _signature(job: Job) -> tuple[dict, dict]:
    """(the argument types, the tt.divisibility=16 attributes) the JIT would derive."""
    fn = _jit(job.fn)
    sig = {n: "constexpr" if n in job.consts else job.types.get(n, "i32") for n in fn.arg_names}
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(fn.arg_names)
        if sig[n] != "constexpr"
        and n not in job.unaligned
        and (sig[n].startswith("*") or n.endswith(ALIGNED_STRIDES) or n in ALIGNED_NAMES)
    }
    return sig, attrs


def _compile(job: Job, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    sig, attrs = _signature(job)
    options = {"num_warps": job.warps}
    if job.stages is not None:
        options["num_stages"] = job.stages
    return triton.compile(
        ASTSource(_jit(job.fn), sig, job.consts, attrs),
        target=GPUTarget("cuda", arch, 32),
        options=options,
    )


def _run(task: tuple[int, str, int]) -> tuple[bool, str]:
    """Compile job `index` of `_jobs(dtype)` for sm_`arch`: (compiled, the line to print)."""
    arch, dtype, index = task
    job = _jobs(dtype)[index]
    name = _jit(job.fn).__name__
    t0 = time.perf_counter()
    try:
        k = _compile(job, arch)
    except Exception as exc:  # report every failure, not just the first
        desc = f"sm_{arch} {dtype} {name} {sorted(job.consts.items())}"
        return False, f"FAILED {desc}: {type(exc).__name__}: {str(exc)[:2000]}"
    ttgir = k.asm.get("ttgir", "")
    piped = "async_copy_global_to_local" in ttgir or "async_tma" in ttgir
    wgmma = "warp_group_dot" in ttgir
    return True, (
        f"ok {time.perf_counter() - t0:5.1f}s sm_{arch} {dtype} {name:20s} "
        f"shared={k.metadata.shared} pipelined={piped} wgmma={wgmma}"
    )


def compile_all(
    archs: list[int],
    dtypes: list[str],
    only: list[str] | None = None,
    workers: int = 1,
    verbose: bool = True,
) -> tuple[int, list[str]]:
    """Compile every job (of the kernels whose name contains one of `only`, when given)
    for every arch and dtype in `workers` processes; returns (jobs tried, the failures)."""
    tasks = [
        (arch, dtype, i)
        for arch in archs
        for dtype in dtypes
        for i, job in enumerate(_jobs(dtype))
        if arch >= job.min_arch and (not only or any(o in _jit(job.fn).__name__ for o in only))
    ]
    if workers > 1:  # each compile is single-threaded; spawn: no forked copy of this process
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
            return len(tasks), _report(pool.map(_run, tasks), verbose)  # in task order
    return len(tasks), _report(map(_run, tasks), verbose)


def _report(results, verbose: bool) -> list[str]:
    """Print each job's line as it comes; returns the failures."""
    failures = []
    for ok, line in results:
        if not ok:
            failures.append(line.removeprefix("FAILED "))
        if verbose:
            print(line, flush=True)
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--dtype", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--only", nargs="+", help="only the kernels whose name contains one")
    parser.add_argument("--workers", type=int, default=1, help="compiling processes")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    tried, failures = compile_all(args.arch, args.dtype, args.only, args.workers)
    print(f"{tried} jobs, {len(failures)} failures, {time.perf_counter() - t0:.0f} s")
    return 1 if failures or not tried else 0


if __name__ == "__main__":
    sys.exit(main())
