"""The model a run trains: `build.py` (the Transformers model on the dropless experts
path), `precision.py` (compute dtype and FP8 recipes), `lora.py` (adapters),
`parallelize.py` (expert parallelism and FSDP2 over the mesh) and `bf16_adamw.py` (the
optimizer for bf16 parameters)."""
