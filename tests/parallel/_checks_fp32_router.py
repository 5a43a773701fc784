"""Checks in spawned processes: FSDP2 with a router Transformers keeps in fp32 in a bf16
model (`_keep_in_fp32_modules`: DeepSeek-V3's `mlp.gate.weight`), as `dropless train
--set model.dtype=bf16` builds it under torchrun. The router becomes its own FSDP unit and
stays fp32 (stored, in compute, its gradient and after the optimizer step); the loss equals
one bf16 process. And the two refusals of `apply_fsdp` that no split can fix."""

# B sequences per rank, L sequence length, V vocabulary, E experts

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

B, L, V, E = 2, 8, 264, 4


def _shared_dir() -> str:
    box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one directory on this machine for every rank
    return box[0]


def _save_deepseek_v3(path: Path) -> None:
    import transformers

    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=E, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # routing spread wide: bf16 noise flips no top-k choice
            if p.dim() == 2 and p.shape[0] == E:
                p.copy_(torch.randn(p.shape) * 2.0)
    model.save_pretrained(path)


def fsdp_bf16_fp32_router(rank, world):
    import transformers

    from dropless.hf import patch_model
    from dropless.train.config.schema import ModelConfig, OptimConfig
    from dropless.train.model.build import build_training_model, hf_config
    from dropless.train.state import build_optimizer

    path = Path(_shared_dir()) / "dsv3"
    if rank == 0:
        _save_deepseek_v3(path)
    dist.barrier()
    mcfg = ModelConfig(path=str(path), dtype="bf16")
    from dropless.parallel import ParallelConfig

    model, par = build_training_model(
        mcfg, hf_config(mcfg, V), ParallelConfig(ep=world), world, expert_bias=False,
        seed=0, device="cpu", compute_dtype=torch.bfloat16,  # every other unit: bf16 policy
    )  # fmt: skip
    assert par is not None
    gates = [model.model.layers[i].mlp.gate for i in range(2)]
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.bfloat16
    seen = []
    hooks = [g.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype)) for g in gates]
    ids = torch.randint(0, V, (world * B, L), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * B : (rank + 1) * B]
    loss = model(input_ids=mine, labels=mine).loss
    loss.backward()
    for h in hooks:
        h.remove()
    assert seen == [torch.float32] * 2, seen  # computed in fp32 too (no param_dtype cast)
    for g in gates:  # its own FSDP unit, stored in fp32 (a DTensor shard)
        assert g.weight.dtype == torch.float32 and hasattr(g.weight, "to_local"), g.weight
        assert hasattr(g, "_get_fsdp_state"), "the fp32 router is not an FSDP unit of its own"
        assert g._get_fsdp_state()._mp_policy.param_dtype is None  # no cast to bf16
        assert g.weight.grad is not None and g.weight.grad.dtype == torch.float32
    layer = model.model.layers[0]
    assert layer._get_fsdp_state()._mp_policy.param_dtype == torch.bfloat16
    # one process, the same bf16 model (Transformers' own fp32 routers), the whole batch
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    patch_model(ref)
    with torch.no_grad():
        want = float(ref(input_ids=ids, labels=ids).loss)
    got = loss.detach().float().clone()
    dist.all_reduce(got)
    # bf16 activations: the two runs round at different places (per-rank batches, the
    # all-to-all's row order); 1e-2 relative is ~4 bf16 ulps, a wrong model is off by O(1)
    torch.testing.assert_close(float(got) / world, want, rtol=1e-2, atol=0.0)
    before = [g.weight.detach().full_tensor().clone() for g in gates]
    opt = build_optimizer(list(model.parameters()), OptimConfig(lr=1e-2))
    opt.step()
    for g, b in zip(gates, before):
        after = g.weight.detach().full_tensor()
        assert after.dtype == torch.float32 and not torch.equal(after, b)


class _MixedLeaf(nn.Module):
    """A module holding parameters in two dtypes itself: no submodule to split off."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.ones(4, 4))
        self.b = nn.Parameter(torch.ones(4, 4, dtype=torch.bfloat16))


def _raises(fn, *words) -> None:
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError(f"no ValueError ({words})")


def fsdp_refuses_unsplittable_dtypes(rank, world):
    """apply_fsdp's two refusals: parameters of two dtypes in one module (no unit can
    take them), and a replicated parameter held by an expert module itself."""
    from torch.distributed.tensor import DTensor, Shard

    from dropless.parallel import ParallelConfig, apply_fsdp, build_mesh
    from dropless.parallel.fsdp import _replicated_children

    pm = build_mesh(ParallelConfig(), num_experts=None)
    block = nn.Sequential(nn.Linear(4, 64, dtype=torch.bfloat16), _MixedLeaf())
    _raises(lambda: apply_fsdp(nn.Sequential(block), pm, blocks=[block]), "one parameter dtype")
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    experts = nn.Module()
    w = torch.ones(1, 4, 4)
    experts.w = nn.Parameter(DTensor.from_local(w, pm.ep_mesh, [Shard(0)], run_check=False))
    experts.scale = nn.Parameter(torch.ones(4))
    _raises(lambda: _replicated_children(experts), "['scale']", "parallel.ep=1")


def fsdp_frozen_dtypes_stay_one_unit(rank, world):
    """Frozen parameters may differ in dtype from the trainable ones (a bf16 base under
    fp32 adapters): FSDP2 checks the trainable ones only, so no extra unit is made."""
    from torch.distributed.fsdp import FSDPModule

    from dropless.parallel import ParallelConfig, apply_fsdp, build_mesh

    pm = build_mesh(ParallelConfig(), num_experts=None)
    base, adapter = nn.Linear(4, 64, dtype=torch.bfloat16), nn.Linear(4, 4)
    base.requires_grad_(False)
    block = nn.Sequential(base, adapter)
    apply_fsdp(nn.Sequential(block), pm, blocks=[block])
    assert isinstance(block, FSDPModule) and not isinstance(adapter, FSDPModule)
    trainable = nn.Linear(4, 64, dtype=torch.bfloat16)
    block = nn.Sequential(trainable, nn.Linear(4, 4))  # both trainable: the fp32 one split off
    apply_fsdp(nn.Sequential(block), pm, blocks=[block])
    assert isinstance(block[1], FSDPModule) and not isinstance(trainable, FSDPModule)
