"""LoRA on fused experts: PEFT's factors run by the dropless path (`peft_lora.py`), and
factors owned by the experts module itself, which shard with their experts under expert
parallelism and convert to and from PEFT adapters (`expert_lora.py`)."""
