"""Checks of `ProgramMemTracker` (tests/train/program_memory.py) in a gloo group of two,
run by tests/train/test_plan_calibration.py through `harness.run_group`."""

import time

import torch
import torch.distributed as dist

N = 1 << 16  # fp32 values


def all_to_all_completed_late(rank: int, world: int) -> None:
    """Rank 0's all-to-all (expert parallelism's dispatch) completes only when rank 1 joins,
    0.5 s after rank 0's op returned; on completion the Work's future takes a reference to
    the output. That reference is the Work's: the output counts as freed once the program
    lets go of it, though `work` (as gloo's thread, when late) still holds it."""
    from program_memory import ProgramMemTracker
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters())
    if rank == 1:
        time.sleep(0.5)
        dist.all_to_all_single(torch.empty(N), torch.ones(N))
        return

    def run():
        x, out = torch.ones(N), torch.empty(N)
        work = dist.all_to_all_single(out, x, async_op=True)
        work.wait()
        del x, out  # the program lets go; `work` holds them on
        torch.empty(2 * N)
        del work

    def total(tracker, kind: str) -> int:
        return sum(d["Total"] for d in tracker.get_tracker_snapshot(kind).values())

    with ProgramMemTracker(model, opt) as tracker:
        before = total(tracker, "current")  # this rank's shard of the parameters
        run()
    assert total(tracker, "peak") - before == 2 * 4 * N  # x and out, then the new 2N


CHECKS = ["all_to_all_completed_late"]
