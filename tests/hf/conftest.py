import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))  # families.py

import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _stock_after_each_test():
    """Every test starts and ends with stock Transformers (no patch active, no warnings remembered)."""
    import dropless.hf as dh
    from dropless.hf.experts import forward as experts

    torch.set_num_threads(1)
    experts._WARNED.clear()
    yield
    dh.unpatch()
    experts._WARNED.clear()
