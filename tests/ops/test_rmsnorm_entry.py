"""The RMSNorm entry point on CPU: torch's op, no Triton import, clear backend errors.
(The Triton kernels themselves are checked under the interpreter in tests/triton.)"""

import sys

import pytest
import torch

from dropless.kernels.rmsnorm import rms_norm


def test_cpu_path_is_torch_op_with_residual():
    x, r, w = torch.randn(5, 12), torch.randn(5, 12), torch.randn(12)
    torch.testing.assert_close(
        rms_norm(x, w, 1e-5), torch.nn.functional.rms_norm(x, (12,), w, 1e-5)
    )
    y, s = rms_norm(x, w, 1e-5, residual=r)
    torch.testing.assert_close(s, x + r)
    torch.testing.assert_close(y, torch.nn.functional.rms_norm(x + r, (12,), w, 1e-5))
    with pytest.raises(ValueError, match="backend='triton' needs a CUDA tensor"):
        rms_norm(x, w, backend="triton")
    with pytest.raises(ValueError, match="backend="):
        rms_norm(x, w, backend="cuda")


def test_cpu_call_loads_no_kernel_module():
    sys.modules.pop("dropless.kernels.rmsnorm_kernels", None)
    rms_norm(torch.randn(3, 4), torch.ones(4))
    assert "dropless.kernels.rmsnorm_kernels" not in sys.modules
