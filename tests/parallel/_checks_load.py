"""Fine-tuning a checkpoint on several processes: the model is built on the meta device,
sharded (expert parallelism x FSDP2), and each rank reads only its shards from the
safetensors files. Checks: every weight equals the stock `from_pretrained` load, logits
match, and the loading raised the rank's peak memory by about 1/world of the model."""

# B sequences, L sequence length, V vocabulary, E experts

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

B, L, V, E = 2, 6, 4096, 8


def _config():
    import transformers

    return transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=256, moe_intermediate_size=1536,
        n_routed_experts=E, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip


def _status() -> dict[str, int]:
    """Resident memory now and its peak (KiB, from /proc)."""
    rows = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    return {k: int(rows[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def _save(path: Path) -> None:
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # loaded, not left at zero
                buf.copy_(torch.randn(buf.shape) * 0.1)
    model.save_pretrained(path)


def hf_sharded_load(rank, world):
    import transformers

    from dropless.hf.distributed.expert_parallel import hf_dispatchers
    from dropless.train.config.load import ModelConfig, ParallelConfig
    from dropless.train.model.build import build_training_model, hf_config

    path = Path(os.environ["DROPLESS_PARALLEL_TEST_DIR"]) / "sharded_load"
    if rank == 0:
        _save(path)
    dist.barrier()
    mcfg = ModelConfig(path=str(path))
    config = hf_config(mcfg, V)
    import safetensors.torch  # noqa: F401  (imports before measuring: code is memory too)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    import dropless.train.model.parallelize  # noqa: F401

    with torch.device("meta"):
        transformers.AutoModelForCausalLM.from_config(config)
    Path("/proc/self/clear_refs").write_text("5")  # restart the peak (VmHWM) from here
    before = _status()["VmRSS"]
    model, _ = build_training_model(
        mcfg, config, ParallelConfig(ep=world), world, expert_bias=False, seed=0, device="cpu"
    )
    grown_mib = (_status()["VmHWM"] - before) / 1024
    print(f"rank {rank}: loading raised the peak by {grown_mib:.1f} MiB", flush=True)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    full_mib = sum(p.numel() * 4 for p in ref.parameters()) / 2**20
    # about 1/world of the weights (+ a few MiB of process groups); the whole model: >= 1.0
    assert 0.3 < grown_mib / full_mib < 0.7, (grown_mib, full_mib)
    state = ref.state_dict()
    assert len(hf_dispatchers(model)) == 2  # experts sharded over "ep"
    for name, t in model.state_dict().items():
        got = t.full_tensor() if hasattr(t, "full_tensor") else t
        assert torch.equal(got, state[name]), name
    for name, buf in ref.named_buffers():  # non-persistent ones too (rotary inv_freq)
        assert torch.equal(model.get_buffer(name), buf), name
    ids = torch.randint(0, V, (world * B, L), generator=torch.Generator().manual_seed(1))
    mine = ids[rank * B : (rank + 1) * B]
    with torch.no_grad():
        got = model(input_ids=mine).logits
        want = ref(input_ids=mine).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
