"""Small pieces shared by the two fused expert-MLP Functions (the activation's math is
in `activation/eager.py`): a weight operand of one expert, the row bounds of each expert, and
the named gradient slots of their inputs."""

# n rows of one expert, E experts

from __future__ import annotations

from dataclasses import dataclass


def wt(w, e, trans_w):
    """The [in, out] operand of expert e: w[e]^T for the nn.Linear layout, else w[e]."""
    return w[e].t() if trans_w else w[e]


def bounds(counts):
    lo = 0
    for e, n in enumerate(counts):
        if n:
            yield e, lo, lo + n
        lo += n


@dataclass(frozen=True)
class Needs:
    """Which inputs of a fused MLP Function want a gradient, by name. Both Functions
    take (x, prob, gate_up, down, gate_up bias, down bias, ...) first and, when low-rank
    updates come in, their factors (a1, b1, a2, b2) and scales at `lora_at`."""

    x: bool
    prob: bool
    gate_up: bool
    down: bool
    gate_up_bias: bool
    down_bias: bool
    a1: bool = False
    b1: bool = False
    a2: bool = False
    b2: bool = False

    @classmethod
    def of(cls, ctx, lora_at: int) -> Needs:
        need = ctx.needs_input_grad
        lora = need[lora_at : lora_at + 4] if len(need) > lora_at else ()
        return cls(*need[:6], *lora)


def input_grads(ctx, lora_at: int, base: tuple, lora: tuple = (None,) * 4) -> tuple:
    """backward's result: the six base gradients, None for the inputs up to `lora_at`,
    then (when factors came in) the four factor gradients and None for the scales."""
    grads = base + (None,) * (lora_at - len(base))
    return grads + ((*lora, None) if len(ctx.needs_input_grad) > lora_at else ())
