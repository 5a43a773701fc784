"""Supervised fine-tuning data: detection from the records' fields, chat-template
formatting with the loss on the assistant tokens only, and a LoRA run on it."""

import json

import numpy as np
import torch

from dropless.cli.main import main
from dropless.train.data import sft
from dropless.train.data.tokenizer import ByteTokenizer
from harness import read_metrics, tiny_args, tiny_moe_config

TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _chat(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = (int(v) for v in rng.integers(0, 50, 2))
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"{a}+{b}"},
                    {"role": "assistant", "content": str(a + b)},
                ]
            }
        )
    return out


def _write(path, recs):
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return path


def test_detection_and_loss_on_assistant_tokens_only(tmp_path):
    assert sft.sft_kind(str(_write(tmp_path / "c.jsonl", _chat(2)))) == "messages"
    pc = _write(tmp_path / "p.jsonl", [{"prompt": "Q: 1+1 A:", "completion": " 2"}])
    assert sft.sft_kind(str(pc)) == "prompt_completion"
    assert sft.sft_kind(str(_write(tmp_path / "t.jsonl", [{"text": "x"}]))) is None
    tok = ByteTokenizer()
    toks, tg = sft.encode_rows(_chat(1), "messages", tok, 64, "completion", TEMPLATE)
    kept = tg[0][tg[0] != sft.IGNORE]
    # rendered like Transformers' apply_chat_template (trim_blocks, lstrip_blocks)
    answer = _chat(1)[0]["messages"][-1]["content"]
    got = tok.decode([int(t) for t in kept if t != tok.eos_id])
    assert got.rstrip("\n") == answer + "</assistant>"
    _, tg_all = sft.encode_rows(_chat(1), "messages", tok, 64, "all", TEMPLATE)
    assert (tg_all[0] != sft.IGNORE).sum() > (tg[0] != sft.IGNORE).sum()
    toks, tg = sft.encode_rows(
        [{"prompt": "Q:", "completion": "ok"}], "prompt_completion", tok, 8, "completion", ""
    )
    assert tok.decode([int(t) for t in tg[0] if t not in (sft.IGNORE, tok.eos_id)]) == "ok"


def test_lora_sft_run(tmp_path):
    import transformers as tf

    cfg = tiny_moe_config(
        vocab_size=264, num_experts=4, norm_topk_prob=False, pad_token_id=None, bos_token_id=None
    )
    torch.manual_seed(0)
    src = tmp_path / "src"
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(src)
    (src / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    data = _write(tmp_path / "chat.jsonl", _chat(60))
    run = tmp_path / "run"
    args = tiny_args(
        f"model.path={src}", f"data.path={data}", "finetune.method=lora", "finetune.lora_rank=4",
        "train.steps=6", "train.seq_len=40", "train.batch_size=4", "optim.warmup_steps=1",
        "optim.lr=3e-2", "log.every=3", "checkpoint.every=0", "log.plots=false",
        "log.tensorboard=false",
    )  # fmt: skip
    assert main(["train", "--run-dir", str(run), *args]) == 0
    recs = read_metrics(run)
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"]
    assert (run / "adapter" / "adapter_config.json").is_file()
