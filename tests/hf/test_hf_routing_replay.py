"""Routing replay on patched Transformers models under gradient checkpointing.

Between the forward and the backward every layer's expert score bias is changed, so a
recompute that routes again sends tokens to other experts. With the replay hooks that
`patch_model` / `patch()` install, every gradient equals the unperturbed run without
checkpointing (fp64); with the hooks removed they differ.
"""

# B sequences, L tokens per sequence, V vocabulary

import pytest
import torch
from families import build

import dropless.hf as dh
from dropless.hf.replay import has_routing_replay, remove_routing_replay

B, L = 2, 6


def _grads(model, ids_BL, g_BLV, *, ckpt: bool, perturb: bool):
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids_BL).logits
    if perturb:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for layer in dh.moe_layers(model):
                bias = layer.expert_bias
                bias.add_(torch.randn(bias.shape, generator=g, dtype=bias.dtype) * 5.0)
    (logits * g_BLV).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _model(family):
    model = build(family)
    dh.patch_model(model, expert_bias=True)
    return model.double()


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_checkpointed_grads_equal_unperturbed(family):
    model = _model(family)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ids = torch.randint(
        0, model.config.vocab_size, (B, L), generator=torch.Generator().manual_seed(0)
    )
    g = torch.randn(B, L, model.config.vocab_size, dtype=torch.float64)
    want = _grads(model, ids, g, ckpt=False, perturb=False)
    assert has_routing_replay(model)
    for replay in (True, False):
        model.load_state_dict(state)
        if not replay:
            remove_routing_replay(model)
        got = _grads(model, ids, g, ckpt=True, perturb=True)
        assert got.keys() == want.keys()
        same = [torch.allclose(got[n], want[n], rtol=1e-10, atol=1e-12) for n in want]
        if replay:
            bad = [n for n, ok in zip(want, same) if not ok]
            assert not bad, bad
        else:  # the test can fail: without replay the recompute routes elsewhere
            assert not all(same)


def test_patch_installs_and_unpatch_removes_replay():
    dh.patch()
    model = build("qwen3_moe", implementation=None)
    assert has_routing_replay(model)
    dh.unpatch()
    assert not has_routing_replay(model)
