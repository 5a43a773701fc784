"""The trainer's collectives helper in real gloo processes (run by test_parallel's group)."""

import torch

from dropless.train.run import collectives


def train_collectives(rank, world):
    t = torch.tensor([float(rank + 1), 10.0 * rank], dtype=torch.float64)
    out = collectives.all_reduce(t)
    assert out is t  # written back in place, on the caller's device
    assert t.tolist() == [sum(range(1, world + 1)), 10.0 * sum(range(world))]
    m = torch.tensor([rank], dtype=torch.int64)
    assert collectives.all_reduce(m, op="max").item() == world - 1
    assert collectives.broadcast_object({"rank": rank}) == {"rank": 0}
    assert collectives.collective_device(t) == torch.device("cpu")  # gloo takes CPU tensors
    collectives.barrier()
