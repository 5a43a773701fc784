"""Time a checkpoint save of `dropless train` on this machine: the synchronous save against
the blocking part of the background save (`checkpoint.async_save`) and its whole write,
for a plain fp32 model with AdamW state on CPU (one process), median of `--rounds`.

    python scripts/checkpoint_save_time.py --dir runs/save-time --layers 16 --width 2048

16 x 2048^2 weights: 67.1M parameters, 0.81 GB of state (weights + AdamW's two moments).
Prints one JSON line; the checkpoints written are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from dropless.train.checkpoint import store as ckpt
from dropless.train.checkpoint.async_save import CheckpointSaver


def _model(layers: int, width: int):
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # the moments exist, as in a checkpoint of a training run
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return model, opt, sched


def _state_bytes(model, opt) -> int:
    tensors = list(model.parameters())
    tensors += [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="a run directory to write into")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    a.dir.mkdir(parents=True, exist_ok=False)
    model, opt, sched = _model(a.layers, a.width)
    gb = _state_bytes(model, opt) / 1e9
    sync, block, total, step = [], [], [], 0
    saver = CheckpointSaver(background=True)
    try:
        for _ in range(a.rounds):
            step += 1
            t0 = time.perf_counter()
            ckpt.save_checkpoint(ckpt.SaveRequest(a.dir, step, model, opt, sched, {}, keep=1))
            sync.append(time.perf_counter() - t0)
            step += 1
            t0 = time.perf_counter()
            saver.save(ckpt.SaveRequest(a.dir, step, model, opt, sched, {}, keep=1))
            block.append(time.perf_counter() - t0)
            saver.wait()
            total.append(time.perf_counter() - t0)
    finally:
        saver.wait()
        shutil.rmtree(a.dir, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in (("sync", sync), ("block", block), ("total", total))}
    print(json.dumps({
        "state_gb": round(gb, 3), "rounds": a.rounds,
        **{f"{k}_s": round(v, 2) for k, v in med.items()},
        **{f"{k}_s_per_gb": round(v / gb, 2) for k, v in med.items()},
        "all_s": {"sync": [round(x, 2) for x in sync], "block": [round(x, 2) for x in block],
                  "total": [round(x, 2) for x in total]},
    }))  # fmt: skip


if __name__ == "__main__":
    main()
