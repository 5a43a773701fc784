"""The grouped GEMMs' offsets are computed once per layer and handed to every GEMM.

`SortedPairs.offsets_E` (the sort's int32 cumulative ends) is what every
`torch._grouped_mm` of a layer's forward and backward reads; callers that pass only
counts (`grouped_mlp`, `grouped_gemm`) get one computation at the entry. Counted at
the aten level (every cumsum of the step, the sort's included), CPU fp32, grouped_mm.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.ops.expert_mlp import expert_mlp, grouped_mlp
from dropless.ops.expert_mlp.eager import run as fused_mlp
from dropless.ops.grouped_gemm import grouped_gemm
from dropless.ops.permute import permute, sort_by_expert

gg = sys.modules["dropless.ops.grouped_gemm.eager"]  # the package exports the function of that name

T, K, E, D, F = 12, 2, 4, 8, 8  # 8 fp32 features: 32-byte rows, what grouped_mm needs


class _Cumsums(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.cumsum:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def offs_seen(monkeypatch):
    """The `offs` tensor of every torch._grouped_mm call."""
    seen, real = [], torch._grouped_mm

    def spy(a, b, offs=None, **kw):
        seen.append(offs)
        return real(a, b, offs=offs, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    return seen


def _operands(capacity=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    gu = torch.randn(E, 2 * F, D, generator=g, requires_grad=True)
    dn = torch.randn(E, D, F, generator=g, requires_grad=True)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:K] for _ in range(T)])  # E-1 empty
    w = torch.rand(T, K, generator=g, requires_grad=True)
    keep = (torch.arange(T * K).view(T, K) % 5 != 0) if capacity else None
    return x, gu, dn, ids, w, keep


def _step(fn, *leaves):
    """(output, gradients of every leaf) of one forward+backward, and the cumsum count."""
    mode = _Cumsums()
    with mode:
        out = fn()
        grads = torch.autograd.grad((out * torch.linspace(-1, 1, out.shape[-1])).sum(), leaves)
    return (out.detach(), *grads), mode.n


def _layer(path, capacity=False, sp_out=None):
    x, gu, dn, ids, w, keep = _operands(capacity)

    def run():
        if path == "expert_mlp":
            out, sp = expert_mlp(x, ids, w, gu, dn, keep_TK=keep, backend="grouped_mm")
            if sp_out is not None:
                sp_out.append(sp)
            return out
        sp = sort_by_expert(ids, E, keep, host_counts=path != "gathered")
        p = w.reshape(-1).index_select(0, sp.pair_S)
        if path == "gathered":
            return fused_mlp(
                x, p, gu, dn, sp.counts_E, token_S=sp.token_S, slot_TK=sp.slot_TK,
                num_out=T, path="gathered", backend="grouped_mm",
            )  # fmt: skip
        return grouped_mlp(permute(x, sp), sp.counts, p, gu, dn, backend="grouped_mm")

    return _step(run, x, w, gu, dn)


@pytest.mark.parametrize(
    "path, capacity",
    [("expert_mlp", False), ("expert_mlp", True), ("grouped_mlp", False), ("gathered", False)],
    ids=["expert_mlp", "expert_mlp_capacity", "grouped_mlp_counts_only", "gathered"],
)
def test_one_offsets_computation_per_layer(path, capacity, offs_seen):
    """expert_mlp: the sort's cumsum is the only one (the six GEMMs read its result);
    grouped_mlp given only counts: the sort's plus one at the entry, for all six.
    Before, each grouped_mm call computed its own (sort + 6)."""
    sps = []
    _, n = _layer(path, capacity, sps)
    assert len(offs_seen) == 6  # up, down; their input and weight gradients
    assert all(o is offs_seen[0] for o in offs_seen), "the GEMMs got different offsets tensors"
    assert n == (1 if path == "expert_mlp" else 2), f"{n} cumsums in one layer step"
    if sps:
        assert offs_seen[0] is sps[0].offsets_E


@pytest.mark.parametrize("path", ["expert_mlp", "grouped_mlp", "gathered"])
def test_results_bitwise_equal_to_per_gemm_offsets(path, monkeypatch):
    """The shared offsets change no bit: the same step with every GEMM computing its own
    offsets (binding switched off, what the backends do without `offs`) gives the same."""
    shared, _ = _layer(path)
    for module in (
        gg,
        sys.modules["dropless.ops.expert_mlp.engine"],
    ):
        monkeypatch.setattr(module, "bind_offsets", lambda be, *a, **k: be)
    own, _ = _layer(path)
    for a, b in zip(shared, own):
        assert torch.equal(a, b)


def test_grouped_gemm_computes_offsets_once(offs_seen):
    """The standalone grouped GEMM (host counts): one offsets tensor for its forward and
    both backward GEMMs, one cumsum."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, D, generator=g, requires_grad=True)
    w = torch.randn(E, 2 * F, D, generator=g, requires_grad=True)
    got, n = _step(lambda: grouped_gemm(x, w, [3, 0, 5, 2], backend="grouped_mm"), x, w)
    assert n == 1 and len(offs_seen) == 3
    assert all(o is offs_seen[0] for o in offs_seen)
    assert offs_seen[0].tolist() == [3, 3, 8, 10]
    ref = torch.cat([x[:3] @ w[0].t(), x[3:8] @ w[2].t(), x[8:] @ w[3].t()])
    torch.testing.assert_close(got[0], ref, rtol=1e-6, atol=1e-6)  # fp32, 8-term dots


def test_bind_offsets_leaves_other_backends_alone():
    """Backends that do not take offsets (loop, triton: their kernels read the counts)
    come back as they are; the bound one no longer advertises `offsets`."""
    from dropless.ops.grouped_gemm.backends import _BACKENDS

    loop, gmm = _BACKENDS["loop"], _BACKENDS["grouped_mm"]
    assert gg.bind_offsets(loop, [1, 2]) is loop
    bound = gg.bind_offsets(gmm, torch.tensor([1, 2]), device="cpu")
    assert bound.name == "grouped_mm" and bound.device_counts and not bound.offsets
    assert bound.mm.keywords["offs"].tolist() == [1, 3]


def test_grouped_gemm_takes_the_sorts_offsets(offs_seen):
    """Two grouped GEMMs given the sort's offsets_E (the Transformers generic path): both,
    forward and backward, read that tensor; the sort's cumsum is the step's only one."""
    x, gu, dn, ids, _, _ = _operands()

    def run():
        sp = sort_by_expert(ids, E)
        run.sp = sp
        h = grouped_gemm(permute(x, sp), gu, sp.counts, offsets_E=sp.offsets_E)
        return grouped_gemm(torch.relu(h[:, :F]), dn, sp.counts, offsets_E=sp.offsets_E)

    got, n = _step(run, x, gu, dn)
    assert n == 1 and len(offs_seen) == 6
    assert all(o is run.sp.offsets_E for o in offs_seen)
