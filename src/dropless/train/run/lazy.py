"""Imports made on first use. `dropless.hf` imports transformers, which a run needs only
once it reads a model config; `dropless --help` and the config checks never import it."""

from __future__ import annotations


def hf():
    """`dropless.hf` (the Transformers integration), imported on first use."""
    from ... import hf as module

    return module
