"""Held-out evaluation: loss (nats/token) and bits per byte over fixed windows, split
over processes."""

# B sequences, L sequence length

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .data.context_split import ContextSplit
from .run.collectives import all_reduce


@dataclass(eq=False)  # stateful: compared and hashed by identity
class Evaluator:
    """Scores the run's held-out windows; `evaluator()` -> {"eval_loss", "eval_bpb"}.
    `split`: which windows this process scores (data/context_split.py): its own, or with
    parallel.cp > 1 its cp group's, each rank its chunks of every window; `collective`:
    forwards are collective (FSDP, EP), as many on every rank; `eval_targets`: supervised
    rows' [B, L] targets, IGNORE (-100) where no loss (prompt, padding)."""

    model: Any
    eval_BL1: np.ndarray
    eval_bytes: int
    env: Any
    micro_batch: int  # at least 1
    collective: bool
    precision: Any
    split: ContextSplit
    eval_targets: np.ndarray | None = None

    def _forward_count(self, mine: np.ndarray) -> int:
        n = -(-len(mine) // self.micro_batch)
        if self.collective:
            n_t = torch.tensor([n])
            all_reduce(n_t, op="max")
            n = int(n_t)
        return n

    @torch.no_grad()
    def __call__(self) -> dict:
        self.model.eval()
        acc = torch.zeros(2, dtype=torch.float64)  # nll sum, targets
        b = self.micro_batch
        rank, step = self.split.data_rank, self.split.data_world
        mine = self.eval_BL1[rank::step]
        tmine = None if self.eval_targets is None else self.eval_targets[rank::step]
        for j in range(self._forward_count(mine)):
            part = mine[j * b : (j + 1) * b]
            xy = torch.from_numpy(part if len(part) else self.eval_BL1[:1]).to(self.env.device)
            y = xy[:, 1:]
            if tmine is not None and len(part):
                y = torch.from_numpy(tmine[j * b : (j + 1) * b]).to(self.env.device)
            x, y, pos = self.split.split(xy[:, :-1], y)  # the whole windows without cp
            kw = {} if pos is None else {"position_ids": pos}
            with self.precision.forward():
                logits = self.model(input_ids=x, use_cache=False, **kw).logits
            if not len(part):  # a filler forward on a rank with no windows left
                continue
            nll = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            n = torch.tensor(float((y != -100).sum()), dtype=torch.float64)
            acc += torch.stack([nll.double().cpu(), n])
        if self.env.world > 1 or self.env.distributed:  # forced at world 1: the node's collective
            all_reduce(acc)
        return {
            "eval_loss": float(acc[0] / acc[1]),
            "eval_bpb": float(acc[0] / math.log(2) / self.eval_bytes),
        }
