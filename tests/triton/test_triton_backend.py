"""How the Triton kernels are found and picked: never imported or chosen for CPU tensors.

These run in the pytest process and never import triton (that is part of what they check);
the import check itself runs in the fresh child process of tests/interpreted.py.
"""

# S rows, D in features, N out features, E experts

from __future__ import annotations

import pytest
import torch

from dropless.ops import gemm_backends, grouped_gemm, registry
from dropless.ops.grouped_gemm import GEMM_BACKENDS, pick_gemm_backend
from dropless.ops.permute.row_ops import registered_row_ops


def test_runs_without_triton_and_loads_no_kernels_on_cpu(import_check):
    # checked first thing in the fresh child process of tests/interpreted.py (no second child)
    if import_check is not None:
        pytest.fail(import_check, pytrace=False)


def test_available_is_false_for_cpu_tensors(monkeypatch):
    x = torch.randn(3, 4)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter is never picked at run time
    assert registry.cuda_with_triton(x) is False
    if not torch.cuda.is_available():
        assert registry.cuda_with_triton() is False


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_auto_never_picks_triton_on_cpu(dtype):
    x_SD, w_END = torch.randn(6, 16, dtype=dtype), torch.randn(2, 16, 16, dtype=dtype)
    GEMM_BACKENDS.load_gpu()  # what the first pick for a CUDA operand does
    assert "triton" in gemm_backends()
    assert pick_gemm_backend(None, x_SD, w_END).name != "triton"
    assert pick_gemm_backend("auto", x_SD, w_END).name != "triton"


def test_naming_triton_on_cpu_raises():
    x_SD, w_END = torch.randn(5, 4), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="'triton' cannot run on torch.float32 tensors on cpu"):
        grouped_gemm(x_SD, w_END, [2, 3], backend="triton")


def test_kernel_functions_without_triton_name_the_extra(monkeypatch):
    monkeypatch.setattr(registry, "_TRITON_OK", [False])
    assert registry.cuda_with_triton(torch.randn(2)) is False
    x = torch.randn(3, 4)
    with pytest.raises(ImportError, match=r"pip install 'dropless\[triton\]'"):
        registered_row_ops("triton").gather_rows(x, torch.arange(3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_auto_picks_triton_for_cuda_fp32():
    x_SD = torch.randn(6, 16, device="cuda")
    w_END = torch.randn(2, 16, 16, device="cuda")
    if registry.triton_importable():
        assert registry.cuda_with_triton(x_SD)
        assert pick_gemm_backend(None, x_SD, w_END).name == "triton"
