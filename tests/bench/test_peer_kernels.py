"""The peer rows' kernels against the layer written as a loop of torch.mm in fp32:
Liger-Kernel's fused MoE experts (`liger-moe`) on CPU under Triton's interpreter in fp32, where liger-kernel is installed (CI has none: the
wheels are carried to the GPU machine only; locally, put the folder `pip install
--target` made on PYTHONPATH); on a GPU (`pytest -m gpu`, the wheels installed by
scripts/gpu_check.py) compiled in bf16, with torchao's FP8 row-wise row beside it."""

from __future__ import annotations

import os

import pytest
import torch

CASES = ["liger-moe"]


def _inputs(device: str, dtype: torch.dtype, T=16, E=4, K=2, D=32, F=16):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g)
    gate_up = torch.randn(E, 2 * F, D, generator=g) * D**-0.5
    down = torch.randn(E, D, F, generator=g) * F**-0.5
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    gy = torch.randn(T, D, generator=g)
    to = dict(device=device, dtype=dtype)
    leaves = [t.to(**to).requires_grad_() for t in (x, gate_up, down)]
    return leaves, ids.to(device), w.to(**to), gy.to(**to)


def _reference(x, ids, w, gate_up, down):
    """The layer as a loop of torch.mm over experts: any dtype, any device (CUDA's
    `torch._grouped_mm` takes no fp32)."""
    F, K = gate_up.shape[1] // 2, ids.shape[1]
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        h = x[tok] @ gate_up[e].t()
        y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ down[e].t()
        out = out.index_add(0, tok, y * w.reshape(-1)[tok * K + slot].unsqueeze(1))
    return out


def _sqnr_db(row, device: str, dtype: torch.dtype, **shape) -> list[float]:
    """SQNR (dB) of the row's output and gradients (x, gate_up, down) against the plain
    layer in fp32 on the same inputs."""
    (x, gu, dn), ids, w, gy = _inputs(device, dtype, **shape)
    y = row(x, ids, w, gu, dn)
    got = [y, *torch.autograd.grad(y, (x, gu, dn), gy)]
    ref_leaves = [t.detach().float().requires_grad_() for t in (x, gu, dn)]
    ref = _reference(ref_leaves[0], ids, w.float(), *ref_leaves[1:])
    want = [ref, *torch.autograd.grad(ref, ref_leaves, gy.float())]
    got, want = [t.detach().float() for t in got], [t.detach() for t in want]
    return [float(10 * torch.log10(b.square().sum() / (a - b).square().sum()))
            for a, b in zip(got, want)]  # fmt: skip


def check(case: str, device: str) -> None:
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")  # one config: no timing loop
    from tools import peers

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    # fp32 under the interpreter: summation order only (~1e-7 relative, > 120 dB);
    # bf16: its rounding of inputs and outputs (8 bits, ~45 dB), 30 dB with margin
    floor = 100.0 if dtype == torch.float32 else 30.0
    sqnr = _sqnr_db(peers.LAYER_PATHS[case], device, dtype)
    assert min(sqnr) > floor, (case, device, sqnr)


def test_liger_moe_under_the_interpreter():
    pytest.importorskip("liger_kernel", reason="liger-kernel is carried to the GPU machine only")
    import interpreted

    path = os.path.abspath(__file__)
    results = interpreted.run_child([path])
    assert results[path] == {"liger-moe": None}, results[path]


@pytest.mark.gpu
def test_liger_moe_compiled_in_bf16():
    pytest.importorskip("liger_kernel")
    check("liger-moe", "cuda")


@pytest.mark.gpu
def test_torchao_fp8_row_against_bf16():
    """FP8 E4M3 operands (3 mantissa bits, power-of-two row scales): the 17 dB floor the
    project's FP8 recipes are held to, output and gradients."""
    pytest.importorskip("torchao")
    from tools import peers

    row = peers.LAYER_PATHS["torchao-fp8-row"]
    sqnr = _sqnr_db(row, "cuda", torch.bfloat16, T=256, D=64, F=32)
    assert min(sqnr) > 17.0, sqnr
