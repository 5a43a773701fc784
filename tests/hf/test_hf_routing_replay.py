"""Routing replay on patched Transformers models under gradient checkpointing.

Between the forward and the backward every layer's expert score bias is changed, so a
recompute that routes again sends tokens to other experts. With the replay hooks that
`patch_model` / `patch()` install, every gradient equals the unperturbed run without
checkpointing (fp64); with the hooks removed they differ, or torch's checkpoint refuses
the recompute's tensors of other shapes.
"""

# B sequences, L tokens per sequence, V vocabulary

import pytest
import torch
from families import FAMILIES, MORE_FAMILIES, build
from torch.utils.checkpoint import CheckpointError

import dropless.hf as dh
from dropless.hf.experts.forward import in_backward
from dropless.hf.experts.replay import has_routing_replay, remove_routing_replay

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
        try:
            got = _grads(model, ids, g, ckpt=True, perturb=True)
        except CheckpointError as e:
            # without replay the recompute routes elsewhere, and each expert's kept h
            # (its token count as rows) has another shape: torch's checkpoint refuses
            assert not replay and "different metadata" in str(e)
            continue
        assert got.keys() == want.keys()
        same = [torch.allclose(got[n], want[n], rtol=1e-10, atol=1e-12) for n in want]
        if replay:
            bad = [n for n, ok in zip(want, same) if not ok]
            assert not bad, bad
        else:  # the test can fail: without replay the recompute routes elsewhere
            # (here with the same counts per expert, so only the numbers tell)
            assert not all(same)


def test_patch_installs_and_unpatch_removes_replay():
    dh.patch()
    model = build("qwen3_moe", implementation=None)
    assert has_routing_replay(model)
    dh.unpatch()
    assert not has_routing_replay(model)


# phimoe selects with max and masks (no top-k to replay); hunyuan_v1_moe's gate has no
# top_k attribute, so no router is found for it: both route again in the recompute
NOT_REPLAYED = {"phimoe", "hunyuan_v1_moe"}


def _experts_ids(model, perturb: bool, refused_ok: bool = False):
    """Expert ids each experts call received in the forward and in the recompute.
    refused_ok: a backward that torch's checkpoint stops (the recompute saved tensors of
    other shapes, as a recompute that routes elsewhere does) still returns the ids seen."""
    seen = {"forward": [], "recompute": []}
    hook = dh.register_experts_hook(
        lambda mod, idx, w: seen["recompute" if in_backward() else "forward"].append(idx.clone())
    )
    try:
        ids = torch.randint(2, 90, (B, L), generator=torch.Generator().manual_seed(0))
        out = model(input_ids=ids).logits
        if perturb:
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for layer in dh.moe_layers(model):
                    w = layer.router.weight
                    w.copy_(torch.randn(w.shape, generator=g, dtype=w.dtype) * 2.0)
        try:
            out.sum().backward()
        except CheckpointError as e:
            if not (refused_ok and "different metadata" in str(e)):
                raise
    finally:
        hook.remove()
    return seen["forward"], seen["recompute"][::-1]  # backward visits layers last-first


@pytest.mark.parametrize("family", sorted(set(FAMILIES + MORE_FAMILIES) - NOT_REPLAYED))
def test_recompute_sees_the_forward_choice(family):
    model = build(family)
    if any(layer.router is None for layer in dh.moe_layers(model)):
        # e.g. jamba on transformers 5.17: a plain nn.Linear router, top-k in the block
        pytest.skip(f"{family}: no router module with top_k on this transformers release")
    dh.patch_model(model).train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    state = {k: v.clone() for k, v in model.state_dict().items()}
    fwd, rec = _experts_ids(model, perturb=True)
    assert fwd and len(fwd) == len(rec)
    assert all(torch.equal(a, b) for a, b in zip(fwd, rec))
    remove_routing_replay(model)  # the check bites: without replay the recompute moves
    model.load_state_dict(state)
    model.zero_grad()
    fwd, rec = _experts_ids(model, perturb=True, refused_ok=True)
    # refused part-way (fewer recomputes seen), or the ids differ
    assert len(rec) < len(fwd) or not all(torch.equal(a, b) for a, b in zip(fwd, rec))
