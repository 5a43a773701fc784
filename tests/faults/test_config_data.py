"""Config and data faults: non-finite numbers, unknown attention implementations, bad
.jsonl lines and .txt bytes, a token cache that follows the data, a cut-short metrics line."""

import json
import os
import warnings

import numpy as np
import pytest

from dropless.train.config.load import DataConfig, load_config
from dropless.train.data.corpus import cache_key, cached_streams, read_documents
from dropless.train.data.tokenizer import ByteTokenizer
from dropless.train.report.metrics import MetricsWriter, read_metrics


@pytest.mark.parametrize(
    "override", ["optim.lr=nan", "optim.lr=inf", "train.aux_loss_coef=-inf", "log.peak_tflops=nan"]
)
def test_non_finite_numbers_are_refused(override):
    key = override.split("=")[0]
    with pytest.raises(ValueError, match=f"{key}=.*must be a finite number"):
        load_config(None, [override])


def test_non_finite_in_a_toml_file(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("[optim]\nlr = inf\n")
    with pytest.raises(ValueError, match=r"optim.lr=inf: must be a finite number"):
        load_config(f)


def test_attn_implementation_is_checked():
    with pytest.raises(
        ValueError, match="model.attn_implementation='sdpa2': allowed values are 'eager', 'sdpa'"
    ):
        load_config(None, ["model.attn_implementation=sdpa2"])
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from dropless.train.config.load import ATTENTION

    for name in ATTENTION[1:]:  # every allowed value is one Transformers knows
        assert name in ALL_ATTENTION_FUNCTIONS, name


def test_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"text": "ok"}\n{"text": "cut sh\n')
    with pytest.raises(ValueError, match=rf"{f}:2: not a JSON line"):
        read_documents(str(f), "text")
    f.write_text('{"text": "ok"}\n["a list"]\n')
    with pytest.raises(ValueError, match=rf"{f}:2: expected a JSON object with a 'text' field"):
        read_documents(str(f), "text")


def test_txt_decode_errors_are_reported_unless_replace(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"good text")
    (tmp_path / "b.txt").write_bytes(b"bad \xff\xfe bytes")
    with pytest.raises(
        ValueError,
        match=r"1 .txt file\(s\) are not valid UTF-8 \(first: .*b.txt \(byte 4\)\); .*data.errors=replace",
    ):
        read_documents(str(tmp_path), "text")
    docs = read_documents(str(tmp_path), "text", errors="replace")
    assert docs[1] == "bad \ufffd\ufffd bytes"
    with pytest.raises(
        ValueError, match="data.errors='ignore': allowed values are 'strict', 'replace'"
    ):
        load_config(None, ["data.errors=ignore"])


def test_token_cache_follows_content_and_is_atomic(tmp_path):
    data = tmp_path / "d.txt"
    data.write_text("abc " * 500)
    cfg, tok = DataConfig(path=str(data), tokenizer="bytes"), ByteTokenizer()
    calls = []

    def docs():
        calls.append(1)
        return [data.read_text()], ["held out text"]

    a, _ = cached_streams(cfg, tok, tmp_path / "cache", docs)
    cached_streams(cfg, tok, tmp_path / "cache", docs)
    assert len(calls) == 1  # second call: from the cache
    key = cache_key(cfg, tok)
    st = data.stat()
    data.write_text("xyz " * 500)  # same size, same mtime: only the content differs
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert cache_key(cfg, tok) != key
    b, _ = cached_streams(cfg, tok, tmp_path / "cache", docs)
    assert len(calls) == 2 and not np.array_equal(a, b)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "eval.npy",
        "meta.json",
        "train.npy",
    ]


def test_truncated_metrics_line_is_dropped_on_resume(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps({"step": 0}) + "\n" + json.dumps({"step": 2}) + "\n" + '{"step": 4, "lo'
    )
    with pytest.warns(
        UserWarning, match=r"metrics.jsonl:3: dropping a truncated or invalid metrics line"
    ):
        w = MetricsWriter(tmp_path, tensorboard=False, resume_step=2)
    w.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 2]
