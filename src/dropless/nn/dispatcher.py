"""Dispatchers move routed tokens to their experts and back; the MoE layer holds none
of that logic. `LocalDispatcher` runs every expert in this process; the
expert-parallel one (all-to-all over a mesh axis) lives in `dropless.parallel`.
"""

# T tokens, D model dim, E experts, K top-k

from __future__ import annotations

import torch


class LocalDispatcher:
    """All experts live here: permute, grouped MLP, combine, in one process.

    A dispatcher is called as `dispatcher(x_TD, ids_TK, weights_TK, experts, keep_TK)`
    and returns (out_TD, tokens_per_expert_E, global_counts_E, global_tokens): the
    last two feed the global balancing loss (here they are the local ones).
    """

    def __call__(self, x_TD, ids_TK, weights_TK, experts, keep_TK=None):
        out_TD, sp = experts(x_TD, ids_TK, weights_TK, keep_TK)
        # scatter_add, not bincount: no device->host sync on CUDA, no graph break
        flat = ids_TK.reshape(-1)
        counts_E = torch.zeros(experts.num_experts, dtype=torch.long, device=flat.device)
        counts_E.scatter_add_(0, flat, torch.ones_like(flat))
        return out_TD, sp.counts_E, counts_E, x_TD.shape[0]
