"""Expert parallelism under TRL's `GRPOTrainer`.

    torchrun --standalone --nproc-per-node 2 examples/ep_trl_grpo.py          # tiny, CPU (gloo)
    python examples/ep_trl_grpo.py                                            # one process
    torchrun --standalone --nproc-per-node 8 examples/ep_trl_grpo.py --model DIR --ep 8 \\
        --global-batch 16 --lr 1e-6 --out runs/grpo

As under `SFTTrainer` (examples/ep_trl_sft.py): the `GRPOConfig` first (it joins the
process group), then `dropless.parallelize`, then the trainer, `fsdp` and `deepspeed` unset.
Completions come from the model's own `generate` (no vLLM), each rank generating for its
prompts; the forward of every decoding step is collective under expert parallelism, and
Transformers' `generate` keeps every rank stepping until all are done (`synced_gpus`, on by
itself for an FSDP2 model). The reward here is a toy: the share of completion tokens with an
even number.
"""

from __future__ import annotations

import moe_example_common as common
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer


def reward_even(completions, **kwargs) -> list[float]:
    """The share of a completion's tokens with an even number (t0, t2, ...)."""
    return [
        sum(int(w[1:]) % 2 == 0 for w in c.split()) / max(len(c.split()), 1) for c in completions
    ]


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--completion-len", type=int, default=4)
    p.add_argument("--generations", type=int, default=2, help="completions per prompt")
    args = p.parse_args()
    base = common.trainer_arguments(args, "ep_trl_grpo_out")
    cfg = GRPOConfig(
        **base, num_generations=args.generations, max_completion_length=args.completion_len,
        shuffle_dataset=False,
    )  # fmt: skip
    # GRPOConfig joined torchrun's process group
    rank, world, out, path, model = common.trainer_setup(args, cfg)
    n = args.steps * args.grad_accum * args.global_batch
    prompts = [" ".join(f"t{3 + (i + j) % 100}" for j in range(4)) for i in range(n)]
    record = common.loss_record()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward_even], args=cfg, callbacks=[record],
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=AutoTokenizer.from_pretrained(path),
    )  # fmt: skip
    common.train_and_report(trainer, record, out, rank, world, lora=bool(args.lora))


if __name__ == "__main__":
    main()
