"""Checks in spawned processes: a tiny Transformers Qwen3-MoE, expert-parallel ==
one process (logits and every gradient), and FSDP2 x EP training steps."""

# B sequences per rank, L sequence length, V vocabulary

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from dropless.hf.distributed.expert_parallel import hf_dispatchers, shard_hf_experts
from dropless.parallel import ParallelConfig, apply_fsdp, build_mesh, clip_grad_norm_
from harness import tiny_moe_config

B, L, V, E = 2, 5, 64, 8
RTOL, ATOL = 1e-5, 1e-6


def _model():
    import transformers

    import dropless

    cfg = tiny_moe_config(
        vocab_size=V, hidden_size=16, intermediate_size=32, moe_intermediate_size=12,
        num_attention_heads=2, num_key_value_heads=1, num_experts=E, max_position_embeddings=32,
        pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).float()
    dropless.patch_model(model)
    return model


def hf_ep_equals_single(rank, world):
    model = _model()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    w = torch.randn(world * B, L, V, generator=g)
    ref = copy.deepcopy(model)
    (ref(input_ids=ids).logits * w).sum().backward()
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    ep = copy.deepcopy(model)
    assert len(shard_hf_experts(ep, pm)) == 2
    sl = slice(rank * B, (rank + 1) * B)
    logits = ep(input_ids=ids[sl]).logits
    (logits * w[sl]).sum().backward()
    torch.testing.assert_close(logits, ref(input_ids=ids[sl]).logits, rtol=RTOL, atol=ATOL)
    rp = dict(ref.named_parameters())
    Le = E // world
    for name, p in ep.named_parameters():
        if hasattr(p, "to_local"):
            got, want = p.grad.to_local(), rp[name].grad[rank * Le : (rank + 1) * Le]
        else:
            got, want = p.grad.clone(), rp[name].grad
            dist.all_reduce(got)
        torch.testing.assert_close(
            got, want, rtol=RTOL, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )
    assert hf_dispatchers(ep)[0].pop_stats()["calls"] == 1


def hf_fsdp_x_ep_train(rank, world):
    model = _model()
    g = torch.Generator().manual_seed(4)
    data = [torch.randint(0, V, (world * B, L), generator=g) for _ in range(2)]
    ref = copy.deepcopy(model)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for ids in data:
        loss = ref(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt_r.step()
        opt_r.zero_grad()
        ref_losses.append(float(loss.detach()))
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    par = copy.deepcopy(model)
    shard_hf_experts(par, pm)
    apply_fsdp(par, pm, blocks=list(par.model.layers))
    opt = torch.optim.AdamW(par.parameters(), lr=1e-2)
    for step, ids in enumerate(data):
        loc = ids[rank * B : (rank + 1) * B]
        loss = par(input_ids=loc, labels=loc).loss  # equal token counts per rank
        loss.backward()
        clip_grad_norm_(list(par.parameters()), 1.0)
        opt.step()
        opt.zero_grad()
        lsum = loss.detach().clone()
        dist.all_reduce(lsum)
        torch.testing.assert_close(float(lsum) / world, ref_losses[step], rtol=RTOL, atol=ATOL)
    # AdamW divides by sqrt(v): where a gradient is ~0, reduction-order noise (1e-7
    # relative) becomes a visible step difference on a few elements; 1e-5 absolute is
    # 1/1000 of one step's size (lr 1e-2) and still catches any real mismatch.
    rp = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        torch.testing.assert_close(
            full, rp[name].detach(), rtol=RTOL, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


def hf_ep_lora_equals_single(rank, world):
    """LoRA factors owned by the experts modules, sharded with the experts over ep: logits
    and every adapter gradient equal one process; the base gets no gradient."""
    from dropless.hf.layers import moe_layers
    from dropless.hf.lora.expert_lora import attach_expert_lora

    model = _model()
    for p in model.parameters():
        p.requires_grad_(False)
    g = torch.Generator().manual_seed(7)
    for layer in moe_layers(model):
        attach_expert_lora(layer.experts, 4, 8, generator=g)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    w = torch.randn(world * B, L, V, generator=g)
    ref = copy.deepcopy(model)
    (ref(input_ids=ids).logits * w).sum().backward()
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    ep = copy.deepcopy(model)
    assert len(shard_hf_experts(ep, pm)) == 2
    sl = slice(rank * B, (rank + 1) * B)
    logits = ep(input_ids=ids[sl]).logits
    (logits * w[sl]).sum().backward()
    torch.testing.assert_close(logits, ref(input_ids=ids[sl]).logits, rtol=RTOL, atol=ATOL)
    rp = dict(ref.named_parameters())
    Le, n = E // world, 0
    for name, p in ep.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, name
            continue
        assert "lora_" in name and hasattr(p, "to_local"), name  # sharded with the experts
        got, want = p.grad.to_local(), rp[name].grad[rank * Le : (rank + 1) * Le]
        torch.testing.assert_close(
            got, want, rtol=RTOL, atol=ATOL, msg=lambda m, k=name: f"{k}: {m}"
        )
        n += 1
    assert n == 8  # 2 layers x (A, B) x (gate_up, down)
    # saved as a PEFT adapter: gathered from the shards, the same file as one process
    import tempfile

    from safetensors.torch import load_file

    from dropless.hf import save_expert_lora_as_peft

    box = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)  # one directory on this machine for every rank
    d = box[0]
    save_expert_lora_as_peft(ep, f"{d}/ep")  # collective: every rank gathers
    save_expert_lora_as_peft(ref, f"{d}/one")
    if rank == 0:
        got, want = (
            load_file(f"{d}/ep/adapter_model.safetensors"),
            load_file(f"{d}/one/adapter_model.safetensors"),
        )
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    dist.barrier()
    # loaded back into a sharded model's own factors: each rank takes its experts' slice
    from dropless.hf.lora.expert_lora import load_peft_into_experts

    fresh = copy.deepcopy(model)
    shard_hf_experts(fresh, pm)
    with torch.no_grad():
        for layer in moe_layers(fresh):
            for name in ("lora_A_first", "lora_B_first", "lora_A_down", "lora_B_down"):
                getattr(layer.experts, name).to_local().zero_()
    assert load_peft_into_experts(fresh, f"{d}/one") == 4
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids[sl]).logits, logits, rtol=RTOL, atol=ATOL)
