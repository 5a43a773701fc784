"""BF16AdamW: with an fp32 master it is torch's AdamW step for step; without one the
stochastic rounding is unbiased and lands on a bf16 neighbour."""

import pytest
import torch

from dropless.train.model.bf16_adamw import BF16AdamW, stochastic_round_to_bf16


def test_stochastic_rounding_lands_on_a_neighbour_and_is_unbiased():
    g = torch.Generator().manual_seed(0)
    x = torch.full((200_000,), 1.0 + 0.3 * 2**-7)  # 0.3 of the way from 1 to the next bf16
    r = stochastic_round_to_bf16(x, generator=g).float()
    assert set(r.unique().tolist()) == {1.0, 1.0 + 2**-7}
    frac_up = float((r > 1).double().mean())
    assert frac_up == pytest.approx(0.3, abs=0.005)  # 0.005 is ~5 sigma at n = 200k


def test_stochastic_rounding_keeps_exact_values_and_non_finite():
    x = torch.tensor([0.0, -2.5, 3.0, float("inf"), float("-inf"), 1e38]).bfloat16().float()
    y = torch.cat([x, torch.tensor([float("nan")])])
    r = stochastic_round_to_bf16(y).float()
    assert torch.equal(r[:-1], x) and r[-1].isnan()


def _params(dtype):
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(7, 5).to(dtype)), torch.nn.Parameter(torch.randn(5))]


def test_master_weights_equal_torch_adamw_on_fp32():
    ours = _params(torch.bfloat16)
    ref = [torch.nn.Parameter(p.detach().float()) for p in ours]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    opt = BF16AdamW(ours, master_weights=True, **kw)
    opt_ref = torch.optim.AdamW(ref, foreach=False, **kw)
    for i in range(5):
        g = torch.Generator().manual_seed(i)
        for p, q in zip(ours, ref):
            p.grad = torch.randn(q.shape, generator=g).to(p.dtype)  # bf16 grads: bf16 params
            q.grad = p.grad.float()
        opt.step()
        opt_ref.step()
    for p, q in zip(ours, ref):
        master = opt.state[p].get("master", p)
        assert torch.equal(master.float(), q.detach())  # the same fp32 arithmetic
        assert torch.equal(p.detach(), q.detach().to(p.dtype))  # rounded to nearest


def test_without_master_tiny_updates_still_move_the_weights():
    """An update of 1/10 of a bf16 ulp vanishes under round-to-nearest; stochastic rounding
    moves the mean by the right amount."""
    torch.manual_seed(1)
    p = torch.nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    opt = BF16AdamW([p], lr=2**-7 / 10, weight_decay=0.0, master_weights=False)
    p.grad = -torch.ones_like(p)  # Adam's first step moves every weight by lr
    opt.step()
    assert opt.state[p].get("master") is None
    assert float(p.detach().float().mean()) == pytest.approx(1 + 2**-7 / 10, rel=2e-4)
    q = torch.nn.Parameter(torch.ones(100_000, dtype=torch.bfloat16))
    nearest = BF16AdamW([q], lr=2**-7 / 10, weight_decay=0.0, master_weights=True)
    q.grad = -torch.ones_like(q)
    nearest.step()
    assert float(q.detach().float().mean()) == 1.0  # vanished in the bf16 copy (kept in the master)


def test_refuses_bad_betas():
    with pytest.raises(ValueError, match="betas"):
        BF16AdamW(_params(torch.bfloat16), betas=(0.9, 1.0))


def test_load_state_dict_keeps_fp32_states():
    """torch's Optimizer.load_state_dict casts floating states to the parameter dtype;
    the moments and master must come back in fp32, bit for bit."""
    ps = _params(torch.bfloat16)
    opt = BF16AdamW(ps, lr=1e-2)
    for p in ps:
        p.grad = torch.randn(p.shape).to(p.dtype)
    opt.step()
    sd = opt.state_dict()
    fresh = BF16AdamW(ps, lr=1e-2)
    fresh.load_state_dict(sd)
    for p in ps:
        for key in ("exp_avg", "exp_avg_sq", "master"):
            if key in opt.state[p]:
                got = fresh.state[p][key]
                assert got.dtype == torch.float32 and torch.equal(got, opt.state[p][key]), key
