"""patch()/unpatch() exactness, loading (incl. the old per-expert key layout), fallback,
bad input, moe_layers / tokens_per_expert, save_hf."""

from __future__ import annotations

import json
import threading
import warnings

import pytest
import torch
from families import BLOCK_BIAS, auto_class, build, clone_into, config, spread_routing

import dropless
import dropless.hf as dh
from dropless.hf import experts as ex
from dropless.hf._compat import check_version
from dropless.hf.patching.patch import is_patched


def _ids(seed=1, B=2, L=7):
    return torch.randint(2, 96, (B, L), generator=torch.Generator().manual_seed(seed))


def _snapshot():
    from transformers import PreTrainedModel
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

    return (
        dict(ExpertsInterface._global_mapping),
        dict(ALL_EXPERTS_FUNCTIONS._local_mapping),
        PreTrainedModel.__dict__["get_correct_experts_implementation"],
    )


def test_patch_makes_default_and_unpatch_restores_exactly():
    import transformers as tf

    stock_state = _snapshot()
    assert "dropless" not in stock_state[0]
    dropless.patch()
    dropless.patch()  # idempotent
    assert is_patched() and _snapshot() != stock_state
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    # registered through the public mapping only: the class-wide one is untouched
    assert ALL_EXPERTS_FUNCTIONS["dropless"] is ex.dropless_experts_forward
    assert _snapshot()[0] == stock_state[0]
    during = tf.AutoModelForCausalLM.from_config(config("qwen3_moe"))
    assert during.get_experts_implementation() == {"": "dropless"}
    explicit = tf.AutoModelForCausalLM.from_config(
        config("qwen3_moe"), experts_implementation="eager"
    )
    assert explicit.get_experts_implementation() == {"": "eager"}  # an explicit choice wins
    dense = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    assert dense.get_experts_implementation()[""] != "dropless"  # non-MoE models untouched
    dropless.unpatch()
    assert _snapshot() == stock_state and not is_patched()
    assert during.get_experts_implementation() == {"": "grouped_mm"}  # live model switched back
    after = tf.AutoModelForCausalLM.from_config(config("qwen3_moe"))
    assert after.get_experts_implementation() == {"": "grouped_mm"}
    with torch.no_grad():
        during(_ids())  # runs on the stock path again
    dropless.unpatch()  # a second unpatch is a no-op
    assert _snapshot() == stock_state


class _Stalling:
    """A stock method whose `__doc__` (read while patch() wraps it) holds the first thread
    there until a second one arrives, and the second until the first's patch() returned:
    without a lock the second then wraps what the first installed."""

    def __init__(self, fn, arrived: list, finished: dict):
        self.fn, self.arrived, self.finished = fn, arrived, finished
        self.second_in = threading.Event()

    def __get__(self, obj, cls=None):
        return self.fn.__get__(obj, cls)

    @property
    def __doc__(self):
        self.arrived.append(threading.current_thread().name)
        if len(self.arrived) == 1:
            self.second_in.wait(timeout=0.5)  # under a lock the second never comes
        else:
            self.second_in.set()
            self.finished[self.arrived[0]].wait(timeout=5)
        return self.fn.__doc__


def test_patch_from_two_threads_then_unpatch_restores_stock(monkeypatch):
    from transformers import PreTrainedModel

    pytest.importorskip("peft")
    from peft.tuners.lora.layer import ParamWrapper

    arrived, finished = [], {"a": threading.Event(), "b": threading.Event()}
    getter = "get_correct_experts_implementation"
    stalling = _Stalling(PreTrainedModel.__dict__[getter], arrived, finished)
    monkeypatch.setattr(PreTrainedModel, getter, stalling)
    stock_post_init = PreTrainedModel.__dict__["post_init"]
    stock_activate = ParamWrapper.__dict__["_activate_lora"]
    errors = []

    def call(name):
        try:
            dropless.patch()
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)
        finished[name].set()

    threads = [threading.Thread(target=call, args=(n,), name=n) for n in finished]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(arrived) >= 1
    assert PreTrainedModel.__dict__[getter] is not stalling and is_patched()
    assert ParamWrapper.__dict__["_activate_lora"] is not stock_activate
    dropless.unpatch()
    assert PreTrainedModel.__dict__[getter] is stalling
    assert PreTrainedModel.__dict__["post_init"] is stock_post_init
    assert ParamWrapper.__dict__["_activate_lora"] is stock_activate


def test_patch_model_and_unpatch_model():
    model = build("mixtral", "grouped_mm")
    assert dropless.patch_model(model) is model
    assert model.get_experts_implementation() == {"": "dropless"}
    dh.unpatch_model(model)
    assert model.get_experts_implementation() == {"": "grouped_mm"}


def test_from_pretrained_with_dropless_after_patch(tmp_path):
    import transformers as tf

    stock = build("olmoe", "eager")
    stock.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="dropless"):  # not registered before patch()
        tf.AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="dropless")
    dropless.patch()
    for kwargs in ({"experts_implementation": "dropless"}, {}):
        model = tf.AutoModelForCausalLM.from_pretrained(
            tmp_path, attn_implementation="eager", **kwargs
        )
        assert model.get_experts_implementation() == {"": "dropless"}
        before = ex.CALLS["olmoe"]
        with torch.no_grad():
            torch.testing.assert_close(
                model(_ids()).logits, stock(_ids()).logits, rtol=1e-4, atol=1e-5
            )
        assert ex.CALLS["olmoe"] - before == 2


def _write_old_layout(model, out_dir, family):
    """Save `model` with one tensor per expert and projection (pre-v5 key layout)."""
    from safetensors.torch import save_file

    old = {}
    for key, t in model.state_dict().items():
        if key.endswith("experts.gate_up_proj"):
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                if family == "mixtral":
                    base = key.replace(
                        ".mlp.experts.gate_up_proj", f".block_sparse_moe.experts.{e}"
                    )
                    old[f"{base}.w1.weight"] = t[e, :F].clone()
                    old[f"{base}.w3.weight"] = t[e, F:].clone()
                else:
                    base = key.replace("experts.gate_up_proj", f"experts.{e}")
                    old[f"{base}.gate_proj.weight"] = t[e, :F].clone()
                    old[f"{base}.up_proj.weight"] = t[e, F:].clone()
        elif key.endswith("experts.down_proj"):
            for e in range(t.shape[0]):
                if family == "mixtral":
                    base = key.replace(".mlp.experts.down_proj", f".block_sparse_moe.experts.{e}")
                    old[f"{base}.w2.weight"] = t[e].clone()
                else:
                    old[key.replace("experts.down_proj", f"experts.{e}.down_proj.weight")] = t[
                        e
                    ].clone()
        elif family == "mixtral" and ".mlp.gate." in key:
            old[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.clone()
        else:
            old[key] = t.clone()
    model.config.save_pretrained(out_dir)
    save_file(old, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return old


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_old_per_expert_layout_loads(family, tmp_path):
    import transformers as tf

    stock = build(family, "eager")
    old = _write_old_layout(stock, tmp_path, family)
    assert any(".experts.0." in k for k in old) and not any("gate_up_proj" in k for k in old)
    dropless.patch()
    model, info = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.get_experts_implementation() == {"": "dropless"}
    for key, t in stock.state_dict().items():
        assert torch.equal(model.state_dict()[key], t), key
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, stock(_ids()).logits, rtol=1e-4, atol=1e-5)


def _phimoe(**kw):
    import transformers as tf

    cfg = tf.PhimoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", **kw)


def test_phimoe_runs_ours_and_report_says_so():
    report = dropless.patch()
    assert "no patched MoE model yet" in str(report)
    model = _phimoe()  # once a fallback family: the spec is read from what it computes
    assert model.get_experts_implementation() == {"": "dropless"}
    stock = _phimoe(experts_implementation="eager")
    stock.load_state_dict(model.state_dict())
    before = ex.PATH_CALLS[("phimoe", "fused")]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            torch.testing.assert_close(
                model(_ids()).logits, stock(_ids()).logits, rtol=1e-4, atol=1e-5
            )
    assert not [w for w in caught if "dropless" in str(w.message)], caught
    assert ex.PATH_CALLS[("phimoe", "fused")] - before == 2
    assert report.families == {"phimoe": "fused"} and not report.fallbacks
    assert report.modules_ours == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert "phimoe: 2 experts module(s) on the fused path (swiglu)" in str(report)
    one = dh.report(stock)  # not patched: nothing of it runs dropless
    assert one.records == []


def _odd_experts_class():
    """An experts class whose weights are not in the v5 layout dropless reads."""
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation
    class OddExperts(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.w_in = torch.nn.Parameter(torch.randn(3, 4, 6))

        def forward(self, hidden_states, top_k_index, top_k_weights):
            w = self.w_in[top_k_index].sum(-1).sum(-1)  # [T, K]
            return hidden_states * (w * top_k_weights).sum(-1, keepdim=True)

    return OddExperts


def test_unknown_layout_falls_back_to_its_own_forward_with_one_warning():
    import transformers as tf

    cls = _odd_experts_class()
    cfg = tf.PretrainedConfig()
    cfg._experts_implementation = "dropless"
    dropless.patch()
    module = cls(cfg)
    spec = dh.experts_spec(module)
    assert isinstance(spec, str) and "gate_up_proj" in spec
    x, ids = torch.randn(5, 6), torch.randint(0, 3, (5, 2))
    w = torch.rand(5, 2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = module(x, ids, w)
        module(x, ids, w)
    ours = [c for c in caught if issubclass(c.category, dh.DroplessFallbackWarning)]
    assert len(ours) == 1 and "gate_up_proj" in str(ours[0].message)
    assert torch.equal(out, type(module).forward.__wrapped__(module, x, ids, w))


def test_bad_input_messages(monkeypatch):
    import transformers as tf

    dense = tf.AutoModelForCausalLM.from_config(
        tf.LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    with pytest.raises(ValueError, match="no Mixture-of-Experts layers"):
        dropless.patch_model(dense)
    with pytest.raises(TypeError, match="PreTrainedModel"):
        dropless.patch_model(torch.nn.Linear(2, 2))
    dropless.patch()
    assert _phimoe(experts_implementation="dropless").get_experts_implementation()[""] == (
        "dropless"
    )
    with pytest.raises(ValueError, match="no Mixture-of-Experts"):
        tf.AutoModelForCausalLM.from_config(
            tf.LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=1,
                num_attention_heads=4,
                num_key_value_heads=2,
            ),
            experts_implementation="dropless",
        )
    with pytest.raises(ValueError, match="expert_bias=True"):
        from dropless.hf.patching.routers import add_expert_bias

        add_expert_bias(torch.nn.Linear(2, 2), "unknown_family", 2)
    check_version("5.17.0")
    check_version("5.24.0.dev0")
    for bad in ("4.57.1", "6.0.0", "5.16.2"):
        with pytest.raises(ImportError, match=r"transformers>=5\.17,<6.*pip install"):
            check_version(bad)
    dropless.unpatch()
    monkeypatch.setattr(tf, "__version__", "4.57.1")
    with pytest.raises(ImportError, match="4.57.1"):
        dropless.patch()
    assert not is_patched()


def test_moe_layers_and_tokens_per_expert():
    model = build("glm4_moe", "eager")  # first_k_dense_replace=1: layer 0 dense, layer 1 MoE
    dh.patch_model(model)
    layers = dh.moe_layers(model)
    assert [layer.name for layer in layers] == ["model.layers.1.mlp"]
    layer = layers[0]
    assert layer.router_name == "model.layers.1.mlp.gate" and layer.family == "glm4_moe"
    assert layer.expert_bias is layer.router.e_score_correction_bias
    assert layer.tokens_per_expert is None and dh.tokens_per_expert(model) is None
    ids = _ids(B=2, L=7)
    K = model.config.num_experts_per_tok
    with torch.no_grad():
        model(ids)
        first = layer.tokens_per_expert.clone()
        model(ids[:, :3])
    assert int(first.sum()) == ids.numel() * K
    assert int(layer.tokens_per_expert.sum()) == 6 * K  # the last forward only
    total = dh.tokens_per_expert(model)  # summed since the last reset, then reset
    assert total.shape == (1, 8) and int(total.sum()) == (14 + 6) * K
    assert dh.tokens_per_expert(model) is None
    gpt = build("gpt_oss", "eager")
    assert [x.router_name for x in dh.moe_layers(gpt)] == [
        "model.layers.0.mlp.router",
        "model.layers.1.mlp.router",
    ]


def test_save_hf_drops_added_buffers(tmp_path):
    import transformers as tf
    from safetensors import safe_open

    model = build("qwen2_moe", "eager")
    dropless.patch_model(model, expert_bias=True)
    assert dh.added_state_keys(model) == [
        "model.layers.0.mlp.gate.expert_bias",
        "model.layers.1.mlp.gate.expert_bias",
    ]
    assert (
        "model.layers.0.mlp.gate.expert_bias" in model.state_dict()
    )  # trainer checkpoints keep it
    dh.save_hf(model, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "expert_bias" in k]
    assert "_experts_implementation" not in json.loads((tmp_path / "config.json").read_text())
    dropless.unpatch()
    assert not dh.added_state_keys(model)  # unpatch removed the buffers and router forwards
    assert "forward" not in dh.moe_layers(model)[0].router.__dict__
    stock, info = tf.AutoModelForCausalLM.from_pretrained(
        tmp_path,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        assert torch.equal(stock(_ids()).logits, model(_ids()).logits)


def test_tracking_does_not_keep_models_alive():
    import gc
    import weakref

    from dropless.hf.patching import patch as patch_mod

    dropless.patch()
    model = clone_into(build("qwen3_moe", "eager"), None)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and all(m is not None for m in patch_mod._models.keys())


def test_activation_checkpointing_counts_tokens_once():
    from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

    model = build("qwen3_moe", "eager")
    dh.patch_model(model)
    block = dh.moe_layers(model)[0].block
    h = torch.randn(2, 7, model.config.hidden_size, requires_grad=True)
    ref = block(h)
    (g_ref,) = torch.autograd.grad(ref.square().sum(), h)
    dh.tokens_per_expert(model)  # reset
    before = ex.CALLS["qwen3_moe"]
    with set_checkpoint_early_stop(False):
        out = checkpoint(block, h, use_reentrant=False)
        (g,) = torch.autograd.grad(out.square().sum(), h)  # re-runs the experts in backward
    assert ex.CALLS["qwen3_moe"] - before == 2
    assert dh.tokens_per_expert(model).sum().item() == 14 * model.config.num_experts_per_tok
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("family", sorted(BLOCK_BIAS))
def test_expert_bias_on_the_block_is_used_not_refused(family):
    """AFMoE and LFM2-MoE keep the score bias on the MoE block: patch_model(expert_bias=True)
    runs them on the dropless path with that bias (none added to the router)."""
    model = build(family, "eager")
    ids = _ids(seed=4)
    with torch.no_grad():
        want = model(ids).logits
    dh.patch_model(model, expert_bias=True)
    assert dh.added_state_keys(model) == []
    layers = dh.moe_layers(model)
    for layer in layers:
        assert layer.expert_bias is layer.block.expert_bias
    before = dict(ex.CALLS)
    with torch.no_grad():
        # fp32 through other kernels (grouped GEMM, fused SwiGLU) than the eager loop
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-4, atol=1e-5)
        assert ex.CALLS[family] == before.get(family, 0) + len(layers)
        layer = layers[-1]
        favoured = int(layer.tokens_per_expert.argmin())  # the expert picked least
        layer.expert_bias[favoured] += 100.0
        model(ids)
    assert int(layer.tokens_per_expert[favoured]) == ids.numel()  # every token picks it


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_vl_moe"])  # vl: with sub-configs
def test_a_config_that_built_a_stock_model_builds_dropless_after_patch(family, tmp_path):
    """The A/B pattern: stock from a config, patch(), again from the same config object.
    The config kept the stock default the first build resolved; the second model runs
    dropless (on its own copy of the config), the first stays stock, an explicit request
    still wins, and the report names each model's path."""
    from transformers import PretrainedConfig

    cfg = config(family)
    torch.manual_seed(0)
    stock = auto_class(cfg).from_config(cfg, attn_implementation="eager")
    spread_routing(stock)
    stock.save_pretrained(tmp_path)
    setter = PretrainedConfig.__dict__["_experts_implementation"]
    report = dropless.patch()
    again = auto_class(cfg).from_config(cfg, attn_implementation="eager")
    again.load_state_dict(stock.state_dict())
    assert set(again.get_experts_implementation().values()) == {"dropless"}
    assert set(stock.get_experts_implementation().values()) == {"grouped_mm"}
    ids = _ids()
    with torch.no_grad():
        calls = sum(ex.CALLS.values())
        want = stock(ids).logits
        assert sum(ex.CALLS.values()) == calls  # the first model still runs stock
        got = again(ids).logits
    assert sum(ex.CALLS.values()) - calls == len(dh.moe_layers(again))
    # fp32, other kernels (grouped GEMM, fused SwiGLU, index-add combine) than stock's
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    loaded = auto_class(cfg).from_pretrained(tmp_path, config=cfg)  # from_pretrained copies it
    explicit = auto_class(cfg).from_pretrained(tmp_path, experts_implementation="grouped_mm")
    assert set(loaded.get_experts_implementation().values()) == {"dropless"}
    assert set(explicit.get_experts_implementation().values()) == {"grouped_mm"}
    paths = {(m.address, m.implementation) for m in report.models}
    assert paths == {
        (f"{id(again):#x}", "dropless"),
        (f"{id(loaded):#x}", "dropless"),
        (f"{id(explicit):#x}", "grouped_mm"),
    }
    text = str(report)
    assert f"{type(again).__name__} at {id(again):#x}: runs dropless" in text
    assert f"at {id(explicit):#x}: runs stock 'grouped_mm'" in text
    dropless.unpatch()
    assert set(again.get_experts_implementation().values()) == {"grouped_mm"}
    assert PretrainedConfig.__dict__["_experts_implementation"] is setter
