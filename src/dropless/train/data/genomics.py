"""Nucleotide sequences for language-model training: a character-level DNA tokenizer,
reverse-complement augmentation, windows of `seq_len` tokens from FASTA files, and
bits per base.

Tokens: 0 PAD, 1 BOS, 2 EOS, 3 UNK, then the bases 4 A, 5 C, 6 G, 7 T, 8 N. Lowercase
(soft-masked) bases fold to uppercase; the other IUPAC codes (R, Y, S, W, K, M, B, D, H,
V, U) become N; any other character is UNK. Every base token (N included) and UNK
stands for one character, the special tokens for none (`nbytes_V`), so a loss per
character computed the way the trainer computes bits per byte is bits per base.
"""

# N tokens, L sequence length, V vocabulary, W windows

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ..run.atomic import write_atomic
from .fasta import iter_fasta_pieces

SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")
BASES = "ACGTN"
TOKENIZER_FILE = "dna_tokenizer.json"
_OTHER_IUPAC = "RYSWKMBDHVU"
_COMPLEMENT = {"A": "T", "C": "G", "G": "C", "T": "A", "N": "N"}
_SPEC = {"kind": "dna", "specials": list(SPECIALS), "bases": BASES}  # what TOKENIZER_FILE holds


def _char_table() -> np.ndarray:
    """byte value -> token id (uint8: a record costs one byte per base)."""
    table = np.full(256, 3, dtype=np.uint8)  # UNK
    for i, b in enumerate(BASES):
        table[ord(b)] = table[ord(b.lower())] = len(SPECIALS) + i
    n_id = len(SPECIALS) + BASES.index("N")
    for c in _OTHER_IUPAC:
        table[ord(c)] = table[ord(c.lower())] = n_id
    return table


class DNATokenizer:
    """Character-level nucleotide tokenizer (same interface as the byte tokenizer)."""

    kind = "dna"
    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3
    vocab_size = len(SPECIALS) + len(BASES)

    def __init__(self):
        self._table = _char_table()
        self.nbytes_V = np.ones(self.vocab_size, dtype=np.int64)
        self.nbytes_V[: self.unk_id] = 0  # PAD, BOS, EOS stand for no character
        self._letters = np.frombuffer(("\0" * len(SPECIALS) + BASES).encode(), dtype=np.uint8)
        self.bytes_V = [self.token_bytes([i]) for i in range(self.vocab_size)]
        # token id -> id of its complement (specials and UNK map to themselves)
        comp = np.arange(self.vocab_size, dtype=np.uint8)
        for b, c in _COMPLEMENT.items():
            comp[self.base_id(b)] = self.base_id(c)
        self.complement_V = comp

    def base_id(self, base: str) -> int:
        """Token id of one of A, C, G, T, N."""
        return len(SPECIALS) + BASES.index(base)

    def encode_array(self, seq: str) -> np.ndarray:
        """uint8 [N] token ids of a sequence string (no BOS/EOS added)."""
        raw = np.frombuffer(seq.encode("ascii", errors="replace"), dtype=np.uint8)
        return self._table[raw]

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.encode_array(text)]

    def encode_batch(self, texts: Iterable[str]) -> list[np.ndarray]:
        """Token ids per text, as uint8 arrays (a genome is too long for Python lists)."""
        return [self.encode_array(t) for t in texts]

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        """The bases behind `ids` (UNK as '?'; special tokens dropped)."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.unk_id:
                out.append(ord("?"))
            elif len(SPECIALS) <= i < self.vocab_size:
                out.append(int(self._letters[i]))
        return bytes(out)

    def decode(self, ids: Iterable[int]) -> str:
        return self.token_bytes(ids).decode("ascii")

    def save(self, directory: str | Path) -> None:
        """Write the vocabulary to `directory/dna_tokenizer.json` (a run's tokenizer dir)."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        write_atomic(d / TOKENIZER_FILE, json.dumps(_SPEC, indent=1) + "\n")

    @classmethod
    def from_dir(cls, directory: str | Path) -> DNATokenizer:
        """Load what `save` wrote; ValueError if the directory holds another vocabulary."""
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(f"{str(directory)!r} has no {TOKENIZER_FILE}: not a DNA tokenizer")
        spec = json.loads(path.read_text())
        if spec != _SPEC:
            raise ValueError(f"{path} describes {spec}, not this DNA tokenizer ({_SPEC})")
        return cls()

    @staticmethod
    def is_saved_in(directory: str | Path) -> bool:
        return (Path(directory) / TOKENIZER_FILE).is_file()


def reverse_complement(seq: str) -> str:
    """The reverse complement of a sequence string: A<->T, C<->G, case kept; every other
    IUPAC code becomes N (n), other characters are kept as they are."""
    table = str.maketrans(
        "ACGTacgt" + _OTHER_IUPAC + _OTHER_IUPAC.lower(),
        "TGCAtgca" + "N" * len(_OTHER_IUPAC) + "n" * len(_OTHER_IUPAC),
    )
    return seq.translate(table)[::-1]


def reverse_complement_ids(tok: DNATokenizer, ids_N: np.ndarray) -> np.ndarray:
    """The reverse complement of a token sequence (specials kept, order reversed)."""
    return tok.complement_V[np.asarray(ids_N)[::-1]]


def record_tokens(
    paths: Iterable[str | Path], tok: DNATokenizer, *, reverse_complement: bool = False
) -> Iterator[np.ndarray]:
    """Per FASTA record, BOS + its bases + EOS as uint8 token ids; with `reverse_complement`,
    each record is followed by its reverse complement as a record of its own."""
    for path in paths:
        current, parts = None, []
        for index, _, piece in iter_fasta_pieces(path):
            if index != current and current is not None:
                yield from _with_rc(tok, parts, reverse_complement)
                parts = []
            current = index
            if piece:
                parts.append(tok.encode_array(piece))
        if current is not None:
            yield from _with_rc(tok, parts, reverse_complement)


def _with_rc(tok: DNATokenizer, parts: list[np.ndarray], rc: bool) -> Iterator[np.ndarray]:
    bases = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    if not len(bases):
        return
    bos, eos = np.array([tok.bos_id], np.uint8), np.array([tok.eos_id], np.uint8)
    yield np.concatenate([bos, bases, eos])
    if rc:
        yield np.concatenate([bos, reverse_complement_ids(tok, bases), eos])


def windows(tokens_N: np.ndarray, seq_len: int) -> np.ndarray:
    """int64 [W, L + 1]: the non-overlapping windows of `seq_len` inputs (+ the next token
    as the last target) of one token stream, as the trainer's sampler cuts them; a tail
    shorter than L + 1 tokens is dropped."""
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r}: expected a positive int")
    W = max(0, (len(tokens_N) - 1) // seq_len)
    idx_WL = np.arange(W)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return np.asarray(tokens_N, dtype=np.int64)[idx_WL]


def fasta_windows(
    paths: Iterable[str | Path],
    seq_len: int,
    *,
    tok: DNATokenizer | None = None,
    reverse_complement: bool = False,
) -> Iterator[np.ndarray]:
    """Windows [L + 1] of one token stream made of the files' records (BOS ... EOS each,
    plus their reverse complements when asked), streaming: one record's tokens (one byte
    per base) are held at a time, never a whole file."""
    tok = tok or DNATokenizer()
    buf = np.zeros(0, dtype=np.uint8)
    for rec in record_tokens(paths, tok, reverse_complement=reverse_complement):
        buf = np.concatenate([buf, rec])
        n = (len(buf) - 1) // seq_len
        if n:
            yield from windows(buf[: n * seq_len + 1], seq_len)
            buf = buf[n * seq_len :]  # the last target is the next window's first input


def bits_per_base(loss_nats: float, num_bases: int | None = None) -> float:
    """Bits per base from a cross-entropy in nats: the mean loss per base (num_bases None),
    or a summed loss divided over `num_bases` bases."""
    total = float(loss_nats) / math.log(2)
    if num_bases is None:
        return total
    if num_bases <= 0:
        raise ValueError(f"num_bases={num_bases}: expected a positive count")
    return total / num_bases
