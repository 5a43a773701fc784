"""A resumed run continues every RNG a checkpoint saves (torch's, Python's `random`,
NumPy's global one) where an uninterrupted run of the same seed has it: the run seeds
all three from train.seed and the checkpoint restores all three."""

import random

import numpy as np
import torch

from dropless.train import trainer
from dropless.train.config.recipes import tiny
from dropless.train.run.hooks import TrainHooks

QUIET = (
    "log.plots=false", "log.tensorboard=false", "log.progress=none", "log.every=4",
    "optim.warmup_steps=1",
)  # fmt: skip


class RngStates(TrainHooks):
    """The RNG states after each step; then a draw from each, as user code might make
    (without the restore the resumed run's states would lag by the stopped run's draws)."""

    def __init__(self):
        self.states = {}

    def after_step(self, step: int) -> None:
        np_state = np.random.get_state()
        self.states[step] = (
            torch.get_rng_state().tolist(),
            random.getstate(),
            (np_state[0], np_state[1].tolist(), *np_state[2:]),
        )
        random.random(), np.random.random(), torch.rand(1)


def _run(run_dir, steps: int, resume: bool = False) -> dict:
    # the process's own draws before the run: a run's states must not depend on them
    random.random(), np.random.random(), torch.rand(1)
    hooks = RngStates()
    cfg = tiny(f"train.steps={steps}", "checkpoint.every=2", *QUIET)
    trainer.train(cfg, run_dir=str(run_dir), resume=resume, hooks=hooks)
    return hooks.states


def test_resume_restores_every_rng_it_saved(tmp_path):
    straight = _run(tmp_path / "straight", 4)
    _run(tmp_path / "stopped", 2)
    resumed = _run(tmp_path / "stopped", 4, resume=True)
    assert sorted(resumed) == [3, 4]
    for step in (3, 4):
        for name, a, b in zip(("torch", "python", "numpy"), straight[step], resumed[step]):
            assert a == b, (step, name)
