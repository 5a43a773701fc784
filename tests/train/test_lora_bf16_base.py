"""A LoRA run with `model.dtype=bf16` keeps the frozen base in bf16 from the load on: the
checkpoint loader is asked for bf16 (no fp32 model is built and cast), every frozen
parameter is bf16 right after the build, the adapters are fp32, and a training step
without autocast runs (the bf16 base computes, the fp32 adapters get fp32 gradients)."""

import pytest
import torch

from harness import tiny_moe_config

pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from dropless.train.config.load import load_config  # noqa: E402
from dropless.train.model.build import build_training_model, hf_config  # noqa: E402
from dropless.train.report.flops import FlopCounter  # noqa: E402


def _saved(path):
    cfg = tiny_moe_config(
        vocab_size=264, num_experts=4, norm_topk_prob=False, pad_token_id=None, bos_token_id=None
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


def test_bf16_lora_base_loads_and_stays_bf16(tmp_path, monkeypatch):
    src = _saved(tmp_path / "src")  # an fp32 checkpoint
    cfg = load_config(
        None,
        [f"model.path={src}", "model.dtype=bf16", "finetune.method=lora", "finetune.lora_rank=4"],
    )
    asked = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        asked.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, par = build_training_model(
        cfg.model, hf_config(cfg.model, 257), cfg.parallel, 1, expert_bias=False, seed=0,
        device=torch.device("cpu"), finetune=cfg.finetune,
    )  # fmt: skip
    monkeypatch.undo()
    assert par is None and asked == [torch.bfloat16]
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
    trained = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert frozen and set(frozen.values()) == {torch.bfloat16}, frozen
    assert trained and set(trained.values()) == {torch.float32}, trained
    assert any("experts.lora_A_first" in n for n in trained)
    # the FLOP count's expert weights are the base's (gate_up 2F x D + down D x F), not the factors
    assert FlopCounter.from_model(model).expert_params == 3 * 16 * 32

    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    out = model(input_ids=ids, labels=ids)  # no autocast: the base's bf16 computes
    out.loss.backward()
    assert torch.isfinite(out.loss)
    for n, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.dtype == torch.float32, n
        else:
            assert p.grad is None and p.dtype == torch.bfloat16, n
