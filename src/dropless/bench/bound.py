"""The limits `dropless bench layer` measures its rows against: the dense bound (the
layer's six expert GEMMs as dense `torch.mm`, nothing else) and the machine's dense
matmul rate (`torch.matmul` of two square matrices: cuBLAS on CUDA)."""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, M = T*K rows

from __future__ import annotations

import statistics

import torch

from .common import step_times

# the six GEMMs of the bound, in the order it runs them: (what, operand shapes)
BOUND_GEMMS = (
    ("gate/up forward", "[M,D] x [D,2F]"),
    ("down forward", "[M,F] x [F,D]"),
    ("down input gradient", "[M,D] x [D,F]"),
    ("down weight gradient", "[D,M] x [M,F]"),
    ("gate/up input gradient (the layer's dx)", "[M,2F] x [2F,D]"),
    ("gate/up weight gradient", "[2F,M] x [M,D]"),
)
# matmul rate: the square size and the matmuls per timed repeat (CPU bf16 runs ~80x
# slower than fp32 on CPUs without AVX-512/AMX, hence its small size)
RATE_SIZES = {"cuda": (8192, 10), "cpu": (512, 1), "cpu-bf16": (256, 1)}


def layer_flops(T: int, K: int, D: int, F: int) -> float:
    """The expert GEMMs' FLOPs of one forward+backward: 3 GEMMs (forward, input grad,
    weight grad) x (gate/up 4*M*D*F + down 2*M*D*F), M = T*K."""
    return 18.0 * T * K * D * F


def dense_bound(x_TD, gate_up, down, grad_TD, K):
    """-> step(): the six GEMMs of the experts with M = T*K rows as dense torch.mm on
    operands allocated here (one expert's weights; random stand-ins for the gate/up output
    gradient and the activation), nothing else. The input is detached: the bound's dx GEMM
    is one of the six, not an autograd node."""
    M, F = x_TD.shape[0] * K, down.shape[2]
    dev, dtype = x_TD.device, x_TD.dtype
    xm, gy = x_TD.detach().repeat(K, 1), grad_TD.repeat(K, 1)
    hm = torch.randn(M, 2 * F, device=dev, dtype=dtype)
    am = torch.randn(M, F, device=dev, dtype=dtype)
    wgu, wd = gate_up[0].detach().clone(), down[0].detach().clone()

    def step():
        torch.mm(xm, wgu.t())  # gate/up forward
        torch.mm(am, wd.t())  # down forward
        torch.mm(gy, wd)  # down input gradient (d act)
        torch.mm(gy.t(), am)  # down weight gradient
        torch.mm(hm, wgu)  # gate/up input gradient: the layer's dx
        torch.mm(hm.t(), xm)  # gate/up weight gradient

    return step


def matmul_rate(device: str, dtype: torch.dtype, n: int | None = None, rounds: int = 5) -> dict:
    """The dense matmul rate of this machine: `torch.matmul` of two n x n matrices (cuBLAS
    on CUDA), median of `rounds` timed repeats after a warm-up -> {dtype, n, ms, tflops, how}."""
    key = "cuda" if device == "cuda" else "cpu-bf16" if dtype == torch.bfloat16 else "cpu"
    size, reps = RATE_SIZES[key]
    n = n or size
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(n, n, generator=g).to(device=device, dtype=dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device == "cuda" else None
    times = step_times(lambda: [torch.matmul(a, b) for _ in range(reps)], rounds, 1, sync)
    ms = statistics.median(times) * 1e3 / reps
    how = "cuBLAS (torch.matmul)" if device == "cuda" else "torch.matmul on CPU"
    name = str(dtype).removeprefix("torch.")
    return {"dtype": name, "n": n, "ms": ms, "tflops": 2.0 * n**3 / ms / 1e9, "how": how}


def machine_rates(device: str, dtype: str) -> dict:
    """{dtype name: matmul_rate}: bf16 always (the GPU's compute dtype), and the bench
    shape's dtype when it differs (fp32 on CPU)."""
    out = {"bfloat16": matmul_rate(device, torch.bfloat16)}
    if dtype != "bfloat16":
        out[dtype] = matmul_rate(device, getattr(torch, dtype))
    return out
