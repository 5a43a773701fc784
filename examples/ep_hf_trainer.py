"""Expert parallelism under Transformers' `Trainer`.

    torchrun --standalone --nproc-per-node 2 examples/ep_hf_trainer.py        # tiny, CPU (gloo)
    python examples/ep_hf_trainer.py                                          # one process
    torchrun --standalone --nproc-per-node 8 examples/ep_hf_trainer.py --model DIR --ep 8 \\
        --global-batch 16 --seq-len 4096 --lr 1e-5 --out runs/trainer

The model is laid out by `dropless.parallelize` before the `Trainer` sees it, which marks
it as Transformers marks a model sharded at load time (`is_distributed_loading_by_transformers`):
the Trainer then leaves its placement and gradient reduction to it (no DDP wrap, no `fsdp`
setting: leave `fsdp` and `deepspeed` unset). Create the `TrainingArguments` first: under
torchrun they join the process group `dropless.parallelize` needs. Gradient clipping
(`max_grad_norm`) spans the two device meshes (Trainer's mixed-mesh norm), and
`trainer.save_model` gathers the model on every rank and writes, on rank 0, a checkpoint
stock `from_pretrained` loads. `--save-steps 3` writes resumable checkpoints (Trainer's
`save_only_model=True` weights, the optimizer and scheduler by
`dropless.hf.trainer_checkpoints()`); `--resume OUT/checkpoint-3` continues from one.

`--lora 4`: LoRA of rank 4 on the experts and the attention, the base frozen, added before
`dropless.parallelize` as `dropless train` adds it (`moe_example_common.load_model`);
`trainer.save_model` then writes the adapter in PEFT's format (gathered from every rank by
`dropless.hf.save_lora_adapter`), which `PeftModel.from_pretrained` loads on the stock model.
"""

from __future__ import annotations

import moe_example_common as common
import torch
from transformers import Trainer, TrainingArguments

import dropless


class Windows(torch.utils.data.Dataset):
    """The global data, in order: every micro-step's global batch, row by row."""

    def __init__(self, args, vocab: int):
        g = torch.Generator().manual_seed(args.seed + 1)
        n = args.steps * args.grad_accum
        self.ids = [
            torch.randint(0, vocab, (args.global_batch, args.seq_len), generator=g)
            for _ in range(n)
        ]
        self.ids = torch.cat(self.ids)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--save-steps", type=int, default=0, help="a resumable checkpoint every N steps")
    p.add_argument("--resume", help="a checkpoint-N directory of a run with --save-steps")
    args = p.parse_args()
    kw = common.trainer_arguments(args, "ep_hf_trainer_out")
    if args.save_steps:  # the weights by Trainer, the optimizer by trainer_checkpoints()
        kw.update(save_strategy="steps", save_steps=args.save_steps, save_only_model=True)
    targs = TrainingArguments(**kw, dataloader_num_workers=0)
    # TrainingArguments joined torchrun's process group
    rank, world, out, _, model = common.trainer_setup(args, targs)
    record = common.loss_record()
    callbacks = [record]
    if args.save_steps or args.resume:
        callbacks.append(dropless.hf.trainer_checkpoints(args.resume))
    trainer = Trainer(
        model=model, args=targs, train_dataset=Windows(args, model.config.vocab_size),
        callbacks=callbacks,
    )  # fmt: skip
    common.train_and_report(
        trainer, record, out, rank, world, lora=bool(args.lora), resume=args.resume
    )


if __name__ == "__main__":
    main()
