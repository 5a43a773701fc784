"""Checks in spawned processes: expert parallelism for every form of experts the dropless
path runs, not only the fused gated MLP. Every family of tests/hf/families.py at EP=2
equals one process; Nemotron-H (non-gated relu^2 experts, `up_proj`)
at EP=2 equals one process (logits, every gradient) and trains under FSDP2 x EP equal to
one process; BEAM's own gate (generic path) and MuSE-Spark's post-expert norm at EP=2
equal their single-process dropless forward (BEAM with LoRA factors too); and the refusal
of a module on its stock forward names the family."""

# B sequences per rank, L sequence length, T tokens per rank, D model dim, E experts

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from dropless.hf.distributed.expert_parallel import hf_dispatchers, shard_hf_experts
from dropless.parallel import ParallelConfig, build_mesh, clip_grad_norm_
from harness import hf_families as _families

B, L, T, HIDDEN = 2, 6, 7, 12
# fp32, the same GEMMs on the same rows as one process: only the order of the gradient
# sums over ranks (and over tokens in a different row order) differs
RTOL, ATOL, GRAD_ATOL = 1e-5, 1e-6, 2e-6


def _nemotron_h():
    import dropless

    model = _families().build("nemotron_h")
    model.config.use_cache = False
    dropless.patch_model(model)
    return model


def _assert_grads(ep, ref, rank, num_experts, world):
    """Every gradient of `ep` equals `ref`'s: this rank's experts' rows for the sharded
    expert tensors, the sum over ranks for the replicated ones."""
    rp = dict(ref.named_parameters())
    Le, n = num_experts // world, 0
    for name, p in ep.named_parameters():
        if p.grad is None:
            assert rp[name].grad is None, name
            continue
        if hasattr(p, "to_local"):
            got, want = p.grad.to_local(), rp[name].grad[rank * Le : (rank + 1) * Le]
            n += 1
        else:
            got, want = p.grad.clone(), rp[name].grad
            dist.all_reduce(got)
        # relative to the tensor's scale: Nemotron-H's gradients reach 400 (conv1d.bias),
        # and fp32 reduction-order noise through the Mamba-2 backward is ~1e-6 of that
        # (9e-7 measured); a wrong row or a missing sum over ranks is off by O(1)
        atol = GRAD_ATOL * max(1.0, float(want.abs().max()))
        torch.testing.assert_close(
            got, want, rtol=RTOL, atol=atol, msg=lambda m, k=name: f"{k}: {m}"
        )
    return n


def hf_ep_nemotron_h(rank, world):
    """Non-gated relu^2 experts (`up_proj`, `down_proj`) sharded over ep and run through
    the same all-to-all forward: logits and every gradient equal one process."""
    from dropless.hf.layers import moe_layers

    model = _nemotron_h()
    E = moe_layers(model)[0].num_experts
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    w = torch.randn(world * B, L, V, generator=g)
    ref = copy.deepcopy(model)
    for r in range(world):  # one process, each rank's sequences in turn: the Mamba-2 scan
        part = slice(r * B, (r + 1) * B)  # sums a batch of 4 in another order than of 2
        (ref(input_ids=ids[part]).logits * w[part]).sum().backward()
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    ep = copy.deepcopy(model)
    assert len(shard_hf_experts(ep, pm)) == 2  # both MoE layers of the hybrid stack
    for layer in moe_layers(ep):
        up = layer.experts.up_proj
        assert up.to_local().shape[0] == E // world, up.to_local().shape
    sl = slice(rank * B, (rank + 1) * B)
    logits = ep(input_ids=ids[sl]).logits
    (logits * w[sl]).sum().backward()
    torch.testing.assert_close(logits, ref(input_ids=ids[sl]).logits, rtol=RTOL, atol=ATOL)
    assert _assert_grads(ep, ref, rank, E, world) == 4  # 2 layers x (up_proj, down_proj)
    assert hf_dispatchers(ep)[0].pop_stats()["calls"] == 1


def _ep_equals_one_process(family: str, rank: int, world: int) -> None:
    import dropless
    from dropless.hf.layers import moe_layers

    F = _families()
    model = F.build(family).eval()  # no dropout, no sampled routing (PhiMoE's sparsemixer)
    model.config.get_text_config().use_cache = False
    dropless.patch_model(model)
    E = moe_layers(model)[0].num_experts
    V = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (world * B, L), generator=g)
    w = torch.randn(world * B, L, V, generator=g)
    ref = copy.deepcopy(model)
    for r in range(world):
        part = slice(r * B, (r + 1) * B)
        (ref(input_ids=ids[part]).logits * w[part]).sum().backward()
    ep = copy.deepcopy(model)
    layers = shard_hf_experts(ep, build_mesh(ParallelConfig(ep=world), num_experts=E))
    assert len(layers) == len(moe_layers(model)) > 0
    sl = slice(rank * B, (rank + 1) * B)
    logits = ep(input_ids=ids[sl]).logits
    (logits * w[sl]).sum().backward()
    with torch.no_grad():
        want = ref(input_ids=ids[sl]).logits
    torch.testing.assert_close(logits, want, rtol=RTOL, atol=ATOL)
    try:
        assert _assert_grads(ep, ref, rank, E, world) >= 2 * len(layers)
    except AssertionError as e:
        raise AssertionError(f"{family}: {e}") from None


def hf_ep_every_family(rank, world):
    """Every family of tests/hf/families.py (Nemotron-H has its own check) at EP=2: logits
    and every gradient equal one process (docs/parallel.md lists them)."""
    F = _families()
    for family in F.FAMILIES + F.MORE_FAMILIES + list(F.BLOCK_BIAS):
        if family != "nemotron_h":  # a failure stops both ranks here (collectives pair up)
            _ep_equals_one_process(family, rank, world)


def hf_fsdp_x_ep_nemotron_h(rank, world):
    """Nemotron-H as `dropless train` shards it (EP x FSDP2 over decoder layers): two AdamW
    steps give the losses and weights of one process."""
    from dropless.train.model.parallelize import parallelize_for_training

    model = _nemotron_h()
    V = model.config.vocab_size
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
    par = copy.deepcopy(model)
    assert parallelize_for_training(par, ParallelConfig(ep=world), world) is not None
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
    # atol 1e-5: AdamW's 1/sqrt(v) turns reduction-order noise on ~0 gradients into a step
    # difference (see _checks_hf.hf_fsdp_x_ep_train); 1/1000 of one step at lr 1e-2
    rp = dict(ref.named_parameters())
    for name, p in par.named_parameters():
        full = p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach()
        torch.testing.assert_close(
            full, rp[name].detach(), rtol=RTOL, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}"
        )


class _Holder(nn.Module):
    """A block holding one experts module (what `moe_layers` finds), without a router."""

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.experts = experts


def _tiny_experts(family: str, E: int = 4) -> nn.Module:
    import dropless
    from dropless.hf.patching.discovery import experts_classes, tiny_experts

    dropless.patch()  # registers the "dropless" implementation
    (cls,) = [c.cls for c in experts_classes() if c.family == family]
    module = tiny_experts(cls, hidden=HIDDEN, experts=E, dtype=torch.float32)
    module.config._experts_implementation = "dropless"
    return module


def _ep_module_equals_single(
    family: str, rank: int, world: int, path: str, lora: bool = False
) -> None:
    from dropless.hf.experts import PATH_CALLS, dropless_experts_forward, experts_spec
    from dropless.hf.lora.expert_lora import attach_expert_lora

    module = _tiny_experts(family)
    if lora:  # factors owned by the module: folded into the weights off the fused path
        attach_expert_lora(module, 2, 4, generator=torch.Generator().manual_seed(0))
    spec = experts_spec(module)
    assert spec.path == path, spec
    E, D, K = module.num_experts, HIDDEN, 2
    g = torch.Generator().manual_seed(5)
    x = torch.randn(world * T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(world * T)])
    w_TK = torch.rand(world * T, K, generator=g)
    gy = torch.randn(world * T, D, generator=g)
    ref = copy.deepcopy(module)
    x_ref = x.clone().requires_grad_(True)
    w_ref = w_TK.clone().requires_grad_(True)
    y_ref = dropless_experts_forward(ref, x_ref, ids, w_ref)
    (y_ref * gy).sum().backward()
    assert PATH_CALLS[(spec.family, path)] >= 1
    holder = _Holder(copy.deepcopy(module))
    pm = build_mesh(ParallelConfig(ep=world), num_experts=E)
    assert shard_hf_experts(holder, pm) == [""]
    sl = slice(rank * T, (rank + 1) * T)
    x_ep = x[sl].clone().requires_grad_(True)
    w_ep = w_TK[sl].clone().requires_grad_(True)
    y = holder.experts(x_ep, ids[sl], w_ep)
    (y * gy[sl]).sum().backward()
    torch.testing.assert_close(y, y_ref[sl], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(x_ep.grad, x_ref.grad[sl], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(w_ep.grad, w_ref.grad[sl], rtol=RTOL, atol=ATOL)
    holder_ref = _Holder(ref)
    assert _assert_grads(holder, holder_ref, rank, E, world) == (4 if lora else 2)
    if spec.post_norm:
        _fsdp_post_norm(module, ref, pm, (x[sl], ids[sl], w_TK[sl], gy[sl]), y_ref[sl], world)


def _fsdp_post_norm(module, ref, pm, batch, y_want, world) -> None:
    """Under FSDP2 x EP the replicated norm inside the experts module is a unit on the
    dense mesh: its gradient is averaged over every rank (as the experts' are), not only
    over the expert mesh."""
    from dropless.parallel import apply_fsdp

    holder = _Holder(copy.deepcopy(module))
    shard_hf_experts(holder, pm)
    apply_fsdp(holder, pm, blocks=[])
    x_TD, ids_TK, w_TK, gy = batch
    y = holder.experts(x_TD, ids_TK, w_TK)
    (y * gy).sum().backward()
    torch.testing.assert_close(y, y_want, rtol=RTOL, atol=ATOL)
    rp = dict(ref.named_parameters())
    for name, p in holder.experts.named_parameters():
        got = p.grad.full_tensor()  # FSDP divides the summed gradients by the world size
        torch.testing.assert_close(got, rp[name].grad / world, rtol=RTOL, atol=ATOL)


def hf_ep_generic_gate(rank, world):
    """BEAM's experts: the module's own gate between our grouped GEMMs, at EP=2; with the
    module's own LoRA factors too (sharded with the experts, folded on this path)."""
    _ep_module_equals_single("beam", rank, world, "generic")
    _ep_module_equals_single("beam", rank, world, "generic", lora=True)


def hf_ep_post_norm(rank, world):
    """MuSE-Spark's experts: the fused MLP, then the post-expert norm, then the weight
    applied at home, at EP=2; the norm's weight (replicated) gets the summed gradient."""
    _ep_module_equals_single("muse_spark", rank, world, "fused")


def _refused(holder, pm, *words) -> None:
    try:
        shard_hf_experts(holder, pm)
    except ValueError as e:
        assert all(w in str(e) for w in words), str(e)
    else:
        raise AssertionError(f"shard_hf_experts did not refuse ({words})")


def hf_ep_refusals(rank, world):
    """The experts EP cannot run are refused with the family named and why: a module on
    its stock forward (weights not in the v5 layout), which needs every expert, and an
    expert count the EP size does not divide."""
    pm = build_mesh(ParallelConfig(ep=world), num_experts=4)
    stock = _tiny_experts("qwen3_moe")
    del stock.gate_up_proj  # the v5 layout's weight gone: dropless runs the class's forward
    _refused(_Holder(stock), pm, "(qwen3_moe)", "runs its own forward", "gate_up_proj")
    odd = _tiny_experts("qwen3_moe", E=3)  # a mesh built for another expert count
    _refused(_Holder(odd), pm, "(qwen3_moe)", "num_experts=3 is not divisible by parallel.ep=2")
