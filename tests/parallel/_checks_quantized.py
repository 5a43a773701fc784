"""Checks in spawned processes: quantised checkpoints (block-FP8 `weight_scale_inv`, MXFP4
`_blocks` / `_scales`) loaded by several processes, as `dropless train --set model.path=DIR`
under torchrun loads them: each rank dequantises only its own slices (its experts under
ep=2; its FSDP rows, some starting inside an FP8 block, under FSDP only), and every slice
equals the same region of Transformers' own dequantisation of the same tensors (fp32
exactly; bf16 as that fp32 result rounded once)."""

# E experts, V vocabulary

from __future__ import annotations

import importlib.util
import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from harness import tiny_moe_config

E, V = 4, 64
_DIRS: dict[str, Path] = {}


def _hf_test_module():
    """tests/hf/test_quantized_weights.py (its FP8 checkpoint writer), under its own name."""
    path = Path(__file__).resolve().parents[1] / "hf" / "test_quantized_weights.py"
    spec = importlib.util.spec_from_file_location("hf_test_quantized_weights", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write_fp8(root: Path) -> None:
    """A Qwen3-MoE checkpoint with every projection in block-FP8 (8 x 8 blocks) and its
    reference dequantised by Transformers. k_proj / v_proj have 8 rows: FSDP gives rank 1
    rows [4, 8), a region that starts inside a block."""
    import transformers

    cfg = tiny_moe_config(
        vocab_size=V, intermediate_size=64, num_key_value_heads=1, num_experts=E,
        max_position_embeddings=32, pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(root / "plain")
    hf = _hf_test_module()
    assert hf.FP8_BLOCK == (8, 8)
    hf._write_fp8(root / "plain", root / "fp8", root / "fp8_deq")


def _write_mxfp4(root: Path) -> None:
    """A GPT-OSS checkpoint with MXFP4 experts ([E, out, G, 16] blocks, [E, out, G] scales)
    and its reference dequantised by Transformers (`convert_moe_packed_tensors`)."""
    import transformers
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = transformers.GptOssConfig(
        vocab_size=V, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_local_experts=E,
        num_experts_per_tok=2, max_position_embeddings=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GptOssForCausalLM(cfg).save_pretrained(root / "gpt_plain")
    gen = torch.Generator().manual_seed(5)
    quant, deq = {}, {}
    for k, w in load_file(root / "gpt_plain" / "model.safetensors").items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            e, n_in, n_out = w.shape  # stored [E, in, out]; packed along `in`
            shape = (e, n_out, n_in // 32)
            blocks = torch.randint(0, 256, (*shape, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(122, 128, shape, generator=gen, dtype=torch.uint8)
            quant[k + "_blocks"], quant[k + "_scales"] = blocks, scales
            deq[k] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        else:
            quant[k] = deq[k] = w
    for d, tensors in (("mxfp4", quant), ("mxfp4_deq", deq)):
        shutil.copytree(root / "gpt_plain", root / d)
        save_file(tensors, root / d / "model.safetensors", metadata={"format": "pt"})
    meta = json.loads((root / "mxfp4" / "config.json").read_text())
    meta["quantization_config"] = {"quant_method": "mxfp4"}
    (root / "mxfp4" / "config.json").write_text(json.dumps(meta))


def _checkpoints() -> Path:
    """The two quantised checkpoints and their references, written once by rank 0."""
    if "root" not in _DIRS:
        box = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)  # one directory on this machine for every rank
        root = Path(box[0])
        if dist.get_rank() == 0:
            _write_fp8(root)
            _write_mxfp4(root)
        dist.barrier()
        _DIRS["root"] = root
    return _DIRS["root"]


def _quantized(name: str, key: str) -> bool:
    """Whether model tensor `key` comes from quantised checkpoint tensors: the experts'
    projections in both checkpoints, the attention projections in the FP8 one (what the
    writers quantise)."""
    if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    return name == "fp8" and "self_attn." in key and key.endswith("proj.weight")


def _load_and_compare(name: str, parallel, dtype: str, rank: int, world: int) -> dict:
    """Load checkpoint `name` sharded per `parallel`; every rank's slice of every tensor
    equals that region of Transformers' dequantised reference. Returns {tensor: offset}
    of this rank's quantised slices."""
    import transformers

    from dropless.hf.distributed.sharded_load import _region
    from dropless.train.config.schema import ModelConfig
    from dropless.train.model.build import build_training_model, hf_config

    root = _checkpoints()
    mcfg = ModelConfig(path=str(root / name), dtype=dtype, attn_implementation="eager")
    model, par = build_training_model(
        mcfg, hf_config(mcfg, V), parallel, world, expert_bias=False, seed=0, device="cpu"
    )
    assert par is not None
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        root / f"{name}_deq", dtype=torch.float32
    ).state_dict()
    want_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    seen = {}
    for key, t in model.state_dict().items():
        if key not in ref:
            continue  # the expert biases dropless adds (zeros)
        local, offset = _region(t)
        region = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
        want = ref[key][region].to(local.dtype)  # fp32 from Transformers, rounded once
        assert torch.equal(local, want), f"rank {rank}: {key} at {offset}"
        if _quantized(name, key) and local.numel():
            assert local.dtype == want_dtype, (key, local.dtype)
            seen[key] = offset
    assert seen, "no quantised tensor on this rank"
    return seen


def quantized_load_ep(rank, world):
    """ep=2: each rank dequantises its own experts (FP8 per-expert, MXFP4 fused)."""
    from dropless.parallel import ParallelConfig

    for name in ("fp8", "mxfp4"):
        seen = _load_and_compare(name, ParallelConfig(ep=world), "fp32", rank, world)
        experts = [o for k, o in seen.items() if "experts" in k]
        assert experts and all(o[0] == rank * (E // world) for o in experts), (name, experts)


def quantized_load_fsdp(rank, world):
    """FSDP only (ep=1), bf16: each rank its rows of every tensor, dequantised straight
    into bf16; on rank 1 k_proj's rows [4, 8) start inside an 8 x 8 FP8 block."""
    from dropless.parallel import ParallelConfig

    seen = _load_and_compare("fp8", ParallelConfig(), "bf16", rank, world)
    k_proj = [o for k, o in seen.items() if k.endswith("self_attn.k_proj.weight")]
    assert len(k_proj) == 2 and all(o[0] == 4 * rank for o in k_proj), k_proj
    _load_and_compare("mxfp4", ParallelConfig(), "bf16", rank, world)
