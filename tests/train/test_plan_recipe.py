"""`dropless plan` runs the trainer's own micro-batch (`train.step.MicroStep`) under the
precision recipe, and asks the expert MLP's folder what it keeps for backward: FP8 and
MXFP8 saved activations plan below bf16 by what the code keeps; the declarations match
the bytes the real ops save; the activation peak is reported where the overall peak is
the optimizer step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dropless.train.config.load import load_config  # noqa: E402
from dropless.train.plan import trace as P  # noqa: E402
from dropless.train.step import MicroStep  # noqa: E402

GIB = 2**30
# tiny.toml with wider experts: h [S, 2F] dominates what the expert path keeps
WIDE = ["model.moe_intermediate_size=128"]
FP8_SAVED = ["precision.fp8_saved_activations=true"]


def _plan(sets, world: int = 1):
    cfg = load_config("examples/tiny.toml", [*WIDE, *sets])
    return cfg, P.make_plan(cfg, world, 80, compare_checkpointing=False)


def test_fp8_and_mxfp8_saved_activations_plan_below_bf16_by_what_they_keep():
    """h [S, 2F] kept in E4M3 with one fp32 scale per row instead of bf16: the activation
    peak (and, with activations at the peak, the peak itself) drops by about
    layers x S x (2F x (2 - 1) - 4) bytes. Without fp8_saved_activations the recipe keeps
    h in bf16, as bf16 does. The old planner ignored the recipe (equal plans)."""
    cfg, bf16 = _plan([])
    hc = P.resolve_hf_config(cfg)
    layers, K, N = hc.num_hidden_layers, hc.num_experts_per_tok, 2 * hc.moe_intermediate_size
    S = cfg.train.batch_size * cfg.train.seq_len * K
    expected = layers * S * (N - 4)
    assert bf16.layout["compute_dtype"] == "bfloat16"
    for recipe in ("current", "mxfp8"):
        _, q = _plan([f"precision.recipe={recipe}", *FP8_SAVED])
        saved = (bf16.activation_peak_gib - q.activation_peak_gib) * GIB
        assert 0.9 * expected < saved < 1.2 * expected, (recipe, saved, expected)
        assert q.peak_gib_per_gpu < bf16.peak_gib_per_gpu, recipe  # the recipe is traced
        assert q.assumptions["precision"].endswith(f"({recipe})")
        _, plain = _plan([f"precision.recipe={recipe}"])  # h kept in bf16
        assert abs(plain.activation_peak_gib - bf16.activation_peak_gib) * GIB < 0.1 * expected


def _saved_bytes(run) -> tuple[int, list]:
    """Bytes of the distinct storages autograd saves while `run()` runs, beside the leaves
    (the operands the caller holds), and their (shape, dtype)."""
    seen: dict[int, tuple] = {}

    def pack(t):
        if t.numel() and not (t.is_leaf and t.requires_grad):
            st = t.untyped_storage()
            seen[st.data_ptr()] = (st.nbytes(), tuple(t.shape), t.dtype)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(b for b, *_ in seen.values()), [v[1:] for v in seen.values()]


def _operands(T=64, D=32, F=48, E=4, K=2, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g).softmax(-1).to(dtype).requires_grad_()
    gate_up = (torch.randn(E, 2 * F, D, generator=g, dtype=dtype) / D**0.5).requires_grad_()
    down = (torch.randn(E, D, F, generator=g, dtype=dtype) / F**0.5).requires_grad_()
    return x, ids, w, gate_up, down


def test_the_custom_op_declares_what_it_keeps():
    """The fake rule's saved part (`ops.expert_mlp.eager.saved_for_backward`) is what
    `dropless::expert_mlp` keeps for backward, byte for byte."""
    from dropless.ops.expert_mlp.eager import expert_mlp_op, saved_for_backward

    x, ids, w, gate_up, down = _operands()

    def run():
        expert_mlp_op(
            x, ids, w, gate_up, down, None, None, "swiglu", True, False, 1.702, 7.0, True, True
        )

    measured, _ = _saved_bytes(run)
    declared = sum(t.nbytes for t in saved_for_backward(x, ids, gate_up, True))
    assert declared <= measured <= declared + 64  # a sort's index may sit in a larger storage


@pytest.mark.parametrize("recipe", ["current", "mxfp8"])
def test_the_recipe_mlp_declares_what_it_keeps(recipe):
    """`quant.mlp.saved_for_backward` against what the recipe's MLP saves through the
    eager expert entry with fp8_saved_activations (the routing weights and token indices
    the entry sorts; per-tensor scales, a few scalars, aside)."""
    import dropless
    from dropless.ops.expert_mlp import expert_mlp
    from dropless.quant.mlp import saved_for_backward

    r = dropless.quant.recipe_from_name(recipe, fp8_saved_activations=True, backend="emulated")
    x, ids, w, gate_up, down = _operands()

    def run():
        with dropless.quant.autocast(recipe=r):
            expert_mlp(x, ids, w, gate_up, down)

    measured, shapes = _saved_bytes(run)
    declared = sum(t.nbytes for t in saved_for_backward(r, x, ids, gate_up, True))
    h_fp8 = x.shape[0] * ids.shape[1] * gate_up.shape[1]  # E4M3: one byte a value
    assert declared < 2 * h_fp8  # h kept in one byte plus a scale per row
    assert declared <= measured <= declared + 64, (measured, declared, shapes)


@pytest.mark.parametrize("recipe", ["current", "current_row", "mxfp8"])
def test_the_recipe_mlp_declares_what_it_keeps_on_received_rows(recipe):
    """`quant.mlp.saved_for_backward_rows` against what the recipe's MLP saves on rows
    already in expert order (what the expert-parallel dispatcher hands it): with
    fp8_saved_activations the rows in E4M3 and their scales, not in the compute dtype."""
    import dropless
    from dropless.ops.expert_mlp import grouped_mlp
    from dropless.quant.mlp import saved_for_backward_rows

    kind, _, gran = recipe.partition("_")
    opts = dict(granularity=gran) if gran else {}
    r = dropless.quant.recipe_from_name(
        kind, fp8_saved_activations=True, backend="emulated", **opts
    )
    x, ids, _, gate_up, down = _operands(T=96)
    counts = torch.bincount(ids.flatten(), minlength=gate_up.shape[0]).tolist()
    x_RD = x.repeat(2, 1)  # the received rows: not a leaf the caller holds

    def run():
        with dropless.quant.autocast(recipe=r):
            grouped_mlp(x_RD, counts, None, gate_up, down)

    measured, shapes = _saved_bytes(run)
    declared = sum(t.nbytes for t in saved_for_backward_rows(r, x_RD, len(x_RD), gate_up, True))
    plain = dropless.quant.recipe_from_name(kind, backend="emulated", **opts)
    in_fp32 = sum(t.nbytes for t in saved_for_backward_rows(plain, x_RD, len(x_RD), gate_up, True))
    assert declared < 0.5 * in_fp32, "the rows and h are declared in E4M3, not in fp32"
    assert 0.9 * declared <= measured <= declared + 64, (measured, declared, shapes)


@pytest.mark.parametrize("fp8_saved", [True, False], ids=["fp8_saved", "rows_kept"])
def test_the_ep_plan_keeps_the_received_rows_as_the_recipe_does(fp8_saved):
    """Under expert parallelism the planner allocates what the recipe's MLP keeps of the
    received rows: in E4M3 with fp8_saved_activations (the rows in the compute dtype are
    then freed after forward), else the received rows themselves; and the plan of an
    ep=2 run with FP8 saved activations sits below bf16's."""
    import dropless
    from dropless.quant.mlp import saved_for_backward_rows
    from dropless.train.plan.experts import received_rows_saved

    r = dropless.quant.recipe_from_name("current", fp8_saved_activations=fp8_saved)
    x, ids, _, gate_up, _ = _operands(dtype=torch.bfloat16)
    recv = x.new_empty(ids.numel(), x.shape[1])
    with dropless.quant.autocast(recipe=r):
        kept = received_rows_saved(x, ids, gate_up, recv)
    declared = saved_for_backward_rows(r, x, ids.numel(), gate_up, True)
    assert [(t.shape, t.dtype) for t in kept] == [(t.shape, t.dtype) for t in declared]
    assert any(t is recv for t in kept) != fp8_saved
    if fp8_saved:
        _, bf16 = _plan(["parallel.ep=2"], world=2)
        _, q = _plan(["parallel.ep=2", "precision.recipe=current", *FP8_SAVED], world=2)
        assert q.activation_peak_gib < bf16.activation_peak_gib


def test_the_activation_peak_shows_when_the_peak_is_the_optimizer_step(capsys):
    """Micro-batch 1 x 256 tokens of a model whose optimizer step is the peak: the
    breakdown there has (almost) no activations, the activation peak does, and the
    printed plan shows it beside them and says why."""
    from dropless.cli.plan import format_plan

    sets = ["train.batch_size=1", "train.seq_len=256", "model.hidden_size=256"]
    sets += ["model.num_experts=16", "model.moe_intermediate_size=256"]
    sets += ["model.dtype=bf16", "optim.master_weights=false"]  # BF16AdamW's step temporaries
    cfg = load_config("examples/tiny.toml", sets)
    p = P.make_plan(cfg, 1, 80)
    acts = p.breakdown_gib["activations"]
    assert p.activation_peak_gib > 0 and acts < 0.05 * p.activation_peak_gib, p
    assert p.peak_moment == "optimizer step"
    # the tokens' own activations: at least the expert MLP's h [S, 2F] of every layer
    hc = P.resolve_hf_config(cfg)
    h_bytes = hc.num_hidden_layers * 256 * hc.num_experts_per_tok * 2 * 256 * 2
    assert p.activation_peak_gib * GIB > h_bytes
    assert p.activation_peak_other_checkpointing_gib < p.activation_peak_gib
    text = format_plan(p)
    assert f"activation peak in forward/backward: {p.activation_peak_gib:.2f}" in text
    assert "the traced peak is the optimizer step" in text
    assert '"activation_peak_gib"' in p.to_json()


def test_trainer_and_planner_run_the_same_micro_step(tmp_path, monkeypatch):
    """One function, `train.step.MicroStep`, runs the micro-batch of `dropless train` and
    of `dropless plan` (with the router outputs the router losses need)."""
    from dropless.train.config.recipes import tiny
    from dropless.train.trainer import train

    calls = []
    real = MicroStep.__call__

    def spy(self, xy_BL1, targets_BL=None):
        calls.append((type(xy_BL1).__name__, self.need_router))
        return real(self, xy_BL1, targets_BL)

    monkeypatch.setattr(MicroStep, "__call__", spy)
    cfg = load_config("examples/tiny.toml", ["train.z_loss_coef=0.001"])
    P.make_plan(cfg, 1, 80, compare_checkpointing=False)
    assert calls == [("FakeTensor", True)]
    calls.clear()
    sets = ("train.steps=1", "log.tensorboard=false", "log.plots=false", "checkpoint.every=0")
    train(tiny(*sets), run_dir=str(tmp_path / "run"))
    assert calls and all(kind == "Tensor" for kind, _ in calls)


def test_the_unfused_loss_lets_go_of_the_logits_before_backward(monkeypatch):
    """With train.fused_cross_entropy=false the step hands the model's logits to the lean
    loss, which keeps them (no copy) for backward, and drops its own references before
    backward, so the loss can write its gradient over them. (It once kept an fp32 copy alive
    until the step returned: a logits-sized tensor on top of the backward's peak, 8 GiB per
    GPU in the Nemotron verdict of docs/parallel.md; then F.cross_entropy's log-probabilities.)"""
    import weakref

    from dropless.train import step as train_step

    real, alive = train_step.cross_entropy, []

    def spy(logits, *args, **kwargs):
        ref = weakref.ref(logits)
        loss = real(logits, *args, **kwargs)
        loss.register_hook(lambda g: alive.append(ref() is not None))
        return loss

    monkeypatch.setattr(train_step, "cross_entropy", spy)
    cfg = load_config("examples/tiny.toml", ["train.fused_cross_entropy=false"])
    P.make_plan(cfg, 1, 80, compare_checkpointing=False)
    assert alive and not any(alive), alive
