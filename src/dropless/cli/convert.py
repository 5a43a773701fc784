"""`dropless convert CHECKPOINT_DIR OUT_DIR`: a training checkpoint to a Hugging Face
`save_pretrained` directory that stock Transformers loads."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "checkpoint",
        help="a training run directory (last checkpoint) or a checkpoints/step_* directory",
    )
    p.add_argument(
        "out_dir",
        help="new directory for the Hugging Face model (config.json, model.safetensors, tokenizer)",
    )
    p.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: fold the adapters into the base weights and write the merged model",
    )
    p.add_argument(
        "--drop-expert-bias",
        action="store_true",
        help="a run trained with train.expert_bias_rate > 0 on a family without its own router "
        "bias: write the model without the bias, which the stock family cannot hold (the "
        "written model routes differently from the run's; refused without this flag)",
    )


def run(args) -> int:
    from ..train.generate import convert

    out = convert(
        args.checkpoint, args.out_dir, merge=args.merge, drop_expert_bias=args.drop_expert_bias
    )
    print(
        f"wrote {out} (load it with transformers.AutoModelForCausalLM.from_pretrained({str(out)!r}))"
    )
    return 0
