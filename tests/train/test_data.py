"""Data: file formats, the global-sample-index sampler, bits-per-byte bookkeeping."""

import json

import numpy as np
import pytest

from dropless.train.config.load import DataConfig
from dropless.train.data.corpus import (
    WindowSampler,
    byte_counts,
    load_corpus,
    micro_batch_indices,
    read_documents,
    tokenize,
    unigram_bits_per_byte,
)
from dropless.train.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

TEXT = "def add(a, b):\n    return a + b  # héllo → wörld\n" * 30


def test_txt_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("first doc")
    (tmp_path / "b.jsonl").write_text(
        json.dumps({"body": "second"}) + "\n\n" + json.dumps({"body": "third"}) + "\n"
    )
    (tmp_path / "ignored.csv").write_text("x")
    assert read_documents(str(tmp_path), "body") == ["first doc", "second", "third"]
    with pytest.raises(ValueError, match="has no field 'text'"):
        read_documents(str(tmp_path / "b.jsonl"), "text")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        read_documents(str(tmp_path / "ignored.csv"), "text")


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet needs pyarrow (pip install pyarrow)")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["fourth", None, "fifth"]}), tmp_path / "c.parquet")
    assert read_documents(str(tmp_path / "c.parquet"), "body") == ["fourth", "fifth"]
    with pytest.raises(ValueError, match="has no column 'text'"):
        read_documents(str(tmp_path / "c.parquet"), "text")


def test_few_documents_hold_out_the_tail(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 900 + "y" * 100)
    train, held = load_corpus(DataConfig(path=str(tmp_path / "one.txt"), eval_fraction=0.1))
    assert train == ["x" * 900] and held == ["y" * 100]


def test_same_samples_whatever_the_process_count():
    # global batch 8: 1 process x 4 micro-batches == 2 processes x 2 == 4 processes x 1
    def step_samples(world, accum, step=3):
        return [
            list(micro_batch_indices(step * 8, a, r, world, 8, accum))
            for a in range(accum)
            for r in range(world)
        ]

    one = step_samples(1, 4)
    assert one == step_samples(2, 2) == step_samples(4, 1)
    assert sorted(sum(one, [])) == list(range(24, 32))


def test_window_sampler_epochs_cover_every_window():
    s = WindowSampler(np.arange(41, dtype=np.int32), seq_len=4, seed=1)
    assert s.num_windows == 10
    batch = s.batch(range(0, 10))
    assert batch.shape == (10, 5) and sorted(batch[:, 0].tolist()) == list(range(0, 40, 4))
    assert (batch[:, 1:] == batch[:, :-1] + 1).all()  # targets are the next tokens
    assert not np.array_equal(s.batch(range(10, 20)), batch)  # a new permutation per epoch
    with pytest.raises(ValueError, match="fewer than train.seq_len"):
        WindowSampler(np.arange(4, dtype=np.int32), seq_len=4, seed=0)


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_bytes_per_token_add_up(kind, tmp_path):
    tok = ByteTokenizer() if kind == "bytes" else HFTokenizer.train_bpe([TEXT], 300)
    ids = tokenize(tok, [TEXT, "ünï"])
    assert ids[-1] == tok.eos_id
    assert tok.nbytes_V[ids].sum() == len((TEXT + "ünï").encode())
    assert tok.token_bytes(ids) == (TEXT + "ünï").encode()
    assert tok.decode(tok.encode(TEXT)) == TEXT
    tok.save(tmp_path)
    again = load_tokenizer(tmp_path)
    assert again.encode(TEXT) == tok.encode(TEXT) and again.vocab_size == tok.vocab_size


def test_unigram_baseline():
    counts = byte_counts(ByteTokenizer(), tokenize(ByteTokenizer(), ["abab"]))
    assert counts[ord("a")] == 2 and counts.sum() == 4
    # add-one smoothing over 256 values: p(a) = 3 / 260
    assert unigram_bits_per_byte(counts, b"a") == pytest.approx(-np.log2(3 / 260))
