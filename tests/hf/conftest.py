import os
import sys

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, os.path.dirname(__file__))  # families.py

import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _no_warning_remembered():
    """Every test starts and ends with no warning remembered (tests/conftest.py unpatches
    after each test)."""
    from dropless.hf.experts import forward as experts

    torch.set_num_threads(1)
    experts._WARNED.clear()
    yield
    experts._WARNED.clear()
