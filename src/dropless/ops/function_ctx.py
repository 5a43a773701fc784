"""`FunctionContext`: what an autograd Function's forward and backward read and write on
their context, for calling them as plain functions inside a custom op's implementation
(the custom op owns autograd: `custom_op.py` of `expert_mlp` and `grouped_gemm`), so the
node runs the very math eager code runs."""

from __future__ import annotations


class FunctionContext:
    """A stand-in for `torch.autograd.function.FunctionCtx`: `needs_input_grad`,
    `saved_tensors` / `save_for_backward`, and any attribute the Function sets (given as
    keywords or set later)."""

    def __init__(self, needs_input_grad: tuple = (), saved_tensors: tuple = (), **attrs):
        self.needs_input_grad, self.saved_tensors = tuple(needs_input_grad), tuple(saved_tensors)
        self.__dict__.update(attrs)

    def save_for_backward(self, *tensors) -> None:
        self.saved_tensors = tensors
