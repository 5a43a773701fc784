"""Runs `dropless train` with the background write of one checkpoint stopped half-way
(a test hook in this wrapper, never in the library):

    python slow_save_child.py STEP MARKER [dropless train arguments ...]

The save of step STEP writes its first chunk of shard bytes, then creates the file MARKER
and waits forever; the test kills this process while training goes on."""

import sys
import threading
from pathlib import Path

import torch

from dropless.cli.main import main
from dropless.train import trainer
from dropless.train.checkpoint import dcp_io
from dropless.train.checkpoint.async_save import THREAD_NAME
from dropless.train.run.hooks import TrainHooks

STEP, MARKER = int(sys.argv[1]), Path(sys.argv[2])


class SaveStep(TrainHooks):
    step = None

    def on_checkpoint(self, phase, step):
        if phase == "before_shards":
            SaveStep.step = step


_write = dcp_io._HashingStream.write


def stalled_write(self, b):
    n = _write(self, b)
    if threading.current_thread().name == THREAD_NAME and SaveStep.step == STEP:
        self.flush()  # the first bytes reach the file, as in a write cut short
        MARKER.touch()
        threading.Event().wait()
    return n


if __name__ == "__main__":
    torch.set_num_threads(1)
    dcp_io._HashingStream.write = stalled_write
    hooks = SaveStep()
    train = trainer.train
    trainer.train = lambda *a, **k: train(*a, **{**k, "hooks": hooks})
    sys.exit(main(sys.argv[3:]))
