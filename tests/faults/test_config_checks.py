"""Config values torch would reject later are refused up front, naming the key: resuming a
LoRA run with other adapters, AdamW betas, seeds and timeouts out of torch's ranges, and a
model too big for this machine's memory (refused before anything is built)."""

import shutil

import pytest
import torch

from dropless.cli.main import main
from harness import tiny_moe_config

from .faults_util import args, snapshot


def _saved_model(path):
    import transformers as tf

    cfg = tiny_moe_config(
        vocab_size=264, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, intermediate_size=32, num_experts=4, norm_topk_prob=False,
        pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished 2-step LoRA (rank 4) run of a saved 1-layer Qwen3-MoE."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    src = _saved_model(root / "src")
    lora = (
        f"model.path={src}", "finetune.method=lora", "finetune.lora_rank=4", "train.steps=2",
        "train.seq_len=16", "train.batch_size=2", "checkpoint.every=2", "log.plots=false",
        "log.tensorboard=false",
    )  # fmt: skip
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert main(["train", "--run-dir", str(root / "run"), *args(*lora)]) == 0
    finally:
        torch.set_num_threads(n)
    return root / "run"


@pytest.mark.parametrize(
    "override, named",
    [
        ("finetune.lora_rank=8", "finetune.lora_rank: checkpoint 4, now 8"),
        ("finetune.lora_targets=experts", "finetune.lora_targets: checkpoint ['experts', 'attention'], now ['experts']"),
        ("finetune.method=full", "finetune.method: checkpoint 'lora', now 'full'"),
    ],
)  # fmt: skip
def test_resume_with_other_adapters_is_refused_in_one_line(
    lora_run, tmp_path, override, named, capsys
):
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    before = snapshot(run)
    assert main(["train", "--run-dir", str(run), "--resume", "--set", override]) == 2
    err = capsys.readouterr().err
    assert "--resume: the checkpoint" in err and named in err and err.count("\n") == 1, err
    assert snapshot(run) == before


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.beta1=1", "optim.beta1=1.0: must be in [0, 1) (AdamW's moving-average decay"),
        ("optim.beta2=1", "optim.beta2=1.0: must be in [0, 1)"),
        ("train.seed=1e30", "train.seed=1000000000000000019884624838656: must be an integer in [0, 2**63) (torch.manual_seed's range)"),
        ("train.seed=-1", "train.seed=-1: must be an integer in [0, 2**63)"),
        ("parallel.timeout_s=1e300", "parallel.timeout_s=1e+300: must be at most 1e+09 seconds"),
        ("parallel.timeout_s=1e10", "torch.distributed's limit is int64 nanoseconds"),
        ("train.steps=1e19", "train.steps=10000000000000000000: must be below 2**63 (torch counts in int64)"),
        ("train.max_skipped_steps=1e30", "train.max_skipped_steps=1000000000000000019884624838656: must be below 2**63"),
        ("model.num_experts=1500000.5", "model.num_experts=1500000.5: expected an int (a whole number, e.g. 1500000)"),
    ],
)  # fmt: skip
def test_values_torch_would_reject_are_refused_naming_the_key(tmp_path, override, message, capsys):
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *args(override)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
    assert not run.exists()  # refused before the run directory is made


def test_config_objects_check_the_same_ranges():
    from dropless.train.config.schema import OptimConfig, TrainSection

    with pytest.raises(ValueError, match=r"optim.beta2=1: must be in \[0, 1\)"):
        OptimConfig(beta2=1)
    with pytest.raises(ValueError, match=r"optim.lr=inf: must be a finite number"):
        OptimConfig(lr=float("inf"))
    with pytest.raises(
        ValueError, match=r"train.seed=9223372036854775808: must be an integer in \[0, 2\*\*63\)"
    ):
        TrainSection(seed=2**63)
    assert TrainSection(seed=2**63 - 1).seed == 2**63 - 1
    assert OptimConfig(beta1=0, beta2=0.999999).beta2 == 0.999999


@pytest.mark.parametrize(
    "override, named",
    [
        ("model.num_experts=1e6", "lower model.num_experts=1000000, model.moe_intermediate_size=32"),
        ("model.head_dim=1e9", "lower model.num_heads=2, model.num_kv_heads=1, model.head_dim=1000000000"),
        ("model.vocab_size=1e12", "lower model.vocab_size=1000000000000, model.hidden_size=32 (embeddings: 100%"),
    ],
)  # fmt: skip
def test_a_model_this_machine_cannot_hold_is_refused_before_it_is_built(
    tmp_path, override, named, capsys
):
    """model.num_experts=1e6 (787B parameters) invoked the OOM killer; now one line."""
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *args(override)]) == 2
    err = capsys.readouterr().err
    assert "dropless train: error: the run needs at least " in err and err.count("\n") == 1, err
    assert "GiB of host memory" in err and named in err, err
    assert not run.exists()


def test_memory_estimate_counts_parameters_and_activations(monkeypatch, tmp_path, capsys):
    from dropless.train.config.load import load_config
    from dropless.train.config.recipes import TINY
    from dropless.train.model.build import hf_config
    from dropless.train.plan import memory_fit

    cfg = load_config(None, list(TINY))
    config = hf_config(cfg.model, 257)
    params = sum(memory_fit.parameter_counts(config).values())
    import transformers

    built = transformers.AutoModelForCausalLM.from_config(config)
    assert params == sum(p.numel() for p in built.parameters())  # the meta count is exact
    need = 16 * params + 4 * 32 * 4 * 32 * 2  # weights+grads+AdamW, one [T, D] per layer
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory_fit, "available_host_bytes", lambda: need)
    memory_fit.check_fits_memory(cfg, config, 1, cpu)  # exactly enough: kept
    monkeypatch.setattr(memory_fit, "available_host_bytes", lambda: need - 1)
    with pytest.raises(
        ValueError,
        match="lower model.num_experts=4, model.moe_intermediate_size=32, model.hidden_size=32, model.num_layers=2 .experts: ",
    ):
        memory_fit.check_fits_memory(cfg, config, 1, cpu)
    # activations dominate: the batch keys are named; through the CLI, nothing is written
    run = tmp_path / "run"
    assert main(["train", "--run-dir", str(run), *args("train.batch_size=4096")]) == 2
    err = capsys.readouterr().err
    assert "lower train.batch_size=4096, train.seq_len=32 (or raise train.grad_accum=1)" in err, err
    assert not run.exists()


@pytest.mark.parametrize(
    "dtype, master, per_param",
    [("fp32", "true", 16), ("bf16", "true", 16), ("bf16", "false", 12)],
)
def test_memory_estimate_follows_model_dtype_and_master_weights(
    monkeypatch, dtype, master, per_param
):
    """bf16 weights and gradients with fp32 moments need 12 bytes a parameter, 16 with an
    fp32 master: a lower bound must not refuse what fits."""
    from dropless.train.config.load import load_config
    from dropless.train.config.recipes import TINY
    from dropless.train.model.build import hf_config
    from dropless.train.plan import memory_fit

    cfg = load_config(None, [*TINY, f"model.dtype={dtype}", f"optim.master_weights={master}"])
    config = hf_config(cfg.model, 257)
    params = sum(memory_fit.parameter_counts(config).values())
    need = per_param * params + 4 * 32 * 4 * 32 * 2  # the state, one [T, D] per layer
    cpu = torch.device("cpu")
    monkeypatch.setattr(memory_fit, "available_host_bytes", lambda: need)
    memory_fit.check_fits_memory(cfg, config, 1, cpu)  # exactly enough: kept
    monkeypatch.setattr(memory_fit, "available_host_bytes", lambda: need - 1)
    with pytest.raises(ValueError, match=f"{per_param} bytes each"):
        memory_fit.check_fits_memory(cfg, config, 1, cpu)
