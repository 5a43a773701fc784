"""Expert score bias for routers that lack one (aux-loss-free balancing on every family).

DeepSeek-V3 and GLM-4-MoE routers already hold `e_score_correction_bias`. For the
others `add_expert_bias` registers an fp32 `expert_bias` buffer [E] (zeros) on the router
instance and gives that instance a forward that adds the bias to the scores used to
*choose* experts while the weights stay the unbiased scores. With a zero bias the
output equals the stock router's bit for bit. `remove_expert_bias` undoes it.
"""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

from ...ops import RoutingConfig, route

# family -> (renormalize attr or a fixed bool, cast weights back to the logits dtype)
_SOFTMAX_FAMILIES = {
    "qwen3_moe": ("norm_topk_prob", True),
    "qwen2_moe": ("norm_topk_prob", True),
    "olmoe": ("norm_topk_prob", True),
    "mixtral": (True, False),
}


def _softmax_router_forward(self, hidden_states: torch.Tensor):
    renorm, cast = _SOFTMAX_FAMILIES[self._dropless_family]
    renormalize = bool(getattr(self, renorm)) if isinstance(renorm, str) else renorm
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # [T, E]
    routing = RoutingConfig(renormalize=renormalize, expert_bias=True)
    weights_TK, ids_TK, _ = route(
        router_logits, self.top_k, routing, expert_bias_E=self.expert_bias
    )
    if cast:
        weights_TK = weights_TK.to(router_logits.dtype)
    return router_logits, weights_TK, ids_TK


def _gpt_oss_router_forward(self, hidden_states: torch.Tensor):
    # gpt_oss: top-k on the logits, softmax over the chosen logits only
    router_logits = F.linear(hidden_states, self.weight, self.bias)  # [T, E]
    choice_TE = router_logits + self.expert_bias.to(router_logits.dtype)
    ids_TK = torch.topk(choice_TE, self.top_k, dim=-1).indices
    top_TK = router_logits.gather(1, ids_TK)
    scores_TK = F.softmax(top_TK, dim=1, dtype=top_TK.dtype)
    return router_logits, scores_TK, ids_TK


_FORWARDS = {
    **dict.fromkeys(_SOFTMAX_FAMILIES, _softmax_router_forward),
    "gpt_oss": _gpt_oss_router_forward,
}


#: Names families give the score bias that shifts expert choice (not the weights).
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")


def router_bias(router: nn.Module | None, block: nn.Module | None = None) -> torch.Tensor | None:
    """The expert score bias a MoE block routes with: the router's own (or one held by a
    router submodule, e.g. Ernie-4.5's `moe_statics`), the block's (AFMoE, LFM2-MoE keep it
    there), or the one dropless added; None if there is none."""
    mods = [] if router is None else [m for _, m in router.named_modules()]
    if block is not None:
        mods.append(block)
    for mod in mods:
        for name in BIAS_NAMES:
            bias = getattr(mod, name, None)
            if isinstance(bias, torch.Tensor):
                return bias
    return None


def add_expert_bias(
    router: nn.Module, family: str, num_experts: int, block: nn.Module | None = None
) -> bool:
    """Give `router` an `expert_bias` buffer and a forward that uses it; False if the router
    (or its MoE `block`) already has a score bias."""
    if router_bias(router, block) is not None:
        return False
    forward = _FORWARDS.get(family)
    if forward is None:
        raise ValueError(
            f"expert_bias=True: no biased router for family {family!r}; "
            f"families with one: {sorted(_FORWARDS)} "
            "(deepseek_v3 and glm4_moe use their own e_score_correction_bias)"
        )
    router.register_buffer(
        "expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=router.weight.device)
    )
    router._dropless_family = family
    router._dropless_added_bias = True
    router.forward = types.MethodType(forward, router)
    return True


def remove_expert_bias(router: nn.Module) -> None:
    """Undo `add_expert_bias` (no-op for routers dropless did not change)."""
    if not router.__dict__.get("_dropless_added_bias"):
        return
    del router.forward
    del router._buffers["expert_bias"]
    del router._dropless_family
    del router._dropless_added_bias
