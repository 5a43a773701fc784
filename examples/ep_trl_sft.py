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

import moe_example_common as common
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import SFTConfig, SFTTrainer


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    cfg = SFTConfig(
        **common.trainer_arguments(args, "ep_trl_sft_out"),
        dataset_kwargs={"skip_prepare_dataset": True}, max_length=args.seq_len,
    )  # fmt: skip
    # SFTConfig joined torchrun's process group
    rank, world, out, path, model = common.trainer_setup(args, cfg)
    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.steps * args.grad_accum * args.global_batch
    ids = torch.randint(0, model.config.vocab_size, (n, args.seq_len), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist()})
    record = common.loss_record()
    trainer = SFTTrainer(
        model=model, args=cfg, train_dataset=data, callbacks=[record],
        processing_class=AutoTokenizer.from_pretrained(path),
    )  # fmt: skip
    common.train_and_report(trainer, record, out, rank, world, lora=bool(args.lora))


if __name__ == "__main__":
    main()
