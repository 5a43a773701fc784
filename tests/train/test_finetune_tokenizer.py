"""Fine-tuning a checkpoint (`model.path`) keeps the checkpoint's tokenizer: with
`data.tokenizer` unset the run encodes with the tokenizer saved beside the weights, a
tokenizer that does not fit the embeddings is refused, and `dropless convert` ships the
tokenizer the run trained with."""

import json

import pytest
import torch

from dropless.cli.main import main
from dropless.train.config.load import load_config
from dropless.train.config.recipes import TINY
from harness import tiny_args, tiny_moe_config

VOCAB = 320  # a 300-token BPE plus padding rows


def _no_tokenizer_args(*extra: str) -> list[str]:
    """The tiny run's arguments without its `data.tokenizer=bytes` (the default applies)."""
    args = []
    for item in (*TINY, *extra):
        if not item.startswith("data.tokenizer="):
            args += ["--set", item]
    return args


def _saved(path, vocab: int = VOCAB, tokenizer: bool = True):
    """A tiny Qwen3-MoE checkpoint; with `tokenizer`, a 300-token BPE saved beside it as
    Transformers saves a model's tokenizer (tokenizer.json + tokenizer_config.json)."""
    import transformers as tf

    from dropless.train.data.corpus import stdlib_corpus
    from dropless.train.data.tokenizer import EOS, HFTokenizer

    cfg = tiny_moe_config(
        vocab_size=vocab, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        intermediate_size=64, moe_intermediate_size=32, num_experts=4, norm_topk_prob=False,
        pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    if tokenizer:
        texts = stdlib_corpus(0.05, 200_000)[0]
        tok = HFTokenizer.train_bpe(texts, 300)
        fast = tf.PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=EOS)
        fast.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("ckpt") / "src")


def test_model_path_runs_with_its_own_tokenizer_and_convert_ships_it(checkpoint, tmp_path):
    run, out = tmp_path / "run", tmp_path / "hf"
    args = _no_tokenizer_args(
        f"model.path={checkpoint}", "train.steps=2", "train.seq_len=16", "log.every=1",
        "checkpoint.every=2", "log.plots=false", "log.tensorboard=false",
    )  # fmt: skip
    assert main(["train", "--run-dir", str(run), *args]) == 0
    # the checkpoint's own tokenizer, byte for byte, not a BPE trained on the new data
    src_tok = (checkpoint / "tokenizer.json").read_bytes()
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == src_tok
    resolved = load_config(run / "config.toml")
    assert resolved.data.tokenizer == str(checkpoint)  # resume checks compare this
    assert main(["convert", str(run), str(out)]) == 0
    assert (out / "tokenizer.json").read_bytes() == src_tok
    want = json.loads((checkpoint / "tokenizer_config.json").read_text())
    assert json.loads((out / "tokenizer_config.json").read_text()) == want


def test_a_smaller_tokenizer_than_the_embeddings_is_refused(tmp_path, capsys):
    src = _saved(tmp_path / "src", vocab=1024, tokenizer=False)
    args = tiny_args(f"model.path={src}")  # bytes: 257 ids for 1024 trained rows
    assert main(["train", "--run-dir", str(tmp_path / "run"), *args]) == 2
    err = capsys.readouterr().err
    assert (
        "the tokenizer has 257 tokens but model.path's embeddings have 1024 rows (more than 256 "
        "padding rows)" in err
    )
    assert "leave data.tokenizer unset" in err
    # without a tokenizer beside the weights and none named, nothing is guessed
    bare = _no_tokenizer_args(f"model.path={src}")
    assert main(["train", "--run-dir", str(tmp_path / "r2"), *bare]) == 2
    err = capsys.readouterr().err
    assert "holds no tokenizer (tokenizer.json), and data.tokenizer is unset" in err


def test_padding_rows_are_accepted(tmp_path):
    from dropless.train.model.build import check_compatible, padding_rows

    class C:
        vocab_size, max_position_embeddings = 151_936, 4096

    check_compatible(C, 151_669, 128, pretrained=True)  # Qwen3: 267 padding rows
    assert padding_rows(151_936) == 1519 and padding_rows(320) == 256
    with pytest.raises(ValueError, match="embeddings have 151936 rows"):
        check_compatible(C, 151_936 - 1520, 128, pretrained=True)
    check_compatible(C, 2048, 128, pretrained=False)  # fresh weights: any smaller vocabulary


def test_a_converted_byte_run_is_found_again(finished_run, tmp_path):
    """`dropless convert` of a byte-tokenizer run writes the tokenizer's marker, so a
    fine-tune of the converted model picks the byte tokenizer by itself."""
    from dropless.train.data.tokenizer import resolve_spec

    out = tmp_path / "hf"
    assert main(["convert", str(finished_run), str(out)]) == 0
    # only what a Hugging Face model directory holds: no extension-less `bytes` marker
    names = {f.name for f in out.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "TOKENIZER.txt"}
    assert resolve_spec("auto", str(out)) == "bytes"
    assert resolve_spec("auto", "") == "bpe" and resolve_spec("bytes", str(out)) == "bytes"
