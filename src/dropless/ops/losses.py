"""Router losses and the aux-loss-free expert-bias update.

The layer holds no communication code: the global balancing loss takes counts that
the caller (dispatcher or trainer) already reduced across processes.
"""

# T tokens, E experts, K top-k, B sequences, L tokens per sequence

from __future__ import annotations

import torch
import torch.distributed


def load_balancing_loss(scores_TE: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """Switch-style loss of one micro-batch: E * sum_e (c_e / T) * mean_t p[t, e].

    c_e counts the pairs routed to e (so c_e / T sums to K), p are the routing scores
    normalised per token (softmax scores as they are). Equals Transformers'
    `load_balancing_loss_func` on the same router logits.
    """
    T, E = scores_TE.shape
    counts_E = torch.bincount(ids_TK.reshape(-1), minlength=E)
    return load_balancing_loss_global(scores_TE, counts_E, T)


def load_balancing_loss_global(
    scores_TE: torch.Tensor, counts_E: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The same loss with token counts from the whole batch (all processes).

    counts_E and num_tokens are already summed over processes by the caller; the
    gradient flows through this process's scores only.
    """
    return load_balancing_loss_from_mean(mean_normalised_scores(scores_TE), counts_E, num_tokens)


def _per_token(scores: torch.Tensor) -> torch.Tensor:
    """[..., E] scores normalised per token (each row over E sums to 1); what both
    balancing losses read."""
    return scores / scores.sum(-1, keepdim=True).clamp_min(1e-20)


def mean_normalised_scores(scores_TE: torch.Tensor) -> torch.Tensor:
    """[E]: the mean over tokens of the scores normalised per token (sum 1), what the
    load-balancing loss reads."""
    return _per_token(scores_TE).mean(0)


def load_balancing_loss_from_mean(
    probs_mean_E: torch.Tensor, counts_E: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """The same loss from the mean over tokens of the per-token normalised scores, as
    `ops.routing.route_with_aux` returns it (a routing kernel computes it in its pass)."""
    frac_E = counts_E.to(probs_mean_E.dtype) / max(int(num_tokens), 1)
    return probs_mean_E.shape[0] * (frac_E * probs_mean_E).sum()


def sequence_aux_loss(
    scores_BLE: torch.Tensor, ids_BLK: torch.Tensor, cp_group=None
) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss, averaged over sequences (no alpha).

    f_e = E / (K * L) * #{t : e in topk(t)};  P_e = mean_t s'[t, e] with s' the scores
    normalised per token;  loss = sum_e f_e * P_e.

    `cp_group`: the context-parallel group each sequence is split over (every rank holding
    an equal share of it): f counts the whole sequences' hits (summed over the group, no
    gradient), P this rank's tokens; the result is this rank's term, whose mean over the
    group (as FSDP averages their gradients) is the whole sequences' loss.
    """
    B, L, E = scores_BLE.shape
    K = ids_BLK.shape[-1]
    hits_BE = torch.zeros(B, E, device=scores_BLE.device, dtype=scores_BLE.dtype)
    hits_BE.scatter_add_(
        1,
        ids_BLK.reshape(B, L * K),
        torch.ones_like(ids_BLK.reshape(B, -1), dtype=scores_BLE.dtype),
    )
    if cp_group is not None:
        torch.distributed.all_reduce(hits_BE, group=cp_group)
        L = L * torch.distributed.get_world_size(cp_group)
    f_BE = hits_BE * (E / (K * L))
    p_BE = _per_token(scores_BLE).mean(1)
    return (f_BE * p_BE).sum(-1).mean()


def z_loss(logits_TE: torch.Tensor) -> torch.Tensor:
    """Router z-loss: mean over tokens of logsumexp(logits)^2 (computed in fp32)."""
    return torch.logsumexp(logits_TE.float(), dim=-1).square().mean()


@torch.no_grad()
def update_expert_bias(
    bias_E: torch.Tensor, counts_E: torch.Tensor, rate: float = 1e-3
) -> torch.Tensor:
    """Aux-loss-free balancing (DeepSeek-V3): b_e += rate * sign(mean(c) - c_e), in place.

    Call after each optimizer step with the step's counts (summed over layers' micro
    batches and processes by the caller). Overloaded experts get a lower bias, so the
    router picks them less; the routing weights are not affected.
    """
    counts = counts_E.to(torch.float32)
    bias_E.add_(rate * torch.sign(counts.mean() - counts).to(bias_E.dtype))
    return bias_E
