"""Tokenizers for training: plain bytes, or a byte-level BPE (the `tokenizers` library)
trained on the run's data and cached in the run directory, or one loaded from a directory.

Each knows the raw bytes every token stands for (`bytes_V`, and their count `nbytes_V`),
so held-out loss can be reported in bits per byte whatever the vocabulary.
"""

# V vocabulary

from __future__ import annotations

import dataclasses
import filecmp
import shutil
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

import numpy as np

from ..run.atomic import write_atomic
from .genomics import DNATokenizer

EOS = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


def _require_tokenizers():
    try:
        import tokenizers
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "the BPE tokenizer needs the `tokenizers` package: pip install 'dropless[train]' "
            "(or use --set data.tokenizer=bytes)"
        ) from None
    return tokenizers


@lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table that ByteLevel pre-tokenizers use."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ByteTokenizer:
    """UTF-8 bytes are the tokens 0..255; 256 separates documents (EOS)."""

    kind = "bytes"
    vocab_size = 257
    eos_id = 256

    def __init__(self):
        self.bytes_V = [bytes([i]) for i in range(256)] + [b""]
        self.nbytes_V = np.ones(self.vocab_size, dtype=np.int64)
        self.nbytes_V[self.eos_id] = 0

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(i for i in ids if i < 256)

    def decode(self, ids: Iterable[int]) -> str:
        return self.token_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_atomic(
            Path(directory) / "bytes", "byte tokenizer: ids 0..255 are bytes, 256 is EOS\n"
        )


class HFTokenizer:
    """A `tokenizers.Tokenizer` (tokenizer.json), e.g. the byte-level BPE trained here."""

    kind = "bpe"

    def __init__(self, tok):
        self.tok = tok
        self.vocab_size = tok.get_vocab_size()
        self.eos_id = tok.token_to_id(EOS)
        self._byte_level = '"ByteLevel"' in tok.to_str()
        self.bytes_V = [self._bytes_of(i) for i in range(self.vocab_size)]
        self.nbytes_V = np.array([len(b) for b in self.bytes_V], dtype=np.int64)

    @classmethod
    def from_dir(cls, directory: str | Path) -> HFTokenizer:
        path = Path(directory) / TOKENIZER_FILE
        if not path.is_file():
            raise ValueError(
                f"tokenizer directory {str(directory)!r} has no {TOKENIZER_FILE}; pass a directory saved by a Hugging Face fast tokenizer"
            )
        return cls(_require_tokenizers().Tokenizer.from_file(str(path)))

    @classmethod
    def train_bpe(cls, texts: Iterable[str], vocab_size: int) -> HFTokenizer:
        tk = _require_tokenizers()
        tok = tk.Tokenizer(tk.models.BPE())
        tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[EOS], show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
        )  # fmt: skip
        tok.train_from_iterator(texts, trainer=trainer)
        return cls(tok)

    def _bytes_of(self, i: int) -> bytes:
        token = self.tok.id_to_token(i)
        if token is None or token == EOS:
            return b""
        if self._byte_level:
            table = _byte_of_char()
            if all(c in table for c in token):
                return bytes(table[c] for c in token)
        return self.tok.decode([i], skip_special_tokens=True).encode("utf-8")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(list(texts), add_special_tokens=False)]

    def token_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.bytes_V[int(i)] for i in ids)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def save(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        write_atomic(Path(directory) / TOKENIZER_FILE, self.tok.to_str(pretty=True))


def load_tokenizer(directory: str | Path) -> ByteTokenizer | HFTokenizer | DNATokenizer:
    """The tokenizer saved in `directory` (a run's `tokenizer/` folder or a HF tokenizer dir)."""
    d = Path(directory)
    if (d / "bytes").is_file():
        return ByteTokenizer()
    if DNATokenizer.is_saved_in(d):
        return DNATokenizer.from_dir(d)
    return HFTokenizer.from_dir(d)


def resolve_spec(spec: str, model_path: str = "") -> str:
    """`data.tokenizer` with "auto" resolved: the tokenizer saved beside the checkpoint of
    `model_path` ("bytes", "dna" or its directory), or "bpe" for a model trained from scratch.
    A checkpoint's embeddings only mean something for the ids of its own tokenizer."""
    if spec != "auto":
        return spec
    if not model_path:
        return "bpe"
    d, notes = Path(model_path), Path(model_path) / "TOKENIZER.txt"
    # saved by `ByteTokenizer.save`, or a `dropless convert` output (its TOKENIZER.txt note)
    if (d / "bytes").is_file() or (
        notes.is_file() and notes.read_text().startswith("byte tokenizer")
    ):
        return "bytes"
    if DNATokenizer.is_saved_in(d):
        return "dna"
    if (d / TOKENIZER_FILE).is_file():
        return str(d)
    raise ValueError(
        f"model.path={model_path!r} holds no tokenizer ({TOKENIZER_FILE}), and data.tokenizer is unset: "
        "set data.tokenizer to the directory of the tokenizer the model was trained with "
        "(a new one would give its ids a meaning the trained embeddings do not have)"
    )


def with_spec_resolved(cfg):
    """`cfg` with data.tokenizer="auto" made concrete (`resolve_spec`), so the run's
    config.toml, its resume checks and its data cache name the tokenizer it used."""
    spec = resolve_spec(cfg.data.tokenizer, cfg.model.path)
    if spec == cfg.data.tokenizer:
        return cfg
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=spec))


def resolve(cfg, run_dir: Path):
    """(`cfg` with its tokenizer resolved, the vocabulary that tokenizer has or will have):
    what a run asks of its tokenizer before any data is read, once its run directory is
    claimed (a BPE already trained there counts at its own size, `vocab_size`)."""
    cfg = with_spec_resolved(cfg)
    return cfg, vocab_size(cfg, run_dir)


def vocab_size(cfg, run_dir: Path | None = None) -> int:
    """The vocabulary the run's tokenizer has, or will have once trained: what `dropless
    train` (its preflight, with the run directory) and `dropless plan` (without) size the
    built-in model's embedding by. A BPE already trained in the run directory counts at its
    own size."""
    spec = resolve_spec(cfg.data.tokenizer, cfg.model.path)
    if spec == "bytes":
        return ByteTokenizer.vocab_size
    if spec == "dna":
        return DNATokenizer.vocab_size
    if spec == "bpe":
        cached = Path(run_dir or "") / "tokenizer"
        if run_dir is not None and (cached / TOKENIZER_FILE).is_file():
            return HFTokenizer.from_dir(cached).vocab_size
        return cfg.data.bpe_vocab_size
    if not Path(spec).is_dir():
        raise ValueError(
            f"data.tokenizer={spec!r}: not 'bpe', 'bytes', 'dna' or an existing tokenizer directory"
        )
    return HFTokenizer.from_dir(spec).vocab_size


def build_tokenizer(spec: str, run_tok_dir: Path, texts, bpe_vocab_size: int):
    """The run's tokenizer: "bytes", "dna", "bpe" (trained on `texts()` once, then cached in
    `run_tok_dir`) or a directory to load (copied into `run_tok_dir`)."""
    # a run that already saved its tokenizer (a resumed one) writes nothing here
    if spec == "bytes":
        tok = ByteTokenizer()
        if (run_tok_dir / "bytes").is_file():
            return tok
    elif spec == "dna":
        if DNATokenizer.is_saved_in(run_tok_dir):
            return DNATokenizer.from_dir(run_tok_dir)
        tok = DNATokenizer()
    elif spec == "bpe":
        if (run_tok_dir / TOKENIZER_FILE).is_file():
            return HFTokenizer.from_dir(run_tok_dir)
        tok = HFTokenizer.train_bpe(texts(), bpe_vocab_size)
    else:
        src = Path(spec)
        if not src.is_dir():
            raise ValueError(
                f"data.tokenizer={spec!r}: not 'bpe', 'bytes', 'dna' or an existing tokenizer directory"
            )
        tok = HFTokenizer.from_dir(src)
        run_tok_dir.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            dst = run_tok_dir / f.name
            if f.is_file() and f.name.endswith((".json", ".txt", ".model")):
                if not (dst.is_file() and filecmp.cmp(f, dst, shallow=False)):
                    shutil.copy2(f, dst)
        return tok
    tok.save(run_tok_dir)
    return tok
