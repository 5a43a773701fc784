"""Transformers models over several processes: expert parallelism (`expert_parallel.py`:
`shard_hf_experts`) and sharded loading of a safetensors checkpoint, each rank reading
its own regions (`sharded_load.py`: `load_sharded_hf`), block-FP8 and MXFP4 checkpoints
dequantised on the way (`quantized_weights.py`); `parallelize.py`: `dropless.parallelize`,
which applies them with FSDP2 to a model, for any training loop and for `dropless train`;
for the trainers people use on such a model: a LoRA adapter gathered and written in PEFT's
format (`peft_save.py`: `save_lora_adapter`) and resumable Transformers `Trainer`
checkpoints (`trainer_checkpoint.py`: `trainer_checkpoints`)."""
