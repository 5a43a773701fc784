"""Expert parallelism with accelerate and a plain loop.

    torchrun --standalone --nproc-per-node 2 examples/ep_accelerate.py        # tiny, CPU (gloo)
    python examples/ep_accelerate.py                                          # one process
    accelerate launch --num-processes 8 examples/ep_accelerate.py --model DIR --ep 8 \\
        --global-batch 16 --seq-len 4096 --lr 1e-5 --out runs/accelerate

`Accelerator()` joins the process group; `dropless.parallelize` then lays the model out and
the model is *not* passed to `accelerator.prepare` (the optimizer and the data loader are):
accelerate would wrap it in DDP, which refuses its DTensor parameters, and its FSDP plugin
would shard it a second time. Everything else is accelerate's usual loop: `accumulate`,
`backward` (divides by the accumulation steps), `clip_grad_norm_` (per device mesh, so
it spans the experts' mesh and the dense one), and `dropless.hf.save_hf` on every rank
for a checkpoint stock `from_pretrained` loads. Leave accelerate's FSDP and DeepSpeed
settings off (`accelerate config`: no distributed wrapper beyond multi-process).

`--cp 2`: each sequence split over 2 consecutive ranks (`dropless.parallelize(cp=2)`): the
loader `accelerator.prepare` returns gives both the same rows (its data-parallel size is
world / cp), and the model takes the whole sequences and splits them itself.
"""

from __future__ import annotations

import torch
from accelerate import Accelerator
from moe_example_common import (
    data_world,
    load_model,
    parser,
    report,
    save,
    shared_dir,
    tiny_checkpoint,
)


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    acc = Accelerator(
        gradient_accumulation_steps=args.grad_accum, cpu=not torch.cuda.is_available()
    )
    rank, world = acc.process_index, acc.num_processes
    out = shared_dir(args.out, rank)
    path = args.model or tiny_checkpoint(out, rank, args.seed)
    model = load_model(
        path, world, args.ep, lora=args.lora, seed=args.seed, cp=args.cp, dtype=args.dtype
    )
    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.steps * args.grad_accum * args.global_batch
    ids = torch.randint(0, model.config.vocab_size, (n, args.seq_len), generator=g)
    # a data-parallel rank's share (world / --cp: the prepared loader gives a cp group the same)
    loader = torch.utils.data.DataLoader(
        ids, batch_size=args.global_batch // data_world(args, world)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    opt, loader = acc.prepare(opt, loader)  # not the model: it is laid out already
    losses, norms, total = [], [], 0.0
    model.train()
    for batch in loader:
        with acc.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            acc.backward(loss)
            total += float(acc.reduce(loss.detach(), "mean")) / args.grad_accum
            if acc.sync_gradients:
                norms.append(float(acc.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
                losses.append(total)
                total = 0.0
            opt.step()
            opt.zero_grad()
    save(model, out / "final", lora=bool(args.lora))
    report(out, rank, {"losses": losses, "grad_norms": norms, "world": world, "out": str(out)})
    acc.end_training()


if __name__ == "__main__":
    main()
