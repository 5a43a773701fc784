"""PEFT LoRA on fused experts (`target_parameters`): stock PEFT vs PEFT + dropless in
float64 (logits, loss, every adapter gradient), the factors' orientation against PEFT's
own `get_delta_weight`, `merge_and_unload`, and an adapter saved from a patched model
loading in stock PEFT on stock Transformers."""

# B batch, L sequence length

from __future__ import annotations

import warnings

import pytest
import torch
from families import build, clone_into

import dropless.hf as dh
from dropless.hf import experts as ex
from dropless.hf.lora import expert_lora as el
from dropless.hf.lora import peft_lora as hl
from harness import run_python

peft = pytest.importorskip("peft")
from peft.tuners.lora.layer import ParamWrapper, _LoraFactorsProxy  # noqa: E402

VOCAB = 96
ATTENTION = {
    "deepseek_v3": ["q_b_proj", "kv_b_proj", "o_proj"],
}
FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "nemotron_h"]


def _ids(seed=1, B=2, L=9):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (B, L), generator=g)


def lora_config(family: str, r: int = 8, attention: bool = True):
    first = "up_proj" if family == "nemotron_h" else "gate_up_proj"
    return peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        target_parameters=[f"experts.{first}", "experts.down_proj"],
        target_modules=ATTENTION.get(family, ["q_proj", "v_proj", "o_proj"]) if attention else [],
        init_lora_weights=False,  # B random too: a zero B would hide its orientation
    )


def _count_folds(monkeypatch) -> list:
    calls = []
    orig = _LoraFactorsProxy.forward

    def counted(self, W):
        calls.append(tuple(W.shape))
        return orig(self, W)

    monkeypatch.setattr(_LoraFactorsProxy, "forward", counted)
    return calls


def _close(got, want, msg=""):
    """float64 tolerances, or float32 ones where the model itself rounds to float32
    (nemotron_h returns float32 logits from a float64 model)."""
    tight = got.dtype == torch.float64
    rtol, atol = (1e-9, 1e-12) if tight else (1e-5, 1e-6)
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * float(want.abs().max()), msg=msg)


def _grads(model) -> dict:
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def _check_orientation(model) -> int:
    """Our reading of PEFT's factors folds to PEFT's own delta, for every wrapper."""
    n = 0
    for m in model.modules():
        if not isinstance(m, ParamWrapper):
            continue
        base = m.get_base_layer()
        trans_w = not base.is_transposed
        proxy = _LoraFactorsProxy(*m.get_delta_factors("default"))
        lr_E = hl._lowrank_of_proxy(proxy, trans_w)
        delta = lr_E.delta() if trans_w else lr_E.delta().transpose(1, 2)
        torch.testing.assert_close(delta, m.get_delta_weight("default"), rtol=1e-12, atol=1e-14)
        n += 1
    return n


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_lora_matches_stock_peft_fp64(family, tmp_path, monkeypatch):
    stock = build(family, "eager").double()
    base_state = {k: v.clone() for k, v in stock.state_dict().items()}
    patched = dh.patch_model(clone_into(stock, "eager").double())
    ps = peft.get_peft_model(stock, lora_config(family))
    pp = peft.get_peft_model(patched, lora_config(family))
    pp.load_state_dict(ps.state_dict())
    assert _check_orientation(pp) == 2 * len(dh.moe_layers(patched))
    ids = _ids()
    ref = ps(ids, labels=ids)
    ref.loss.backward()
    folds = _count_folds(monkeypatch)
    before = sum(ex.CALLS.values())
    with warnings.catch_warnings():
        warnings.simplefilter("error", hl.DroplessLoRAFallbackWarning)
        out = pp(ids, labels=ids)
        out.loss.backward()
    assert sum(ex.CALLS.values()) - before == len(dh.moe_layers(patched))
    assert folds == []  # no weight-sized fold: the factors ran in the fused Function
    _close(out.logits, ref.logits)
    # stock's loss is fp32 (its `logits.float()`), the patched one fp64: compared, and the
    # gradients through it, at the reference's precision
    _close(out.loss.to(ref.loss.dtype), ref.loss)
    want, got = _grads(ps), _grads(pp)
    assert got.keys() == want.keys() and any("experts" in k for k in got)
    for name, g in got.items():
        assert g is not None, name
        _close(g.to(ref.loss.dtype), want[name].to(ref.loss.dtype), msg=name)
    for name, p in pp.named_parameters():  # frozen base: no gradient computed
        if not p.requires_grad:
            assert p.grad is None, name

    # the adapter saved from the patched model loads in stock PEFT on stock Transformers
    pp.save_pretrained(tmp_path / "adapter")
    with torch.no_grad():
        logits = pp(ids).logits
    fresh = build(family, "eager").double()
    fresh.load_state_dict(base_state)
    loaded = peft.PeftModel.from_pretrained(fresh.double(), tmp_path / "adapter")
    with torch.no_grad():
        _close(loaded(ids).logits, logits)

    # merged into the weights, the patched model computes the same
    merged = pp.merge_and_unload()
    with torch.no_grad():
        _close(merged(ids).logits, logits)


def test_two_active_adapters_run_peft_fold_with_one_warning():
    stock = build("qwen3_moe", "eager").double()
    patched = dh.patch_model(clone_into(stock, "eager").double())
    models = []
    for m in (stock, patched):
        pm = peft.get_peft_model(m, lora_config("qwen3_moe"))
        pm.add_adapter("other", lora_config("qwen3_moe", r=4))
        pm.base_model.set_adapter(["default", "other"])
        models.append(pm)
    models[1].load_state_dict(models[0].state_dict())
    ids = _ids()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = models[1](ids).logits
        models[1](ids)
    lora_warnings = [w for w in caught if w.category is hl.DroplessLoRAFallbackWarning]
    assert len(lora_warnings) == 1 and "several active adapters" in str(lora_warnings[0].message)
    _close(got, models[0](ids).logits)


def test_unpatch_restores_peft_activation():
    before = ParamWrapper._activate_lora
    dh.patch()
    assert ParamWrapper._activate_lora is not before
    dh.unpatch()
    assert ParamWrapper._activate_lora is before


def test_patch_covers_a_peft_imported_after_it():
    """patch() does not import peft; a peft imported after it gets the lean activation
    as it is imported (never from a forward), and unpatch() takes it off again."""
    code = (
        "import inspect, sys, dropless\n"
        "dropless.patch()\n"
        "assert 'peft' not in sys.modules, 'patch() imported peft'\n"
        "from peft.tuners.lora.layer import ParamWrapper\n"
        "from dropless.hf.lora.peft_lora import _activate_lora_lean\n"
        "assert ParamWrapper._activate_lora is _activate_lora_lean\n"
        "assert 'class ParamWrapper' in inspect.getsource(ParamWrapper)\n"
        "dropless.unpatch()\n"
        "assert ParamWrapper._activate_lora is not _activate_lora_lean\n"
        "print('ok')\n"
    )
    out = run_python(["-c", code], env={"OMP_NUM_THREADS": "1"}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ok"]


def _trainer_losses(patched: bool, tmp_path) -> list[float]:
    import transformers as tf

    model = build("qwen3_moe", "eager")
    if patched:
        dh.patch_model(model)
    model = peft.get_peft_model(model, lora_config("qwen3_moe"))
    model.enable_input_require_grads()  # checkpointed blocks need a grad-carrying input
    data = [{"input_ids": ids, "labels": ids} for ids in _ids(seed=5, B=8, L=12)]
    args = tf.TrainingArguments(
        output_dir=str(tmp_path / ("p" if patched else "s")), max_steps=3,
        per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, report_to=[],
        save_strategy="no", gradient_checkpointing=True, use_cpu=True, seed=0,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = tf.Trainer(model=model, args=args, train_dataset=data)
    before = sum(ex.CALLS.values())
    trainer.train()
    assert (sum(ex.CALLS.values()) > before) == patched  # which experts path ran
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


def test_transformers_trainer_with_checkpointing_matches_unpatched(tmp_path):
    stock = _trainer_losses(False, tmp_path)
    ours = _trainer_losses(True, tmp_path)
    assert len(ours) == 3
    assert ours == pytest.approx(stock, rel=1e-5)


def _wrappers(model):
    """{(experts module, projection name): ParamWrapper}."""
    return {
        (m.get_base_layer(), m.parameter_name): m
        for m in model.modules()
        if isinstance(m, ParamWrapper)
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "nemotron_h"])
def test_expert_owned_factors_match_peft(family):
    """PEFT's layout <-> [E, r, in] / [E, out, r] (what expert parallelism shards), and the
    factors attached to the experts module compute what PEFT computes."""
    stock = build(family, "eager").double()
    patched = dh.patch_model(clone_into(stock, "eager").double())
    ps = peft.get_peft_model(stock, lora_config(family, attention=False))
    g = torch.Generator().manual_seed(0)
    for layer in dh.moe_layers(patched):
        el.attach_expert_lora(layer.experts, 8, 16, generator=g)
    wrappers = _wrappers(ps)
    with torch.no_grad():
        for ref, layer in zip(dh.moe_layers(ps), dh.moe_layers(patched)):
            first = "gate_up_proj" if layer.experts.has_gate else "up_proj"  # nemotron_h: up
            for which, name in (("first", first), ("down", "down_proj")):
                w = wrappers[(ref.experts, name)]
                a_w, b_w = w.lora_A["default"].weight, w.lora_B["default"].weight
                a, b = el.peft_to_experts(a_w, b_w, w.num_experts)
                back = el.experts_to_peft(a, b)
                assert torch.equal(back[0], a_w) and torch.equal(back[1], b_w)
                getattr(layer.experts, f"lora_A_{which}").copy_(a)
                getattr(layer.experts, f"lora_B_{which}").copy_(b)
    ids = _ids()
    with torch.no_grad():
        _close(patched(ids).logits, ps(ids).logits)


def test_expert_owned_factors_save_as_a_peft_adapter(tmp_path):
    model = dh.patch_model(build("qwen3_moe", "eager").double())
    g = torch.Generator().manual_seed(1)
    for layer in dh.moe_layers(model):
        el.attach_expert_lora(layer.experts, 4, 8, generator=g)
    ids = _ids()
    with torch.no_grad():
        want = model(ids).logits
    dh.save_expert_lora_as_peft(model, tmp_path / "adapter")
    dh.unpatch()
    stock = build("qwen3_moe", "eager").double()
    loaded = peft.PeftModel.from_pretrained(stock, tmp_path / "adapter")
    with torch.no_grad():
        _close(loaded(ids).logits, want)
    # and back: a fresh model's own factors filled from the adapter file
    dh.patch()
    again = dh.patch_model(build("qwen3_moe", "eager").double())
    for layer in dh.moe_layers(again):
        el.attach_expert_lora(layer.experts, 4, 8)  # B zeros until loaded
    assert el.load_peft_into_experts(again, tmp_path / "adapter") == 4
    with torch.no_grad():
        _close(again(ids).logits, want)
