"""Context parallelism: each sequence split over the cp ranks (`sharding`), all-gather-KV
causal attention across them (`attention`), as a Transformers attention implementation
(`hf`). Tested on gloo/CPU; NCCL/GPU is unverified (not run).
"""

from .attention import all_gather_sequence, context_parallel_attention, reference_attention
from .hf import ATTENTION_NAME, attention_forward, enable, register
from .sharding import (
    check_seq_len,
    chunk_ids,
    local_positions,
    shard_batch,
    shard_sequence,
    unshard_sequence,
)

__all__ = [
    "ATTENTION_NAME",
    "all_gather_sequence",
    "attention_forward",
    "check_seq_len",
    "chunk_ids",
    "context_parallel_attention",
    "enable",
    "local_positions",
    "reference_attention",
    "register",
    "shard_batch",
    "shard_sequence",
    "unshard_sequence",
]
