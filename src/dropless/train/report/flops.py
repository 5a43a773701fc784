"""The training FLOPs of a step, for the metrics (MFU) and the plan, and how a FLOP rate
reads."""

# T tokens, L sequence length

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..run.lazy import hf


@dataclass
class FlopCounter:
    """Training FLOPs of one step from the tokens actually routed (formula in docs/train.md).

    forward = 2 * T * dense + 2 * P * expert + attention, training = 3 * forward, where
    dense counts the weights every token multiplies (attention projections, routers, dense
    or shared MLPs, LM head), expert the weights of one expert (gate_up + down), P the
    (token, expert) pairs computed over all MoE layers, and attention (causal) is
    2 * L^2 * H * head_dim per sequence and layer (QK^T and AV, half the square each).
    """

    dense_params: int
    expert_params: int
    attn_per_seq_l2: float  # multiply by L^2 per sequence
    # LoRA: the frozen base gets no weight gradient, so backward is one forward's worth
    # (input gradients only; the adapters' own FLOPs are left out): training = 2 * forward
    frozen_base: bool = False

    @classmethod
    def from_model(cls, model: nn.Module) -> FlopCounter:
        layers = hf().moe_layers(model)
        expert_mods = {id(layer.experts) for layer in layers}
        dense = sum(
            m.weight.numel()
            for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and ".lora_" not in n  # LoRA factors: not dense layers
        )
        dense += sum(
            layer.router.weight.numel()
            for layer in layers
            if layer.router is not None and not isinstance(layer.router, nn.Linear)
        )
        ex = layers[0].experts
        expert = sum(
            p[0].numel()
            for n, p in ex.named_parameters(recurse=False)
            if p.dim() == 3 and not n.startswith("lora_")  # the experts' own LoRA factors
        )
        assert len(expert_mods) == len(layers)
        c = model.config
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        return cls(dense, expert, 2.0 * heads * head_dim * c.num_hidden_layers)

    def step_flops(self, sequences: int, seq_len: int, routed_pairs: int) -> float:
        tokens = sequences * seq_len
        fwd = 2.0 * tokens * self.dense_params + 2.0 * routed_pairs * self.expert_params
        fwd += sequences * self.attn_per_seq_l2 * seq_len * seq_len
        return (2.0 if self.frozen_base else 3.0) * fwd


def rate(tflops: float) -> str:
    """A FLOP rate in the unit that reads best (CPU peaks are GFLOP/s, GPU peaks TFLOP/s)."""
    return f"{tflops:.4g} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:.4g} GFLOP/s"
