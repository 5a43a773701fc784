"""All-to-all with uneven splits that autograd can go through, sync or split in two:
`a2a_start` returns the receive buffer while the transfer runs and `a2a_wait` finishes
it; their backward mirrors the pair, so the autograd engine can run other chunks'
backward while a gradient's all-to-all is in flight.
"""

# N rows, D features

from __future__ import annotations

import torch
import torch.distributed as dist


def _launch(x_ND, out_splits, in_splits, group, async_op):
    """Returns (receive buffer, work or None, the contiguous send tensor)."""
    x_ND = x_ND.contiguous()
    out = x_ND.new_empty((sum(out_splits), *x_ND.shape[1:]))
    work = dist.all_to_all_single(
        out,
        x_ND,
        output_split_sizes=out_splits,
        input_split_sizes=in_splits,
        group=group,
        async_op=async_op,
    )
    return out, work, x_ND


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _launch(x_ND, out_splits, in_splits, group, False)[0]

    @staticmethod
    def backward(ctx, grad_ND):
        out_splits, in_splits = ctx.splits
        return _launch(grad_ND, in_splits, out_splits, ctx.group, False)[0], None, None, None


def all_to_all(x_ND: torch.Tensor, out_splits: list[int], in_splits: list[int], group=None):
    """Rows [sum(in_splits), D] sent in_splits[r] to rank r; returns [sum(out_splits), D].

    Backward sends the gradient back with the splits swapped.
    """
    return _AllToAll.apply(x_ND, list(out_splits), list(in_splits), group)


class Pending:
    """A transfer in flight: its work handle, and the gradient's on the way back."""

    __slots__ = ("work", "send", "grad", "grad_work", "splits", "group")

    def __init__(self, splits, group):
        self.work = self.send = self.grad = self.grad_work = None
        self.splits, self.group = splits, group


class _Start(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, pending):
        out_splits, in_splits = pending.splits
        # keep the send tensor referenced until the transfer is awaited
        out, pending.work, pending.send = _launch(x_ND, out_splits, in_splits, pending.group, True)
        ctx.pending = pending
        return out

    @staticmethod
    def backward(ctx, _grad_unused):
        # _Wait.backward started the gradient's transfer; finish it here
        p = ctx.pending
        p.grad_work.wait()
        grad, p.grad, p.grad_work, p.send = p.grad, None, None, None
        return grad, None


class _Wait(torch.autograd.Function):
    @staticmethod
    def forward(ctx, buf_ND, pending):
        pending.work.wait()
        pending.work = pending.send = None
        ctx.pending = pending
        return buf_ND.view_as(buf_ND)

    @staticmethod
    def backward(ctx, grad_ND):
        p = ctx.pending
        out_splits, in_splits = p.splits
        p.grad, p.grad_work, p.send = _launch(grad_ND, in_splits, out_splits, p.group, True)
        # _Start ignores what it receives; pass the same tensor (no copy)
        return grad_ND, None


def a2a_start(
    x_ND: torch.Tensor, out_splits, in_splits, group=None
) -> tuple[torch.Tensor, Pending]:
    """Start an all-to-all; returns (buffer, pending). Read the buffer only through
    `a2a_wait(buffer, pending)`."""
    pending = Pending((list(out_splits), list(in_splits)), group)
    return _Start.apply(x_ND, pending), pending


def a2a_wait(buf_ND: torch.Tensor, pending: Pending) -> torch.Tensor:
    """Finish a transfer started by `a2a_start` and return the received rows."""
    return _Wait.apply(buf_ND, pending)
