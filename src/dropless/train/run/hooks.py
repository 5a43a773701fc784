"""Callbacks a `Trainer` calls at fixed points of a run.

The default object does nothing. Tests (and tools) pass a subclass to observe a run or
to inject faults at an exact point: a NaN gradient at step k, a process death between
two files of a checkpoint, a signal in the middle of a step.

    class KillBeforeManifest(TrainHooks):
        def on_checkpoint(self, phase, step):
            if phase == "before_manifest":
                os.kill(os.getpid(), signal.SIGKILL)
"""

from __future__ import annotations

from torch import nn

#: phases of a checkpoint write, in order, passed to `TrainHooks.on_checkpoint`
CHECKPOINT_PHASES = (
    "before_shards",  # the temporary directory and this process's RNG file exist
    "after_shards",  # every process wrote its DCP shards
    "before_manifest",  # trainer.json and config.toml are written and synced
    "before_rename",  # the manifest is written and synced
    "after_rename",  # the checkpoint is complete under its final name
)


class TrainHooks:
    """No-op callbacks; override the ones you need. `step` counts optimizer steps from 1."""

    def after_backward(self, step: int, model: nn.Module) -> None:
        """Gradients of step `step` are accumulated; nothing is checked or applied yet."""

    def after_step(self, step: int) -> None:
        """Step `step` is complete (applied, skipped or refused)."""

    def on_checkpoint(self, phase: str, step: int) -> None:
        """A checkpoint write of step `step` reached `phase` (see `CHECKPOINT_PHASES`); in a
        background save (checkpoint.async_save) the phases after "before_shards" are called
        from the save's thread."""
