"""Streaming FASTA / FASTA.gz reader.

A file holds records: a `>` header line (the first word is the record's name, the rest
its description) followed by sequence lines, wrapped at any width. Blank lines, CRLF
line ends, lowercase (soft-masked) bases and `;` comment lines are accepted. Gzip is
detected from the file's first bytes, whatever its name. Sequence lines may hold the
IUPAC nucleotide letters (any case), `*` and the gap characters `-` and `.`; anything
else, sequence data before the first header, or a header without a name raises a
ValueError naming the file and line.

`iter_fasta_pieces` never holds more than one line; `read_fasta` joins each record.
"""

from __future__ import annotations

import gzip
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FASTA_SUFFIXES = (".fa", ".fasta", ".fna", ".ffn", ".fas", ".fa.gz", ".fasta.gz", ".fna.gz")
# IUPAC nucleotide codes (U for RNA) plus stop and gap symbols
_ALLOWED = re.compile(r"[ACGTURYSWKMBDHVNacgturyswkmbdhvn*.\-]*")
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class FastaRecord:
    """One record: `name` (first word of the header), `description` (the rest) and the
    sequence with line breaks removed, case kept."""

    name: str
    description: str
    sequence: str


def is_fasta_path(path: str | Path) -> bool:
    """Whether the file name has a FASTA suffix (optionally .gz)."""
    return str(path).lower().endswith(FASTA_SUFFIXES)


def _open_binary(path: Path):
    with path.open("rb") as fh:
        magic = fh.read(2)
    return gzip.open(path, "rb") if magic == _GZIP_MAGIC else path.open("rb")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text without the line end); decoded line by line so an error names
    its line."""
    lineno = 0
    try:
        with _open_binary(path) as fh:
            for lineno, raw in enumerate(fh, 1):
                yield lineno, raw.decode("ascii").rstrip("\r\n")
    except UnicodeDecodeError as exc:
        raise ValueError(
            f"{path}:{lineno}: not a text FASTA file (byte {exc.object[exc.start]:#x} is not ASCII)"
        ) from None
    except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError
        raise ValueError(f"{path}: unreadable compressed FASTA file ({exc})") from None


def iter_fasta_pieces(path: str | Path) -> Iterator[tuple[int, str, str]]:
    """Yield (record index, header, sequence line) per sequence line, streaming.

    Records without sequence lines yield one piece with an empty line, so every record
    is seen. Raises ValueError (file:line) for malformed input or an empty file.
    """
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"FASTA file {str(path)!r} does not exist")
    index, header, has_seq, lineno = -1, None, False, 0
    for lineno, line in _lines(p):
        line = line.strip()
        if not line or line.startswith(";"):
            continue
        if line.startswith(">"):
            if header is not None and not has_seq:
                yield index, header, ""
            header, has_seq, index = line[1:].strip(), False, index + 1
            if not header:
                raise ValueError(f"{p}:{lineno}: empty '>' header; a record needs a name after '>'")
            continue
        if header is None:
            raise ValueError(
                f"{p}:{lineno}: sequence data before the first '>' header; "
                "a FASTA file starts with a '>name' line"
            )
        if not _ALLOWED.fullmatch(line):
            bad = next(c for c in line if not _ALLOWED.fullmatch(c))
            raise ValueError(
                f"{p}:{lineno}: character {bad!r} (column {line.index(bad) + 1}) is not "
                "an IUPAC nucleotide code; expected A, C, G, T, N, other IUPAC "
                "letters, '-' or '.'"
            )
        has_seq = True
        yield index, header, line
    if header is None:
        raise ValueError(f"{p}: no FASTA records (no '>' header line) in {lineno} line(s)")
    if not has_seq:
        yield index, header, ""


def read_fasta(path: str | Path) -> Iterator[FastaRecord]:
    """Yield the records of a FASTA / FASTA.gz file, one joined sequence at a time."""
    current, header, parts = None, "", []
    for index, head, piece in iter_fasta_pieces(path):
        if index != current:
            if current is not None:
                yield _record(header, parts)
            current, header, parts = index, head, []
        if piece:
            parts.append(piece)
    if current is not None:
        yield _record(header, parts)


def _record(header: str, parts: list[str]) -> FastaRecord:
    name, _, description = header.partition(" ")
    return FastaRecord(name, description.strip(), "".join(parts))
