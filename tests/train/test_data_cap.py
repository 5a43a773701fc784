"""data.max_bytes caps what is read, not what is kept: a file far larger than the cap is
read only up to it (peak memory a small multiple of the cap), and a .jsonl text field
that is not a string is refused with file:line."""

import json
import re
import tracemalloc

import pytest

from dropless.train.data.corpus import read_documents

CAP = 300_000
BIG = 50 * 1024 * 1024  # 50 MiB


def _peak(fn):
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def big_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    line = "the quick brown fox jumps over the lazy dog " * 20 + "\n"  # 901 bytes
    txt, jsonl = root / "big.txt", root / "big.jsonl"
    with txt.open("w") as f:
        for _ in range(BIG // len(line) + 1):
            f.write(line)
    row = json.dumps({"text": line}) + "\n"
    with jsonl.open("w") as f:
        for _ in range(BIG // len(row) + 1):
            f.write(row)
    assert txt.stat().st_size > BIG and jsonl.stat().st_size > BIG
    return txt, jsonl


@pytest.mark.parametrize("kind", ["txt", "jsonl"])
def test_a_50_mib_file_is_read_only_up_to_the_cap(big_files, kind):
    path = big_files[0] if kind == "txt" else big_files[1]
    docs, peak = _peak(lambda: read_documents(str(path), "text", max_bytes=CAP))
    assert sum(map(len, docs)) == CAP
    # the text kept (~CAP characters, a few copies while decoding and joining) and
    # bookkeeping; reading the whole file would take more than 50 MiB
    assert peak < 8 * CAP, peak


def test_a_cap_inside_a_multibyte_character_keeps_whole_characters(tmp_path):
    f = tmp_path / "u.txt"
    f.write_text("é" * 1000)  # 2 bytes each
    (doc,) = read_documents(str(f), "text", max_bytes=1001)
    assert doc == "é" * 500  # the first 1001 bytes hold 500 whole characters


@pytest.mark.parametrize("value, shown", [(None, "null"), (5, "5"), (["a"], '["a"]')])
def test_jsonl_text_that_is_not_a_string_is_refused(tmp_path, value, shown):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
    with pytest.raises(
        ValueError, match=re.escape(f"d.jsonl:2: field 'text' is {shown}, not a string")
    ):
        read_documents(str(f), "text")
