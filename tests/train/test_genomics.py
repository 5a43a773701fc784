"""DNA tokenizer, FASTA reader (plain and gzip, wrapped, CRLF, blank lines, bad input),
reverse complement, windows and bits per base. The tests write their own FASTA files."""

# N tokens, L sequence length, W windows

from __future__ import annotations

import gzip
import math
import random

import numpy as np
import pytest

from dropless.train.data.fasta import FastaRecord, is_fasta_path, iter_fasta_pieces, read_fasta
from dropless.train.data.genomics import (
    DNATokenizer,
    bits_per_base,
    fasta_windows,
    record_tokens,
    reverse_complement,
    reverse_complement_ids,
    windows,
)
from harness import read_metrics


def _random_seq(n: int, seed: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice("ACGTacgtN") for _ in range(n))


def _write_fasta(path, records, width=60, newline="\n", blank_lines=False, gz=False):
    lines = []
    for header, seq in records:
        lines.append(">" + header)
        lines += [seq[i : i + width] for i in range(0, len(seq), width)]
        if blank_lines:
            lines.append("")
    data = newline.join(lines) + newline
    if gz:
        with gzip.open(path, "wt", newline="") as fh:
            fh.write(data)
    else:
        path.write_bytes(data.encode())
    return path


RECORDS = [
    ("chr1 test chromosome one", _random_seq(250, 1)),
    ("chr2", _random_seq(61, 2)),
    ("empty_record", ""),
    ("chr3 soft-masked", "acgtnACGTRYKM"),
]


@pytest.mark.parametrize(
    "layout",
    [
        dict(),
        dict(width=7, newline="\r\n", blank_lines=True),
        dict(width=80, gz=True),
    ],
    ids=["plain", "crlf_wrapped_blank_lines", "gzip"],
)
def test_read_fasta_round_trips_records(tmp_path, layout):
    path = _write_fasta(tmp_path / "x.fa", RECORDS, **layout)
    got = list(read_fasta(path))
    want = [FastaRecord(h.split(" ")[0], h.partition(" ")[2], s) for h, s in RECORDS]
    assert got == want
    pieces = list(iter_fasta_pieces(path))
    assert {i for i, _, _ in pieces} == {0, 1, 2, 3}  # the empty record is seen too
    assert max(len(p) for _, _, p in pieces) <= layout.get("width", 60)


def test_gzip_detected_by_content_and_suffixes(tmp_path):
    path = _write_fasta(tmp_path / "named_plain.fasta", RECORDS[:1], gz=True)
    assert [r.sequence for r in read_fasta(path)] == [RECORDS[0][1]]
    assert is_fasta_path("a/b.fa.gz") and is_fasta_path("B.FASTA") and not is_fasta_path("x.txt")


@pytest.mark.parametrize(
    "content, message",
    [
        ("ACGT\n>r\nACGT\n", r"x\.fa:1: sequence data before the first '>' header"),
        (">r\nACGT\nAC1T\n", r"x\.fa:3: character '1' \(column 3\)"),
        (">r\nACGT\n>\nAC\n", r"x\.fa:3: empty '>' header"),
        ("\n\n", r"no FASTA records"),
        (">r\nAC GT\n", r"x\.fa:2: character ' '"),
    ],
    ids=["no_header", "bad_char", "empty_header", "empty_file", "inner_space"],
)
def test_malformed_input_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "x.fa"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        list(read_fasta(path))


def test_bad_gzip_and_binary_and_missing(tmp_path):
    bad = tmp_path / "x.fa.gz"
    bad.write_bytes(b"\x1f\x8b" + b"garbage" * 4)
    with pytest.raises(ValueError, match="unreadable compressed FASTA"):
        list(read_fasta(bad))
    binary = tmp_path / "y.fa"
    binary.write_bytes(b">r\nAC\xffGT\n")
    with pytest.raises(ValueError, match=r"y\.fa:2: not a text FASTA"):
        list(read_fasta(binary))
    with pytest.raises(ValueError, match="does not exist"):
        list(read_fasta(tmp_path / "missing.fa"))


def test_tokenizer_vocabulary_and_round_trip(tmp_path):
    tok = DNATokenizer()
    ids = tok.encode("ACGTNacgtnRyU-x")
    A, C, G, T, N = (tok.base_id(b) for b in "ACGTN")
    assert ids == [A, C, G, T, N, A, C, G, T, N, N, N, N, tok.unk_id, tok.unk_id]
    assert tok.vocab_size == 9 and len({tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id}) == 4
    assert tok.decode([tok.bos_id, *tok.encode("acgtR"), tok.eos_id, tok.pad_id]) == "ACGTN"
    # bits per byte of the trainer become bits per base: bases count 1, specials 0
    assert tok.nbytes_V.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 1]
    assert tok.token_bytes(tok.encode("ACGT")) == b"ACGT"
    tok.save(tmp_path / "tok")
    assert DNATokenizer.is_saved_in(tmp_path / "tok")
    assert DNATokenizer.from_dir(tmp_path / "tok").encode("GATTACA") == tok.encode("GATTACA")
    (tmp_path / "tok" / "dna_tokenizer.json").write_text('{"kind": "dna", "bases": "ACGU"}')
    with pytest.raises(ValueError, match="not this DNA tokenizer"):
        DNATokenizer.from_dir(tmp_path / "tok")
    with pytest.raises(ValueError, match="not a DNA tokenizer"):
        DNATokenizer.from_dir(tmp_path)


def test_reverse_complement():
    assert reverse_complement("AACGTn") == "nACGTT"
    assert reverse_complement("ACGR") == "NCGT"
    seq = _random_seq(101, 3)
    assert reverse_complement(reverse_complement(seq)) == seq.replace("n", "n")
    tok = DNATokenizer()
    ids = tok.encode_array(seq)
    assert (reverse_complement_ids(tok, ids) == tok.encode_array(reverse_complement(seq))).all()
    assert (reverse_complement_ids(tok, reverse_complement_ids(tok, ids)) == ids).all()


def test_record_tokens_and_reverse_complement_augmentation(tmp_path):
    path = _write_fasta(tmp_path / "x.fa", RECORDS, width=9)
    tok = DNATokenizer()
    plain = list(record_tokens([path], tok))
    assert len(plain) == 3  # the empty record yields nothing
    for rec, (_, seq) in zip(plain, [RECORDS[0], RECORDS[1], RECORDS[3]]):
        assert rec[0] == tok.bos_id and rec[-1] == tok.eos_id
        assert (rec[1:-1] == tok.encode_array(seq)).all()
    aug = list(record_tokens([path], tok, reverse_complement=True))
    assert len(aug) == 6
    assert (aug[0] == plain[0]).all()
    assert tok.decode(aug[1]) == reverse_complement(RECORDS[0][1]).upper()


def test_windows_stream_matches_one_stream(tmp_path):
    a = _write_fasta(tmp_path / "a.fa", RECORDS[:2], width=13)
    b = _write_fasta(tmp_path / "b.fa.gz", RECORDS[3:], gz=True)
    tok = DNATokenizer()
    L = 16
    stream = np.concatenate(list(record_tokens([a, b], tok, reverse_complement=True)))
    got = np.stack(list(fasta_windows([a, b], L, reverse_complement=True)))
    want = windows(stream, L)
    assert got.dtype == np.int64 and got.shape == want.shape == ((len(stream) - 1) // L, L + 1)
    assert (got == want).all()
    assert (got[1:, 0] == got[:-1, -1]).all()  # a window's last target opens the next
    assert windows(stream[:L], L).shape == (0, L + 1)
    with pytest.raises(ValueError, match="seq_len"):
        windows(stream, 0)


def test_bits_per_base():
    assert bits_per_base(math.log(4)) == pytest.approx(2.0)  # uniform over ACGT
    assert bits_per_base(10 * math.log(2), num_bases=5) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="num_bases"):
        bits_per_base(1.0, num_bases=0)


def test_dna_training_run_learns(tmp_path, capsys):
    """`data.tokenizer = "dna"` + `data.reverse_complement = true` on a generated FASTA.gz:
    the tiny model trains, its held-out bits per base fall, the tokenizer reloads."""
    from dropless.cli.main import main
    from dropless.train.config.load import DataConfig
    from dropless.train.data.corpus import load_corpus
    from dropless.train.data.tokenizer import load_tokenizer

    rng = random.Random(7)
    motif = "ACGGTCAT"
    recs = []
    for i in range(3):  # a repeated motif with 10% mutations: learnable, not trivial
        seq = "".join(c if rng.random() > 0.1 else rng.choice("ACGT") for c in motif * 400)
        recs.append((f"contig{i}", seq.lower() if i == 1 else seq))
    fa = _write_fasta(tmp_path / "genome.fa.gz", recs, width=70, gz=True)
    data = DataConfig(path=str(fa), tokenizer="dna", reverse_complement=True)
    train, held = load_corpus(data)
    assert len(train) == 6 and train[3] == reverse_complement(train[0]) and len(held) == 3
    run = tmp_path / "run"
    from dropless.train.config.recipes import TINY

    overrides = (
        "data.tokenizer=dna", f"data.path={fa}", "data.reverse_complement=true",
        "train.seq_len=64", "train.steps=8", "optim.lr=3e-2",
    )  # fmt: skip
    args = [a for item in (*TINY, *overrides) for a in ("--set", item)]
    assert main(["train", "--run-dir", str(run), *args]) == 0
    import json

    recs = read_metrics(run)
    first, last = recs[0]["eval_bpb"], recs[-1]["eval_bpb"]  # bits per base for "dna"
    assert first > 2.5 and last < first - 0.5, (first, last)  # random init: > 2 bits per base
    assert recs[-1]["bpb_unit"] == "base"  # the log lines and the summary say bits/base
    assert json.loads((run / "summary.json").read_text())["bpb_unit"] == "base"
    assert isinstance(load_tokenizer(run / "tokenizer"), DNATokenizer)
    capsys.readouterr()
    prompt = ["generate", str(run), "--prompt", "ACGG", "--max-new-tokens", "16"]
    assert main([*prompt, "--temperature", "0"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("ACGG") and len(out) > 4 and set(out) <= set("ACGTN?"), out
    with pytest.raises(ValueError, match="reverse_complement=true needs data.tokenizer='dna'"):
        DataConfig(reverse_complement=True)
