"""How a run's batches are split when each sequence is spread over context-parallel ranks.

With `parallel.cp = cp`, the world is world / cp data-parallel groups of cp ranks each:
a group reads one micro-batch (as one process would at world / cp), and each of its
ranks keeps its load-balanced part of every sequence (chunks r and 2*cp-1-r of 2*cp,
`dropless.parallel.context`), with the global positions. The targets are shifted on the
whole sequence first, so a rank's last token still predicts the next token of the sequence.
"""

# B sequences, L sequence length (train.seq_len), S local length (L / cp)

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...parallel.context import shard_sequence
from ...parallel.context.sharding import check_seq_len, local_positions


@dataclass(frozen=True)
class ContextSplit:
    """This process's place in the data and context layout: `data_rank` of `data_world`
    data-parallel groups (which samples it reads), `cp_rank` of `cp` (which chunks of each
    sequence it keeps). cp == 1: every process is its own group, nothing is split."""

    data_rank: int
    data_world: int
    cp_rank: int = 0
    cp: int = 1

    @classmethod
    def for_run(cls, env, parallel, seq_len: int) -> ContextSplit:
        """From the run's `Env` and its `TrainParallel` (None on one process), checked
        against train.seq_len (`check`)."""
        if parallel is None or parallel.cp == 1:
            return cls(env.rank, env.world)
        split = cls(parallel.data_rank, env.world // parallel.cp, parallel.cp_rank, parallel.cp)
        split.check(seq_len)
        return split

    def check(self, seq_len: int) -> None:
        """A clear error when train.seq_len cannot be split into 2*cp equal chunks."""
        if self.cp > 1:
            check_seq_len(seq_len, self.cp)

    def split(self, x_BL: torch.Tensor, y_BL: torch.Tensor):
        """(inputs, targets, position_ids) of this rank: [B, S] each, positions global;
        (x, y, None) when cp == 1 (the model numbers the positions itself)."""
        if self.cp == 1:
            return x_BL, y_BL, None
        B, L = x_BL.shape
        pos_BS = local_positions(L, self.cp, self.cp_rank, x_BL.device).expand(B, -1)
        x_BS = shard_sequence(x_BL, self.cp, self.cp_rank)
        y_BS = shard_sequence(y_BL, self.cp, self.cp_rank)
        return x_BS, y_BS, pos_BS
