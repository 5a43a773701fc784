"""The Triton SwiGLU x prob backward that writes the recomputed activation in FP8 (the
down weight gradient's operand under per-tensor scaling) against the row op's eager
backward and the torch quantizer of its recomputed activation.

Run under TRITON_INTERPRET=1 in the interpreted child (tests/interpreted.py). exp may
differ by an ulp between numpy and torch: gradients agree to fp32 rounding (1e-6
relative) and the FP8 codes differ by at most one, rarely.
"""

# S rows, F expert hidden dim

from __future__ import annotations

import torch

from interpreted import interpreted_tests

CASES = ["with_prob", "no_prob", "no_prob_grad", "partial_tiles", "bf16_grads", "no_rows"]


def _inputs(S, F, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(S, 2 * F, generator=g) * 2
    return h, torch.rand(S, generator=g), torch.randn(S, F, generator=g)


def check(case: str, device: str = "cpu") -> None:
    from dropless.ops.activation.eager import act_bwd_eager
    from dropless.quant import formats as fm
    from dropless.quant.mlp import swiglu_bwd_quant

    S, F = {"partial_tiles": (13, 40), "no_rows": (0, 32)}.get(case, (9, 64))
    h, prob, g = _inputs(S, F, CASES.index(case))
    prob = None if case == "no_prob" else prob
    want_gp = case != "no_prob_grad"
    dtype = torch.bfloat16 if case == "bf16_grads" else None
    scale = torch.tensor(57.25)
    dev = [t.to(device) if t is not None else None for t in (g, h, prob)]
    gh, gp, q = swiglu_bwd_quant(*dev, scale, need_prob_grad=want_gp, grad_dtype=dtype)
    ref_h, ref_p, a = act_bwd_eager(g, h, prob, False, want_gp, True)
    ref_q = fm.quantize_scaled(a, "e4m3", scale)
    assert gh.dtype == (dtype or torch.float32) and gh.shape == (S, 2 * F)
    # bf16: one ulp (2^-7 relative): the interpreter's fp32 -> bf16 cast does not round
    # to nearest even as torch's does
    tol = 2**-7 if dtype else 1e-6
    torch.testing.assert_close(gh.cpu().float(), ref_h.to(gh.dtype).float(), rtol=tol, atol=1e-6)
    if prob is not None and want_gp:
        torch.testing.assert_close(gp.cpu(), ref_p, rtol=1e-5, atol=1e-6)
    else:
        assert gp is None
    diff = (q.data.view(torch.uint8).cpu().int() - ref_q.data.view(torch.uint8).int()).abs()
    if S:
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    assert torch.equal(q.scale_inv.cpu(), ref_q.scale_inv) and q.scale.shape == ()


test_interpreted, test_cuda = interpreted_tests(CASES, check)
