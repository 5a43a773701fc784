"""Expert parallelism in a plain torch training loop.

    torchrun --standalone --nproc-per-node 2 examples/ep_torch_loop.py        # tiny, CPU (gloo)
    python examples/ep_torch_loop.py                                          # one process
    torchrun --standalone --nproc-per-node 8 examples/ep_torch_loop.py --model DIR --ep 8 \\
        --global-batch 16 --seq-len 4096 --lr 1e-5 --out runs/loop

Each rank builds the model on the meta device and `dropless.parallelize` lays it out
(experts split over --ep ranks, FSDP2 over all) and fills it from the checkpoint, each
rank reading its own shards. The loop accumulates gradients over --grad-accum
micro-batches, clips them with `dropless.parallel.clip_grad_norm_` (gradients live on two
device meshes, which `torch.nn.utils.clip_grad_norm_` cannot span) and writes the final
model with `dropless.hf.save_hf` (gathered; stock `from_pretrained` loads it).
"""

from __future__ import annotations

import torch
from moe_example_common import (
    batches,
    init,
    load_model,
    mean_over_ranks,
    parser,
    report,
    save,
    shared_dir,
    tiny_checkpoint,
)

import dropless


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    rank, world = init()
    out = shared_dir(args.out, rank)
    path = args.model or tiny_checkpoint(out, rank, args.seed)
    model = load_model(
        path, world, args.ep, lora=args.lora, seed=args.seed, cp=args.cp, dtype=args.dtype
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    losses, norms = [], []
    for micro in batches(args, model.config.vocab_size, rank, world):
        total = 0.0
        for ids in micro:
            loss = model(input_ids=ids, labels=ids).loss / len(micro)
            loss.backward()
            total += float(loss.detach())
        norm = dropless.parallel.clip_grad_norm_(list(model.parameters()), args.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(mean_over_ranks(total))
        norms.append(float(norm))
    save(model, out / "final", lora=bool(args.lora))
    report(out, rank, {"losses": losses, "grad_norms": norms, "world": world, "out": str(out)})
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
