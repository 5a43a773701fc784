"""Config: TOML + --set, validation messages, unknown keys, the resolved dump."""

import pytest

from dropless.train.config import Config, dump_config, known_keys, load_config
from dropless.train.trainer import lr_factor


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
        ("train.steps=abc", "train.steps='abc': expected a int"),
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
