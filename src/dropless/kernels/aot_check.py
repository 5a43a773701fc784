"""Compile every Triton kernel ahead of time for NVIDIA targets, on a machine without a GPU.

The interpreter (TRITON_INTERPRET=1) checks what the kernels compute, not whether they
compile: type errors in loops and branches, layouts, shared memory, software
pipelining only show in the real compiler. Triton ships ptxas, so `triton.compile` can
build cubins for any sm_XX here. This runs the launch configurations the wrappers use
(bf16/fp32 operands, unit inner strides and 16-byte alignment, as the JIT specializes
them at run time) and reports shared memory and whether the GEMM K loop is pipelined.
It proves compilation only; speed and results on a GPU stay unverified until run there.

    python -m dropless.kernels.aot_check --arch 80 90 [--dtype bf16 fp32]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

# arguments the JIT sees as multiples of 16 at real model shapes (it specializes on that)
ALIGNED = (
    "_ptr",
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


def _jobs(dtype: str) -> list[tuple]:
    """(kernel, pointer/scalar types, constexprs, num_warps, num_stages) per launch shape."""
    from . import cross_entropy_kernels as X
    from . import gemm_kernels as G
    from . import permute_kernels as P
    from . import swiglu_kernels as W

    bk = 32 if dtype == "fp32" else 64
    prec = "ieee" if dtype == "fp32" else "tf32"
    d = f"*{dtype}"
    gmm = {"a_ptr": d, "b_ptr": d, "y_ptr": d, "cnt_ptr": "*i32"}
    jobs = []
    for bm, warps in ((128, 8), (64, 4)):
        consts = dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=bk, BLOCK_E=128, PRECISION=prec)
        jobs.append((G._gmm_kernel, gmm, {**consts, "stride_ak": 1, "stride_bk": 1}, warps, 3))
        jobs.append((G._gmm_kernel, gmm, {**consts, "stride_ak": 1, "stride_bn": 1}, warps, 3))
    wg = {"a_ptr": d, "b_ptr": d, "out_ptr": d, "cnt_ptr": "*i32"}
    consts = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, BLOCK_E=128, PRECISION=prec)
    jobs.append((G._wgrad_kernel, wg, {**consts, "stride_am": 1, "stride_bn": 1}, 8, 3))
    rows = dict(BLOCK_R=2, BLOCK_N=1024)
    jobs.append((P._gather_rows_kernel, {"x_ptr": d, "idx_ptr": "*i64", "scale_ptr": "*fp32",
                 "sidx_ptr": "*i64", "out_ptr": d}, dict(HAS_SCALE=True, **rows), 4, 1))  # fmt: skip
    jobs.append((P._gather_sum_kernel, {"rows_ptr": d, "slot_ptr": "*i64", "w_ptr": "*fp32",
                 "out_ptr": d}, dict(K=8, HAS_W=True, **rows), 4, 1))  # fmt: skip
    jobs.append((P._pair_dot_kernel, {"g_ptr": d, "y_ptr": d, "slot_ptr": "*i64",
                 "out_ptr": "*fp32"}, dict(K=8, BLOCK_P=16, BLOCK_N=256), 4, 1))  # fmt: skip
    sw = dict(INTERLEAVED=False, ACTIVATION="swiglu")
    jobs.append((W._swiglu_fwd_kernel, {"h_ptr": d, "p_ptr": "*fp32", "a_ptr": d, "alpha": "fp32",
                 "limit": "fp32"}, dict(HAS_P=True, BLOCK_R=2, BLOCK_F=1024, **sw), 4, 1))  # fmt: skip
    for kind in ("gpt_oss", "gelu"):  # the clamps; erf (the other kinds: sigmoid, as swiglu)
        jobs.append((W._swiglu_bwd_kernel, {"g_ptr": d, "h_ptr": d, "p_ptr": "*fp32", "gh_ptr": d,
                     "gp_ptr": "*fp32", "a_ptr": d, "alpha": "fp32", "limit": "fp32"},
                     dict(HAS_P=True, NEED_GP=True, RECOMPUTE=True, BLOCK_R=4, BLOCK_F=512,
                          INTERLEAVED=True, ACTIVATION=kind), 4, 1))  # fmt: skip
    jobs.append((X._ce_rows_kernel, {"x_ptr": d, "labels_ptr": "*i64", "scale_ptr": "*fp32",
                 "loss_ptr": "*fp32", "smoothing": "fp32"},
                 dict(GRAD=True, SMOOTH=True, BLOCK_R=1, BLOCK_V=4096), 8, 1))  # fmt: skip
    return jobs + _gather_jobs(dtype, d, bk, prec)


def _gather_jobs(dtype: str, d: str, bk: int, prec: str) -> list[tuple]:
    """The row-gathering GEMMs: pointer loads of the weights, and TMA descriptors."""
    from . import gather_gemm_kernels as K

    jobs = []
    tiles = dict(BLOCK_M=128, BLOCK_M_TAIL=64, BLOCK_N=64, BLOCK_K=bk, BLOCK_E=128)
    base = dict(HAS_INDEX=True, HAS_P=True, INTERLEAVED=False, KIND="swiglu", PRECISION=prec)
    up = {"x_ptr": d, "idx_ptr": "*i64", "p_ptr": "*fp32", "h_ptr": d, "a_ptr": d,
          "cnt_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    dact = {"g_ptr": d, "idx_ptr": "*i64", "h_ptr": d, "p_ptr": "*fp32", "dh_ptr": d,
            "gp_ptr": "*fp32", "a_ptr": d, "cnt_ptr": "*i32", "alpha": "fp32", "limit": "fp32"}  # fmt: skip
    for tma in (False, True):
        w_up = f"tensordesc<{dtype}[1,64,{bk}]>" if tma else d  # W_T: [1, BN, BK] blocks
        w_dn = f"tensordesc<{dtype}[1,{bk},64]>" if tma else d
        unit = {"stride_xd": 1} if tma else {"stride_xd": 1, "stride_wk": 1}
        jobs.append((K._up_act_kernel, {**up, "w": w_up},
                     {**tiles, **base, **unit, "W_T": True, "USE_TMA": tma}, 8, 3))  # fmt: skip
        unit = {"stride_gd": 1} if tma else {"stride_gd": 1, "stride_wn": 1}
        jobs.append((K._dact_kernel, {**dact, "w": w_dn},
                     {**tiles, **base, **unit, "W_T": False, "USE_TMA": tma, "NEED_GP": True,
                      "RECOMPUTE": True}, 8, 3))  # fmt: skip
    wg = {
        "a_ptr": d,
        "ia_ptr": "*i64",
        "b_ptr": d,
        "ib_ptr": "*i64",
        "out_ptr": d,
        "cnt_ptr": "*i32",
    }
    consts = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=bk, BLOCK_E=128, PRECISION=prec)
    jobs.append((K._wgrad_kernel, wg, {**consts, "GATHER_A": True, "GATHER_B": False,
                 "stride_am": 1, "stride_bn": 1}, 8, 3))  # fmt: skip
    return jobs


def compile_all(archs: list[int], dtypes: list[str], verbose: bool = True) -> list[str]:
    """Compile every job for every arch; returns the failures (empty: all compiled)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    failures = []
    for arch in archs:
        for dtype in dtypes:
            for fn, types, consts, warps, stages in _jobs(dtype):
                sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
                attrs = {
                    (i,): [["tt.divisibility", 16]]
                    for i, n in enumerate(fn.arg_names)
                    if n not in consts and (n.endswith(ALIGNED) or n in ALIGNED_NAMES)
                }
                name = f"sm_{arch} {dtype} {fn.__name__} {sorted(consts.items())}"
                t0 = time.perf_counter()
                try:
                    k = triton.compile(
                        ASTSource(fn, sig, consts, attrs),
                        target=GPUTarget("cuda", arch, 32),
                        options={"num_warps": warps, "num_stages": stages},
                    )
                except Exception as exc:  # report every failure, not just the first
                    failures.append(f"{name}: {type(exc).__name__}: {str(exc)[:2000]}")
                    if verbose:
                        print("FAILED", failures[-1], flush=True)
                    continue
                if verbose:
                    ttgir = k.asm.get("ttgir", "")
                    piped = "async_copy_global_to_local" in ttgir or "async_tma" in ttgir
                    wgmma = "warp_group_dot" in ttgir
                    print(
                        f"ok {time.perf_counter() - t0:5.1f}s sm_{arch} {dtype} {fn.__name__:20s} "
                        f"shared={k.metadata.shared} pipelined={piped} wgmma={wgmma}",
                        flush=True,
                    )
    return failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter replaces the compiler", file=sys.stderr)
        return 2
    failures = compile_all(args.arch, args.dtype)
    print(f"{len(failures)} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
