"""The RMSNorm entry point on CPU: the lean torch op (`dropless.ops.rmsnorm`) against the
reference (torch's op), forward and backward, what it keeps for backward, no Triton
import, clear backend errors. (The Triton kernels themselves are checked under the
interpreter in tests/triton.)"""

import sys

import pytest
import torch

from dropless.ops.reference import rms_norm_reference
from dropless.ops.rmsnorm import rms_norm
from dropless.ops.rmsnorm.eager import rms_norm as lean_rms_norm


def test_cpu_path_is_torch_op_with_residual():
    x, r, w = torch.randn(5, 12), torch.randn(5, 12), torch.randn(12)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (12,), w, 1e-5)
    )
    y, s = rms_norm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (12,), w, 1e-5))
    with pytest.raises(ValueError, match="'triton' cannot run on torch.float32 tensors on cpu"):
        rms_norm(x, w, backend="triton")
    with pytest.raises(ValueError, match="'cuda' is not registered; known: "):
        rms_norm(x, w, backend="cuda")


def test_cpu_call_loads_no_kernel_module():
    sys.modules.pop("dropless.ops.rmsnorm.rmsnorm_kernels", None)
    rms_norm(torch.randn(3, 4), torch.ones(4))
    assert "dropless.ops.rmsnorm.rmsnorm_kernels" not in sys.modules


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (3, 5, 16), (2, 4, 3, 7)])
def test_torch_path_matches_reference_forward_and_backward(dtype, shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(shape[-1], generator=g) * 0.3 + 1).to(dtype)
    gy = torch.randn(shape, generator=g).to(dtype)
    got_in = [t.clone().requires_grad_(True) for t in (x, w)]
    ref_in = [t.clone().requires_grad_(True) for t in (x, w)]
    y = rms_norm(*got_in, 1e-5)
    y_ref = rms_norm_reference(*ref_in, 1e-5)
    assert y.dtype == y_ref.dtype == dtype
    assert torch.equal(y, y_ref)  # same ops in the same precision
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for a, b in zip(torch.autograd.grad(y, got_in, gy), torch.autograd.grad(y_ref, ref_in, gy)):
        torch.testing.assert_close(a, b, **tol)


def test_torch_path_gradcheck_fp64():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: lean_rms_norm(a, b, 1e-3), (x, w))
    r = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b, c: rms_norm(a, b, 1e-3, residual=c)[0], (x, w, r))


def test_torch_path_keeps_input_and_one_value_per_row():
    x = torch.randn(2, 5, 16, requires_grad=True)
    w = torch.ones(16, requires_grad=True)
    kept = []

    def pack(t):
        kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lean_rms_norm(x, w)
    others = [t for t in kept if t is not x and t is not w]
    assert [tuple(t.shape) for t in others] == [(2, 5)] and others[0].dtype == torch.float32
    with pytest.raises(ValueError, match="does not match the last dim"):
        lean_rms_norm(x, torch.ones(8))
