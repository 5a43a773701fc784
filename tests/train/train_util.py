"""Helpers of the training tests (a module of its own: `conftest` is a shared name
across test folders)."""

import os

from dropless.train.config.recipes import TINY


def tiny_args(*extra: str) -> list[str]:
    args = []
    for item in (*TINY, *extra):
        args += ["--set", item]
    return args


def sub_env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
