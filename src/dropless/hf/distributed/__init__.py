"""Transformers models over several processes: expert parallelism, sharded loading of
safetensors checkpoints (block-FP8 and MXFP4 dequantised on the way), `dropless.parallelize`
which applies them with FSDP2, and what trainers need of such a model (PEFT-format LoRA
saves, resumable `Trainer` checkpoints)."""
