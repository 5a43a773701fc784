"""Training tests: tiny configs (byte tokenizer, hidden 32, 2 layers, 4 experts), one
thread so in-process and subprocess runs are bit-comparable, one shared finished run."""

import shutil

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from train_util import sub_env, tiny_args  # noqa: E402, F401  (also imported from conftest)

from dropless.cli.main import main  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """A finished 8-step tiny run (checkpoints at 4 and 8) shared by several tests."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    run_dir = tmp_path_factory.mktemp("train") / "run"
    assert main(["train", "--run-dir", str(run_dir), *tiny_args()]) == 0
    torch.set_num_threads(n)
    yield run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
