"""The fused expert MLP's grouped path with the Triton row ops (permute / combine /
activation x prob kernels) against the same path with the eager row ops, forward and
backward, fp32.

`check(case, device)` runs under TRITON_INTERPRET=1 in a child process (tests/interpreted.py).
On CPU the registry never picks the Triton row ops (CUDA only, by design), so the check
registers them, for any tensor and above every other, for the duration of the call.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

from __future__ import annotations

import contextlib
import dataclasses

import torch

from interpreted import interpreted_tests

# name -> (T, E, K, D, F, options)
CASES = {
    "swiglu": (9, 4, 2, 12, 10, {}),
    "bias_trans_w_false": (7, 3, 2, 8, 6, dict(bias=True, trans_w=False)),
    "gpt_oss_interleaved": (6, 5, 2, 8, 6, dict(activation="gpt_oss", interleaved=True, limit=1.5)),
    "empty_expert": (5, 4, 1, 8, 4, dict(ids=[[0], [2], [0], [3], [2]])),
    "T=1": (1, 3, 2, 8, 4, {}),
    "K=E_E_not_pow2": (4, 3, 3, 8, 4, {}),
    "capacity_dropped_pairs": (8, 4, 2, 8, 4, dict(drop=True)),
}


@contextlib.contextmanager
def _row_ops(impl):
    """Make `impl` what every row-op pick returns: registered first, for any tensor."""
    from dropless.ops.permute import row_ops

    real = dict(row_ops._ROW_OPS)
    row_ops.register_row_ops(
        dataclasses.replace(impl, name="swapped_in", supports=lambda t: True, priority=10**6)
    )
    try:
        yield
    finally:
        row_ops._ROW_OPS.clear()
        row_ops._ROW_OPS.update(real)


def _run(impl, device, T, E, K, D, F, opt, seed=0):
    from dropless.ops import sort_by_expert
    from dropless.ops.expert_mlp.eager import run as fused_mlp

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen)
    if "ids" in opt:
        ids = torch.tensor(opt["ids"])
    else:
        ids = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w_TK = torch.rand(T, K, generator=gen)
    trans_w = opt.get("trans_w", True)
    gu = torch.randn(E, 2 * F, D, generator=gen) * 0.4
    dn = torch.randn(E, D, F, generator=gen) * 0.4
    if not trans_w:
        gu, dn = gu.transpose(1, 2).contiguous(), dn.transpose(1, 2).contiguous()
    bias = opt.get("bias", False)
    gb = torch.randn(E, 2 * F, generator=gen) if bias else None
    db = torch.randn(E, D, generator=gen) if bias else None
    g = torch.randn(T, D, generator=gen)
    keep = torch.rand(T, K, generator=gen) > 0.3 if opt.get("drop") else None
    leaves = [t.to(device).requires_grad_(True) for t in (x, w_TK, gu, dn)]
    extra = [t.to(device).requires_grad_(True) if t is not None else None for t in (gb, db)]
    sp = sort_by_expert(ids.to(device), E, None if keep is None else keep.to(device))
    counts = sp.counts if keep is not None else sp.counts_E
    with _row_ops(impl):
        prob_S = leaves[1].reshape(-1).index_select(0, sp.pair_S)
        out = fused_mlp(
            leaves[0], prob_S, leaves[2], leaves[3], counts,
            token_S=sp.token_S, slot_TK=sp.slot_TK, num_out=T,
            gate_up_bias=extra[0], down_bias=extra[1],
            activation=opt.get("activation", "swiglu"), interleaved=opt.get("interleaved", False),
            trans_w=trans_w, limit=opt.get("limit", 7.0), path="grouped", backend="loop",
        )  # fmt: skip
        ins = leaves + [t for t in extra if t is not None]
        grads = torch.autograd.grad(out, ins, g.to(device))
    return [out.detach().cpu()] + [t.cpu() for t in grads]


def check(case, device: str) -> None:
    from dropless.ops.permute.gpu import triton_row_ops
    from dropless.ops.permute.row_ops import EAGER

    got = _run(triton_row_ops(), device, *case)
    want = _run(EAGER, "cpu", *case)
    names = ["out", "x", "w_TK", "gate_up", "down", "gate_up_bias", "down_bias"]
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


test_interpreted, test_cuda = interpreted_tests(CASES, check)
