"""Expert-parallel dispatcher: tokens go to the rank that owns their expert and back.

Per chunk of tokens (one chunk unless overlap is asked for): sort the pairs by global
expert (so the rows are grouped by owning rank); one all-to-all of the per-expert counts
for all chunks, then ONE host copy of every count the layer needs (the layer's only host
sync); the all-to-all of the rows and of each row's routing weight (`comm.py`); the
received rows reordered to local-expert order, the local experts' grouped MLP with the
routing weight fused into its activation, reordered back; the reverse all-to-all and the
unweighted combine. The counts summed over every data-parallel rank feed the global
balancing loss. With overlap, every chunk's dispatch is started first; chunk c's experts
then run while later chunks' rows are still in flight, and chunk c's return transfer runs
while chunk c+1 computes. Why each step: docs/parallel.md, "The expert-parallel
dispatcher".
"""

# T tokens, D model dim, E experts (global), L local experts, P EP ranks, K top-k,
# S sorted pairs sent, R rows received, C chunks

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..ops.permute import permute, sort_by_expert, unpermute
from ..ops.replay import remember
from .comm import a2a_start, a2a_wait


class _RowPerm(torch.autograd.Function):
    """y = x[perm] for a permutation; backward gathers with the inverse (no scatter)."""

    @staticmethod
    def forward(ctx, x_RD, perm_R, inv_R):
        ctx.save_for_backward(inv_R)
        return x_RD.index_select(0, perm_R)

    @staticmethod
    def backward(ctx, g_RD):
        (inv_R,) = ctx.saved_tensors
        return g_RD.contiguous().index_select(0, inv_R), None, None


def _local_order(recv_PL: torch.Tensor, R: int):
    """Permutation taking rows laid out as (source p, expert l) blocks to (l, p) order.

    R: the received row count (known on the host). Returns (perm, inverse) or None when
    the order is already right (P or L is 1).
    """
    P, L = recv_PL.shape
    if P == 1 or L == 1:
        return None
    sizes_PL = recv_PL.reshape(-1)
    src_start_PL = (torch.cumsum(sizes_PL, 0) - sizes_PL).view(P, L)
    sizes_LP = recv_PL.t().reshape(-1)
    dst_start_LP = torch.cumsum(sizes_LP, 0) - sizes_LP
    shift = torch.repeat_interleave(
        src_start_PL.t().reshape(-1) - dst_start_LP, sizes_LP, output_size=R
    )
    perm = torch.arange(R, device=recv_PL.device) + shift
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(R, device=perm.device)
    return perm, inv


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


class ExpertParallelDispatcher:
    """Dispatcher (see `dropless.nn.LocalDispatcher`) over an expert-parallel group.

    ep_group: the ranks that split the experts; dp_group: the ranks whose expert counts
    are summed for the global balancing loss (default: the world); num_experts: global E
    (default `experts.num_global_experts`, else `experts.num_experts * ep`); num_chunks:
    token chunks; overlap: start every chunk's all-to-all first, so one chunk's transfer
    runs under another's expert compute. `pop_stats()` returns and clears the forward's
    dispatch / experts / combine seconds and the bytes this rank sent to others.
    """

    def __init__(
        self, ep_group=None, dp_group=None, *, num_experts=None, num_chunks=1, overlap=False
    ):
        if not isinstance(num_chunks, int) or num_chunks < 1:
            raise ValueError(f"num_chunks={num_chunks!r} must be an int >= 1")
        self.ep_group, self.dp_group = ep_group, dp_group
        self.num_experts, self.num_chunks, self.overlap = num_experts, num_chunks, bool(overlap)
        self.stats = _zero_stats()

    def pop_stats(self) -> dict:
        out, self.stats = self.stats, _zero_stats()
        return out

    def _sizes(self, experts) -> tuple[int, int]:
        P = _group_size(self.ep_group)
        E = self.num_experts or getattr(experts, "num_global_experts", None)
        if E is None:
            E = experts.num_experts * P
        if E % P:
            raise ValueError(f"num_experts={E} is not divisible by the EP group size {P}")
        return E, P

    def __call__(self, x_TD, ids_TK, weights_TK, experts, keep_TK=None):
        E, P = self._sizes(experts)
        L = E // P
        st, t0 = self.stats, time.perf_counter()
        C = self.num_chunks  # the same on every rank (collectives pair up), even if T < C
        xs = torch.tensor_split(x_TD, C)
        ids = torch.tensor_split(ids_TK, C)
        ws = torch.tensor_split(weights_TK, C)
        keeps = torch.tensor_split(keep_TK, C) if keep_TK is not None else [None] * C
        # dropless: counts stay on the device; capacity mode reads them (one sync per chunk)
        sps = [
            sort_by_expert(ids[c], E, keeps[c], host_counts=keep_TK is not None) for c in range(C)
        ]
        send_PCL = torch.stack([sp.counts_E for sp in sps], 0).view(C, P, L).transpose(0, 1)
        # a checkpointed recompute reuses the forward's exchange: no collective, no sync
        recv_PCL, send_h, recv_h, global_counts_E, n_tokens = remember(
            (id(self), "counts"), lambda: self._exchange_counts(ids_TK, send_PCL, E)
        )
        plans = []
        for c in range(C):
            out_splits, in_splits = [r[c] for r in recv_h], [s[c] for s in send_h]
            plans.append((out_splits, in_splits, recv_PCL[:, c, :]))
        me = dist.get_rank(self.ep_group)
        # dispatch (rows + routing weights) and combine rows to other ranks (rows to
        # itself never leave memory)
        row = 2 * x_TD.element_size() * x_TD.shape[1] + weights_TK.element_size()
        st["bytes_sent"] += row * sum(sum(p[1]) - p[1][me] for p in plans)

        def start_dispatch(c):
            x_SD = permute(xs[c], sps[c])
            prob_S = ws[c].reshape(-1)[sps[c].pair_S]  # each sorted row's routing weight
            send = (plans[c][0], plans[c][1], self.ep_group)
            return a2a_start(x_SD, *send), a2a_start(prob_S, *send)

        pend = [None] * C
        if self.overlap:
            pend = [start_dispatch(c) for c in range(C)]
        st["dispatch_s"] += time.perf_counter() - t0
        backs = []
        for c in range(C):
            t0 = time.perf_counter()
            rows, probs = pend[c] if self.overlap else start_dispatch(c)
            x_RD, prob_R = a2a_wait(*rows), a2a_wait(*probs)
            order = _local_order(plans[c][2], sum(plans[c][0]))
            if order is not None:
                x_RD, prob_R = _RowPerm.apply(x_RD, *order), _RowPerm.apply(prob_R, *order)
            # a device tensor: the grouped path (CUDA) keeps it there, the CPU loop reads it
            local_counts = plans[c][2].sum(0)
            t1 = time.perf_counter()
            st["dispatch_s"] += t1 - t0
            y_RD = experts.forward_sorted(x_RD, local_counts, prob_R)
            t2 = time.perf_counter()
            st["expert_s"] += t2 - t1
            if order is not None:
                y_RD = _RowPerm.apply(y_RD, order[1], order[0])
            back = a2a_start(y_RD, plans[c][1], plans[c][0], self.ep_group)
            if not self.overlap:
                back = (a2a_wait(*back), None)
            backs.append(back)
            st["combine_s"] += time.perf_counter() - t2
        t0 = time.perf_counter()
        outs = []
        for c in range(C):
            y_SD = backs[c][0] if backs[c][1] is None else a2a_wait(*backs[c])
            outs.append(unpermute(y_SD, sps[c]))
        out_TD = outs[0] if C == 1 else torch.cat(outs, 0)
        tokens_per_expert_E = sum(sp.counts_E for sp in sps)
        st["combine_s"] += time.perf_counter() - t0
        st["calls"] += 1
        return out_TD, tokens_per_expert_E, global_counts_E, n_tokens

    def _exchange_counts(self, ids_TK, send_PCL, E):
        """The layer's counts exchange: per-expert counts to the ranks that own the
        experts (all-to-all), global counts for the balancing loss (all-reduce), and the
        one host sync of the layer. Returns (recv_PCL, send_h, recv_h, global counts
        [E], tokens)."""
        P, C = send_PCL.shape[0], send_PCL.shape[1]
        global_buf = _global_counts(ids_TK, E, self.dp_group)
        recv_PCL = torch.empty_like(send_PCL.contiguous())
        dist.all_to_all_single(recv_PCL, send_PCL.contiguous(), group=self.ep_group)
        send_PC, recv_PC = send_PCL.sum(-1), recv_PCL.sum(-1)
        host = torch.cat([send_PC.reshape(-1), recv_PC.reshape(-1), global_buf[E:]])
        host = host.tolist()  # the one host sync of the layer
        send_h = [host[p * C : (p + 1) * C] for p in range(P)]
        recv_h = [host[P * C + p * C : P * C + (p + 1) * C] for p in range(P)]
        return recv_PCL, send_h, recv_h, global_buf[:E], int(host[-1])


class GlobalCountsDispatcher:
    """All experts local (ep == 1), but the balancing-loss counts summed over the
    data-parallel group, so the loss is the global-batch one whatever the EP size."""

    def __init__(self, dp_group=None):
        self.dp_group = dp_group

    def __call__(self, x_TD, ids_TK, weights_TK, experts, keep_TK=None):
        out_TD, sp = experts(x_TD, ids_TK, weights_TK, keep_TK)
        E = experts.num_experts
        buf = remember(
            (id(self), "global_counts"), lambda: _global_counts(ids_TK, E, self.dp_group)
        )
        return out_TD, sp.counts_E, buf[:E], int(buf[E])  # host sync: the token count


def _global_counts(ids_TK: torch.Tensor, E: int, group) -> torch.Tensor:
    """[E + 1] int64: pairs per expert, then the token count, summed over the data-parallel
    `group` on the device (read with the layer's one host copy). index_add_, not bincount:
    CUDA's bincount reads the max id on the host to size its output."""
    flat = ids_TK.reshape(-1)
    buf = torch.zeros(E + 1, dtype=torch.long, device=flat.device)
    buf.index_add_(0, flat, torch.ones_like(flat))
    buf[E:].fill_(ids_TK.shape[0])  # `buf[E] = n` would copy a host scalar: a sync
    dist.all_reduce(buf, group=group)
    return buf


def _zero_stats() -> dict:
    return {"dispatch_s": 0.0, "expert_s": 0.0, "combine_s": 0.0, "bytes_sent": 0, "calls": 0}
