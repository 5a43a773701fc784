"""The FP8 cast kernel on 3-D grouped weights [E, M, N] (the delayed recipe quantizes its
weights at every call): one scale per expert, per row or per column, any strides, bit
for bit against the torch cast. Run under TRITON_INTERPRET=1 in the interpreted child
(tests/interpreted.py); the gpu test runs the same cases and the CUDA dispatch."""

# E experts, M rows, N columns

from __future__ import annotations

import torch

from interpreted import interpreted_tests

CASES = ["per_expert", "per_row", "per_column", "transposed_view", "two_d_unchanged", "empty"]


def _torch_cast(x, scale):
    return (x.float() * scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def check(case: str, device: str = "cpu") -> None:
    from dropless.ops.quantize.triton_quant import scale_cast
    from dropless.quant import formats as fm

    g = torch.Generator().manual_seed(CASES.index(case))
    x = torch.randn(3, 20, 40, generator=g) * 50
    x[1, 2, 3], x[2, 0, 0] = float("nan"), float("inf")
    if case == "per_expert":
        scale = fm.scale_from_amax(fm.amax(x.nan_to_num(0.0, 0.0, 0.0), (1, 2)), "e4m3")
    elif case == "per_row":
        scale = torch.rand(3, 20, 1, generator=g) * 10
    elif case in ("per_column", "transposed_view"):
        scale = torch.rand(3, 1, 40, generator=g) * 10
        if case == "transposed_view":  # a [E, N, M] weight read as [E, M, N]
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
    elif case == "two_d_unchanged":
        x, scale = x[0], torch.rand(20, 1, generator=g) * 10
    else:
        x, scale = x[:, :0], torch.ones(3, 1, 1)
    q = scale_cast(x.to(device), scale.to(device)).cpu()
    assert q.shape == x.shape and q.is_contiguous()
    assert torch.equal(q.view(torch.uint8), _torch_cast(x, scale).view(torch.uint8))
    if device == "cuda":  # the dispatch of formats.quantize_scaled / amax
        xc = x.to(device)
        want = fm.quantize_scaled(x, "e4m3", scale).data
        got = fm.quantize_scaled(xc, "e4m3", scale.to(device)).data.cpu()
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        if x.dim() == 3 and x.numel():
            a, b = fm.amax(xc, (1, 2)).cpu(), fm.amax(x, (1, 2))
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


test_interpreted, test_cuda = interpreted_tests(CASES, check)
