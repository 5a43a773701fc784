"""Training tests: tiny configs (byte tokenizer, hidden 32, 2 layers, 4 experts), one
thread so in-process and subprocess runs are bit-comparable, one shared finished run."""

import shutil

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import harness  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished 8-step tiny run (checkpoints at 4 and 8) shared by several tests."""
    run_dir = harness.finished_run(tmp_path_factory.mktemp("train"))
    yield run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
