"""Hugging Face Transformers v5 integration: one line makes stock MoE models use dropless.

    import dropless
    report = dropless.patch()                          # models built/loaded afterwards
    model = AutoModelForCausalLM.from_pretrained(path) # ... run their experts via dropless
    print(report)                                      # which modules run which path
    dropless.patch_model(model, expert_bias=True)      # or switch a model already built
    dropless.hf.save_hf(model, "out")                  # stock-loadable checkpoint
    dropless.unpatch()                                 # stock behaviour, exactly

Transformers is imported on first use (`pip install 'dropless[hf]'`). The names below are
the ones the docs tell a user to call; everything else is imported from its own module.
"""

from .distributed.expert_parallel import shard_hf_experts
from .distributed.parallelize import parallel_mesh, parallelize
from .distributed.peft_save import save_expert_lora_as_peft, save_lora_adapter
from .distributed.sharded_load import load_sharded_hf
from .distributed.trainer_checkpoint import trainer_checkpoints
from .experts.forward import (
    DroplessFallbackWarning,
    DroplessGenericGateWarning,
    experts_spec,
    register_experts_hook,
)
from .experts.router_losses import RouterLosses, RouterStats
from .fusions.fused_loss import disable_fused_cross_entropy, enable_fused_cross_entropy
from .layers import MoELayer, added_state_keys, moe_layers, save_hf, tokens_per_expert
from .lora.expert_lora import (
    attach_expert_lora,
    experts_to_peft,
    load_peft_into_experts,
    peft_to_experts,
)
from .lora.peft_lora import DroplessLoRAFallbackWarning
from .patching.patch import patch, patch_model, report, unpatch, unpatch_model
from .patching.report import ModelRecord, ModuleRecord, PatchReport

__all__ = [
    # switch models to the dropless experts path and back (docs/hf.md)
    "patch",
    "patch_model",
    "report",
    "unpatch",
    "unpatch_model",
    "PatchReport",
    "ModelRecord",
    "ModuleRecord",
    "experts_spec",
    "DroplessFallbackWarning",
    "DroplessGenericGateWarning",
    # a patched model's MoE layers, token counts, hooks and checkpoints (docs/hf.md)
    "MoELayer",
    "moe_layers",
    "tokens_per_expert",
    "register_experts_hook",
    "RouterLosses",
    "RouterStats",
    "added_state_keys",
    "save_hf",
    # the loss from hidden states (docs/hf.md, docs/genomics.md)
    "enable_fused_cross_entropy",
    "disable_fused_cross_entropy",
    # expert parallelism, FSDP2 and sharded loading for any training loop (docs/hf.md)
    "parallelize",
    "parallel_mesh",
    "save_lora_adapter",
    "trainer_checkpoints",
    # expert parallelism and sharded loading (docs/parallel.md)
    "shard_hf_experts",
    "load_sharded_hf",
    # LoRA on fused experts (docs/lora.md)
    "DroplessLoRAFallbackWarning",
    "attach_expert_lora",
    "peft_to_experts",
    "experts_to_peft",
    "save_expert_lora_as_peft",
    "load_peft_into_experts",
]
