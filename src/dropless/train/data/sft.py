"""Supervised fine-tuning data: `.jsonl` records with `messages` (a list of
{role, content}) or `prompt` / `completion`, detected from the fields of the first
record (records with a plain `text` field stay pretraining-style streams).

Conversations are formatted with the chat template of the model directory
(`chat_template` in its tokenizer_config.json, or chat_template.jinja; a plain
"<|role|>\\ncontent\\n" template when it has none), rendered with jinja2; prompt/completion
records are the two strings joined. The loss covers the assistant (completion) tokens
only with `data.loss_on = "completion"`, every token with "all".

Each sample is one row of seq_len + 1 tokens, padded at its end (longer samples are
cut): no attention crosses from one sample into another, at the price of computing the
padding (its share is printed when the data is loaded).
"""

# R rows (samples), L sequence length

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .corpus import RunData, ShuffledSampler, byte_counts, split_by_key, unigram_bits_per_byte

IGNORE = -100  # cross_entropy's ignore_index: targets without loss
FALLBACK_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _jsonl_files(path: str) -> list[Path]:
    p = Path(path)
    files = sorted(p.rglob("*.jsonl")) if p.is_dir() else [p]
    return [f for f in files if f.suffix == ".jsonl" and f.is_file()]


def sft_kind(path: str) -> str | None:
    """ "messages", "prompt_completion", or None (not supervised data) from the first record."""
    for f in _jsonl_files(path):
        with open(f) as fh:
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    if isinstance(rec, dict) and "messages" in rec:
                        return "messages"
                    if isinstance(rec, dict) and "prompt" in rec and "completion" in rec:
                        return "prompt_completion"
                    return None
    return None


def read_records(path: str) -> list[dict]:
    recs = []
    for f in _jsonl_files(path):
        recs += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    return recs


def chat_template(model_dir: str) -> str:
    """The model directory's chat template, or the plain fallback."""
    d = Path(model_dir) if model_dir else None
    if d is not None and (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json" if d is not None else None
    if cfg is not None and cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, str):
            return t
    return FALLBACK_TEMPLATE


def _renderer(template: str):
    try:
        import jinja2
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "chat-formatted data needs jinja2: pip install 'dropless[lora]'"
        ) from None
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    tmpl = env.from_string(template)
    return lambda messages, gen: tmpl.render(messages=messages, add_generation_prompt=gen)


def segments(rec: dict, kind: str, render) -> list[tuple[str, bool]]:
    """The record as consecutive (text, is_completion) pieces."""
    if kind == "prompt_completion":
        return [(str(rec["prompt"]), False), (str(rec["completion"]), True)]
    msgs = rec["messages"]
    pieces, done = [], ""
    for i, m in enumerate(msgs):
        if m.get("role") != "assistant":
            continue
        before, upto = render(msgs[:i], True), render(msgs[: i + 1], False)
        if not (before.startswith(done) and upto.startswith(before)):
            raise ValueError(
                "the chat template does not render a conversation as a prefix of its longer "
                "turns, so the assistant tokens cannot be located; use prompt/completion records"
            )
        pieces += [(before[len(done) :], False), (upto[len(before) :], True)]
        done = upto
    full = render(msgs, False)
    if full[len(done) :]:
        pieces.append((full[len(done) :], False))
    return pieces


def encode_rows(
    recs: list[dict], kind: str, tok, seq_len: int, loss_on: str, template: str
) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [R, L+1], targets [R, L]): padded rows and their targets, IGNORE where no
    loss; samples left without a completion token by the cut at seq_len + 1 are dropped."""
    render = _renderer(template) if kind == "messages" else None
    L1 = seq_len + 1
    pad = tok.eos_id if tok.eos_id is not None else 0
    toks = np.full((len(recs), L1), pad, dtype=np.int64)
    keep = np.zeros((len(recs), L1), dtype=bool)
    for r, rec in enumerate(recs):
        ids, mask = [], []
        for text, is_completion in segments(rec, kind, render):
            t = tok.encode(text)
            ids += t
            mask += [is_completion or loss_on == "all"] * len(t)
        if tok.eos_id is not None:  # end of the sample: the model learns to stop
            ids.append(tok.eos_id)
            mask.append(mask[-1] if mask else False)
        n = min(len(ids), L1)
        toks[r, :n], keep[r, :n] = ids[:n], mask[:n]
    targets = np.where(keep[:, 1:], toks[:, 1:], IGNORE)
    # a sample cut before its completion has nothing to learn (and a NaN mean loss)
    useful = (targets != IGNORE).any(1)
    if not useful.any():
        raise ValueError(
            f"train.seq_len={seq_len} cuts every sample before its completion tokens; raise "
            "train.seq_len (or shorten the prompts)"
        )
    return toks[useful], targets[useful]


class RowSampler(ShuffledSampler):
    """Sample index -> one padded row and its targets (`data.ShuffledSampler`)."""

    def __init__(self, toks_RL1: np.ndarray, targets_RL: np.ndarray, seed: int):
        super().__init__(len(toks_RL1), seed)
        self.toks, self.targets_RL = toks_RL1, targets_RL
        if self.num_windows < 1:
            raise ValueError("the supervised data has no records; point data.path at .jsonl data")

    def batch(self, indices) -> np.ndarray:
        return self.toks[[self._item(i) for i in indices]]

    def targets(self, indices) -> np.ndarray:
        return self.targets_RL[[self._item(i) for i in indices]]


def prepare_sft(cfg, kind: str, make_tokenizer, seq_len: int, verbose: bool) -> RunData:
    """Records -> tokenizer (`make_tokenizer(texts)`), padded rows, held-out rows and the
    byte counts the metrics use (loss tokens only)."""
    recs = read_records(cfg.data.path)
    if cfg.data.eval_path:
        train, held = recs, read_records(cfg.data.eval_path)
    else:
        train, held = split_by_key(recs, cfg.data.eval_fraction)
    texts = [
        str(r["prompt"]) + str(r["completion"])
        if kind == "prompt_completion"
        else "\n".join(str(m.get("content", "")) for m in r["messages"])
        for r in train
    ]
    tok = make_tokenizer(texts)
    template = chat_template(cfg.model.path)
    rows, targets = encode_rows(train, kind, tok, seq_len, cfg.data.loss_on, template)
    ev_rows, ev_tg = encode_rows(held, kind, tok, seq_len, cfg.data.loss_on, template)
    n = max(1, cfg.data.eval_tokens // seq_len)
    ev_rows, ev_tg = ev_rows[:n], ev_tg[:n]
    ev_targets = ev_tg[ev_tg != IGNORE]
    train_targets = targets[targets != IGNORE]
    if verbose:
        pad = tok.eos_id if tok.eos_id is not None else 0
        share = 1 - float((rows[:, 1:] != pad).mean())
        print(
            f"supervised data ({kind}): {len(rows)} train / {len(ev_rows)} held-out samples, "
            f"{train_targets.size} loss tokens, ~{share:.0%} of positions padding",
            flush=True,
        )
    return RunData(
        tokenizer=tok,
        sampler=RowSampler(rows, targets, cfg.train.seed),
        eval_BL1=ev_rows,
        eval_targets=ev_tg,
        eval_bytes=max(1, int(tok.nbytes_V[ev_targets].sum())),
        unigram_bpb=unigram_bits_per_byte(
            byte_counts(tok, train_targets), tok.token_bytes(ev_targets)
        ),
        train_tokens=int(train_targets.size),
    )
