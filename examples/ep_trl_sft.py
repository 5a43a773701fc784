"""Expert parallelism under TRL's `SFTTrainer`.

    torchrun --standalone --nproc-per-node 2 examples/ep_trl_sft.py           # tiny, CPU (gloo)
    python examples/ep_trl_sft.py                                             # one process
    torchrun --standalone --nproc-per-node 8 examples/ep_trl_sft.py --model DIR --ep 8 \\
        --global-batch 16 --seq-len 4096 --lr 1e-5 --out runs/sft

As under Transformers' `Trainer` (examples/ep_hf_trainer.py), which `SFTTrainer` is: the
`SFTConfig` first (it joins the process group), then `dropless.parallelize`, then the
trainer, with `fsdp` and `deepspeed` unset and `save_strategy="no"` (or
`save_only_model=True`). The data here is already tokenized (`skip_prepare_dataset`);
with a real checkpoint and its tokenizer pass a text dataset as TRL's docs do.
"""

from __future__ import annotations

import os

import torch
from datasets import Dataset
from moe_example_common import init, load_model, parser, report, shared_dir, tiny_checkpoint
from transformers import AutoTokenizer, TrainerCallback
from trl import SFTConfig, SFTTrainer


class Record(TrainerCallback):
    def __init__(self):
        self.losses, self.norms = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.norms.append(float(logs.get("grad_norm", float("nan"))))


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = SFTConfig(
        output_dir=args.out or "ep_trl_sft_out",
        per_device_train_batch_size=args.global_batch // world,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=args.max_grad_norm,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=args.seed,
        train_sampling_strategy="sequential",  # the same global batches for any world size
        use_cpu=not torch.cuda.is_available(),
        dataset_kwargs={"skip_prepare_dataset": True},
        max_length=args.seq_len,
    )
    rank, world = init()  # SFTConfig joined torchrun's process group
    out = shared_dir(args.out, rank)
    cfg.output_dir = str(out)
    path = args.model or tiny_checkpoint(out, rank, args.seed)
    model = load_model(path, world, args.ep)
    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.steps * args.grad_accum * args.global_batch
    # ids from 3 up: no pad (t0) or end-of-text token inside a row
    ids = torch.randint(3, model.config.vocab_size, (n, args.seq_len), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist()})
    record = Record()
    trainer = SFTTrainer(
        model=model, args=cfg, train_dataset=data, callbacks=[record],
        processing_class=AutoTokenizer.from_pretrained(path),
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "final"))
    report(out, rank, {"losses": record.losses, "grad_norms": record.norms, "world": world,
                       "out": str(out)})  # fmt: skip


if __name__ == "__main__":
    main()
