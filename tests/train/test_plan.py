"""`dropless plan`: the JSON contract, the verdict and its exit code, bad input, the skew
at which a layout stops fitting, and `dropless train`'s preflight refusal on GPUs."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from dropless.cli.main import main  # noqa: E402
from dropless.train.config.load import load_config  # noqa: E402
from dropless.train.plan import preflight as PF  # noqa: E402
from dropless.train.plan import trace as P  # noqa: E402

CONTRACT = {
    "peak_gib_per_gpu", "reserve_gib", "fits", "max_skew", "breakdown_gib",
    "tokens_per_s_per_gpu", "assumptions",
}  # fmt: skip


def _json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_json_contract_and_fitting_verdict(capsys):
    rc = main(["plan", "examples/tiny.toml", "--gpus", "1", "--gpu-memory-gib", "80", "--json"])
    d = _json(capsys)
    assert rc == 0 and d["fits"] is True
    assert CONTRACT <= set(d)
    assert sum(d["breakdown_gib"].values()) == pytest.approx(d["peak_gib_per_gpu"], abs=1e-8)
    assert d["reserve_gib"] >= P.CONTEXT_GIB  # one process: no NCCL share
    assert d["tokens_per_s_per_gpu"] > 0
    assert "estimate" in d["assumptions"]["throughput"]
    assert d["activations_other_checkpointing_gib"] < d["breakdown_gib"]["activations"] + 1e-9
    # the activation peak over forward/backward, wherever the overall peak falls
    assert d["activation_peak_gib"] >= d["breakdown_gib"]["activations"] > 0


def test_does_not_fit_exits_1_and_says_so(capsys):
    rc = main(["plan", "examples/tiny.toml", "--gpus", "1", "--gpu-memory-gib", "0.5"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "does NOT fit" in out and "estimate" in out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "3", "--set", "parallel.ep=2"], "parallel"),
        (["--gpus", "1", "--skew", "0.5"], "--skew 0.5"),
        (["--gpus", "0"], "--gpus 0"),
    ],
)
def test_bad_input_is_one_error_line(capsys, args, needle):
    rc = main(["plan", "examples/tiny.toml", "--gpu-memory-gib", "80", *args])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err


def test_help_states_every_assumption(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    out = capsys.readouterr().out
    for word in ("fake process group", "declare", "reserve", "ESTIMATE", "387", "790", "skew"):
        assert word in out, word


def test_expert_parallel_memory_grows_with_skew_and_max_skew_bounds_it():
    cfg = load_config("examples/tiny.toml", ["parallel.ep=2", "train.batch_size=64"])
    hc = P.resolve_hf_config(cfg)
    lo = P.make_plan(cfg, 2, 80, skew=1.0, hf_config=hc, compare_checkpointing=False)
    hi = P.make_plan(cfg, 2, 80, skew=2.0, hf_config=hc, compare_checkpointing=False)
    assert hi.peak_gib_per_gpu > lo.peak_gib_per_gpu
    assert hi.all_to_all_gib > lo.all_to_all_gib > 0
    assert lo.max_skew == P._skew_cap(hc, 2) == 2.0  # 80 GiB: fits at any possible skew
    # a budget between the two peaks: the layout stops fitting at a skew between them
    room = (hi.peak_gib_per_gpu + lo.peak_gib_per_gpu) / 2 * (1 + P.FRAGMENTATION)
    budget = room + P.CONTEXT_GIB + P.NCCL_GIB
    mid = P.make_plan(cfg, 2, budget, skew=2.0, hf_config=hc, compare_checkpointing=False)
    assert not mid.fits and 1.0 < mid.max_skew < 2.0


def test_preflight_refuses_a_predicted_oom_on_cuda_only(monkeypatch):
    cfg = load_config("examples/tiny.toml", [])
    hc = P.resolve_hf_config(cfg)
    PF.check_plan_fits(cfg, hc, 1, torch.device("cpu"))  # CPU: never traced
    on = load_config("examples/tiny.toml", ["train.activation_checkpointing=true"])
    need = [
        (p.peak_gib_per_gpu + p.reserve_gib)
        for p in (
            P.make_plan(c, 1, 80, hf_config=hc, compare_checkpointing=False) for c in (cfg, on)
        )
    ]
    assert need[1] < need[0]  # checkpointing keeps less for backward
    monkeypatch.setattr(PF, "device_memory_gib", lambda device: sum(need) / 2)
    with pytest.raises(ValueError, match="does not fit") as e:
        PF.check_plan_fits(cfg, hc, 1, torch.device("cuda", 0))
    msg = str(e.value)
    assert "train.preflight=false" in msg
    assert "predicted to fit: train.activation_checkpointing=true" in msg
    PF.check_plan_fits(on, hc, 1, torch.device("cuda", 0))  # the suggestion does fit
    off = load_config("examples/tiny.toml", ["train.preflight=false"])
    PF.check_plan_fits(off, hc, 1, torch.device("cuda", 0))  # skipped when asked


def test_lora_plan_traces_a_frozen_base(tmp_path):
    """LoRA on a config-only model.path: the frozen base has parameters and no optimizer
    state (torch's tracker refuses hooks on frozen parameters; the planner's skips them)."""
    base = load_config("examples/tiny.toml", [])
    P.resolve_hf_config(base).save_pretrained(tmp_path)  # config.json only, no weights
    sets = [f"model.path={tmp_path}", "data.tokenizer=bytes"]
    full = P.make_plan(load_config("examples/tiny.toml", sets), 1, 80, compare_checkpointing=False)
    lora_cfg = load_config(
        "examples/tiny.toml", [*sets, "finetune.method=lora", "finetune.lora_rank=1"]
    )
    lora = P.make_plan(lora_cfg, 1, 80, compare_checkpointing=False)
    f, lo = full.breakdown_gib, lora.breakdown_gib
    assert lo["parameters"] >= f["parameters"]  # the base plus the adapters
    assert 0 < lo["optimizer_states"] < 0.2 * f["optimizer_states"]
    assert lora.layout["finetune"] == "lora"


def test_preflight_under_a_process_group_plans_in_a_child_process():
    """torchrun: this process is in a process group, so the verdict comes from a fresh
    process (the one a real run's rank 0 starts, handed the same config objects), with the
    same figures; a failure there is an answer, not an exception."""
    cfg = load_config("examples/tiny.toml", [])
    hc = P.resolve_hf_config(cfg)
    here = PF.verdict(cfg, hc, 1, 0.5)
    child = PF.verdict_in_child(cfg, hc, 1, 0.5)
    assert child["fits"] is here["fits"] is False
    assert child["peak"] == pytest.approx(here["peak"], rel=1e-9)
    assert child["fixes"] == here["fixes"]
    failed = PF.verdict_in_child(cfg, hc, 0, 0.5)  # no processes: the planner refuses
    assert failed["error"].startswith("the plan's process failed: "), failed


def _tiny_deepseek(path) -> None:
    """A 2-layer DeepSeek-V3 config.json: MLA with query/key head dim 24, value 16."""
    import transformers

    transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1024,
    ).save_pretrained(path)  # fmt: skip


def test_sdpa_is_traced_as_the_gpu_kernels_keep_it(tmp_path):
    """With query and value head dims apart (MLA) CPU sdpa falls back to the math path and
    materializes the [B, H, L, L] scores; GPU kernels do not, and neither does the plan:
    its sdpa peak stays below eager attention's by more than one layer's fp32 scores."""
    _tiny_deepseek(tmp_path)
    sets = [f"model.path={tmp_path}", "data.tokenizer=bytes", "train.seq_len=512"]
    sets += ["train.batch_size=2", "precision.dtype=fp32"]
    peaks = {
        attn: P.make_plan(
            load_config(None, [*sets, f"model.attn_implementation={attn}"]), 1, 80,
            compare_checkpointing=False,
        ).peak_gib_per_gpu * 2**30
        for attn in ("sdpa", "eager")
    }  # fmt: skip
    scores = 2 * 4 * 512 * 512 * 4  # B x H x L x L fp32
    assert peaks["eager"] - peaks["sdpa"] > scores


def test_sdpa_plan_grows_linearly_with_the_sequence():
    """Flash-style attention keeps O(L) per sequence, and so does the plan of one: from
    4,096 to 8,192 tokens its activation peak doubles. On fake tensors Transformers'
    `sdpa_mask` builds an [L, L] causal mask the GPU run never holds; traced, it made the
    plan grow ~4x here."""
    peaks = []
    for L in (4096, 8192):
        sets = ["train.activation_checkpointing=true", f"train.seq_len={L}", "train.batch_size=1"]
        sets += [f"model.max_position_embeddings={L}", "precision.dtype=fp32"]
        cfg = load_config("examples/tiny.toml", sets)
        peaks.append(P.make_plan(cfg, 1, 80, compare_checkpointing=False).activation_peak_gib)
    assert 1.8 < peaks[1] / peaks[0] < 2.2, peaks


def test_bf16_family_with_fp32_kept_parameters_plans(tmp_path, capsys):
    """DeepSeek-V3 keeps its router weight in fp32 under model.dtype=bf16; FSDP2 takes one
    dtype per unit, so each such router is its own fp32 unit (`apply_fsdp`), as in
    dropless train: the plan runs, and its parameters are about half the fp32 plan's."""
    _tiny_deepseek(tmp_path)
    args = ["plan", "--set", f"model.path={tmp_path}", "--set", "data.tokenizer=bytes"]
    args += ["--set", "train.seq_len=16", "--set", "train.batch_size=2", "--gpus", "2"]
    args += ["--gpu-memory-gib", "80", "--json"]
    params = {}
    for dtype in ("bf16", "fp32"):
        assert main([*args, "--set", f"model.dtype={dtype}"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        params[dtype] = out["breakdown_gib"]["parameters"]
    # bf16 storage halves every parameter but the fp32 routers (a few percent here)
    assert 0.5 < params["bf16"] / params["fp32"] < 0.6, params


def test_planner_refuses_a_process_in_a_process_group(tmp_path):
    """The fake process group needs the default group slot: a process already in a real
    group (torchrun) plans in a child (see the preflight test) and never here."""
    import torch.distributed as dist

    from dropless.train.plan.trace import fake_world

    dist.init_process_group(
        "gloo", store=dist.FileStore(str(tmp_path / "s"), 1), rank=0, world_size=1
    )
    try:
        with pytest.raises(RuntimeError, match="needs a process without a process group"):
            with fake_world(2):
                pass
    finally:
        dist.destroy_process_group()
