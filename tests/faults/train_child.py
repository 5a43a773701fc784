"""Runs `dropless <argv[2:]>` with faults injected through `TrainHooks` (never through
the library's environment): argv[1] is a JSON object with any of

    {"rank": 1,                               # only this rank (default: every rank)
     "checkpoint": ["before_manifest", 9],    # SIGKILL at this phase of this step's save
     "kill_after_step": 3,                    # SIGKILL right after this optimizer step
     "signal_in_step": [10, "SIGINT", 1]}     # send the signal (this many times) mid-step

Used as a script by the fault tests, directly or under torchrun.
"""

import functools
import json
import os
import signal
import sys

from dropless.cli.main import main
from dropless.train import trainer
from dropless.train.hooks import TrainHooks


class Faults(TrainHooks):
    def __init__(self, spec: dict):
        self.spec = spec
        self.mine = spec.get("rank") in (None, int(os.environ.get("RANK", "0")))

    def on_checkpoint(self, phase, step):
        if self.mine and self.spec.get("checkpoint") == [phase, step]:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step):
        if self.mine and self.spec.get("kill_after_step") == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_backward(self, step, model):
        sig = self.spec.get("signal_in_step")
        if self.mine and sig and sig[0] == step:
            for _ in range(sig[2] if len(sig) > 2 else 1):
                os.kill(os.getpid(), getattr(signal, sig[1]))


if __name__ == "__main__":
    trainer.train = functools.partial(trainer.train, hooks=Faults(json.loads(sys.argv[1])))
    sys.exit(main(sys.argv[2:]))
