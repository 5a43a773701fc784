"""What the scripts `ep_*.py` of this folder share: their options, the process group, a tiny
Qwen3-MoE checkpoint when no `--model` is given, the model laid out by `dropless.parallelize`,
and the batches (the same global batch for any number of processes, split over the
data-parallel ranks: world / cp, the ranks of a cp group reading the same rows)."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import dropless


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model", help="a local Hugging Face MoE checkpoint (default: a tiny Qwen3-MoE)"
    )
    p.add_argument("--out", help="where the final model and losses.json go (default: a temp dir)")
    p.add_argument(
        "--ep", type=int, default=0, help="expert-parallel size (default: every process)"
    )
    p.add_argument(
        "--cp", type=int, default=1,
        help="context-parallel size: each sequence split over this many consecutive ranks, "
        "which get the same samples (default 1; ignored on one process)",
    )  # fmt: skip
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument(
        "--global-batch", type=int, default=4, help="sequences per micro-step, all ranks"
    )
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--max-grad-norm", type=float, default=0.5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--bf16", action="store_true",
        help="Trainer-based scripts: compute under bf16 autocast (default fp32; TRL's own "
        "configs default to bf16, these scripts set it explicitly)",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=("float32", "float64"), default="float32",
        help="the parameters' (and so the computation's) dtype (default float32; float64 "
        "for comparisons whose only difference is the summation order, e.g. cp vs one process)",
    )  # fmt: skip
    p.add_argument(
        "--lora", type=int, default=0, metavar="RANK",
        help="LoRA of this rank on the experts and the attention, base frozen (default 0: "
        "every weight trained); the adapter goes to OUT/final in PEFT's format",
    )  # fmt: skip
    return p


def init() -> tuple[int, int]:
    """(rank, world): joins torchrun's group (gloo on CPU, NCCL on CUDA) when there is one."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def shared_dir(path: str | None, rank: int) -> Path:
    """`path`, or a temporary directory rank 0 makes and every rank is told."""
    name = [path or (tempfile.mkdtemp(prefix="dropless_ep_") if rank == 0 else None)]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)
    out = Path(name[0])
    out.mkdir(parents=True, exist_ok=True)
    return out


def tiny_checkpoint(out: Path, rank: int, seed: int) -> str:
    """A tiny random Qwen3-MoE (8 experts, top-2) written by rank 0 with `save_pretrained`:
    what the scripts load when no --model is given."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    path = out / "init"
    if rank == 0:
        config = Qwen3MoeConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
            max_position_embeddings=64, tie_word_embeddings=False, use_cache=False,
            router_aux_loss_coef=0.0,
        )  # fmt: skip
        torch.manual_seed(seed)
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        tiny_tokenizer(config.vocab_size).save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def tiny_tokenizer(vocab: int):
    """A word-level tokenizer of `vocab` tokens t0, t1, ... (t0 pads): what TRL asks for."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", unk_token="t1", eos_token="t2"
    )


def trainer_setup(args, trainer_args):
    """(rank, world, out, path, model) for a Trainer-based script, after its
    TrainingArguments (or TRL config) `trainer_args` joined torchrun's group: the shared
    output directory (set as trainer_args.output_dir), the checkpoint (--model, or a tiny
    one written there) and its model."""
    rank, world = init()
    out = shared_dir(args.out, rank)
    trainer_args.output_dir = str(out)
    path = args.model or tiny_checkpoint(out, rank, args.seed)
    model = load_model(
        path, world, args.ep, lora=args.lora, seed=args.seed, cp=args.cp, dtype=args.dtype
    )
    return rank, world, out, path, model


def data_world(args, world: int) -> int:
    """The data-parallel ranks: the processes over --cp (the cp ranks share samples)."""
    return world // args.cp if world > 1 else 1


def load_model(
    path: str, world: int, ep: int, lora: int = 0, seed: int = 0, cp: int = 1,
    dtype: str = "float32", **parallelize_kwargs,
):  # fmt: skip
    """The patched model: on one process loaded whole; on several built on the meta device
    and laid out by `dropless.parallelize`, each rank reading only its shards.

    lora > 0: the base frozen and LoRA adapters of that rank added before the layout, as
    `dropless train`'s `finetune.method="lora"` adds them (`apply_lora`: the experts own
    their factors, which shard with them; the attention gets PEFT's), the base read from the
    checkpoint under its own names (`rename=checkpoint_name`), then the adapters given
    PEFT's initial values, drawn over their global shapes (`init_adapters`: the same for any
    number of processes). dtype: the parameters' ("float32" or "float64": the checkpoint's
    fp32 values widened). cp > 1 (several processes): each sequence split over cp ranks
    (`dropless.parallelize(cp=...)`: the model then takes whole sequences and splits them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dropless.patch()
    dtype = getattr(torch, dtype)
    if world == 1:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device())
        return _with_lora(model, path, world, lora, seed) if lora else model
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if not lora:
        return dropless.parallelize(
            model, ep=ep or world, cp=cp, checkpoint=path, **parallelize_kwargs
        )
    from dropless.train.model.lora import checkpoint_name

    model = _with_lora(model, path, world, lora, seed=None)
    dropless.parallelize(
        model, ep=ep or world, cp=cp, checkpoint=path, rename=checkpoint_name, **parallelize_kwargs
    )
    return _init_lora(model, seed)


def _with_lora(model, path: str, world: int, rank: int, seed: int | None):
    from dropless.train.config.schema import FinetuneConfig
    from dropless.train.model.lora import apply_lora

    fcfg = FinetuneConfig(method="lora", lora_rank=rank, lora_targets=["experts", "attention"])
    model = apply_lora(model, fcfg, path, world)
    if world == 1:  # what parallelize does to a PeftModel: save_pretrained writes every adapter
        from dropless.hf.distributed.peft_save import route_peft_save

        route_peft_save(model)
    return model if seed is None else _init_lora(model, seed)


def _init_lora(model, seed: int):
    from dropless.train.model.lora import init_adapters

    init_adapters(model, seed)
    return model


def save(model, out: Path, lora: bool) -> None:
    """The trained model, gathered from every rank (every rank calls this; rank 0 writes):
    a stock Transformers checkpoint, or with LoRA the adapter in PEFT's format."""
    if lora:
        dropless.hf.save_lora_adapter(model, out)
    else:
        dropless.hf.save_hf(model, out)


@torch.no_grad()
def probe_logits(model, vocab: int, seq_len: int) -> list:
    """The trained model's logits on a fixed batch of 2 rows (every rank runs it: under
    `parallelize` a forward is collective), what a reloaded model must reproduce."""
    ids = torch.arange(2 * seq_len).reshape(2, seq_len) % vocab
    return model(input_ids=ids.to(device())).logits.float().cpu().tolist()


def batches(args, vocab: int, rank: int, world: int):
    """Per optimizer step, its grad_accum micro-batches of token ids: this rank's rows of the
    global batch (the same global data for any number of processes; the ranks of a cp group
    get the same rows)."""
    g = torch.Generator().manual_seed(args.seed + 1)
    dp = data_world(args, world)
    per, i = args.global_batch // dp, rank // (world // dp)
    for _ in range(args.steps):
        step = []
        for _ in range(args.grad_accum):
            ids = torch.randint(0, vocab, (args.global_batch, args.seq_len), generator=g)
            step.append(ids[i * per : (i + 1) * per].to(device()))
        yield step


def mean_over_ranks(x: float) -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device())
    dist.all_reduce(t)
    return float(t) / dist.get_world_size()


def report(out: Path, rank: int, record: dict) -> None:
    """Rank 0 prints the record as one JSON line and writes it to OUT/losses.json."""
    if rank == 0:
        print("RESULT " + json.dumps(record), flush=True)
        (out / "losses.json").write_text(json.dumps(record))


def trainer_arguments(args, out_default: str) -> dict:
    """The keyword arguments of a Transformers `TrainingArguments` (or TRL's `SFTConfig`)
    for the run these scripts make: each data-parallel rank (world / --cp) takes its share
    of the global batch, in order, constant learning rate without weight decay, clipping, a loss logged per step,
    no intermediate save (the Trainer script's --save-steps sets resumable ones), fp32
    unless --bf16 (TRL's SFTConfig and GRPOConfig would default to bf16 autocast)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return dict(
        output_dir=args.out or out_default,
        per_device_train_batch_size=args.global_batch // data_world(args, world),
        gradient_accumulation_steps=args.grad_accum, max_steps=args.steps, learning_rate=args.lr,
        lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=args.max_grad_norm,
        logging_steps=1, save_strategy="no", report_to=[], seed=args.seed,
        train_sampling_strategy="sequential",  # the same global batches for any world size
        use_cpu=not torch.cuda.is_available(), bf16=args.bf16,
    )  # fmt: skip


def loss_record():
    """A Trainer callback that keeps each logged step's loss and gradient norm."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self):
            self.losses, self.norms = [], []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                self.norms.append(float(logs.get("grad_norm", float("nan"))))

    return Record()


def train_and_report(
    trainer, record, out: Path, rank: int, world: int, lora: bool = False, resume=None
) -> None:
    """Train, save the model gathered from every rank to OUT/final (every rank calls it; rank
    0 writes), and report the losses and gradient norms `record` (`loss_record()`) kept.
    With LoRA `trainer.save_model` writes the adapter in PEFT's format (the PeftModel's
    `save_pretrained`, which `dropless.parallelize` routes to `dropless.hf.save_lora_adapter`
    on several processes) and the record has the trained model's `probe_logits`."""
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(out / "final"))
    result = {"losses": record.losses, "grad_norms": record.norms, "world": world, "out": str(out)}
    if lora:
        cfg = trainer.model.config
        result["probe_logits"] = probe_logits(trainer.model, cfg.vocab_size, 8)
    report(out, rank, result)
