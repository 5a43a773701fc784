"""AdamW for parameters stored in bf16 (`model.dtype=bf16`).

The moments are fp32. With `master_weights=True` each parameter also has an fp32 master
copy (an optimizer state, so under FSDP2 it is sharded as the parameter is): the update
runs on the master, which is then rounded to nearest into the bf16 parameter; that is
torch's AdamW on fp32 weights, step for step. With `master_weights=False` the bf16
parameter itself is updated, and the fp32 result is rounded stochastically (up or down
with probabilities that make the rounding unbiased), so updates far below one bf16 ulp
still move the weights on average instead of vanishing. Bytes per parameter with its
gradient: fp32 training 4 + 4 + 8 (moments) = 16; bf16 with a master 2 + 2 + 4 + 8 = 16;
bf16 without one 2 + 2 + 8 = 12.

Every operation is elementwise, so a DTensor parameter is updated through its local
shard. Temporaries are at most a few tensors of one parameter's size, never the model's.
"""

from __future__ import annotations

import math

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def stochastic_round_to_bf16(x: torch.Tensor, generator=None) -> torch.Tensor:
    """fp32 `x` rounded to bf16 up or down, P(up) = the distance to the lower neighbour
    over one ulp, so E[round(x)] = x. Values a bf16 holds exactly are returned unchanged."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic rounding takes fp32 input, got {x.dtype}")
    bits = x.view(torch.int32)
    noise = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, device=x.device, generator=generator
    )
    # adding noise below the 16 bits bf16 drops carries into the kept bits with exactly
    # the probability of rounding up; NaN/inf (all exponent bits set) are left alone
    finite = torch.isfinite(x)
    rounded = torch.bitwise_and(bits + noise, -65536).view(torch.float32)
    return torch.where(finite, rounded, x).to(torch.bfloat16)


#: optimizer states kept in fp32 whatever the parameter's dtype
_FP32_STATES = ("exp_avg", "exp_avg_sq", "master")


class BF16AdamW(torch.optim.Optimizer):
    """Decoupled-weight-decay Adam for bf16 parameters (fp32 parameters are updated as by
    torch's AdamW). See the module docstring for `master_weights`."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        master_weights: bool = True,
    ):
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"BF16AdamW: lr={lr}, betas={betas}, eps={eps} out of range")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)
        self.master_weights = master_weights

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's loader casts every floating state to its parameter's dtype: put the fp32
        moments and master back in fp32, from the saved values (not the bf16 casts)."""
        super().load_state_dict(state_dict)
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for saved_id, p in zip(saved_ids, params):
            for key, value in state_dict["state"].get(saved_id, {}).items():
                if key in _FP32_STATES and torch.is_tensor(value):
                    self.state[p][key] = value.to(device=p.device, dtype=torch.float32)

    def _state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
            if self.master_weights and p.dtype != torch.float32:
                state["master"] = p.detach().clone().float()
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, self._state(p), group)
        return loss

    def _update(self, p: torch.Tensor, state: dict, group: dict) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        state["step"] += 1
        t = float(state["step"])
        g = _local(p.grad).float()
        exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
        exp_avg.lerp_(g, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        master = state.get("master")
        weight = _local(master) if master is not None else _local(p).float()
        weight.mul_(1 - lr * group["weight_decay"])
        weight.addcdiv_(exp_avg, denom, value=-lr / (1 - beta1**t))
        target = _local(p)
        if master is None and target.dtype == torch.bfloat16:
            target.copy_(stochastic_round_to_bf16(weight))
        elif weight is not target:  # from the fp32 master: round to nearest
            target.copy_(weight)
