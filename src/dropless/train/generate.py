"""Loading a finished (or running) training run back: for `dropless generate` (sampling)
and `dropless convert` (a stock Hugging Face directory)."""

# B sequences, L tokens, V vocabulary

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from .checkpoint import store as ckpt
from .config.load import load_config
from .data.tokenizer import load_tokenizer
from .model.build import build_model, hf_config


def resolve_checkpoint(path: str | Path) -> tuple[Path, Path]:
    """(run directory, checkpoint directory) for a run directory or a checkpoints/step_* one:
    verified, and held against a live run's pruning until loaded (`ckpt.pick_checkpoint`)."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"{str(p)!r} is not a directory; pass a run directory (dropless train --run-dir) or one of its checkpoints/step_* directories"
        )
    found = ckpt.pick_checkpoint(p)
    if found is None:
        raise ValueError(
            f"{str(p)!r} has no complete checkpoint (checkpoints/step_*); train first, or pass a checkpoint directory"
        )
    return found


def load_run(path: str | Path, device: str | torch.device = "cpu"):
    """(config, tokenizer, model with the checkpoint's weights in eval mode, checkpoint dir)."""
    run_dir, ck = resolve_checkpoint(path)
    config_file = ck / "config.toml" if (ck / "config.toml").is_file() else run_dir / "config.toml"
    if not config_file.is_file():
        raise ValueError(
            f"no config.toml in {str(ck)!r} or {str(run_dir)!r}: not a dropless training run"
        )
    cfg = load_config(config_file)
    tok = load_tokenizer(run_dir / "tokenizer")
    model = build_model(
        cfg.model,
        hf_config(cfg.model, tok.vocab_size),
        expert_bias=cfg.train.expert_bias_rate > 0,
        seed=cfg.train.seed,
        device=device,
    )
    lora = cfg.finetune.method == "lora"
    if lora:  # the checkpoint holds the adapters; the base comes from model.path
        from .model.lora import apply_lora

        model = apply_lora(model, cfg.finetune, cfg.model.path)
    ckpt.load_checkpoint(ck, model, restore_rng=False, trainable_only=lora)
    model.eval()
    return cfg, tok, model, ck


def _padding_mask(vocab_size: int):
    """A Transformers logits processor that gives the embedding's padding rows (ids past
    the tokenizer's vocabulary) no probability."""
    from transformers import LogitsProcessor

    class PaddingRows(LogitsProcessor):
        def __call__(self, input_ids, scores_BV):
            scores_BV[:, vocab_size:] = -float("inf")
            return scores_BV

    return PaddingRows()


@torch.no_grad()
def sample(
    model,
    tok,
    prompt: str,
    max_new_tokens: int = 200,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    top_p: float = 1.0,
    context: int = 256,
    seed: int = 0,
) -> str:
    """Continue `prompt` with Transformers' `generate` on `model` (the dropless path, its
    KV cache on): greedy for temperature 0, else sampling with temperature, top-k (0: all)
    and top-p; returns the new text. The prompt keeps its last `context` tokens; the
    end-of-text token does not stop it (the text leaves it out)."""
    from transformers import GenerationConfig, LogitsProcessorList

    if temperature < 0 or top_k < 0 or max_new_tokens < 0 or not 0 < top_p <= 1:
        raise ValueError(
            "temperature, top_k and max_new_tokens must be >= 0 and top_p in (0, 1] (got "
            f"temperature={temperature}, top_k={top_k}, max_new_tokens={max_new_tokens}, top_p={top_p})"
        )
    if max_new_tokens == 0:
        return ""
    ids = tok.encode(prompt) or ([tok.eos_id] if tok.eos_id is not None else [0])
    device = next(model.parameters()).device
    x_BL = torch.tensor([ids[-context:]], device=device)
    greedy = temperature == 0
    gen = GenerationConfig(
        max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, use_cache=True,
        do_sample=not greedy, temperature=None if greedy else temperature,
        top_k=None if greedy or not top_k else min(top_k, tok.vocab_size),
        top_p=None if greedy else top_p, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        out_BL = model.generate(
            input_ids=x_BL, attention_mask=torch.ones_like(x_BL), generation_config=gen,
            logits_processor=LogitsProcessorList([_padding_mask(tok.vocab_size)]),
        )  # fmt: skip
    return tok.decode(out_BL[0, x_BL.shape[1] :].tolist())


def ship_tokenizer(tok, run_tok_dir: Path, out: Path) -> None:
    """The tokenizer the run trained with, beside the converted weights: a model directory's
    own tokenizer files as they were copied into the run (tokenizer_config.json, special
    tokens, chat template kept), a BPE trained by the run as a Transformers fast tokenizer,
    the DNA tokenizer in its own saved form, and for the byte and DNA tokenizers a
    TOKENIZER.txt note for other readers, by which a later `dropless train --set
    model.path=OUT` also finds the byte tokenizer."""
    if tok.kind == "bpe":
        if (run_tok_dir / "tokenizer_config.json").is_file():
            for f in run_tok_dir.iterdir():
                if f.is_file():
                    shutil.copy2(f, out / f.name)
            return
        from transformers import PreTrainedTokenizerFast

        from .data.tokenizer import EOS

        PreTrainedTokenizerFast(tokenizer_object=tok.tok, eos_token=EOS).save_pretrained(out)
        return
    if tok.kind == "bytes":  # no file of its own (its run-directory marker is named `bytes`)
        note = "byte tokenizer: token ids 0..255 are UTF-8 bytes, 256 is end-of-text\n"
    else:
        tok.save(out)
        note = "DNA tokenizer (dropless): see dna_tokenizer.json for its bases and special tokens\n"
    (out / "TOKENIZER.txt").write_text(note)


def _added_bias_in_use(model) -> list[str]:
    """The routers' `expert_bias` buffers dropless added (the family has no score bias of
    its own) that hold a trained, nonzero bias: a stock model without them routes
    differently."""
    from .. import hf

    state = model.state_dict()
    return [k for k in hf.added_state_keys(model) if bool(state[k].ne(0).any())]


def convert(
    path: str | Path, out_dir: str | Path, merge: bool = False, drop_expert_bias: bool = False
) -> Path:
    """Write a training checkpoint as a Hugging Face `save_pretrained` directory.

    merge: for a LoRA run (finetune.method="lora"), fold the adapters into the weights
    (PEFT's `merge_and_unload`) and write the merged stock model. A run trained with the
    aux-loss-free expert bias (`train.expert_bias_rate` > 0) on a family whose routers have
    no score bias of their own (dropless added `expert_bias`) is refused: the stock family
    cannot hold the bias, so the written model would choose other experts than the run's.
    drop_expert_bias: write it anyway, without the bias (families with their own bias,
    DeepSeek-V3's `e_score_correction_bias`, keep it in the written model)."""
    from .. import hf

    cfg, tok, model, ck = load_run(path)
    lora = cfg.finetune.method == "lora"
    if lora and not merge:
        raise ValueError(
            f"{str(path)!r} is a LoRA run: its checkpoints hold the adapters only. Pass --merge "
            "to write the base model with the adapters folded in (the adapter alone, in PEFT's "
            "format, is in the run's adapter/ directory)"
        )
    if merge and not lora:
        raise ValueError(
            f"--merge: {str(path)!r} is a full fine-tuning run (finetune.method='full'), there "
            "is no adapter to merge; drop --merge"
        )
    if lora:
        from .model.lora import merge_lora

        model = merge_lora(model)
    biased = _added_bias_in_use(model)
    if biased and not drop_expert_bias:
        raise ValueError(
            f"{str(path)!r} trained with the aux-loss-free expert bias (train.expert_bias_rate="
            f"{cfg.train.expert_bias_rate:g}) on {type(model).__name__}, whose routers have no "
            f"score bias of their own ({len(biased)} layers' `expert_bias`, added by dropless): "
            "stock Transformers would choose experts without it, so the written model would not "
            "compute what the run trained. Pass --drop-expert-bias to write it without the bias "
            "knowingly (its routing and loss change; docs/train.md, Router losses), or train with "
            "train.expert_bias_rate=0"
        )
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise ValueError(
            f"output directory {str(out)!r} is not empty; pass a new or empty directory"
        )
    hf.unpatch_model(model)
    model.config.use_cache = True
    if tok.eos_id is not None:
        model.config.eos_token_id = tok.eos_id
    hf.save_hf(model, out)
    ship_tokenizer(tok, resolve_checkpoint(path)[0] / "tokenizer", out)
    mode = ckpt.default_file_mode()
    for f in out.iterdir():  # safetensors creates model.safetensors 0600; give the usual mode
        if f.is_file():
            f.chmod(mode)
    return out
