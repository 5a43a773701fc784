"""Host syncs of a MoE forward+backward, counted on CPU (see sync_counter.py).

The local dropless path that CUDA runs (grouped GEMMs with the counts on the device)
must make none; the CPU default (the per-expert loop) makes exactly one, the host copy
of the counts, which also shows the counter sees what it should.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k

import pytest
import torch
from sync_counter import count_syncs

import dropless


def _step(moe, x):
    out, aux = moe(x)
    (out.float().square().sum() + aux.lb_loss + aux.z_loss).backward()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(bias=True),
        dict(activation="gpt_oss", bias=True),
        dict(score_func="sigmoid", n_group=2, topk_group=1, expert_bias=True),
    ],
    ids=["swiglu", "bias", "gpt_oss", "grouped_sigmoid_routing"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_local_grouped_path_makes_no_host_sync(kw, dtype):
    moe = dropless.MoE(16, 8, 6, 2, backend="grouped_mm", dtype=dtype, **kw)
    x = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    _step(moe, x)  # first call: lazy registrations, caches
    with count_syncs() as found:
        _step(moe, x)
    assert found == []
    assert torch.isfinite(moe.experts.gate_up_proj.grad.float()).all()


def test_counter_sees_the_loop_paths_one_sync():
    moe = dropless.MoE(16, 8, 6, 2)  # CPU default: the per-expert loop, host counts
    x = torch.randn(7, 16, requires_grad=True)
    with count_syncs() as found:
        _step(moe, x)
    assert len(found) == 1 and "tolist" in found[0], found


@pytest.mark.parametrize("recipe_name", ["delayed", "current", "mxfp8"])
def test_local_fp8_path_makes_no_host_sync(recipe_name):
    from dropless.quant import recipe_from_name

    recipe = recipe_from_name(recipe_name, fp8_saved_activations=True)
    moe = dropless.MoE(32, 16, 6, 2, bias=True)
    x = torch.randn(2, 5, 32, requires_grad=True)
    with dropless.autocast(recipe=recipe):
        _step(moe, x)
        with count_syncs() as found:
            _step(moe, x)
    assert found == []
    assert torch.isfinite(moe.experts.gate_up_proj.grad).all()
