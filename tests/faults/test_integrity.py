"""Every byte of a checkpoint is verified before any of it is used: a flipped byte in a
shard larger than 1 MiB is caught by --resume (the previous checkpoint is used, one
warning names the file), by generate and convert; a crafted `.metadata` pickle runs no
code; readers hold their checkpoint against pruning; step numbers past 10^8 sort."""

import json
import pickle
import shutil

import pytest

from dropless.cli.main import main
from dropless.train.checkpoint import manifest
from dropless.train.checkpoint import store as ckpt
from dropless.train.generate import load_run

from .faults_util import args


@pytest.fixture(scope="module")
def large_run(tmp_path_factory):
    """2 steps of a model whose shard is over 1 MiB: checkpoints at 1 and 2."""
    run = tmp_path_factory.mktemp("large") / "run"
    extra = ("model.moe_intermediate_size=96", "train.steps=2", "checkpoint.every=1")
    argv = ["train", "--run-dir", str(run), *args(*extra, "log.plots=false")]
    assert main([*argv, "--set", "log.tensorboard=false"]) == 0
    return run


def _flip(path, at: int) -> None:
    with path.open("r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_flipped_byte_in_a_large_shard_is_caught(large_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(large_run, run)
    ck2 = ckpt.step_dir(run, 2)
    (shard,) = ck2.glob("*.distcp")
    assert shard.stat().st_size > 1 << 20
    _flip(shard, shard.stat().st_size // 2)
    assert ckpt.verify_checkpoint(ck2) == f"file {shard.name} does not match its checksum"
    # generate / convert on that checkpoint by name: refused, naming the file
    with pytest.raises(ValueError, match=f"does not verify: file {shard.name} does not match"):
        load_run(ck2)
    capsys.readouterr()
    assert main(["convert", str(ck2), str(tmp_path / "hf")]) == 2
    assert "does not verify" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    # --resume: the previous checkpoint, with one warning line naming the file
    assert main(["train", "--run-dir", str(run), "--resume", "--set", "train.steps=3"]) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if "warning" in x]
    assert len(warned) == 1 and f"file {shard.name} does not match its checksum" in warned[0]
    assert warned[0].endswith("using the previous complete one, step_00000001")
    assert ckpt.verify_checkpoint(ckpt.step_dir(run, 2)) is None  # redone from step 1


class _Payload:
    def __init__(self, witness):
        self.witness = witness

    def __reduce__(self):
        return (exec, (f"open({str(self.witness)!r}, 'w').close()",))


@pytest.mark.parametrize("kind", ["code", "not metadata"])
def test_crafted_metadata_runs_no_code(run_copy, tmp_path, kind):
    witness = tmp_path / "ran"
    payload = _Payload(witness) if kind == "code" else {"model": 1}
    ck = ckpt.step_dir(run_copy, 8)
    (ck / ".metadata").write_bytes(pickle.dumps(payload))
    manifest = ckpt.build_manifest(ck, 8)  # whoever plants it can rewrite the manifest too
    (ck / ckpt.MANIFEST).write_text(json.dumps(manifest))
    assert ckpt.verify_checkpoint(ck) is None
    said = (
        r"global builtins\.exec is not part of DCP metadata"
        if kind == "code"
        else "it holds a dict"
    )
    with pytest.raises(ValueError, match=f"is not DCP checkpoint metadata .*{said}"):
        load_run(ck)
    assert not witness.exists()


def test_a_checkpoint_without_a_manifest_is_not_loaded(run_copy):
    _, _, model, _ = load_run(run_copy)
    ck = ckpt.step_dir(run_copy, 8)
    (ck / ckpt.MANIFEST).unlink()
    with pytest.raises(ValueError, match="has no manifest.json .or was removed while opening it"):
        ckpt.load_checkpoint(ck, model)
    (ck / "extra").write_text("x")
    with pytest.raises(ValueError, match="does not verify: unreadable manifest.json"):
        (ck / ckpt.MANIFEST).write_text("{")
        ckpt.load_checkpoint(ck, model)


def test_a_held_checkpoint_is_not_pruned(run_copy):
    run, ck = ckpt.pick_checkpoint(run_copy)
    assert (run, ck) == (run_copy, ckpt.step_dir(run_copy, 8))
    try:
        ckpt._prune(run_copy, keep=0)  # a live run pruning while generate loads
        assert [s for s, _ in ckpt.list_checkpoints(run_copy)] == [8]
    finally:
        ckpt.release(ck)
    ckpt._prune(run_copy, keep=0)
    assert ckpt.list_checkpoints(run_copy) == []


def test_a_checkpoint_pruned_before_it_is_held_gives_the_next(run_copy, monkeypatch):
    listed = ckpt.list_checkpoints(run_copy)
    shutil.rmtree(ckpt.step_dir(run_copy, 8))  # listed, then pruned by the live run
    monkeypatch.setattr(manifest, "list_checkpoints", lambda run_dir: listed)
    run, ck = ckpt.pick_checkpoint(run_copy)
    ckpt.release(ck)
    assert ck == ckpt.step_dir(run_copy, 4)


def test_steps_past_ten_to_the_eighth_are_listed_and_pruned(tmp_path):
    for step in (99_999_999, 100_000_000, 100_000_001):
        d = ckpt.step_dir(tmp_path, step)
        d.mkdir(parents=True)
        (d / "trainer.json").write_text(json.dumps({"step": step}))
        (d / ckpt.MANIFEST).write_text(json.dumps(ckpt.build_manifest(d, step)))
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [99_999_999, 100_000_000, 100_000_001]
    assert ckpt.latest_checkpoint(tmp_path) == ckpt.step_dir(tmp_path, 100_000_001)
    ckpt._prune(tmp_path, keep=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [100_000_000, 100_000_001]


@pytest.mark.parametrize(
    "field, value, said",
    [("step", "8", "step is '8', expected an integer >= 0"),
     ("sample_index", -4, "sample_index is -4, expected an integer >= 0")],
)  # fmt: skip
def test_crafted_trainer_json_is_one_line(run_copy, field, value, said, capsys):
    ck = ckpt.step_dir(run_copy, 8)
    state = json.loads((ck / "trainer.json").read_text())
    (ck / "trainer.json").write_text(json.dumps({**state, field: value}))
    (ck / ckpt.MANIFEST).write_text(json.dumps(ckpt.build_manifest(ck, 8)))
    assert main(["train", "--run-dir", str(run_copy), "--resume", "--set", "train.steps=9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"trainer.json': {said}; the checkpoint is damaged or was edited" in err
