"""Checks in spawned processes: elastic DCP checkpoints of a sharded model.

World 4 (FSDP2 x EP 4) trains 2 steps, saves with `dropless.train.checkpoint.store`, then
runs 2 more steps: the uninterrupted losses. World 2 (ep 2) and one process (no
process group, in the pytest process) load that checkpoint and run the same 2
steps on the same global batches: their losses must match (fp32, rtol 1e-5).
World 2 also saves in the background (`ckpt_async_w2`) while it trains on.
The directory comes from $DROPLESS_PARALLEL_TEST_DIR (set by the test module).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _checks_fsdp import MAX_NORM, Net, T, _loss  # noqa: F401

from dropless.parallel import (
    ParallelConfig,
    apply_fsdp,
    build_mesh,
    clip_grad_norm_,
    shard_moe_experts,
)

SAVE_AT, TOTAL, RTOL, ATOL = 2, 4, 1e-5, 1e-6
D = 8


def _dir() -> Path:
    return Path(os.environ["DROPLESS_PARALLEL_TEST_DIR"])


def _data(world_max=4):
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(world_max * T, D, generator=g), torch.randn(world_max * T, D, generator=g))
        for _ in range(TOTAL)
    ]


def _setup(world, ep):
    torch.manual_seed(0)
    net = Net()
    rank = 0
    if world > 1:
        pm = build_mesh(ParallelConfig(dp_shard=world, ep=ep), num_experts=8)
        shard_moe_experts(net, pm)
        apply_fsdp(net, pm)
        rank = pm.dp_rank
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return net, opt, sched, rank


def _steps(net, opt, sched, rank, world, steps):
    data, per = _data(), 4 * T // world  # the same global batch of 4*T rows, split by world
    losses = []
    for s in steps:
        x, y = data[s]
        sl = slice(rank * per, (rank + 1) * per)
        loss = _loss(net, x[sl], y[sl])
        loss.backward()
        if world > 1:
            clip_grad_norm_(list(net.parameters()), MAX_NORM)
        else:
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
        opt.step()
        sched.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if world > 1:
            dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def ckpt_save_w4(rank, world):
    from dropless.train.checkpoint.store import SaveRequest, save_checkpoint

    net, opt, sched, r = _setup(world, ep=world)
    before = _steps(net, opt, sched, r, world, range(SAVE_AT))
    save_checkpoint(SaveRequest(_dir(), SAVE_AT, net, opt, sched, {"losses": before}, keep=2))
    after = _steps(net, opt, sched, r, world, range(SAVE_AT, TOTAL))
    if rank == 0:
        (_dir() / "uninterrupted.json").write_text(json.dumps(after))


def resume_and_compare(world, ep):
    from dropless.train.checkpoint.store import latest_checkpoint, load_checkpoint

    net, opt, sched, r = _setup(world, ep)
    path = latest_checkpoint(_dir())
    assert path is not None and path.name == f"step_{SAVE_AT:08d}", path
    state = load_checkpoint(path, net, opt, sched, restore_rng=False)
    assert len(state["losses"]) == SAVE_AT
    assert sched.last_epoch == SAVE_AT
    got = _steps(net, opt, sched, r, world, range(SAVE_AT, TOTAL))
    want = json.loads((_dir() / "uninterrupted.json").read_text())
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def ckpt_resume_w2(rank, world):
    resume_and_compare(world, ep=world)


def ckpt_async_w2(rank, world):
    """A background save (`CheckpointSaver`, as `dropless train` makes it) of FSDP2 x EP 2
    at step 2, its shard write held until steps 2-3 trained (their collectives run while
    the save's thread waits on its own gloo group), then released: loaded into a fresh
    model, steps 2-3 give the same losses, bit for bit."""
    import threading

    from dropless.train.checkpoint import dcp_io
    from dropless.train.checkpoint.async_save import THREAD_NAME, CheckpointSaver
    from dropless.train.checkpoint.store import SaveRequest, load_checkpoint, step_dir

    run = _dir() / "async_w2"
    if rank == 0:
        run.mkdir()
    dist.barrier()
    net, opt, sched, r = _setup(world, ep=world)
    _steps(net, opt, sched, r, world, range(SAVE_AT))
    release, held, write = threading.Event(), [], dcp_io._HashingStream.write

    def held_write(stream, b):
        if threading.current_thread().name == THREAD_NAME and not held:
            held.append(True)
            release.wait(60)
        return write(stream, b)

    dcp_io._HashingStream.write = held_write
    try:
        saver = CheckpointSaver()
        req = SaveRequest(run, SAVE_AT, net, opt, sched, {}, keep=2)
        assert saver.save(req) == step_dir(run, SAVE_AT)
        after = _steps(net, opt, sched, r, world, range(SAVE_AT, TOTAL))
        assert saver.in_flight and not step_dir(run, SAVE_AT).exists()
        release.set()
        assert saver.wait() == step_dir(run, SAVE_AT) and held == [True]
    finally:
        dcp_io._HashingStream.write = write
    net, opt, sched, r = _setup(world, ep=world)
    load_checkpoint(step_dir(run, SAVE_AT), net, opt, sched, restore_rng=False)
    again = _steps(net, opt, sched, r, world, range(SAVE_AT, TOTAL))
    assert again == after, (again, after)
