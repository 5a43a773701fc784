"""Bad input fails fast (before tokenizing or building the model) with a message naming
the problem and the fix."""

import pytest
import torch

from dropless.cli.main import main
from dropless.train.config.load import load_config
from dropless.train.config.recipes import TINY
from dropless.train.plan.preflight import preflight
from dropless.train.run.setup import Env
from harness import tiny_args


def _fails(capsys, tmp_path, *args, run_dir=None):
    run_dir = run_dir or tmp_path / "run"
    assert main(["train", "--run-dir", str(run_dir), *tiny_args(), *args]) == 2
    assert not (run_dir / "data").exists()  # failed before any tokenization
    return capsys.readouterr().err


def test_missing_data_path(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", f"data.path={tmp_path / 'nope.txt'}")
    assert (
        "nope.txt' does not exist; pass a .txt/.jsonl/.parquet file or a directory of them" in err
    )


def test_empty_data_dir_and_file(capsys, tmp_path):
    (tmp_path / "empty").mkdir()
    err = _fails(capsys, tmp_path, "--set", f"data.path={tmp_path / 'empty'}")
    assert "is a directory with no .txt/.jsonl/.parquet files" in err
    (tmp_path / "empty" / "a.txt").write_text("")
    err = _fails(capsys, tmp_path, "--set", f"data.path={tmp_path / 'empty'}")
    assert "holds no text (0 characters in 1 file(s)); point it at non-empty data" in err


def test_unknown_config_key(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", "train.bach_size=4")
    assert "unknown config key 'train.bach_size'; did you mean 'train.batch_size'?" in err


def test_sequence_longer_than_the_model(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", "model.max_position_embeddings=16")
    assert (
        "train.seq_len=32 is above the model's maximum sequence length (max_position_embeddings=16)"
        in err
    )


def test_vocabulary_mismatch(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", "model.vocab_size=200")
    assert (
        "tokenizer/model vocabulary mismatch: the tokenizer has 257 tokens but the model's vocab_size is 200"
        in err
    )


def test_batch_not_divisible_by_processes(tmp_path):
    cfg = load_config(None, [*TINY, "train.batch_size=3"])
    with pytest.raises(
        ValueError, match=r"train.batch_size=3 is not divisible by the number of processes \(2\)"
    ):
        preflight(
            cfg, Env(rank=0, world=2, local_rank=0, device=torch.device("cpu")), tmp_path / "run"
        )


def test_unwritable_run_dir(capsys, tmp_path):
    (tmp_path / "file").write_text("not a directory")
    err = _fails(capsys, tmp_path, run_dir=tmp_path / "file" / "run")
    assert "is not writable (Not a directory); pass --run-dir to a writable directory" in err


def test_unknown_precision_recipe(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", "precision.recipe=fp4")
    assert "precision.recipe='fp4': allowed values are 'none', 'delayed', 'current', 'mxfp8'" in err


def test_fp8_recipe_resolves():
    from dropless.train.model.precision import recipe_context

    with recipe_context("mxfp8")() as recipe:
        assert type(recipe).__name__ == "MXFP8BlockScaling"


def test_expert_parallel_layout_checked_before_work(capsys, tmp_path):
    err = _fails(capsys, tmp_path, "--set", "parallel.ep=2")  # one process: ep cannot be 2
    assert "parallel.ep=2 must divide parallel.dp_shard=1" in err
