"""Training data: documents from files (or the embedded corpus), tokenized once into a
flat token stream (cached in the run directory), cut into windows of seq_len + 1.

The loader is addressed by a *global sample index*: sample i is window perm_e[i mod n]
of epoch e = i // n (a seeded permutation per epoch). Step s, micro-batch a, process r
of W take the samples s*B + (a*W + r)*b + j, j < b (B global batch, b = B/(W*A)). So a
checkpoint stores one integer, and the same global batch gives the same micro-batches
whatever the number of processes.
"""

# B sequences, L sequence length, N tokens

from __future__ import annotations

import codecs
import hashlib
import json
import os
import sys
import sysconfig
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..run.atomic import atomic_file, write_atomic
from .fasta import FASTA_SUFFIXES, is_fasta_path, iter_fasta_pieces
from .genomics import reverse_complement
from .tokenizer import build_tokenizer

SUFFIXES = (".txt", ".jsonl", ".parquet")
MIB = 1 << 20


def _supported(p: Path) -> bool:
    return p.suffix in SUFFIXES or is_fasta_path(p)


def stdlib_files() -> list[Path]:
    """This Python's standard library sources (no site-packages), sorted."""
    files = []
    for folder, subdirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        # pruned, not filtered: the installed packages can outnumber the library many times
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(files)


def split_key(name: str) -> float:
    return (zlib.crc32(name.encode()) % 100_000) / 100_000


def stdlib_corpus(
    eval_fraction: float, max_bytes: int, say: Callable[[str], None] | None = None
) -> tuple[list[str], list[str]]:
    """Train/held-out documents from the standard library, split by file (hash of its
    relative path) in a fixed pseudo-random file order; train text capped at `max_bytes`,
    held-out text at `eval_fraction` of that (only the files needed are read). `say`, if
    given, is told what was read (files, bytes, where) before anything is tokenized."""
    files = stdlib_files()
    if not files:
        raise ValueError(
            "the embedded corpus is empty: no standard-library .py files found via sysconfig; pass --set data.path=YOUR_DATA"
        )
    root = Path(sysconfig.get_paths()["stdlib"])
    held_cap = max_bytes * eval_fraction / (1 - eval_fraction) if max_bytes else 0
    docs: dict[bool, list[str]] = {False: [], True: []}
    size = {False: 0, True: 0}
    nbytes = {False: 0, True: 0}
    cap = {False: max_bytes, True: held_cap}
    for p in sorted(
        files, key=lambda p: hashlib.sha1(str(p.relative_to(root)).encode()).hexdigest()
    ):
        held = split_key(str(p.relative_to(root))) < eval_fraction
        if cap[held] and size[held] >= cap[held]:
            if cap[not held] and size[not held] >= cap[not held]:
                break
            continue
        text = p.read_text(encoding="utf-8", errors="replace")
        docs[held].append(text)
        size[held] += len(text)
        nbytes[held] += p.stat().st_size
    if say is not None:
        n = len(docs[False]) + len(docs[True])
        cap_note = f"data.max_bytes={max_bytes}" if max_bytes else "data.max_bytes=0: all of it"
        say(
            f"dropless train: data.path is unset, so the run reads this Python's standard library "
            f"({root}): {n:,} .py files, {(nbytes[False] + nbytes[True]) / MIB:.1f} MiB "
            f"({nbytes[False]:,} bytes for training, {nbytes[True]:,} held out; {cap_note}), and "
            "tokenizes it once (cached in the run directory); --set data.path=DIR trains on your own text"
        )
    return docs[False], docs[True]


def data_files(path: str, key: str) -> list[Path]:
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"{key}={path!r} does not exist; pass a .txt/.jsonl/.parquet file or a directory of them"
        )
    if p.is_file():
        if not _supported(p):
            raise ValueError(
                f"{key}={path!r}: unsupported file type {p.suffix!r}; supported: {', '.join(SUFFIXES)} and FASTA ({', '.join(FASTA_SUFFIXES)})"
            )
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and _supported(f))
    if not files:
        raise ValueError(
            f"{key}={path!r} is a directory with no {'/'.join(SUFFIXES)} files or FASTA files; point it at your data"
        )
    return files


class _DecodeErrors:
    """.txt files that are not valid UTF-8: counted, the first one named."""

    def __init__(self, errors: str):
        self.errors, self.count, self.first = errors, 0, None

    def read(self, f: Path, limit: int = 0) -> str:
        """The text of `f`; with `limit`, of its first `limit` bytes only (a character cut
        at the limit is dropped)."""
        with f.open("rb") as fh:
            raw = fh.read(limit) if limit else fh.read()
        final = not limit or len(raw) < limit
        try:
            return codecs.getincrementaldecoder("utf-8")().decode(raw, final=final)
        except UnicodeDecodeError as e:
            self.count += 1
            self.first = self.first or f"{f} (byte {e.start})"
            return codecs.getincrementaldecoder("utf-8")("replace").decode(raw, final=final)

    def check(self, key: str) -> None:
        if self.count and self.errors == "strict":
            raise ValueError(
                f"{key}: {self.count} .txt file(s) are not valid UTF-8 (first: {self.first}); convert them to UTF-8, "
                "or set data.errors=replace to decode them with U+FFFD replacement characters"
            )


def _jsonl(f: Path, text_field: str) -> Iterator[str]:
    """The `text_field` of each line, read one line at a time."""
    with f.open("rb") as fh:
        for n, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                row = json.loads(line)
            except (UnicodeDecodeError, ValueError) as e:
                raise ValueError(
                    f"{f}:{n}: not a JSON line ({e}); fix or remove that line"
                ) from None
            if not isinstance(row, dict):
                raise ValueError(f"{f}:{n}: expected a JSON object with a {text_field!r} field")
            if text_field not in row:
                raise ValueError(
                    f"{f}:{n} has no field {text_field!r} (fields: {sorted(row)}); set data.text_field"
                )
            text = row[text_field]
            if not isinstance(text, str):
                raise ValueError(
                    f"{f}:{n}: field {text_field!r} is {json.dumps(text)[:40]}, not a string; "
                    "give every line text there, or remove that line"
                )
            yield text


def _fasta(f: Path, limit: int) -> Iterator[str]:
    """Each record's sequence, joined from its lines; stops reading at `limit` characters."""
    current, parts, size = None, [], 0
    for index, _, piece in iter_fasta_pieces(f):
        if index != current:
            if parts:
                yield "".join(parts)
            current, parts = index, []
        if piece:
            parts.append(piece)
            size += len(piece)
            if limit and size >= limit:
                break
    if parts:
        yield "".join(parts)


def _parquet(f: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ModuleNotFoundError:
        raise ModuleNotFoundError(f"reading {f} needs pyarrow: pip install pyarrow") from None
    pf = pq.ParquetFile(f)
    if text_field not in pf.schema_arrow.names:
        raise ValueError(
            f"{f} has no column {text_field!r} (columns: {pf.schema_arrow.names}); set data.text_field"
        )
    for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
        yield from (str(t) for t in batch.column(0).to_pylist() if t is not None)


def _read_file(f: Path, text_field: str, decode: _DecodeErrors, limit: int = 0) -> Iterator[str]:
    """The documents of one file, read lazily; `limit` (characters, 0: none) lets a reader
    that needs only the start of a file stop there."""
    if is_fasta_path(f):  # one document per record
        return _fasta(f, limit)
    if f.suffix == ".txt":
        return iter([decode.read(f, limit)])
    if f.suffix == ".jsonl":
        return _jsonl(f, text_field)
    return _parquet(f, text_field)


def read_documents(
    path: str, text_field: str, key: str = "data.path", max_bytes: int = 0, errors: str = "strict"
) -> list[str]:
    """Documents of a .txt (one per file) / .jsonl / .parquet / FASTA file or directory of
    them. `max_bytes` (0: no cap) is enforced while reading: files are read in a stream and
    reading stops at the cap, the last document cut there. `errors`: "strict" refuses .txt
    files that are not UTF-8, "replace" decodes them lossily."""
    docs, size = [], 0
    files = data_files(path, key)
    decode = _DecodeErrors(errors)
    for f in files:
        for d in _read_file(f, text_field, decode, max_bytes - size if max_bytes else 0):
            if max_bytes and size + len(d) >= max_bytes:
                docs.append(d[: max_bytes - size])
                size = max_bytes
                break
            docs.append(d)
            size += len(d)
        if max_bytes and size >= max_bytes:
            break
    decode.check(key)
    if size == 0:
        raise ValueError(
            f"{key}={path!r} holds no text (0 characters in {len(files)} file(s)); point it at non-empty data"
        )
    return docs


def load_corpus(cfg, say: Callable[[str], None] | None = None) -> tuple[list[str], list[str]]:
    """(train documents, held-out documents) for a DataConfig; `say` is told what the
    embedded corpus read (see `stdlib_corpus`)."""
    if not cfg.path:
        if cfg.eval_path:
            raise ValueError(
                "data.eval_path is set but data.path is empty: give both, or neither for the embedded corpus"
            )
        return stdlib_corpus(cfg.eval_fraction, cfg.max_bytes, say)
    errors = getattr(cfg, "errors", "strict")
    docs = read_documents(cfg.path, cfg.text_field, max_bytes=cfg.max_bytes, errors=errors)
    if cfg.eval_path:
        held = read_documents(cfg.eval_path, cfg.text_field, key="data.eval_path", errors=errors)
        return _with_rc(cfg, docs), held
    if len(docs) < 20 and cfg.tokenizer == "dna":  # few long records: hold out each one's tail
        cuts = [int(len(d) * (1 - cfg.eval_fraction)) for d in docs]
        return _with_rc(cfg, [d[:c] for d, c in zip(docs, cuts)]), [
            d[c:] for d, c in zip(docs, cuts)
        ]
    if len(docs) < 20:  # too few documents to hold some out: hold out the tail of the text
        text = "\n".join(docs)
        cut = int(len(text) * (1 - cfg.eval_fraction))
        return [text[:cut]], [text[cut:]]
    train, held = split_by_key(docs, cfg.eval_fraction)
    return _with_rc(cfg, train), held


def split_by_key(items: list, eval_fraction: float) -> tuple[list, list]:
    """(kept, held out): every item whose index hashes below eval_fraction is held out (at
    least one)."""
    train, held = [], []
    for i, d in enumerate(items):
        (held if split_key(str(i)) < eval_fraction else train).append(d)
    if not held:
        held.append(train.pop())
    return train, held


def _with_rc(cfg, train: list[str]) -> list[str]:
    """data.reverse_complement: the training records plus their reverse complements."""
    return train + [reverse_complement(d) for d in train] if cfg.reverse_complement else train


def tokenize(tok, docs: list[str]) -> np.ndarray:
    """One stream: the documents' tokens with EOS between them (when the tokenizer has one)."""
    parts = []
    for ids in tok.encode_batch(docs):
        parts.append(np.asarray(ids, dtype=np.int32))
        if tok.eos_id is not None:
            parts.append(np.asarray([tok.eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def _fingerprint(f: Path) -> list:
    """A file's identity for the token cache: size, mtime and a hash of its content
    (all of it up to 2 MiB, else the first and last MiB)."""
    st = f.stat()
    h = hashlib.sha256()
    with f.open("rb") as fh:
        if st.st_size <= 2 * MIB:
            h.update(fh.read())
        else:
            h.update(fh.read(MIB))
            fh.seek(-MIB, 2)
            h.update(fh.read(MIB))
    return [str(f), st.st_size, st.st_mtime_ns, h.hexdigest()]


def cache_key(cfg, tok) -> str:
    """What the token cache depends on: settings, tokenizer and the data files' contents."""
    files = []
    for path, key in ((cfg.path, "data.path"), (cfg.eval_path, "data.eval_path")):
        if path:
            files += [_fingerprint(f) for f in data_files(path, key)]
    if not cfg.path:  # the embedded corpus: this Python's standard library
        files.append([sysconfig.get_paths()["stdlib"], sys.version])
    settings = (
        "path",
        "eval_path",
        "text_field",
        "eval_fraction",
        "max_bytes",
        "errors",
        "reverse_complement",
    )
    return json.dumps(
        {
            "data": {k: getattr(cfg, k, None) for k in settings},
            "tokenizer": cfg.tokenizer,
            "vocab": tok.vocab_size,
            "files": files,
        },
        sort_keys=True,
    )


def _save_npy(path: Path, a: np.ndarray) -> None:
    with atomic_file(path) as f:
        np.save(f, a)


def cached_streams(cfg, tok, cache_dir: Path, docs_fn) -> tuple[np.ndarray, np.ndarray]:
    """Token streams (train, held-out), tokenized once and cached under `cache_dir`; each
    file is replaced atomically and meta.json (the key) is written last."""
    key = cache_key(cfg, tok)
    meta = cache_dir / "meta.json"
    if meta.is_file() and meta.read_text() == key:
        try:
            return np.load(cache_dir / "train.npy"), np.load(cache_dir / "eval.npy")
        except (OSError, ValueError):
            pass  # a damaged cache: tokenize again
    train_docs, held_docs = docs_fn()
    train, held = tokenize(tok, train_docs), tokenize(tok, held_docs)
    cache_dir.mkdir(parents=True, exist_ok=True)
    meta.unlink(missing_ok=True)
    _save_npy(cache_dir / "train.npy", train)
    _save_npy(cache_dir / "eval.npy", held)
    write_atomic(meta, key)
    return train, held


class ShuffledSampler:
    """Sample index -> an item of a fresh permutation of the `num_items` items each epoch
    (seeded by (seed, epoch)); subclasses give `batch(indices)` and `targets(indices)`."""

    def __init__(self, num_items: int, seed: int):
        self.num_windows, self.seed = num_items, seed
        self._perm_epoch, self._perm = -1, None

    def _item(self, i: int) -> int:
        epoch, j = divmod(i, self.num_windows)
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._perm_epoch = epoch
        return int(self._perm[j])

    def targets(self, indices):
        return None  # a stream's targets are its inputs shifted (the step does it)

    def micro_batch(self, start, micro, rank, world, batch_size, grad_accum) -> tuple:
        """(int64 [b, L + 1], its targets [b, L] or None): one process's micro-batch
        (`micro_batch_indices`)."""
        idx = micro_batch_indices(start, micro, rank, world, batch_size, grad_accum)
        return self.batch(idx), self.targets(idx)


class WindowSampler(ShuffledSampler):
    """Sample index -> a window of L + 1 tokens of the stream (inputs and shifted targets)."""

    def __init__(self, tokens_N: np.ndarray, seq_len: int, seed: int):
        super().__init__((len(tokens_N) - 1) // seq_len, seed)
        self.tokens_N, self.seq_len = tokens_N, seq_len
        if self.num_windows < 1:
            raise ValueError(
                f"the training data has {len(tokens_N)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; use more data or a shorter train.seq_len"
            )

    def batch(self, indices) -> np.ndarray:
        """int64 [B, L + 1] for the given global sample indices."""
        L = self.seq_len
        rows = [self.tokens_N[w * L : w * L + L + 1] for w in map(self._item, indices)]
        return np.stack(rows).astype(np.int64)


def micro_batch_size(batch_size: int, world: int, grad_accum: int) -> int:
    """Sequences in one process's micro-batch: the global batch over the processes and the
    accumulation steps (at least 1: the planner asks about layouts wider than the batch;
    a run's batch is a multiple of both, which the preflight checks)."""
    return max(batch_size // (world * grad_accum), 1)


def micro_batch_indices(
    start: int, micro: int, rank: int, world: int, batch_size: int, grad_accum: int
) -> range:
    """Global sample indices of one process's micro-batch in the step whose first global
    sample index is `start` (see the module docstring)."""
    b = micro_batch_size(batch_size, world, grad_accum)
    first = start + (micro * world + rank) * b
    return range(first, first + b)


def eval_windows(tokens_N: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """int64 [B, L + 1]: consecutive held-out windows covering up to `max_tokens` targets."""
    n = min(max(1, max_tokens // seq_len), (len(tokens_N) - 1) // seq_len)
    if n < 1:
        raise ValueError(
            f"the held-out data has {len(tokens_N)} tokens, fewer than train.seq_len + 1 = {seq_len + 1}; give more held-out text (data.eval_path / data.eval_fraction) or a shorter train.seq_len"
        )
    return np.stack([tokens_N[w * seq_len : w * seq_len + seq_len + 1] for w in range(n)]).astype(
        np.int64
    )


def byte_counts(tok, tokens_N: np.ndarray) -> np.ndarray:
    """float64 [256]: how often each byte value occurs in the text behind `tokens_N`."""
    V = tok.vocab_size
    hist_V256 = np.zeros((V, 256), dtype=np.float64)
    for i, b in enumerate(tok.bytes_V):
        if b:
            hist_V256[i] = np.bincount(np.frombuffer(b, dtype=np.uint8), minlength=256)
    return np.bincount(tokens_N, minlength=V)[:V].astype(np.float64) @ hist_V256


def unigram_bits_per_byte(train_counts_256: np.ndarray, eval_bytes: bytes) -> float:
    """Cross-entropy (bits/byte) on `eval_bytes` of a byte-frequency model fit on the
    training text's byte counts with add-one smoothing: the baseline a model must beat."""
    counts = train_counts_256 + 1.0
    logp = np.log2(counts / counts.sum())
    ev = np.frombuffer(eval_bytes, dtype=np.uint8)
    return float(-logp[ev].mean()) if len(ev) else float("nan")


@dataclass
class RunData:
    """Tokenizer, training windows and the held-out set of one run."""

    tokenizer: object
    sampler: object  # WindowSampler, or sft.RowSampler for supervised records
    eval_BL1: np.ndarray
    eval_bytes: int
    unigram_bpb: float
    train_tokens: int
    eval_targets: np.ndarray | None = None  # supervised data: [B, L], IGNORE where no loss


def text_data(cfg, run_dir: Path, verbose: bool) -> RunData:
    """A run's text data, made in one go: the tokenizer (trained on the training documents
    or loaded, saved in `run_dir/tokenizer`), the token streams (tokenized once, cached in
    `run_dir/data`), the training windows, the held-out windows and the unigram baseline.
    The documents are read only when the tokenizer or the streams need them; `verbose`
    prints what the embedded corpus read."""
    loaded: list = []

    def docs():
        if not loaded:
            say = (lambda text: print(text, flush=True)) if verbose else None
            loaded.append(load_corpus(cfg.data, say=say))
        return loaded[0]

    dc, seq_len = cfg.data, cfg.train.seq_len
    tok = build_tokenizer(dc.tokenizer, run_dir / "tokenizer", lambda: docs()[0], dc.bpe_vocab_size)
    train_N, held_N = cached_streams(dc, tok, run_dir / "data", docs)
    eval_BL1 = eval_windows(held_N, seq_len, dc.eval_tokens)
    targets = eval_BL1[:, 1:].reshape(-1)
    return RunData(
        tokenizer=tok,
        sampler=WindowSampler(train_N, seq_len, cfg.train.seed),
        eval_BL1=eval_BL1,
        eval_bytes=int(tok.nbytes_V[targets].sum()),
        unigram_bpb=unigram_bits_per_byte(
            byte_counts(tok, train_N), b"".join(tok.bytes_V[i] for i in targets)
        ),
        train_tokens=len(train_N),
    )
