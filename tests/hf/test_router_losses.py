"""Router losses the trainer takes from the model itself (`dropless.hf.experts.router_losses`).

Families with their own balancing loss: ours is stock's `out.aux_loss`. Families without
(DeepSeek-V3, Nemotron-H): DeepSeek-V3's sequence-wise loss on the family's own sigmoid
scores and the experts its router selected, checked against a per-token loop; counts and
the expert-bias update follow the selected experts.
"""

# B sequences, L tokens per sequence, T tokens, E experts, K top-k

import pytest
import torch
from families import build, clone_into, spread_routing

import dropless.hf as dh
from dropless.hf import experts as ex
from dropless.hf.experts.router_losses import RouterLosses, identify_score_func

B, L = 2, 7


def _ids(vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, vocab, (B, L), generator=torch.Generator().manual_seed(seed))


def nemotron_h(**overrides):
    """A tiny Nemotron-H: attention, MoE, Mamba, MoE (sigmoid router, correction bias)."""
    import transformers as tf

    kw = dict(
        vocab_size=96, hidden_size=32, layers_block_type=["full_attention", "moe", "mamba", "moe"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
        moe_shared_expert_intermediate_size=16, n_group=1, topk_group=1, routed_scaling_factor=2.0,
        ssm_state_size=8, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, chunk_size=8,
        use_mamba_kernels=False, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    kw.update(overrides)
    return tf.NemotronHConfig(**kw)


def _tiny(family: str):
    import transformers as tf

    if family == "nemotron_h":
        torch.manual_seed(0)
        model = tf.AutoModelForCausalLM.from_config(
            nemotron_h(), attn_implementation="eager", experts_implementation="eager"
        ).float()
        spread_routing(model, 0)
        return model
    return build(family)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss"])
def test_aux_loss_equals_stock(family):
    stock = build(family)
    ours = clone_into(stock, None)
    dh.patch_model(ours, expert_bias=True)  # the added bias (zero) changes nothing
    ids = _ids(stock.config.vocab_size)
    want = stock(input_ids=ids, output_router_logits=True).aux_loss
    rl = RouterLosses(ours)
    before = ex.CALLS[family]
    with rl.capture():
        out = ours(input_ids=ids, output_router_logits=True)
    assert ex.CALLS[family] > before  # our experts path ran
    st = rl.stats(out, ids.shape)
    assert st.source == "model"
    torch.testing.assert_close(st.aux, want.float(), rtol=1e-5, atol=1e-7)
    st.aux.backward()  # and it reaches the router weights
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in dh.moe_layers(ours))
    K = ours.config.num_experts_per_tok
    assert (st.counts_ME.sum(1) == B * L * K).all()


def _router_outputs(model):
    """Hooks that keep each router's own (logits, weights, ids) output."""
    seen, handles = [], []
    for layer in dh.moe_layers(model):
        handles.append(layer.router.register_forward_hook(lambda m, a, out: seen.append(out)))
    return seen, handles


def _loop_loss(outputs, E: int, K: int) -> float:
    """DeepSeek-V3's sequence-wise loss written token by token, averaged over layers."""
    total = 0.0
    for logits_TE, _, ids_TK in outputs:
        s = torch.sigmoid(logits_TE.detach().double()).reshape(B, L, E)
        ids = ids_TK.reshape(B, L, K)
        layer = 0.0
        for b in range(B):
            for e in range(E):
                hits = sum(int(e in ids[b, t].tolist()) for t in range(L))
                f = E / (K * L) * hits
                p = sum(float(s[b, t, e] / s[b, t].sum()) for t in range(L)) / L
                layer += f * p
        total += layer / B
    return total / len(outputs)


@pytest.mark.parametrize("family", ["deepseek_v3", "nemotron_h"])
def test_sequence_aux_loss_on_own_scores_and_selection(family):
    model = _tiny(family)
    before = ex.CALLS[family]
    dh.patch_model(model)
    E, K = model.config.n_routed_experts, model.config.num_experts_per_tok
    with torch.no_grad():  # a correction bias that changes the selection
        for layer in dh.moe_layers(model):
            layer.expert_bias.copy_(torch.linspace(-0.4, 0.4, E))
    ids = _ids(model.config.vocab_size, 1)
    seen, handles = _router_outputs(model)
    rl = RouterLosses(model)
    with rl.capture():
        out = model(input_ids=ids, output_router_logits=True)
    for h in handles:
        h.remove()
    assert ex.CALLS[family] > before  # our experts path ran
    assert getattr(out, "aux_loss", None) is None  # the family defines none
    st = rl.stats(out, ids.shape)
    assert st.source == "sequence"
    torch.testing.assert_close(  # on sigmoid scores: the score function identified
        st.aux.double(),
        torch.tensor(_loop_loss(seen, E, K), dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    # the selection is the router's (bias and groups), which a softmax top-k would not give
    resoftmax = [torch.topk(lg.softmax(-1), K).indices.sort(-1).values for lg, _, _ in seen]
    assert any((r != i.sort(-1).values).any() for r, (_, _, i) in zip(resoftmax, seen))
    want_counts = torch.stack([torch.bincount(i.reshape(-1), minlength=E) for _, _, i in seen])
    assert torch.equal(st.counts_ME, want_counts)
    st.aux.backward()
    assert all(layer.router.weight.grad.abs().sum() > 0 for layer in dh.moe_layers(model))


def test_bias_update_uses_selected_experts():
    from dropless.ops import update_expert_bias

    model = build("deepseek_v3")
    ids = _ids(model.config.vocab_size, 2)
    rl = RouterLosses(model)
    with rl.capture():
        model(input_ids=ids)
    counts_ME = rl.stats(None, ids.shape, need_losses=False).counts_ME
    layer = dh.moe_layers(model)[0]
    bias = layer.expert_bias
    assert bias is layer.router.e_score_correction_bias
    before = bias.clone()
    update_expert_bias(bias, counts_ME[0], 0.01)
    over = counts_ME[0].float() > counts_ME[0].float().mean()
    assert (bias[over] < before[over]).all() and (bias[~over] >= before[~over]).all()


def test_capture_is_off_outside_and_in_backward_recompute():
    model = build("qwen3_moe")
    dh.patch_model(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = _ids(model.config.vocab_size, 3)
    rl = RouterLosses(model)
    model(input_ids=ids)  # not captured
    with rl.capture():
        out = model(input_ids=ids, output_router_logits=True)
    out.logits.sum().backward()  # recomputes every layer's forward
    st = rl.stats(out, ids.shape)
    assert (st.counts_ME.sum(1) == B * L * 2).all()
    rl.remove()
    with rl.capture():
        model(input_ids=ids)
    assert rl.counts().sum() == 0


@pytest.mark.parametrize(
    "func,renorm,scale",
    [("softmax", False, 1.0), ("sigmoid", True, 2.5), ("sqrtsoftplus", True, 1.0)],
)
def test_identify_score_func(func, renorm, scale):
    from dropless.hf.experts.router_losses import SCORE_FUNCS

    g = torch.Generator().manual_seed(0)
    logits_TE = torch.randn(16, 6, generator=g)
    ids_TK = torch.topk(logits_TE + torch.randn(16, 6, generator=g), 3).indices
    w_TK = SCORE_FUNCS[func](logits_TE).gather(1, ids_TK)
    if renorm:
        w_TK = w_TK / w_TK.sum(-1, keepdim=True)
    assert identify_score_func(logits_TE, w_TK * scale, ids_TK, None) == func
    # top-1 with renormalised weights says nothing: the hint decides
    ones = torch.ones(16, 1)
    assert identify_score_func(logits_TE, ones, ids_TK[:, :1], "sigmoid") == "sigmoid"


def test_no_router_logits_is_a_clear_error():
    model = build("deepseek_v3")
    rl = RouterLosses(model)
    ids = _ids(model.config.vocab_size)
    with rl.capture():
        out = model(input_ids=ids)
    with pytest.raises(ValueError, match="output_router_logits=True"):
        rl.stats(out, ids.shape)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_cp_switch_aux_is_the_familys_and_refuses_another_form(family, tmp_path):
    """Under context parallelism the balancing loss of families with their own (Transformers'
    Switch `load_balancing_loss_func`) is recounted over the whole sequences: on a cp group
    of one it equals the family's own, with its gradient; a family whose own loss has
    another form (here: the value the check compares with, changed) is refused, saying
    what to set."""
    import torch.distributed as dist

    model = build(family)
    ids = _ids(model.config.vocab_size)
    router = dh.moe_layers(model)[0].router.weight
    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        for changed in (False, True):
            rl = RouterLosses(model)
            with rl.capture():
                out = model(input_ids=ids, output_router_logits=True)
            if changed:
                out.aux_loss = out.aux_loss.detach() * 1.5
                with pytest.raises(
                    ValueError, match="not Transformers' Switch form.*aux_loss_coef=0"
                ):
                    rl.stats(out, ids.shape, cp_group=dist.group.WORLD)
                continue
            got = rl.stats(out, ids.shape, cp_group=dist.group.WORLD)
            torch.testing.assert_close(got.aux, out.aux_loss.float(), rtol=1e-5, atol=1e-7)
            (g,) = torch.autograd.grad(got.aux, router, retain_graph=True)
            (want,) = torch.autograd.grad(out.aux_loss, router)
            # rtol: the recount sums in another order (one CPU: 3.8e-5 relative, 2e-8 absolute)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-7)
    finally:
        dist.destroy_process_group()
