"""patch()/patch_model() options: fused linear cross-entropy, dropless's RMSNorm and the
expert engine's schedule (expert_path).

fused_cross_entropy: a patched causal LM given labels returns stock's loss (and
gradients) with logits=None; unpatch gives the logits back. fused_rmsnorm: a tensor of
the weight's dtype (CPU here; CUDA runs the Triton kernel) goes to dropless's RMSNorm
once the module passed its probe, with stock's logits and gradients and less kept for
backward; other dtypes keep the stock forward; a norm that computes something else
(Gemma-style `(1 + w)`) stays on its own forward.
"""

# B sequences, L tokens per sequence

import pytest
import torch
from families import build, clone_into
from torch import nn

import dropless.hf as dh
from dropless.bench.fp8 import saved_tensor_bytes
from dropless.hf.fusions import rmsnorm as hf_rmsnorm
from dropless.hf.fusions.fused_loss import is_fused_cross_entropy_enabled
from dropless.ops.reference import rms_norm_reference

B, L = 2, 7


def _ids(model):
    return torch.randint(
        2, model.config.vocab_size, (B, L), generator=torch.Generator().manual_seed(0)
    )


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_patch_fused_cross_entropy_matches_stock():
    dh.patch(fused_cross_entropy=True)
    model = build("qwen3_moe", implementation=None)
    assert is_fused_cross_entropy_enabled(model)
    stock = clone_into(model, "eager")  # an explicit implementation: not patched
    assert not is_fused_cross_entropy_enabled(stock)
    ids = _ids(model)
    out, grads = _loss_and_grads(model, ids)
    want, want_grads = _loss_and_grads(stock, ids)
    assert out.logits is None and want.logits is not None
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], want_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    torch.testing.assert_close(model(input_ids=ids).logits, stock(input_ids=ids).logits)
    dh.unpatch()
    assert not is_fused_cross_entropy_enabled(model)
    assert model(input_ids=ids, labels=ids).logits is not None


def test_fused_cross_entropy_is_off_by_default():
    dh.patch()
    model = build("qwen3_moe", implementation=None)
    assert not is_fused_cross_entropy_enabled(model)
    assert model(input_ids=_ids(model), labels=_ids(model)).logits is not None


def test_patch_model_fused_cross_entropy_and_bad_options():
    model = dh.patch_model(build("mixtral"), fused_cross_entropy=True)
    assert is_fused_cross_entropy_enabled(model)
    assert model(input_ids=_ids(model), labels=_ids(model)).logits is None
    with pytest.raises(TypeError, match="fused_rmsnorm='yes': expected True or False"):
        dh.patch(fused_rmsnorm="yes")
    with pytest.raises(TypeError, match="needs a causal LM"):
        dh.patch_model(model.model, fused_cross_entropy=True)


def test_expert_path_chooses_the_engine_schedule_and_unpatch_puts_auto_back():
    """patch(expert_path=) sets the schedule every expert call plans with (the same logits
    on the loop and the grouped path); a bad value is refused; unpatch() restores "auto"
    (on CPU: the per-expert loop)."""
    from dropless.ops.expert_mlp import plan

    seen = []
    real = plan._plan

    def spy(*args):
        schedule = real(*args)
        seen.append(schedule.path)
        return schedule

    logits = {}
    for path in ("grouped", "loop"):
        dh.patch(expert_path=path)
        plan._PLANS.clear()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(plan, "_plan", spy)
            model = build("qwen3_moe", implementation=None)
            ids = _ids(model)
            logits[path] = model(input_ids=ids).logits
        assert set(seen) == {path}
        seen.clear()
    torch.testing.assert_close(logits["grouped"], logits["loop"], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="expert_path='fast'; expected one of"):
        dh.patch(expert_path="fast")
    dh.unpatch()
    assert plan.expert_path() == "auto"


class GemmaLikeRMSNorm(nn.Module):
    """Normalises as Gemma does: (1 + w) * x_hat, which the kernel does not compute."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d) * 0.1)
        self.eps = 1e-6

    def forward(self, x):
        return (1 + self.weight) * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaLikeRMSNorm(nn.Module):
    """w * x_hat, what the kernel computes."""

    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = 1e-6

    def forward(self, x):
        return rms_norm_reference(x, self.weight, self.eps)


def _norms(model):
    return [m for m in model.modules() if hf_rmsnorm.is_rmsnorm_module(m)]


def _saved_bytes(model, ids) -> int:
    """Bytes autograd keeps for backward in one forward (parameters left out)."""
    return saved_tensor_bytes(lambda: model(input_ids=ids).logits, list(model.parameters()))[0]


def test_fused_rmsnorm_on_cpu_same_numbers_less_kept(monkeypatch):
    model = build("qwen3_moe")
    stock = clone_into(model, "eager")
    ids = _ids(model)
    dh.patch_model(model)
    plain = _saved_bytes(model, ids)
    dh.patch_model(model, fused_rmsnorm=True)
    norms = _norms(model)
    # probed when wired, for the weight's dtype and device: a forward reads the answer
    assert norms and all(hf_rmsnorm.fused_rmsnorm_state(m) == "kernel" for m in norms)
    report = dh.report(model)
    assert report.rmsnorm == {"kernel": len(norms)}
    calls = []
    real = hf_rmsnorm._kernel

    def counted(x, w, eps):
        calls.append(x.shape)
        return real(x, w, eps)

    monkeypatch.setattr(hf_rmsnorm, "_kernel", counted)
    got, want = model(input_ids=ids).logits, stock(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert calls and all(hf_rmsnorm.fused_rmsnorm_state(m) == "kernel" for m in norms)
    assert report.rmsnorm == {"kernel": len(norms)}
    assert f"RMSNorm: {len(norms)} module(s) on dropless's RMSNorm, 0 on" in str(report)
    got.sum().backward()
    want.sum().backward()
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-4, msg=name)
    # per norm call, the normalised tensor is no longer kept: x's size less each
    calls.clear()
    lean = _saved_bytes(model, ids)
    assert len(calls) == len(norms)
    assert plain - lean >= sum(shape.numel() * 4 for shape in calls)

    # another dtype than the weight's: the module's own forward, no call
    calls.clear()
    x = torch.randn(3, norms[0].weight.shape[0], dtype=torch.float64)
    assert torch.equal(norms[0](x), type(norms[0]).forward(norms[0], x))
    assert calls == []

    gemma = GemmaLikeRMSNorm(16)
    assert hf_rmsnorm.enable_fused_rmsnorm(gemma) == 1
    x = torch.randn(3, 16)
    assert torch.equal(gemma(x), GemmaLikeRMSNorm.forward(gemma, x))
    assert hf_rmsnorm.fused_rmsnorm_state(gemma) == "stock"  # the probe refused the kernel

    def failing(x, w, eps):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(hf_rmsnorm, "_kernel", failing)
    llama = LlamaLikeRMSNorm(16)
    with pytest.warns(UserWarning, match="failed its probe on torch.float32 cpu"):
        hf_rmsnorm.enable_fused_rmsnorm(llama)
    out = llama(x)
    assert torch.equal(out, rms_norm_reference(x, llama.weight, 1e-6))
    assert hf_rmsnorm.fused_rmsnorm_state(llama) == "stock"

    dh.unpatch()
    assert all(hf_rmsnorm.fused_rmsnorm_state(m) is None for m in norms)
    assert all("forward" not in vars(m) for m in norms)


def test_fused_rmsnorm_probe_inside_checkpointing_leaves_no_trace():
    """A model cast after wiring is probed again at its first eager call, here inside a
    checkpointed forward: the recompute must save as many tensors as the forward did, and
    the global RNG stream (dropout, checkpointing's replayed RNG) must not move."""
    model = build("qwen3_moe")
    stock = clone_into(model, "eager")
    ids = _ids(model)
    dh.patch_model(model.double(), fused_rmsnorm=True)  # probed for float64 (stock: fp32 math)
    model.float()
    assert all(hf_rmsnorm.fused_rmsnorm_state(m) == "unprobed" for m in _norms(model))
    for m in (model, stock):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    torch.manual_seed(5)
    got = model(input_ids=ids).logits
    after_probe = torch.randn(3)
    torch.manual_seed(5)
    want = stock(input_ids=ids).logits
    assert torch.equal(after_probe, torch.randn(3))
    assert all(hf_rmsnorm.fused_rmsnorm_state(m) == "kernel" for m in _norms(model))
    got.sum().backward()  # the recompute saves what the forward saved
    want.sum().backward()
    grads = dict(stock.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-4, msg=name)
