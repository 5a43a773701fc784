"""Every torch._grouped_mm call of the grouped paths follows CUDA's operand rules.

Most of these bugs only show on a GPU (a device assert that poisons the CUDA
context), so a spy (`cuda_rules.GemmSpy`) checks each call's layout on CPU, in bf16
(16-byte alignment is 8 elements), forward and backward.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

import pytest
import torch
from cuda_rules import GemmSpy

from dropless import ops
from dropless.ops.expert_mlp.eager import run as fused_mlp

BF16 = torch.bfloat16


def _weights(E, D, F, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(E, 2 * F, D, generator=g) / D**0.5).to(dtype).requires_grad_(True)
    dn = (torch.randn(E, D, F, generator=g) / F**0.5).to(dtype).requires_grad_(True)
    return gu, dn


ROUTINGS = {
    # name: (T, E, K, ids of expert choice per token: None = random)
    "odd_counts_and_empty_expert": (
        7,
        5,
        2,
        [[0, 2], [2, 3], [0, 2], [3, 2], [0, 3], [2, 0], [3, 0]],
    ),
    "all_on_one": (5, 3, 1, [[1]] * 5),
    "T=1": (1, 4, 2, [[3, 1]]),
    "K=E": (3, 3, 3, [[0, 1, 2], [2, 1, 0], [1, 0, 2]]),
}


@pytest.mark.parametrize("case", list(ROUTINGS))
def test_expert_mlp_grouped_path_calls_follow_cuda_rules(case, monkeypatch):
    T, E, K, ids = ROUTINGS[case]
    D, F = 16, 8
    spy = GemmSpy(monkeypatch)
    gu, dn = _weights(E, D, F)
    x = torch.randn(T, D).to(BF16).requires_grad_(True)
    w_TK = torch.rand(T, K).to(BF16).requires_grad_(True)
    out, _ = ops.expert_mlp(x, torch.tensor(ids), w_TK, gu, dn, backend="grouped_mm")
    out.float().square().sum().backward()
    kinds = [len(c["shapes"][1]) for c in spy.calls]
    assert kinds.count(3) == 4 and kinds.count(2) == 2, spy.calls  # 2 fwd + 2 dgrad, 2 wgrad
    assert spy.bad() == [], spy.bad()
    for t in (x, w_TK, gu, dn):
        assert t.grad is not None and torch.isfinite(t.grad.float()).all()


def test_grouped_gemm_wgrad_is_column_major_and_right(monkeypatch):
    spy = GemmSpy(monkeypatch)
    counts = [3, 0, 5, 1]  # no count a multiple of 8: a row-major [D, S] would assert
    x = torch.randn(9, 16).to(BF16).requires_grad_(True)
    w = torch.randn(4, 24, 16).to(BF16).requires_grad_(True)
    y = ops.grouped_gemm(x, w, counts, backend="grouped_mm")
    g = torch.randn_like(y)
    y.backward(g)
    assert spy.bad() == [] and len(spy.calls) == 3
    xs, gs = x.detach().double().split(counts), g.double().split(counts)
    want = torch.stack([gs[e].t() @ xs[e] for e in range(4)])
    torch.testing.assert_close(w.grad.double(), want, rtol=2e-2, atol=2e-2)
    assert torch.equal(w.grad[1], torch.zeros_like(w.grad[1]))  # the empty group


def test_no_rows_calls_no_gemm_and_gives_zero_grads(monkeypatch):
    """An expert-parallel rank whose experts got nothing: S == 0."""
    spy = GemmSpy(monkeypatch)
    x = torch.randn(0, 16).to(BF16).requires_grad_(True)
    w = torch.randn(3, 8, 16).to(BF16).requires_grad_(True)
    y = ops.grouped_gemm(x, w, [0, 0, 0], backend="grouped_mm")
    y.sum().backward()
    assert y.shape == (0, 8) and spy.calls == []
    assert torch.equal(w.grad, torch.zeros_like(w))
    counts_E = torch.zeros(3, dtype=torch.long)  # device counts, the sync-free path
    gu, dn = _weights(3, 16, 8)
    out = fused_mlp(x, None, gu, dn, counts_E, path="grouped", backend="grouped_mm")
    out.sum().backward()
    assert spy.calls == [] and torch.equal(gu.grad, torch.zeros_like(gu))


def test_misaligned_hidden_dim_never_reaches_grouped_mm(monkeypatch):
    """F = 12 (24 bytes in bf16): the down GEMM's inner dim breaks the 16-byte rule."""
    spy = GemmSpy(monkeypatch)
    E, D, F, T = 3, 16, 12, 6
    gu, dn = _weights(E, D, F, dtype=torch.float32)
    gu16, dn16 = (t.detach().to(BF16).requires_grad_(True) for t in (gu, dn))
    x = torch.randn(T, D)
    sp = ops.sort_by_expert(torch.randint(0, E, (T, 2)), E)
    x_SD = ops.permute(x, sp).to(BF16)
    out = fused_mlp(x_SD, None, gu16, dn16, sp.counts_E, path="grouped", backend=None)
    out.float().sum().backward()
    assert spy.calls == []  # auto fell back to a backend that runs it
    want = ops.grouped_mlp(x_SD.float(), sp.counts, None, gu, dn, backend="loop")
    torch.testing.assert_close(out.float(), want, rtol=3e-2, atol=3e-2)
    with pytest.raises(ValueError, match="16 bytes"):
        fused_mlp(x_SD, None, gu16, dn16, sp.counts_E, path="grouped", backend="grouped_mm")


def test_spy_flags_the_layouts_cuda_rejects():
    """The rules themselves: the old wgrad layout and an empty operand are flagged."""
    from cuda_rules import problems

    a_SM, b_SN = torch.randn(9, 16).to(BF16), torch.randn(9, 8).to(BF16)
    offs = torch.tensor([3, 3, 8, 9], dtype=torch.int32)
    assert problems(a_SM.t(), b_SN, offs, scaled=False) == []
    assert any(
        "column-major" in p for p in problems(a_SM.t().contiguous(), b_SN, offs, scaled=False)
    )
    empty = torch.randn(0, 16).to(BF16)
    assert any(
        "empty" in p for p in problems(empty.t().contiguous(), empty[:, :8], offs, scaled=False)
    )
    w = torch.randn(4, 12, 16).to(BF16)  # N = 12: 24 bytes
    assert any("16 bytes" in p for p in problems(a_SM, w.transpose(1, 2), offs, scaled=False))
