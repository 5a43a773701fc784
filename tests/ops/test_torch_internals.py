"""The private torch behaviours dropless relies on, pinned so that a torch release
that changes them fails here, loudly, instead of silently changing results or memory.

- Routing replay (`ops/replay.py`) finds the non-reentrant checkpoint's frame in the
  closure of torch's saved-tensors pack hook (forward: the frame; recompute: a weak
  reference to it and the id of the backward it serves). torch has no public way to
  ask "am I in a checkpointed forward / its recompute" without the caller passing a
  `context_fn`, which Transformers' gradient checkpointing does not.
- The per-expert loop (`ops/expert_mlp/loop.py`) frees each expert's kept h early when
  `torch._C._autograd._get_current_graph_task_keep_graph()` says the graph is freed
  after this backward (torch's own AOTAutograd reads the same flag; no public API).
- (`ops/expert_mlp/eager.py`'s use of `torch._disable_dynamo`, the lazy
  `torch.compiler.disable`, is pinned by tests/ops/test_compile.py's recipe break.)

Each test runs on CPU (CI's torch) and, marked gpu, on CUDA (the GPU machine's torch).
"""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from dropless.ops.expert_mlp import engine
from dropless.ops.replay import _frame_class, checkpoint_state

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_checkpoint_frame_is_found_in_forward_and_recompute(device):
    seen = []

    def region(x):
        seen.append(checkpoint_state())
        return (x * 2).sin()

    x = torch.randn(4, device=device, requires_grad=True)
    checkpoint(region, x, use_reentrant=False).sum().backward()
    assert len(seen) == 2, "the region ran once in forward and once in its recompute"
    (fwd_frame, fwd_gid), recompute = seen
    assert isinstance(fwd_frame, _frame_class()) and fwd_gid is None, (
        "torch's checkpoint pack hook no longer holds its _CheckpointFrame in a closure "
        "cell: routing replay cannot tell a checkpointed forward (see ops/replay.py)"
    )
    assert recompute is not None and recompute[0] is fwd_frame and recompute[1] is not None, (
        "torch's recompute hook no longer holds a weak reference to the frame and the "
        "graph id: routing replay cannot find the records of the forward"
    )
    assert checkpoint_state() is None  # outside: nothing


@pytest.mark.parametrize("device", DEVICES)
def test_the_graph_task_says_whether_the_graph_is_kept(device):
    assert hasattr(torch._C._autograd, "_get_current_graph_task_keep_graph"), (
        "torch removed _get_current_graph_task_keep_graph: the loop MLP no longer frees "
        "each expert's kept h early (peak backward memory grows; see ops/expert_mlp/engine.py)"
    )
    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 1

        @staticmethod
        def backward(ctx, g):
            seen.append(engine.graph_released())
            return g

    x = torch.randn(3, device=device, requires_grad=True)
    Probe.apply(x).sum().backward()
    Probe.apply(x).sum().backward(retain_graph=True)
    torch.autograd.grad(Probe.apply(x).sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(Probe.apply(x).sum(), x)
    assert seen == [True, False, False, True]
