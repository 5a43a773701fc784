"""Held-out evaluation: loss (nats/token) and bits per byte over fixed windows, split
over processes."""

# B sequences, L sequence length

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from .run.collectives import all_reduce


class Evaluator:
    """Scores the run's held-out windows; `evaluator()` -> {"eval_loss", "eval_bpb"}."""

    def __init__(
        self,
        model,
        eval_BL1: np.ndarray,
        eval_bytes: int,
        env,
        micro_batch: int,
        collective: bool,
        precision,
        eval_targets: np.ndarray | None = None,
    ):
        self.model, self.eval_BL1, self.eval_bytes, self.env = model, eval_BL1, eval_bytes, env
        # supervised rows: [B, L] targets, IGNORE (-100) where no loss (prompt, padding)
        self.eval_targets = eval_targets
        self.micro_batch, self.collective, self.precision = (
            max(micro_batch, 1),
            collective,
            precision,
        )

    def _forward_count(self, mine: np.ndarray) -> int:
        n = -(-len(mine) // self.micro_batch)
        if self.collective:  # forwards are collective (FSDP, EP): as many on every rank
            n_t = torch.tensor([n])
            all_reduce(n_t, op="max")
            n = int(n_t)
        return n

    @torch.no_grad()
    def __call__(self) -> dict:
        from .. import hf

        self.model.eval()
        acc = torch.zeros(2, dtype=torch.float64)  # nll sum, targets
        world, b = self.env.world, self.micro_batch
        mine = self.eval_BL1[self.env.rank :: world]
        tmine = None if self.eval_targets is None else self.eval_targets[self.env.rank :: world]
        for j in range(self._forward_count(mine)):
            part = mine[j * b : (j + 1) * b]
            xy = torch.from_numpy(part if len(part) else self.eval_BL1[:1]).to(self.env.device)
            with self.precision.autocast(), self.precision.recipe():
                logits = self.model(input_ids=xy[:, :-1], use_cache=False).logits
            if not len(part):  # a filler forward on a rank with no windows left
                continue
            y = xy[:, 1:]
            if tmine is not None:
                y = torch.from_numpy(tmine[j * b : (j + 1) * b]).to(self.env.device)
            nll = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
            )
            n = torch.tensor(float((y != -100).sum()), dtype=torch.float64)
            acc += torch.stack([nll.double().cpu(), n])
        if world > 1 or self.env.distributed:  # forced at world 1: the node's collective
            all_reduce(acc)
        hf.tokens_per_expert(self.model, reset=True)
        return {
            "eval_loss": float(acc[0] / acc[1]),
            "eval_bpb": float(acc[0] / math.log(2) / self.eval_bytes),
        }


__all__ = ["Evaluator"]
