"""Config: TOML + --set, validation messages, unknown keys, the resolved dump."""

import pytest

from dropless.train.config.load import Config, dump_config, known_keys, load_config
from dropless.train.state import lr_factor


def test_defaults_are_the_demo_run():
    cfg = Config()
    assert cfg.model.num_layers >= 4 and cfg.model.num_experts >= 8 and cfg.model.top_k == 2
    assert cfg.model.hidden_size >= 256 and cfg.precision.recipe == "none"


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text(
        '[train]\nsteps = 7\nseq_len = 64\n[optim]\nlr = 1\nschedule = "wsd"\n[log]\ntensorboard = false\n'
    )
    cfg = load_config(f, ["train.steps=9", "log.plots=false", "optim.warmup_steps=1e1"])
    assert cfg.train.steps == 9 and cfg.train.seq_len == 64  # --set wins over the file
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float) and cfg.optim.schedule == "wsd"
    assert cfg.log.tensorboard is False and cfg.log.plots is False and cfg.optim.warmup_steps == 10


def test_dump_roundtrip(tmp_path):
    cfg = load_config(
        None, ['data.path=/a "quoted" path', "train.seed=3", "model.tie_embeddings=false"]
    )
    again = load_config(dump_config(cfg, tmp_path / "c.toml"))
    assert again == cfg


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.step=3", "unknown config key 'train.step'; did you mean 'train.steps'?"),
        ("optim.lrr=3", "did you mean 'optim.lr'?"),
        ("trian.seq_len=3", "did you mean 'train.seq_len'?"),
        (
            "precision.recipe=fp4",
            "precision.recipe='fp4': allowed values are 'none', 'delayed', 'current', 'mxfp8'",
        ),
        (
            "optim.schedule=linear",
            "optim.schedule='linear': allowed values are 'cosine', 'wsd', 'constant'",
        ),
        ("train.steps=0", "train.steps=0: must be an integer >= 1"),
        ("train.steps=abc", "train.steps='abc': expected an int"),
        ("log.tensorboard=maybe", "expected true or false"),
        ("model.top_k=9", "model.top_k=9 exceeds model.num_experts=8"),
        ("train.grad_accum=3", "train.batch_size=8 must be divisible by train.grad_accum=3"),
        ("steps", "expected KEY=VALUE"),
    ],
)
def test_bad_values(override, message):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    assert message in str(e.value)


def test_unknown_key_in_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[checkpoint]\nevry = 5\n")
    with pytest.raises(ValueError, match="did you mean 'checkpoint.every'"):
        load_config(f)
    assert "parallel.ep" in known_keys() and "log.every" in known_keys()


SECTIONS = "sections: model, data, train, optim, precision, parallel, checkpoint, log, finetune"


@pytest.mark.parametrize(
    "override, suggestion",
    [
        ("modle.xyz=1", "; did you mean section [model]?; "),
        ("trainer.whatever=1", "; did you mean section [train]?; "),
        ("foo.bar=1", " (in 'foo.bar'); sections"),  # nothing close: the sections only
        ("batch_size=4", "; did you mean 'train.batch_size'?; "),  # the section left out
        ("optim.steps=4", "; did you mean 'optim.eps' or 'train.steps'?; "),  # another section's
    ],
)
def test_an_unknown_section_names_the_closest_not_every_key(override, suggestion):
    with pytest.raises(ValueError) as e:
        load_config(None, [override])
    msg = str(e.value)
    assert suggestion in msg and SECTIONS in msg and len(msg) < 300, msg
    assert "model.num_experts" not in msg  # the ~80 keys are not listed


def test_an_unknown_key_of_a_known_section_lists_that_section_only():
    with pytest.raises(ValueError) as e:
        load_config(None, ["checkpoint.qqqqqqqq=1"])
    assert "the keys of [checkpoint]: every, keep, async_save; " + SECTIONS in str(e.value)


@pytest.mark.parametrize(
    "schedule, checks",
    [
        ("cosine", [(0, 0.1), (9, 1.0), (10, 1.0), (110, 0.1), (60, 0.55)]),
        ("wsd", [(0, 0.1), (10, 1.0), (88, 1.0), (99, 0.55), (110, 0.1)]),
        ("constant", [(0, 0.1), (50, 1.0), (110, 1.0)]),
    ],
)
def test_lr_schedules(schedule, checks):
    o = load_config(
        None,
        [
            f"optim.schedule={schedule}",
            "optim.warmup_steps=10",
            "optim.min_lr_ratio=0.1",
            "optim.decay_fraction=0.2",
        ],
    ).optim
    for step, want in checks:
        assert lr_factor(step, 110, o) == pytest.approx(want, abs=1e-9), (schedule, step)


def _with_section(monkeypatch):
    """Config with one more section holding a list, a bool and a string (the shape later
    keys such as finetune.lora_targets take; under its own name)."""
    import dataclasses

    from dropless.train.config import load as config_mod

    @dataclasses.dataclass
    class Finetune:
        lora_targets: list[str] = dataclasses.field(default_factory=lambda: ["experts"])
        layers: list[int] = dataclasses.field(default_factory=list)
        saved_fp8: bool = False
        name: str = "x"

    fields = [(f.name, f.type, f) for f in dataclasses.fields(Config)]
    fields.append(("probe", Finetune, dataclasses.field(default_factory=Finetune)))
    monkeypatch.setattr(config_mod, "Config", dataclasses.make_dataclass("Config", fields))
    return config_mod


def test_lists_booleans_and_strings(monkeypatch, tmp_path):
    cm = _with_section(monkeypatch)
    f = tmp_path / "run.toml"
    f.write_text(
        '[probe]\nlora_targets = ["experts", "attention"]\nsaved_fp8 = true\nname = "a b"\n'
    )
    cfg = cm.load_config(f)
    assert cfg.probe.lora_targets == ["experts", "attention"] and cfg.probe.saved_fp8 is True
    sets = [
        'probe.lora_targets=["attention"]',
        "probe.layers=[1, 2]",
        "probe.saved_fp8=false",
        "probe.name=2024",
    ]
    cfg = cm.load_config(f, sets)
    assert cfg.probe.lora_targets == ["attention"] and cfg.probe.layers == [1, 2]
    assert cfg.probe.saved_fp8 is False and cfg.probe.name == "2024"  # a string stays one
    assert cm.load_config(None, ["probe.lora_targets=experts,attention"]).probe.lora_targets == [
        "experts",
        "attention",
    ]
    assert cm.load_config(cm.dump_config(cfg, tmp_path / "out.toml")) == cfg
    for bad, msg in (
        ("probe.layers=[1, 2.5]", "probe.layers=2.5: expected an int (a whole number, e.g. 2)"),
        ("probe.layers=[1, nan]", "must be a finite number"),
        ("probe.lora_targets=[1]", "probe.lora_targets=1: expected a string, got int"),
        ("probe.saved_fp8=[true]", "expected true or false"),
        ("probe.lora_target=[]", "did you mean 'probe.lora_targets'?"),
    ):
        with pytest.raises(ValueError) as e:
            cm.load_config(None, [bad])
        assert msg in str(e.value), bad


def test_python_310_falls_back_to_tomli(monkeypatch, tmp_path):
    import importlib.util
    import sys

    import tomllib as real

    from dropless.train.config import load as config_mod

    monkeypatch.setitem(sys.modules, "tomllib", None)  # as on Python 3.10: no tomllib
    monkeypatch.setitem(sys.modules, "tomli", real)  # the PyPI package of the same parser
    spec = importlib.util.spec_from_file_location(
        "dropless.train.config.load_py310", config_mod.__file__
    )
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dropless.train.config.load_py310", mod)
    spec.loader.exec_module(mod)
    assert mod.tomllib is real
    (tmp_path / "c.toml").write_text("[train]\nsteps = 3\n")
    assert mod.load_config(tmp_path / "c.toml").train.steps == 3


def test_examples_load():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "examples").glob("*.toml"))
    assert len(examples) >= 3
    for f in examples:
        load_config(f)  # every key known, every value valid


def test_activation_checkpointing_uses_the_name_transformers_has():
    from dropless.hf.distributed.parallelize import enable_activation_checkpointing

    calls = []

    class New:
        def activation_checkpointing_enable(self, activation_checkpointing_kwargs=None):
            calls.append(("new", activation_checkpointing_kwargs))

    class Old:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(("old", gradient_checkpointing_kwargs))

    enable_activation_checkpointing(New())
    enable_activation_checkpointing(Old())
    assert calls == [("new", {"use_reentrant": False}), ("old", {"use_reentrant": False})]


def test_header_names_the_class_under_fsdp():
    from dropless.train.build import model_class_name

    class Qwen3MoeForCausalLM:
        pass

    class FSDPModule:
        pass

    fsdp = type("FSDPQwen3MoeForCausalLM", (FSDPModule, Qwen3MoeForCausalLM), {})
    assert (
        model_class_name(fsdp()) == model_class_name(Qwen3MoeForCausalLM()) == "Qwen3MoeForCausalLM"
    )


#: keys a resumed run may change, each with why (every other key is in resume.FIXED_KEYS)
MAY_CHANGE_ON_RESUME = {
    "model.init_std": "used only when weights are created",
    "model.implementation": "the same parameters on either experts path",
    "model.expert_path": "a kernel schedule of the same math",
    "model.attn_implementation": "a kernel choice",
    "data.eval_tokens": "how much held-out text is scored",
    **{
        f"train.{k}": "the loop's options, not the sample order or the tensors"
        for k in (
            "steps",
            "grad_accum",
            "aux_loss_coef",
            "balance_loss",
            "z_loss_coef",
            "activation_checkpointing",
            "fused_cross_entropy",
            "fused_rmsnorm",
            "on_nonfinite",
            "max_skipped_steps",
            "preflight",
        )
    },  # fmt: skip
    # on/off is refused by changed_fixed_keys (the bias buffer); its value may change
    "train.expert_bias_rate": "a rate; on/off is checked on its own",
    "parallel.force_distributed": "the same tensors, sharded over one process; DCP reshards",
}


def _docs_table_keys() -> list[str]:
    """Keys in docs/train.md's configuration table (`section.a, b, c` rows name several)."""
    from pathlib import Path

    text = (Path(__file__).parents[2] / "docs" / "train.md").read_text()
    section = text.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    keys = []
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        first, *rest = line.split("`")[1].split(", ")
        prefix = first.split(".")[0]
        keys += [first] + [f"{prefix}.{name}" for name in rest]
    return keys


def test_every_key_is_documented_and_classified_for_resume():
    import dataclasses

    from dropless.train.checkpoint.resume import FIXED_KEYS
    from dropless.train.config.schema import Config

    walked = [
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(Config)
        for f in dataclasses.fields(type(getattr(Config(), s.name)))
    ]
    assert sorted(walked) == sorted(known_keys())
    documented = _docs_table_keys()
    assert [k for k in walked if k not in documented] == [], "keys missing in docs/train.md"
    assert [k for k in documented if k not in walked] == [], "docs/train.md rows of no key"
    assert len(documented) == len(set(documented))
    may_change = dict(MAY_CHANGE_ON_RESUME)
    for section in ("parallel", "optim", "precision", "log", "checkpoint"):  # run options
        # ... but optim.master_weights: whether the checkpoint holds an fp32 master copy
        may_change.update(
            {k: section for k in walked if k.startswith(section + ".") and k not in FIXED_KEYS}
        )
    unclassified = [k for k in walked if (k in FIXED_KEYS) == (k in may_change)]
    assert unclassified == [], "each key is either fixed on resume or may change"
    assert set(FIXED_KEYS) <= set(walked)
    assert {k for k in walked if k.startswith("finetune.")} <= set(FIXED_KEYS)
