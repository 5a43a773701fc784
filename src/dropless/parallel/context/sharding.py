"""Causal load-balanced sharding of sequences over the context-parallel (cp) ranks.

Under a causal mask the last tokens of a sequence attend to every earlier one and the
first tokens to almost none, so contiguous slices would give the last rank most of the
attention work. The sequence is cut into 2*cp equal chunks and rank r holds chunk r
(a head) and chunk 2*cp-1-r (a tail): every rank then does the same causal work (the
layout Megatron-Core and TorchTitan use). Positions stay global: rank r's
`position_ids` are the original indices of its two chunks, so RoPE, the attention mask
and the labels mean what they mean on one process.
"""

# B batch, L global sequence length, C chunk length (L / (2 cp)), S local length (2 C)

from __future__ import annotations

import torch


def check_seq_len(seq_len: int, cp: int) -> int:
    """The chunk length L / (2*cp); a ValueError naming the sizes and a fix when L is not a
    multiple of 2*cp (each rank holds two equal chunks)."""
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"context parallel size cp={cp!r} must be an int >= 1")
    if seq_len % (2 * cp):
        lo = seq_len // (2 * cp) * 2 * cp
        raise ValueError(
            f"sequence length {seq_len} is not divisible by 2 x cp = {2 * cp} (context "
            f"parallelism gives each of the {cp} ranks two equal chunks): set the sequence "
            f"length (train.seq_len) to a multiple of {2 * cp}, e.g. {lo or 2 * cp} or "
            f"{lo + 2 * cp}, or pad it with labels = -100"
        )
    return seq_len // (2 * cp)


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) that `rank` holds: (rank, 2*cp-1-rank)."""
    if not 0 <= rank < cp:
        raise ValueError(f"cp rank {rank} is outside 0..{cp - 1}")
    return rank, 2 * cp - 1 - rank


def local_positions(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """[S] int64: the global positions of the tokens `rank` holds, head chunk then tail."""
    C = check_seq_len(seq_len, cp)
    head, tail = chunk_ids(cp, rank)
    ar = torch.arange(C, device=device)
    return torch.cat([head * C + ar, tail * C + ar])


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """`rank`'s part of `x` along `dim` (length L): chunk r then chunk 2*cp-1-r, contiguous."""
    C = check_seq_len(x.shape[dim], cp)
    head, tail = chunk_ids(cp, rank)
    return torch.cat([x.narrow(dim, head * C, C), x.narrow(dim, tail * C, C)], dim).contiguous()


def unshard_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `shard_sequence`: `parts[r]` is rank r's local tensor (length 2*C
    along `dim`); returns the whole sequence in its original order."""
    cp = len(parts)
    S = parts[0].shape[dim]
    if S % 2 or any(p.shape[dim] != S for p in parts):
        raise ValueError(
            f"unshard_sequence needs {cp} parts of one even length along dim {dim}; got "
            f"{[p.shape[dim] for p in parts]}"
        )
    C = S // 2
    heads = [p.narrow(dim, 0, C) for p in parts]
    tails = [p.narrow(dim, C, C) for p in reversed(parts)]  # chunk cp .. 2cp-1
    return torch.cat(heads + tails, dim)


def shard_batch(batch: dict, cp: int, rank: int) -> dict:
    """Split a batch of [B, L] tensors (input_ids, labels, attention_mask, position_ids, ...)
    along the sequence for `rank`. `position_ids` are added (global, 0..L-1 before the
    split) when absent, so the model's positions stay global. Non-tensor values and
    tensors of fewer than 2 dimensions pass through unchanged."""
    out = dict(batch)
    ref = batch.get("input_ids", batch.get("labels"))
    if ref is None:
        raise ValueError("shard_batch needs `input_ids` or `labels` in the batch")
    B, L = ref.shape[:2]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(L, device=ref.device).expand(B, L)
    for k, v in out.items():
        if isinstance(v, torch.Tensor) and v.dim() >= 2:
            if v.shape[1] != L:
                raise ValueError(
                    f"batch[{k!r}] has length {v.shape[1]} along the sequence, the batch has {L}"
                )
            out[k] = shard_sequence(v, cp, rank, dim=1)
    return out
