"""Transformers models over several processes: expert parallelism (`expert_parallel.py`:
`shard_hf_experts`) and sharded loading of a safetensors checkpoint, each rank reading
its own regions (`sharded_load.py`: `load_sharded_hf`), block-FP8 and MXFP4 checkpoints
dequantised on the way (`quantized_weights.py`)."""
