"""One optimizer step: micro-batches with gradient accumulation, the router losses (taken
from the model by `dropless.hf.RouterLosses`), the checks that must pass before
`optimizer.step()` (finite loss and gradient norm, no dropped token) and the learning-rate
schedule."""

# B sequences, L sequence length, T tokens, E experts, K top-k, M MoE layers

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.linear_cross_entropy.rows import cross_entropy
from .data.context_split import ContextSplit
from .data.sft import IGNORE
from .model.lora import base_model
from .model.precision import Precision
from .run.collectives import all_reduce
from .run.errors import DroppedTokensError, NonFiniteError
from .run.hooks import TrainHooks
from .run.lazy import hf
from .state import TrainState


def nonfinite_message(step: int, loss: float, grad_norm: float, policy: str) -> str:
    """What went wrong at `step` (which of loss / gradient norm) and what to do."""
    bad = [
        f"{n} is {v}" for n, v in (("loss", loss), ("grad norm", grad_norm)) if not math.isfinite(v)
    ]
    fix = (
        "resume from the last checkpoint with a lower optim.lr (--resume --set optim.lr=...)"
        if policy == "stop"
        else "lower optim.lr or raise train.max_skipped_steps, then --resume"
    )
    return f"step {step}: {' and '.join(bad)}; no weight was updated and no checkpoint was written or removed; {fix}"


def fuse_cross_entropy(model) -> list:
    """The model computes the loss from its hidden states given labels (no [T, V] logits,
    `dropless.hf.fusions.fused_loss`). Returns the list each forward's cross-entropy is appended to
    (read there: `out.loss` may include an aux loss the family adds)."""
    from ..hf.fusions.fused_loss import enable_fused_cross_entropy

    seen = []
    try:
        enable_fused_cross_entropy(model, on_loss=seen.append)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"train.fused_cross_entropy=true: {e}; set train.fused_cross_entropy=false"
        ) from None
    return seen


@dataclass
class StepParts:
    """What one optimizer step works on, each part by name."""

    model: torch.nn.Module
    layers: list  # dropless.hf.moe_layers(model): block, router, experts, family
    router: Any  # dropless.hf.experts.router_losses.RouterLosses: the model's own router losses
    top_k: int
    optimizer: torch.optim.Optimizer
    scheduler: Any  # torch.optim.lr_scheduler.LambdaLR
    parallel: Any  # the parallel layout (model/parallelize.py), None on one process
    sampler: Any  # the run's training windows (data/corpus.py) or rows (data/sft.py)
    precision: Precision
    hooks: TrainHooks


#: the statistics that open the step's vector, averaged over the processes (the rest is summed)
MEANS = ("loss", "lb_loss", "z_loss")


@dataclass
class StepStats:
    """The statistics of one step over every process: the mean losses, whether any process
    was asked to stop, the per-expert counts of the routers' choices and the (token,
    expert) pairs the experts path computed. `pack` and `unpack` are the one place that
    knows how they travel in the single float64 vector the step's all-reduce sums."""

    loss: float
    lb_loss: float
    z_loss: float
    stop: bool
    counts_ME: torch.Tensor  # int64
    pairs: float

    @staticmethod
    def pack(sums: torch.Tensor, stop: bool, counts_ME: torch.Tensor, pairs: float) -> torch.Tensor:
        """One float64 CPU vector [loss, lb, z (this process's means), stop, counts_ME, pairs]."""
        head = torch.cat([sums.cpu(), torch.tensor([float(stop)], dtype=torch.float64)])
        tail = torch.tensor([pairs], dtype=torch.float64)
        return torch.cat([head, counts_ME.cpu().double().reshape(-1), tail])

    @classmethod
    def unpack(cls, vec: torch.Tensor, M: int, E: int, processes: int = 1) -> StepStats:
        """The statistics of `vec`, summed over `processes` (its losses averaged)."""
        n = len(MEANS)
        means = vec[:n] / processes
        return cls(
            *(float(v) for v in means), stop=bool(vec[n] > 0),
            counts_ME=vec[n + 1 : -1].reshape(M, E).round().long(), pairs=float(vec[-1]),
        )  # fmt: skip


@dataclass
class MicroStep:
    """One micro-batch's forward, loss and backward, as `dropless train` runs it and as
    `dropless plan` traces it (`train/plan/trace.py` calls this on fake tensors): the
    forward under the precision context (autocast and the recipe), with the router
    outputs the losses need; the cross-entropy (fused when `ce_seen` collects it) plus the
    router losses; the backward of loss / grad_accum under the recipe (activation
    checkpointing recomputes forwards there). Returns the detached cross-entropy, aux and z
    losses and the routers' per-expert counts [M, E].

    With context parallelism (`split.cp` > 1) each sequence is split over the cp ranks of
    `cp_group` (`ContextSplit.split`: the targets shifted on the whole sequence, global
    positions) and the cross-entropy is this rank's sum over the targets of the whole
    sequences (counted over the cp group) times cp: FSDP averages the gradients over every
    rank, so the group's gradient is that of its sequences' mean, as one process computes.
    The router losses are this rank's, over its tokens (as a micro-batch's are), the
    balancing loss of `balance_loss` (`train.balance_loss`: per layer, the family's own, or
    sequence-wise) counting the whole sequences' pairs."""

    model: torch.nn.Module
    precision: Any  # Precision: .forward() and .recipe() contexts
    router: Any  # dropless.hf.experts.router_losses.RouterLosses
    ce_seen: list | None  # fuse_cross_entropy's list, or None: logits and the lean loss
    aux_loss_coef: float
    z_loss_coef: float
    grad_accum: int
    split: ContextSplit | None = None  # None: the whole sequences on this process
    cp_group: Any = None  # the process group of this rank's sequences (cp > 1)
    balance_loss: str = "family"  # train.balance_loss: which balancing loss RouterLosses takes

    @classmethod
    def for_run(
        cls, cfg, model, precision, router, ce_seen, split=None, cp_group=None
    ) -> MicroStep:
        tc = cfg.train
        return cls(
            model, precision, router, ce_seen, tc.aux_loss_coef, tc.z_loss_coef, tc.grad_accum,
            split, cp_group, tc.balance_loss,
        )  # fmt: skip

    def _split(self, x, y):
        """(x, y, position_ids, num_items_in_batch) of this rank: num_items None without cp."""
        if self.split is None or self.split.cp == 1:
            return x, y, None, None
        x, y, pos = self.split.split(x, y)
        n = (y != IGNORE).sum().to(torch.float32).reshape(1)
        all_reduce(n, group=self.cp_group)  # the targets of the whole sequences
        # sum x cp / count: FSDP's average over the cp ranks leaves the group's mean
        return x, y, pos, n.clamp(min=1.0)[0] / self.split.cp

    @property
    def need_router(self) -> bool:
        return self.aux_loss_coef > 0 or self.z_loss_coef > 0

    def __call__(self, xy_BL1: torch.Tensor, targets_BL: torch.Tensor | None = None):
        # supervised rows carry their own targets (IGNORE where no loss: prompt, padding)
        x, y = xy_BL1[:, :-1], (xy_BL1[:, 1:] if targets_BL is None else targets_BL)
        x, y, pos, num_items = self._split(x, y)
        need_router = self.need_router
        kw = dict(output_router_logits=need_router, use_cache=False)
        if pos is not None:  # context parallel: the global positions of this rank's tokens
            kw["position_ids"] = pos
        if self.ce_seen is not None:  # y as the already shifted labels
            kw.update(labels=y, shift_labels=y)
            if num_items is not None:
                kw["num_items_in_batch"] = num_items
            self.ce_seen.clear()
        with self.precision.forward(), self.router.capture():
            out = self.model(input_ids=x, **kw)
        if self.ce_seen is not None:
            assert len(self.ce_seen) == 1, "the fused loss ran once per forward"
            ce = self.ce_seen.pop()
        else:  # the lean loss: sums in fp32, the logits (no copy) all it keeps for backward
            reduction = "mean" if num_items is None else "sum"
            ce = cross_entropy(out.logits, y, ignore_index=IGNORE, reduction=reduction)
            ce = ce if num_items is None else ce / num_items
        # the model's own router outputs and selected experts (dropless.hf.experts.router_losses)
        rs = self.router.stats(out, x.shape, need_router, self.cp_group, self.balance_loss)
        del out  # the logits (unfused) are not held through backward
        loss = ce + self.aux_loss_coef * rs.aux + self.z_loss_coef * rs.z
        with self.precision.recipe():  # activation checkpointing recomputes forwards in backward
            (loss / self.grad_accum).backward()
        return ce.detach(), rs.aux.detach(), rs.z.detach(), rs.counts_ME


class StepRunner:
    """Runs one optimizer step on `parts` (`StepParts`) for the run's config and process."""

    def __init__(self, cfg, env, parts: StepParts):
        self.cfg, self.env, self.parts = cfg, env, parts
        self.model, self.layers = parts.model, parts.layers
        self.router = parts.router
        self.top_k, self.optimizer, self.scheduler = parts.top_k, parts.optimizer, parts.scheduler
        self.parallel, self.sampler = parts.parallel, parts.sampler
        self.precision, self.hooks = parts.precision, parts.hooks
        model, tc = parts.model, cfg.train
        # train.fused_cross_entropy: where the model's loss lands (LoRA: the Transformers
        # model inside PEFT's wrapper computes it)
        self.ce_seen = fuse_cross_entropy(base_model(model)) if tc.fused_cross_entropy else None
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.grad_accum, self.world, self.global_batch = tc.grad_accum, env.world, tc.batch_size
        self.seq_len = tc.seq_len
        # parallel.cp > 1: a group of cp ranks reads one micro-batch and splits its sequences
        self.split = ContextSplit.for_run(env, parts.parallel, tc.seq_len)
        cp_group = parts.parallel.pmesh.cp_group if self.split.cp > 1 else None
        self.micro = MicroStep.for_run(
            cfg, model, parts.precision, parts.router, self.ce_seen, self.split, cp_group
        )

    def _accumulate(self, state: TrainState, stops) -> tuple[StepStats, bool]:
        """Forward/backward over the micro-batches; returns the step's statistics over every
        process and whether the experts path counted its pairs (the dropless path does,
        stock not)."""
        M, E = len(self.layers), self.layers[0].num_experts
        dev = self.env.device
        # device accumulators: no host read until the step's one reduction below
        sums = torch.zeros(3, dtype=torch.float64, device=dev)
        counts_ME = torch.zeros(M, E, dtype=torch.int64, device=dev)
        hf().tokens_per_expert(self.model, reset=True)  # the evaluation's counts dropped
        for a in range(self.grad_accum):
            sp = self.split  # the cp ranks of one group read the same samples
            xy, tg = self.sampler.micro_batch(
                state.sample_index, a, sp.data_rank, sp.data_world, self.global_batch,
                self.grad_accum,
            )  # fmt: skip
            xy = torch.from_numpy(xy).to(dev)
            if tg is not None:  # supervised data (sft.RowSampler): its own targets
                tg = torch.from_numpy(tg).to(dev)
            ce, lb, zl, c = self.micro(xy, tg)
            sums += torch.stack([ce, lb, zl]).double() / self.grad_accum
            counts_ME += c.to(dev)
        path_ME = hf().tokens_per_expert(self.model, reset=True)
        self.hooks.after_backward(state.step + 1, self.model)
        # read after backward, so a signal during this step stops after this step; the
        # all-reduce below makes every process stop at the same step
        pairs = 0.0 if path_ME is None else float(path_ME.sum())
        vec = StepStats.pack(sums, stops is not None and stops.signum is not None, counts_ME, pairs)
        processes = 1
        if self.world > 1 or self.env.distributed:  # forced at world 1: the node's collective
            all_reduce(vec)
            processes = self.world
        return StepStats.unpack(vec, M, E, processes), path_ME is not None

    def _clip(self) -> float:
        clip = self.cfg.optim.grad_clip or float("inf")
        if self.parallel is not None:  # parameters on several DTensor meshes
            return float(self.parallel.clip_grad_norm_(self.params, clip))
        return float(torch.nn.utils.clip_grad_norm_(self.params, clip))

    def _check_dropped(self, pairs: float, step: int) -> int:
        expected = self.global_batch * self.seq_len * self.top_k * len(self.layers)
        dropped = int(expected - round(pairs))
        if dropped:
            raise DroppedTokensError(
                f"step {step}: {dropped} (token, expert) pairs of {expected} were not computed by the experts; "
                "the dropless path must compute every pair: report this with your config (model.implementation, precision.recipe, parallel.*)"
            )
        return dropped

    def run(self, state: TrainState, stops=None) -> dict:
        """One optimizer step; advances `state`. `stops` (a `run.interrupts.StopRequests`)
        says whether this process was asked to stop (the result's "stop" is whether any
        process was). Raises before
        `optimizer.step()` when a check fails (non-finite values under
        on_nonfinite="stop", dropped tokens)."""
        self.model.train()
        tc = self.cfg.train
        stats, path_counted = self._accumulate(state, stops)
        grad_norm = self._clip()
        loss, step = stats.loss, state.step + 1
        counts_ME = stats.counts_ME
        lr = self.optimizer.param_groups[0]["lr"]
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        dropped = None
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            state.skipped_in_a_row += 1
            if tc.on_nonfinite == "stop" or state.skipped_in_a_row > tc.max_skipped_steps:
                raise NonFiniteError(nonfinite_message(step, loss, grad_norm, tc.on_nonfinite))
            state.skipped_steps += 1
            counts_ME = None
        else:
            if path_counted:  # the routers' choices say nothing about what the experts computed
                dropped = self._check_dropped(stats.pairs, step)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            state.skipped_in_a_row = 0
            self._update_expert_bias(counts_ME)
        self.scheduler.step()  # a skipped step keeps its place in the schedule
        state.step, state.sample_index = step, state.sample_index + self.global_batch
        ep_stats = self.parallel.pop_stats() if self.parallel is not None else {}
        return {
            "loss": loss, "lb_loss": stats.lb_loss, "z_loss": stats.z_loss, "lr": lr,
            "grad_norm": grad_norm, "counts_ME": counts_ME, "dropped": dropped,
            "skipped": skipped, "stop": stats.stop, **ep_stats,
        }  # fmt: skip

    def _update_expert_bias(self, counts_ME: torch.Tensor) -> None:
        rate = self.cfg.train.expert_bias_rate
        if rate <= 0:
            return
        from ..ops import update_expert_bias

        for layer, c in zip(self.layers, counts_ME):
            update_expert_bias(layer.expert_bias, c.to(layer.expert_bias.device), rate)


__all__ = [
    "MicroStep",
    "StepParts",
    "StepRunner",
    "StepStats",
    "fuse_cross_entropy",
    "nonfinite_message",
]
