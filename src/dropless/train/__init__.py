"""`dropless train`: configuration, data, model building, the training loop, metrics,
plots and checkpoints.

`trainer.py`, `step.py` and `evaluation.py` are the route of a run; the parts they call
live in one folder per concept: `config/`, `data/`, `model/`, `checkpoint/`, `plan/`,
`report/` and `run/` (each folder's `__init__` lists its files).

    from dropless.train import load_config, train
    summary = train(load_config("run.toml", ["train.steps=100"]), run_dir="runs/mine")

Heavy dependencies (transformers, tokenizers, tensorboard, matplotlib) are imported
when a run needs them; install them with `pip install 'dropless[train]'`.
"""

from .config.load import Config, dump_config, known_keys, load_config
from .run.hooks import TrainHooks

__all__ = ["Config", "TrainHooks", "dump_config", "known_keys", "load_config", "train"]


def train(
    cfg: Config, run_dir: str | None = None, resume: bool = False, hooks: TrainHooks | None = None
) -> dict:
    """Run a training job (see `dropless.train.trainer.train`); returns the summary dict.
    `hooks`: a `TrainHooks` (`dropless.train.run.hooks`) called at fixed points of the run."""
    from .trainer import train as _train

    return _train(cfg, run_dir=run_dir, resume=resume, hooks=hooks)
