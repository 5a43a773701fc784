"""Why a run stopped early: errors the command line turns into one line and an exit code."""

from __future__ import annotations


class TrainingStopped(RuntimeError):
    """A run stopped before `train.steps`; `exit_code` is what `dropless train` returns."""

    exit_code = 2


class NonFiniteError(TrainingStopped):
    """The loss or the global gradient norm was NaN/Inf (train.on_nonfinite)."""


class DroppedTokensError(TrainingStopped):
    """The experts computed fewer (token, expert) pairs than routed: a dropless invariant."""


class Interrupted(TrainingStopped):
    """SIGINT or SIGTERM: the run finished its step, saved a checkpoint and stopped."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_code = 128 + signum
