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
stock `from_pretrained` loads. Such a Trainer cannot save its optimizer for a resume:
`save_strategy="no"` or `save_only_model=True`.
"""

from __future__ import annotations

import torch
from moe_example_common import init, load_model, parser, report, shared_dir, tiny_checkpoint
from transformers import Trainer, TrainerCallback, TrainingArguments


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


class Record(TrainerCallback):
    def __init__(self):
        self.losses, self.norms = [], []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            self.norms.append(float(logs.get("grad_norm", float("nan"))))


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    out_dir = args.out
    targs = TrainingArguments(
        output_dir=out_dir or "ep_hf_trainer_out",
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
        dataloader_num_workers=0,
    )
    rank, world = init()  # TrainingArguments joined torchrun's process group
    out = shared_dir(out_dir, rank)
    targs.output_dir = str(out)
    path = args.model or tiny_checkpoint(out, rank, args.seed)
    model = load_model(path, world, args.ep)
    record = Record()
    trainer = Trainer(
        model=model, args=targs, train_dataset=Windows(args, model.config.vocab_size),
        callbacks=[record],
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(out / "final"))
    report(out, rank, {"losses": record.losses, "grad_norms": record.norms, "world": world,
                       "out": str(out)})  # fmt: skip


if __name__ == "__main__":
    main()
