"""Router losses from what a Transformers MoE model computed, not from a re-route.

    rl = RouterLosses(model)                        # hooks on every MoE layer's experts module
    with rl.capture():
        out = model(input_ids=x_BL, output_router_logits=True)
    stats = rl.stats(out, x_BL.shape)               # RouterStats: aux, z, counts_ME (tensors)
    rl.remove()

The balancing loss (`RouterLosses(model, balance=...)`, one of `BALANCE_LOSSES`):
- "family" (the default): families that define a balancing loss (`output_router_logits=True`
  -> `out.aux_loss`, Transformers' `load_balancing_loss_func` over the layers' pooled
  counts and probabilities) keep exactly that loss; families without one (DeepSeek-V3,
  Nemotron-H, GLM-4-MoE, ...) get the "sequence" loss.
- "per_layer": the Switch loss of each MoE layer, E * sum_e f_e * P_e with that layer's
  share of (token, expert) pairs f_e (the experts its router selected, as passed to the
  experts module) and mean per-token normalised score P_e, summed over layers: each layer
  pays its own loss at the full coefficient, whatever the depth, as Megatron-Core adds
  each router's aux loss (M x top_k when balanced). Pooling the layers lets one layer's
  collapse be offset by another's, and a mean would give each layer 1/M of the
  coefficient; this form does neither.
- "sequence": DeepSeek-V3's sequence-wise auxiliary loss (`dropless.ops.sequence_aux_loss`)
  per layer, averaged over layers.
"per_layer" and "sequence" read the family's own scores (softmax, sigmoid or sqrt-softplus
of the recorded router logits, normalised per token).
- counts_ME: the (token, expert) pairs each expert received per layer, for the aux-loss-free
  expert-bias update; read from the experts call, so it holds for any experts path (ours,
  stock, expert-parallel).

Everything stays on the device: nothing here waits on the host.
"""

# B sequences, L tokens per sequence, T = B*L tokens, E experts, K top-k, M MoE layers

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed
import torch.nn.functional as F
from torch import nn

from ...ops import sequence_aux_loss, z_loss
from ..layers import moe_layers
from .forward import in_backward


def _sqrtsoftplus(logits_TE: torch.Tensor) -> torch.Tensor:
    return F.softplus(logits_TE).sqrt()


#: The balancing losses `RouterLosses` computes (see the module's docstring).
def _whole_shares(hits_E: torch.Tensor, rows: int, group) -> tuple:
    """(f_E, rows, cp) of the whole sequences: each expert's share of the (token, expert)
    pairs and the token count, `hits_E` and `rows` summed over the context-parallel `group`
    (this rank's alone when None; no gradient), and the group's size."""
    whole = torch.cat([hits_E, hits_E.new_tensor([float(rows)])])
    cp = 1
    if group is not None:
        torch.distributed.all_reduce(whole, group=group)
        cp = torch.distributed.get_world_size(group)
    return whole[:-1] / whole[-1], whole[-1], cp


BALANCE_LOSSES = ("per_layer", "family", "sequence")

#: Score functions routers apply to their logits (the aux loss normalises them per token).
SCORE_FUNCS = {
    "softmax": lambda logits_TE: logits_TE.softmax(-1),
    "sigmoid": torch.sigmoid,
    "sqrtsoftplus": _sqrtsoftplus,
}


@dataclass
class RouterStats:
    """Losses of one forward (0-dim tensors with grad) and the pairs per expert [M, E] (int64)."""

    aux: torch.Tensor
    z: torch.Tensor
    counts_ME: torch.Tensor
    source: str  # "model" (the family's own aux loss), "per_layer" or "sequence" (ours)


def identify_score_func(
    logits_TE: torch.Tensor, weights_TK: torch.Tensor, ids_TK: torch.Tensor, hint: str | None
) -> str:
    """The score function whose scores at the selected experts are proportional, token by
    token, to the routing weights the router produced (renormalisation and scaling keep
    that ratio constant within a token). `hint` decides when the data cannot (top-1 with
    renormalised weights) and breaks near-ties. Fake tensors (`dropless plan` traces the
    step on them) have no values to read: every candidate makes the same [T, E] scores
    there, so the hint decides (softmax without one)."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(logits_TE):
        return hint if hint in SCORE_FUNCS else "softmax"
    spread = {}
    w_TK = weights_TK.detach().double()
    for name, fn in SCORE_FUNCS.items():
        g_TK = fn(logits_TE.detach().double()).gather(1, ids_TK)
        ratio_TK = w_TK / g_TK.clamp_min(1e-300)
        rel = (ratio_TK.amax(1) - ratio_TK.amin(1)) / ratio_TK.abs().mean(1).clamp_min(1e-300)
        spread[name] = float(rel.max())  # one host read per layer, once per run
    best = min(spread, key=spread.get)
    ranked = sorted(spread.values())
    decisive = len(ranked) < 2 or ranked[1] > 100 * ranked[0] + 1e-6
    if decisive:
        return best
    return hint if hint in SCORE_FUNCS else best


def _score_hint(router: nn.Module | None, config) -> str | None:
    declared = getattr(config, "scoring_func", None)
    if declared in SCORE_FUNCS:
        return declared
    if router is not None and isinstance(
        getattr(router, "e_score_correction_bias", None), torch.Tensor
    ):
        return "sigmoid"
    return None


class RouterLosses:
    """Captures, per MoE layer and forward, the expert ids and routing weights the experts
    module receives (a forward pre-hook, active only inside `capture()`), and turns them and
    the model's recorded router logits into `RouterStats`. `balance`: which balancing loss
    (`BALANCE_LOSSES`; "family", the default, is what the model computes itself)."""

    def __init__(self, model: nn.Module, balance: str = "family"):
        if balance not in BALANCE_LOSSES:
            raise ValueError(f"balance={balance!r}: must be one of {', '.join(BALANCE_LOSSES)}")
        self.model = model
        self.balance = balance
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError(f"{type(model).__name__} has no MoE layers to take router losses from")
        self.E = self.layers[0].num_experts
        self._index = {id(layer.experts): m for m, layer in enumerate(self.layers)}
        self._calls: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self._active = False
        self._score: dict[int, str] = {}
        self._switch_checked = False  # _cp_switch_aux's check of the family's loss, once
        self._handles = [
            layer.experts.register_forward_pre_hook(self._hook, with_kwargs=True)
            for layer in self.layers
        ]

    def _hook(self, module, args, kwargs):
        if not self._active or in_backward():  # checkpointing re-runs forwards in backward
            return None
        names = ("hidden_states", "top_k_index", "top_k_weights")
        got = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
        self._calls.append(
            (
                self._index[id(module)],
                got["top_k_index"].detach().long(),
                got["top_k_weights"].detach(),
            )
        )
        return None

    @contextlib.contextmanager
    def capture(self):
        """Record the experts calls of the forwards run inside (earlier records are dropped)."""
        self._calls = []
        self._active = True
        try:
            yield self
        finally:
            self._active = False

    def counts(self) -> torch.Tensor:
        """int64 [M, E]: pairs per expert of the captured calls, on the model's device."""
        device = self._calls[0][1].device if self._calls else torch.device("cpu")
        counts_ME = torch.zeros(len(self.layers), self.E, dtype=torch.int64, device=device)
        for m, ids_TK, _ in self._calls:
            flat = ids_TK.reshape(-1).long()
            counts_ME[m].scatter_add_(0, flat, torch.ones_like(flat))
        return counts_ME

    def stats(
        self,
        out,
        batch_shape: tuple[int, ...],
        need_losses: bool = True,
        cp_group=None,
        balance: str | None = None,
    ) -> RouterStats:
        """Losses and counts of the forward that produced `out` (run inside `capture()` with
        output_router_logits=True when `need_losses`). batch_shape: (B, L) of its input ids.
        `cp_group`: the context-parallel group this rank's sequences are split over (None:
        whole sequences here); the balancing loss is then this rank's term of the whole
        sequences' (`_cp_switch_aux`, `_per_layer_aux`, `sequence_aux_loss`). `balance`:
        this call's balancing loss (None: the one given to the constructor)."""
        balance = self.balance if balance is None else balance
        if balance not in BALANCE_LOSSES:
            raise ValueError(f"balance={balance!r}: must be one of {', '.join(BALANCE_LOSSES)}")
        counts_ME = self.counts()
        zero = torch.zeros((), device=counts_ME.device)
        if not need_losses:
            return RouterStats(zero, zero, counts_ME, "none")
        logits = getattr(out, "router_logits", None)
        if not logits:
            raise ValueError(
                f"{type(self.model).__name__} returned no router_logits: call it with "
                "output_router_logits=True to take router losses from it"
            )
        logits = [x for x in logits if isinstance(x, torch.Tensor)]
        z = torch.stack([z_loss(x.reshape(-1, x.shape[-1])) for x in logits]).mean()
        aux = getattr(out, "aux_loss", None)
        if balance == "family" and isinstance(aux, torch.Tensor):
            if cp_group is not None:
                aux = self._cp_switch_aux(logits, aux, cp_group)
            return RouterStats(aux.float(), z, counts_ME, "model")
        if balance == "per_layer":
            aux = self._per_layer_aux(logits, cp_group)
            return RouterStats(aux, z, counts_ME, "per_layer")
        aux = self._sequence_aux(logits, batch_shape, cp_group)
        return RouterStats(aux, z, counts_ME, "sequence")

    def _cp_switch_aux(self, logits: list[torch.Tensor], family_aux, group) -> torch.Tensor:
        """Transformers' Switch balancing loss (`load_balancing_loss_func`: E x sum_e f_e P_e,
        f the share of (token, expert) assignments, P the mean router probability, pooled
        over layers) of the whole sequences, as this rank's term: f counted over the cp
        group (no gradient), P over this rank's tokens, times cp, so that the cp ranks'
        mean (FSDP averages their gradients) is the whole sequences' loss and gradient.
        Checked once against the family's own loss over this rank's tokens: a family whose
        loss has another form is refused."""
        from torch._subclasses.fake_tensor import is_fake

        K = self._calls[0][1].shape[1]
        hits_E = torch.zeros(self.E, device=logits[0].device)
        probs_E, rows = 0, 0
        for x in logits:
            w_TE = x.reshape(-1, self.E).softmax(-1)  # in the logits' dtype, as Transformers
            sel = torch.topk(w_TE, K, -1).indices.reshape(-1)
            hits_E.scatter_add_(0, sel, torch.ones(sel.shape, device=sel.device))
            probs_E = probs_E + w_TE.float().sum(0)
            rows += w_TE.shape[0]
        if not self._switch_checked and not is_fake(hits_E):
            mine = float(self.E * (hits_E / rows * probs_E.detach() / rows).sum())
            if abs(mine - float(family_aux)) > 1e-3 * abs(float(family_aux)) + 1e-6:
                raise ValueError(
                    f"{type(self.model).__name__}'s load-balancing loss is not Transformers' "
                    f"Switch form (its {float(family_aux):.6g}, the Switch form's {mine:.6g}); "
                    "under context parallelism only that form is counted over whole "
                    "sequences: set train.aux_loss_coef=0, or parallel.cp=1"
                )
            self._switch_checked = True
        f_E, whole_rows, cp = _whole_shares(hits_E, rows, group)
        return self.E * (f_E * probs_E / whole_rows).sum() * cp

    def _scored_calls(self, logits: list[torch.Tensor], what: str, B: int = 1):
        """(scores_TE fp32 with grad, ids_TK) of each captured experts call, its router
        logits scored by the family's own score function (identified once per layer)."""
        if len(logits) != len(self._calls):
            raise ValueError(
                f"{type(self.model).__name__}: {len(logits)} router_logits were recorded but the "
                f"experts ran {len(self._calls)} times; the {what} needs one per call "
                "(set train.aux_loss_coef=0 to train this model without it)"
            )
        for logits_TE, (m, ids_TK, weights_TK) in zip(logits, self._calls):
            logits_TE = logits_TE.reshape(-1, logits_TE.shape[-1]).float()
            T = ids_TK.shape[0]
            if T != logits_TE.shape[0] or T % B:
                raise ValueError(
                    f"MoE layer {self.layers[m].name}: router logits for {logits_TE.shape[0]} tokens, "
                    f"experts called on {T}, batch of {B} sequences; they must agree"
                )
            func = self._score.get(m)
            if func is None:
                layer = self.layers[m]
                hint = _score_hint(layer.router, getattr(layer.experts, "config", None))
                func = self._score[m] = identify_score_func(logits_TE, weights_TK, ids_TK, hint)
            yield SCORE_FUNCS[func](logits_TE), ids_TK

    def _sequence_aux(self, logits: list[torch.Tensor], batch_shape, cp_group=None) -> torch.Tensor:
        B = int(batch_shape[0])
        losses = [
            sequence_aux_loss(
                scores_TE.reshape(B, -1, scores_TE.shape[-1]),
                ids_TK.reshape(B, -1, ids_TK.shape[-1]),
                cp_group,
            )
            for scores_TE, ids_TK in self._scored_calls(logits, "sequence-wise aux loss", B)
        ]
        return torch.stack(losses).mean()

    def _per_layer_aux(self, logits: list[torch.Tensor], cp_group=None) -> torch.Tensor:
        """The Switch loss of each layer (E x sum_e f_e P_e, f_e = c_e / T the share of pairs,
        P_e the mean normalised score), summed over layers. With `cp_group`, this rank's
        term of the whole sequences' loss: c and T counted over the group (no gradient), P
        summed over this rank's tokens, times cp (the cp ranks' mean is the whole loss)."""
        losses = []
        for scores_TE, ids_TK in self._scored_calls(logits, "per-layer balancing loss"):
            T, E = scores_TE.shape
            hits_E = torch.zeros(E, device=scores_TE.device)
            flat = ids_TK.reshape(-1)
            hits_E.scatter_add_(0, flat, torch.ones(flat.shape, device=flat.device))
            f_E, whole_rows, cp = _whole_shares(hits_E, T, cp_group)
            # the scores normalised per token (as ops.losses does), summed over this rank's
            # tokens, over the whole sequences' count, times cp: this rank's term
            norm_TE = scores_TE / scores_TE.sum(-1, keepdim=True).clamp_min(1e-20)
            p_E = norm_TE.sum(0) * (cp / whole_rows)
            losses.append(E * (f_E * p_E).sum())
        return torch.stack(losses).sum()

    def remove(self) -> None:
        """Take the hooks off the model."""
        for h in self._handles:
            h.remove()
        self._handles = []


__all__ = ["BALANCE_LOSSES", "SCORE_FUNCS", "RouterLosses", "RouterStats", "identify_score_func"]
