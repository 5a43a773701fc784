"""FSDP2 x EP under bf16 compute as `dropless train` sets it up (`parallelize_for_training`
with compute_dtype=bf16): every unit, experts included, all-gathers bf16 parameters for
forward and reduces fp32 gradients; the experts reshard after their forward."""

# B sequences per rank, L sequence length, V vocabulary

from __future__ import annotations

import copy

import torch
from _checks_hf import B, L, V, _model
from torch.distributed.tensor import DTensor

from dropless.hf.layers import moe_layers
from dropless.parallel import ParallelConfig
from dropless.train.model.parallelize import parallelize_for_training


def _seen_weight_dtypes(model) -> tuple[dict, list]:
    seen: dict[str, set] = {"experts": set(), "dense": set()}

    def record(kind, name):
        def hook(module, args):
            seen[kind].add(getattr(module, name).dtype)

        return hook

    handles = []
    for layer in moe_layers(model):
        handles.append(layer.experts.register_forward_pre_hook(record("experts", "gate_up_proj")))
    q = model.model.layers[0].self_attn.q_proj
    handles.append(q.register_forward_pre_hook(record("dense", "weight")))
    return seen, handles


def _policies(model) -> list:
    return [
        m._get_fsdp_state()._mp_policy
        for m in model.modules()
        if hasattr(m, "_get_fsdp_state") and m._get_fsdp_state()._fsdp_param_group is not None
    ]


def fsdp_bf16_policy(rank, world):
    model = _model()
    ref = copy.deepcopy(model)
    par = parallelize_for_training(model, ParallelConfig(ep=2), world, torch.bfloat16)
    policies = _policies(model)
    assert len(policies) == 2 * 2 + 1  # 2 decoder layers + their 2 experts units + the root
    for pol in policies:
        assert (pol.param_dtype, pol.reduce_dtype) == (torch.bfloat16, torch.float32), pol
    seen, handles = _seen_weight_dtypes(model)
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    loc = ids[rank * B : (rank + 1) * B]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=loc, labels=loc).loss
    assert seen == {"experts": {torch.bfloat16}, "dense": {torch.bfloat16}}, seen
    for layer in moe_layers(model):  # resharded: the registered parameter is the shard again
        assert isinstance(layer.experts.gate_up_proj, DTensor)
    loss.backward()
    for h in handles:
        h.remove()
    for name, p in model.named_parameters():  # sharded fp32 parameters, fp32 gradients
        assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, name
    want = ref(input_ids=loc, labels=loc).loss
    torch.testing.assert_close(loss.float(), want, rtol=2e-2, atol=2e-2)  # bf16 vs fp32
    assert par is not None


def fsdp_experts_reshard_w4(rank, world):
    """world 4, ep 2: each experts unit is also FSDP-sharded over 2 ranks; after the
    forward only the shard (E/ep/2 experts) is left on a rank."""
    model = _model()
    parallelize_for_training(model, ParallelConfig(ep=2), world, torch.bfloat16)
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(rank))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    for layer in moe_layers(model):
        w = layer.experts.gate_up_proj
        num_experts = layer.num_experts
        assert isinstance(w, DTensor) and w.to_local().shape[0] == num_experts // 4, w.shape
    loss.backward()
