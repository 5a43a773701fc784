"""Fused language-model head + loss for a Transformers causal LM (docs/hf.md,
`fused_cross_entropy=True`).

    from dropless.hf import enable_fused_cross_entropy
    enable_fused_cross_entropy(model)
    out = model(input_ids=ids, labels=labels)   # out.loss as stock, out.logits is None

How: the instance's `forward` records the labels of the call, the output head's `forward`
(an `nn.Linear`) computes the loss where the full logits would have been computed and
returns an empty stand-in, and the instance's `loss_function` hands that loss back, shifted
exactly like Transformers' `ForCausalLMLoss`. A model that changes the logits between its
head and its loss (soft-capping, scaling) is refused. With labels, forward hooks of the
head see the stand-in, not logits; hooks that act on the head's output in backward get
nothing (an output head sharded as an FSDP unit of its own is untested).
"""

# B sequences, L positions, D hidden, V vocabulary

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.linear_cross_entropy import linear_cross_entropy
from .causal_lm_loss import causal_lm_loss

_STATE_ATTR = "_dropless_fused_ce"
# config fields through which families transform logits before the loss
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logits_scaling", "logit_scale")


@dataclass
class _State:
    head: nn.Linear
    stock_loss_fn: Any  # ForCausalLMLoss (or the lean one), for calls without the fused path
    chunk_size: int | None
    backend: str
    # instance-level forwards set before ours (e.g. by accelerate hooks), restored by disable
    own_forwards: tuple = (None, None)
    call: dict | None = None  # labels and loss kwargs of the call in flight
    stand_in: torch.Tensor | None = None
    loss: torch.Tensor | None = None
    on_loss: Any = None  # called with each loss `loss_function` returns
    sig: inspect.Signature | None = field(default=None, repr=False)


def is_fused_cross_entropy_enabled(model: nn.Module) -> bool:
    """True when `enable_fused_cross_entropy` is active on this model instance."""
    return _STATE_ATTR in vars(model)


def enable_fused_cross_entropy(
    model: nn.Module, *, chunk_size: int | None = None, backend: str = "auto", on_loss=None
) -> nn.Module:
    """Make this causal-LM instance compute its loss without materializing the logits.

    Given `labels`, the model returns the same loss (and gradients) as stock with
    `logits=None`; without labels it is unchanged. `chunk_size` and `backend` are passed to
    `dropless.ops.linear_cross_entropy`. `on_loss(loss)` is called with each cross-entropy
    the model's loss function computes (`out.loss` may add what the family adds, such as a
    router auxiliary loss). Idempotent (a second call sets `on_loss`); returns the model.
    Raises ValueError for a model whose loss is not Transformers' causal-LM loss on its
    head's logits.
    """
    if is_fused_cross_entropy_enabled(model):
        if on_loss is not None:
            vars(model)[_STATE_ATTR].on_loss = on_loss
        return model
    head = _check_model(model)
    state = _State(
        head=head,
        stock_loss_fn=model.loss_function,
        chunk_size=chunk_size,
        backend=backend,
        on_loss=on_loss,
        # the class's signature: an instance-level wrapper may take (*args, **kwargs)
        sig=inspect.signature(type(model).forward),
        own_forwards=(vars(model).get("forward"), vars(head).get("forward")),
    )
    fused_forward = _fused_forward(model, state, model.forward)
    head_forward = _head_forward(head, state, head.forward)
    loss_function = _loss_function(model, state)
    vars(model)[_STATE_ATTR] = state
    model.forward = fused_forward
    head.forward = head_forward
    model.loss_function = loss_function
    return model


def _fused_forward(model: nn.Module, state: _State, forward):
    """The model's forward: given labels, arms the head for one fused loss."""

    def fused_forward(*args, **kwargs):
        labels = kwargs.get("labels")
        if labels is None and args:
            labels = state.sig.bind_partial(model, *args).arguments.get("labels")
        if labels is None:
            return forward(*args, **kwargs)
        state.call = {"labels": labels, **kwargs}
        try:
            out = forward(*args, **kwargs)
            return _drop_stand_in(out, state.stand_in, getattr(model, "config", None))
        finally:
            state.call = state.stand_in = state.loss = None

    return fused_forward


def _head_forward(head: nn.Module, state: _State, head_plain):
    """The head's forward: when armed, the loss from the hidden states and an empty
    stand-in for the logits."""

    def head_forward(hidden_BLD: torch.Tensor) -> torch.Tensor:
        if state.call is None:  # a call without labels, or the head used on its own
            return head_plain(hidden_BLD)
        call, state.call = state.call, None
        state.loss = _causal_lm_loss(hidden_BLD, head, call, state)
        state.stand_in = hidden_BLD.new_empty((*hidden_BLD.shape[:-1], 0))
        return state.stand_in

    return head_forward


def _loss_function(model: nn.Module, state: _State):
    """The model's loss function: the fused loss for the stand-in, stock's otherwise."""

    def loss_function(logits, labels, vocab_size, **kwargs):
        if state.stand_in is None:
            loss = state.stock_loss_fn(logits, labels, vocab_size, **kwargs)
        elif not _from_stand_in(logits, state.stand_in, getattr(model, "config", None)):
            raise ValueError(
                f"{type(model).__name__} transforms its logits between the output head and "
                "the loss, which the fused cross-entropy cannot reproduce; call "
                "disable_fused_cross_entropy(model)"
            )
        else:
            loss = state.loss
        if state.on_loss is not None:
            state.on_loss(loss)
        return loss

    return loss_function


def _from_stand_in(logits, stand_in: torch.Tensor, config) -> bool:
    """The stand-in, or the stand-in divided by a `logits_scaling` of 1 (GraniteMoE divides
    its logits by it; `_check_model` refused any other value): a new tensor of its shape."""
    if logits is stand_in:
        return True
    identity = getattr(config, "logits_scaling", None) in (1, 1.0)
    return identity and isinstance(logits, torch.Tensor) and logits.shape == stand_in.shape


def disable_fused_cross_entropy(model: nn.Module) -> nn.Module:
    """Undo `enable_fused_cross_entropy` on this instance (a no-op if it is not active)."""
    state = vars(model).pop(_STATE_ATTR, None)
    if state is None:
        return model
    for module, before in zip((model, state.head), state.own_forwards):
        if before is None:
            vars(module).pop("forward", None)
        else:
            module.forward = before
    vars(model).pop("_loss_function", None)
    if state.stock_loss_fn is causal_lm_loss:  # the lean loss it replaced
        model.loss_function = causal_lm_loss
    return model


def _check_model(model: nn.Module) -> nn.Linear:
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if not isinstance(head, nn.Linear):
        raise TypeError(
            f"enable_fused_cross_entropy needs a Transformers causal LM whose output head is "
            f"an nn.Linear; {type(model).__name__} has {type(head).__name__}"
        )
    from transformers.loss.loss_utils import LOSS_MAPPING

    if model.loss_function not in (LOSS_MAPPING["ForCausalLM"], causal_lm_loss):
        raise ValueError(
            f"{type(model).__name__} does not use Transformers' ForCausalLMLoss "
            "(a custom or non-causal loss is set); the fused cross-entropy only replaces that one"
        )
    config = getattr(model, "config", None)
    for name in _LOGIT_TRANSFORMS:
        value = getattr(config, name, None)
        if value not in (None, 1, 1.0):
            raise ValueError(
                f"{type(model).__name__} has config.{name}={value}: its logits are transformed "
                "before the loss, which the fused cross-entropy cannot reproduce"
            )
    return head


def _causal_lm_loss(hidden_BLD: torch.Tensor, head: nn.Linear, call: dict, state: _State):
    """Transformers' ForCausalLMLoss on `head(hidden)`, without the logits."""
    ignore_index = call.get("ignore_index", -100)
    shift_labels = call.get("shift_labels")
    if shift_labels is None:
        labels = F.pad(call["labels"], (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(hidden_BLD.device)
    num_items = call.get("num_items_in_batch")
    loss = linear_cross_entropy(
        hidden_BLD.reshape(-1, hidden_BLD.shape[-1]),
        head.weight,
        shift_labels.reshape(-1),
        head.bias,
        ignore_index=ignore_index,
        reduction="mean" if num_items is None else "sum",
        chunk_size=state.chunk_size,
        backend=state.backend,
    )
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    return loss


def _drop_stand_in(out, stand_in, config):
    """The output with `logits=None`, as stock builds it (a tuple drops None entries)."""
    if stand_in is None:
        return out
    if isinstance(out, tuple):
        return tuple(x for x in out if not _from_stand_in(x, stand_in, config))
    values = {f.name: getattr(out, f.name) for f in fields(out) if f.init}
    values["logits"] = None
    return type(out)(**values)
