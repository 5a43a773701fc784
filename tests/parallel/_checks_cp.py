"""Context parallelism checks, run by one spawned gloo group of 4 (test_context_parallel.py).

The group hosts cp=4 (all ranks) and two cp=2 groups ({0, 1} and {2, 3}). Each check
compares against one process computing the whole sequence: the reference model or
`reference_attention`, run by every rank on the same data.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dropless.parallel import context as cpx
from harness import hf_families as _families

# fp32: the same math as one process, only the order of the sums differs (the attention
# of a chunk against a prefix, the gradients summed over ranks)
RTOL, ATOL = 1e-4, 1e-5
SEQ = 2048
IGNORE = -100


_GROUPS: dict = {}


def _groups(rank: int, world: int):
    """(cp=4 group, this rank's cp=2 group, rank in it); every rank creates every group."""
    if not _GROUPS:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        _GROUPS["all"] = dist.group.WORLD
        _GROUPS["pairs"] = pairs
    return _GROUPS["all"], _GROUPS["pairs"][rank // 2]


def _close(got, want, what):
    if not torch.allclose(got, want, rtol=RTOL, atol=ATOL):
        err = (got - want).abs().max().item()
        raise AssertionError(f"{what}: max abs error {err:.3g} (shape {tuple(got.shape)})")


def _attention_case(group, seed: int, padded: bool) -> None:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    g = torch.Generator().manual_seed(seed)
    B, H, G, L, D = 2, 6, 2, 16 * cp, 8  # GQA: 3 query heads per key/value head
    q, k, v = (torch.randn(B, n, L, D, generator=g) for n in (H, G, G))
    dout = torch.randn(B, H, L, D, generator=g)
    pad = None
    if padded:  # left padding in row 1: its first 5 keys are never attended
        pad = torch.ones(B, L, dtype=torch.bool)
        pad[1, :5] = False
    scale = 0.37  # not 1/sqrt(D): the scaling the caller passes is the one used
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out_ref = cpx.reference_attention(*ref, scale=scale, key_padding_BL=pad)
    (out_ref * dout).nan_to_num().sum().backward()
    loc = [cpx.shard_sequence(t, cp, r, dim=2).requires_grad_() for t in (q, k, v)]
    pad_loc = None if pad is None else cpx.shard_sequence(pad, cp, r, dim=1)
    out = cpx.context_parallel_attention(*loc, group, scale=scale, key_padding_BS=pad_loc)
    (out * cpx.shard_sequence(dout, cp, r, dim=2)).nan_to_num().sum().backward()
    want = cpx.shard_sequence(out_ref.detach(), cp, r, dim=2)
    rows = slice(None) if pad is None else slice(0, 1)  # fully masked rows are NaN in both
    _close(out[rows].detach(), want[rows], f"cp={cp} output")
    for name, t, t_ref in zip("qkv", loc, ref, strict=True):
        _close(t.grad, cpx.shard_sequence(t_ref.grad, cp, r, dim=2), f"cp={cp} d{name}")


def cp_attention_equals_reference(rank, world):
    """All-gather-KV attention (GQA, a custom scale, with and without a padding mask)
    equals whole-sequence SDPA, output and dQ/dK/dV, at cp=4 and cp=2."""
    everyone, pair = _groups(rank, world)
    for group in (everyone, pair):
        for padded in (False, True):
            _attention_case(group, seed=3, padded=padded)


def _batch(vocab: int, seed: int):
    """One row of SEQ+1 tokens, padded at its end and with a masked prompt at its start
    (targets IGNORE): the cp ranks hold different numbers of targets."""
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(2, vocab, (1, SEQ + 1), generator=g)
    x, y = xy[:, :-1], xy[:, 1:].clone()
    y[0, SEQ - 300 :] = IGNORE
    y[0, :7] = IGNORE
    return x, y


_REFERENCE: dict = {}


def _reference(family: str, seed: int):
    """(the model before any step, the batch, one process's loss and its gradients), once
    per process and family: the cp=4 and cp=2 checks compare with the same run."""
    if family not in _REFERENCE:
        fam = _families()
        ref = fam.build(family, implementation=None, seed=seed, max_position_embeddings=SEQ)
        with torch.no_grad():  # wide logits: tokens' losses differ, so a local mean would show
            ref.get_output_embeddings().weight.mul_(20)
        model = copy.deepcopy(ref)
        for m in ref.modules():  # whole-sequence SDPA: the specification, and fast
            cfg = getattr(m, "config", None)
            if cfg is not None and hasattr(cfg, "_attn_implementation"):
                cfg._attn_implementation = "sdpa"
        x, y = _batch(ref.config.vocab_size, seed)
        logits = ref(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
        loss.backward()
        grads = [p.grad for p in ref.parameters()]
        _REFERENCE[family] = (model, x, y, loss.detach(), grads)
    return _REFERENCE[family]


def _model_equals_one_process(family: str, group, seed: int) -> None:
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    model0, x, y, loss_ref, grads_ref = _reference(family, seed)
    model = copy.deepcopy(model0)

    cpx.enable(model, group)
    local = cpx.shard_batch({"input_ids": x, "labels": y}, cp, r)
    logits = model(
        input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
    ).logits
    y_loc = local["labels"]
    # the global count of targets: the ranks hold different numbers of them
    n = (y_loc != IGNORE).sum().float()
    dist.all_reduce(n, group=group)
    loss = (
        F.cross_entropy(logits.flatten(0, 1), y_loc.flatten(), ignore_index=IGNORE, reduction="sum")
        / n
    )
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    _close(total, loss_ref, f"{family} cp={cp} loss")
    checked = 0
    for (name, p), g_ref in zip(model.named_parameters(), grads_ref, strict=True):
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)  # each rank holds its tokens' share
        if g_ref is None:
            continue
        _close(grad, g_ref, f"{family} cp={cp} grad of {name}")
        checked += 1
    assert checked > 10, f"only {checked} gradients compared"


def _router_aux_equals_one_process(family: str, group, seed: int) -> None:
    """The balancing loss of `dropless.hf.experts.router_losses` under cp (each rank's term
    of the whole sequence's: f counted over the group) summed over the ranks, and its
    gradients, equal one process's on the whole sequence."""
    from dropless.hf.experts.router_losses import RouterLosses

    cp, r = dist.get_world_size(group), dist.get_rank(group)
    model0, x, _, _, _ = _reference(family, seed)
    ref = copy.deepcopy(model0)
    for m in ref.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "sdpa"
    rl = RouterLosses(ref)
    with rl.capture():
        out = ref(input_ids=x, output_router_logits=True, use_cache=False)
    want = rl.stats(out, x.shape)
    want.aux.backward()
    model = copy.deepcopy(model0)
    cpx.enable(model, group)
    local = cpx.shard_batch({"input_ids": x}, cp, r)
    rl = RouterLosses(model)
    with rl.capture():
        out = model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                    output_router_logits=True, use_cache=False)  # fmt: skip
    got = rl.stats(out, local["input_ids"].shape, True, group)
    assert got.source == want.source, (got.source, want.source)
    share = got.aux / cp  # the ranks' mean is the whole sequence's loss: sum the shares here
    share.backward()
    total = share.detach().clone()
    dist.all_reduce(total, group=group)
    _close(total, want.aux.detach(), f"{family} cp={cp} {want.source} aux")
    checked = 0
    for (name, p), p_ref in zip(model.named_parameters(), ref.parameters(), strict=True):
        if p_ref.grad is None:
            continue
        grad = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(grad, group=group)
        _close(grad, p_ref.grad, f"{family} cp={cp} aux grad of {name}")
        checked += 1
    assert checked >= 2, f"only {checked} gradients compared"


def cp_router_losses(rank, world):
    """The balancing loss under cp=4 equals one process's, loss and gradients: Qwen3-MoE's
    own (Transformers' Switch form) and DeepSeek-V2's sequence-wise one."""
    everyone, _ = _groups(rank, world)
    _router_aux_equals_one_process("qwen3_moe", everyone, seed=0)
    _router_aux_equals_one_process("deepseek_v2", everyone, seed=3)


def cp_qwen3_moe_cp4(rank, world):
    """A tiny Qwen3-MoE at seq 2048, cp=4: loss and every gradient equal one process."""
    everyone, _ = _groups(rank, world)
    _model_equals_one_process("qwen3_moe", everyone, seed=0)


def cp_mixtral_cp4(rank, world):
    """A tiny Mixtral (sliding_window None) at seq 2048, cp=4, equals one process."""
    everyone, _ = _groups(rank, world)
    _model_equals_one_process("mixtral", everyone, seed=1)


def cp_families_cp2(rank, world):
    """cp=2: Qwen3-MoE on ranks {0, 1}, Mixtral on {2, 3}, each equal to one process."""
    _, pair = _groups(rank, world)
    _model_equals_one_process("qwen3_moe" if rank < 2 else "mixtral", pair, seed=rank // 2)


def cp_x_ep_fsdp(rank, world):
    """World 4 as dp_shard 2 x cp 2 with ep=2 (each expert group spans a data- and a
    context-parallel rank) and FSDP2 over dp_shard x cp, through the public
    `dropless.parallelize(model, ep=2, cp=2)` (`dropless train`'s `parallelize_config` runs
    the same layout): the loss over the global target count and every gradient equal one
    process."""
    import dropless
    from dropless.hf import parallel_mesh

    fam = _families()
    model = fam.build("qwen3_moe", implementation=None, seed=5, max_position_embeddings=SEQ)
    dropless.patch_model(model)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20)
    ref = copy.deepcopy(model)
    g = torch.Generator().manual_seed(5)
    xy = torch.randint(2, ref.config.vocab_size, (2, SEQ + 1), generator=g)
    x, y = xy[:, :-1], xy[:, 1:].clone()
    y[1, SEQ - 500 :] = IGNORE  # sequence 1 is padded: the ranks hold different counts
    for m in ref.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "sdpa"
    logits = ref(input_ids=x, use_cache=False).logits
    loss_ref = F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    loss_ref.backward()

    dropless.parallelize(model, ep=2, cp=2)  # the cp attention switched on too
    pm = parallel_mesh(model)
    assert (pm.config.dp_shard, pm.expert_shard_size, pm.cp_mesh.size()) == (2, 2, 2)
    # the expert group spans two sequences' ranks: {0, 1} split sequence 0, ep pairs are
    # consecutive ranks of the flattened dp_shard x cp
    assert model.config._attn_implementation == cpx.ATTENTION_NAME
    seq = pm.dp_rank
    assert seq == rank // 2 and pm.cp_rank == rank % 2
    local = cpx.shard_batch(
        {"input_ids": x[seq : seq + 1], "labels": y[seq : seq + 1]}, 2, pm.cp_rank
    )
    logits = model(
        input_ids=local["input_ids"], position_ids=local["position_ids"], use_cache=False
    ).logits
    n = (y != IGNORE).sum().float()  # every rank knows the global count here
    # FSDP averages gradients over the 4 ranks: scale the local sum by the world size
    loss = F.cross_entropy(
        logits.flatten(0, 1), local["labels"].flatten(), ignore_index=IGNORE, reduction="sum"
    ) * (world / n)
    loss.backward()
    total = loss.detach() / world
    dist.all_reduce(total)
    _close(total, loss_ref.detach(), "cp=2 x ep=2 loss")
    ref_params = dict(ref.named_parameters())
    checked = 0
    for name, p in model.named_parameters():
        if p.grad is None:
            continue
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        _close(grad, ref_params[name].grad, f"cp=2 x ep=2 grad of {name}")
        checked += 1
    assert checked == len(ref_params), (checked, len(ref_params))


def cp_refusals(rank, world):
    """Sliding windows and sequence lengths not divisible by 2*cp are clear errors."""
    everyone, _ = _groups(rank, world)
    fam = _families()
    model = fam.build("mixtral", implementation=None, sliding_window=8)
    try:
        cpx.enable(model, everyone)
    except ValueError as e:
        assert "sliding_window=8" in str(e) and "sliding_window=None" in str(e), e
    else:
        raise AssertionError("a sliding-window model was accepted")
    try:
        cpx.shard_batch({"input_ids": torch.zeros(1, 100, dtype=torch.long)}, 4, rank)
    except ValueError as e:
        assert "100" in str(e) and "multiple of 8" in str(e), e
    else:
        raise AssertionError("a length not divisible by 2*cp was accepted")


def _raises(fn, *words) -> None:
    try:
        fn()
    except ValueError as e:
        assert all(w in str(e) for w in words), (words, str(e))
        return
    raise AssertionError(f"no error; expected one naming {words}")


def _loaders_and_trainer_see_dp(model, pm) -> None:
    """At dp 2 x cp 2: the data loader accelerate prepares gives the 2 ranks of a cp group
    the same rows and the 2 groups the two halves of the data; Trainer's cp size is 2."""
    from types import SimpleNamespace

    from accelerate import Accelerator
    from transformers import Trainer

    loader = Accelerator(cpu=True).prepare(
        torch.utils.data.DataLoader(torch.arange(8), batch_size=2)
    )
    mine = torch.cat(list(loader))
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    assert torch.equal(rows[0], rows[1]) and torch.equal(rows[2], rows[3]), rows
    assert sorted(torch.cat([rows[0], rows[2]]).tolist()) == list(range(8)), rows
    fake = SimpleNamespace(model=model, accelerator=SimpleNamespace(parallelism_config=None))
    assert Trainer.get_cp_size(fake) == pm.config.cp == 2


def _trl_packed_batch_refused(model) -> None:
    """What TRL's SFTTrainer feeds with packing=True (its `pack_dataset` and its collator,
    padding-free: 4 documents in one row, positions restarting) is refused."""
    try:
        from datasets import Dataset
        from trl.data_utils import pack_dataset
        from trl.trainer.sft_trainer import DataCollatorForLanguageModeling
    except ImportError:
        return
    docs = [list(range(3, 3 + n)) for n in (10, 6, 12, 4)]
    packed = pack_dataset(Dataset.from_dict({"input_ids": docs}), 16)
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(list(packed))
    assert batch["input_ids"].shape == (1, 32)
    keep = ("input_ids", "labels", "position_ids")
    _raises(lambda: model(**{k: batch[k] for k in keep}), "packing=False", "padding_free=False")


def cp_whole_sequences(rank, world):
    """`dropless.parallelize(model, ep=2, cp=2)` on 4 ranks fed whole sequences, as
    Transformers' Trainer, TRL and accelerate feed them (`context_parallel.install`): each
    rank's logits are its half of the sequence, the model's own loss (labels shifted over
    the whole sequence, over the group's target count) and every gradient equal one process
    averaging the two groups' losses (FSDP's mean over the ranks); a batch `shard_batch`
    split passes unchanged; different batches in a cp group, packed rows (TRL's packing
    included), an odd length and the model's own balancing loss are refused on every rank.
    Accelerate's prepared data loader gives each cp group its rows (dp 2 x cp 2)."""
    import dropless
    from dropless.hf import parallel_mesh
    from dropless.hf.distributed.context_parallel import cp_inputs

    fam = _families()
    model = fam.build("qwen3_moe", implementation=None, seed=7, max_position_embeddings=64)
    dropless.patch_model(model)
    ref = copy.deepcopy(model)
    for m in ref.modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "sdpa"
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(2, ref.config.vocab_size, (4, 16), generator=g)
    labels = ids.clone()
    labels[1, 10:] = IGNORE  # the groups hold different target counts
    ref_losses = [ref(input_ids=ids[i : i + 2], labels=labels[i : i + 2]).loss for i in (0, 2)]
    (sum(ref_losses) / 2).backward()

    dropless.parallelize(model, ep=2, cp=2)
    pm = parallel_mesh(model)
    rows = slice(2 * pm.dp_rank, 2 * pm.dp_rank + 2)
    out = model(input_ids=ids[rows], labels=labels[rows])
    assert out.logits.shape[:2] == (2, 8), out.logits.shape  # this rank's half
    out.loss.backward()
    mean = out.loss.detach() / world
    dist.all_reduce(mean)
    _close(mean, (sum(ref_losses) / 2).detach(), "cp=2 x ep=2 whole-sequence loss")
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        _close(grad, ref_params[name].grad, f"whole sequences: grad of {name}")
    with torch.no_grad():  # split by the loop: passed through, the same logits
        local = cpx.shard_batch({"input_ids": ids[rows]}, 2, pm.cp_rank)
        split = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
        _close(split, out.logits.detach(), "a batch shard_batch split")
        hook = cp_inputs(model)
        hook.checked = False  # the check runs on the first forward: run it again
        _raises(lambda: model(input_ids=ids[rows] + pm.cp_rank), "hold different batches",
                "dp_rank")  # fmt: skip
        packed = torch.cat([torch.arange(8), torch.arange(8)]).expand(2, 16)
        _raises(lambda: model(input_ids=ids[rows], position_ids=packed), "packing=False")
        _trl_packed_batch_refused(model)
        _raises(lambda: model(input_ids=ids[rows, :14]), "not divisible by 2 x cp = 4")
        model.config.router_aux_loss_coef = 0.01
        _raises(lambda: model(input_ids=ids[rows], output_router_logits=True),
                "balancing loss", "RouterLosses")  # fmt: skip
    _loaders_and_trainer_see_dp(model, pm)


CHECKS = [
    "cp_attention_equals_reference",
    "cp_refusals",
    "cp_qwen3_moe_cp4",
    "cp_mixtral_cp4",
    "cp_families_cp2",
    "cp_x_ep_fsdp",
    "cp_router_losses",
    "cp_whole_sequences",
]
