"""Fault tests: one tiny finished run per session, copied per case; real processes only
for kills, signals and torchrun."""

import shutil

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

import harness  # noqa: E402
from dropless.cli.main import main  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory):
    """A finished 8-step tiny run: checkpoints at 4 and 8, a record every 2 steps."""
    base = tmp_path_factory.mktemp("faults")
    run_dir = harness.finished_run(base, "log.tensorboard=false", "log.plots=false")
    yield run_dir
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def continued(finished_run, tmp_path_factory):
    """The records of the finished run continued to step 10 without faults."""
    from .faults_util import records

    ref = tmp_path_factory.mktemp("continued") / "run"
    shutil.copytree(finished_run, ref)
    assert main(["train", "--run-dir", str(ref), "--resume", "--set", "train.steps=10"]) == 0
    return records(ref)


@pytest.fixture
def run_copy(finished_run, tmp_path):
    dst = tmp_path / "run"
    shutil.copytree(finished_run, dst)
    return dst
