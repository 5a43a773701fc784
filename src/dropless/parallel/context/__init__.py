"""Context parallelism: each sequence split over the cp ranks, attention across them.

- `sharding`: the causal load-balanced layout (rank r holds chunks r and 2*cp-1-r of
  2*cp), its inverse, and the batch split with global positions;
- `attention`: all-gather-KV causal attention (autograd Function: all-gather K/V in
  forward, reduce-scatter dK/dV in backward) and its single-process reference;
- `hf`: the same as a Transformers attention implementation (`enable(model, group)`).

Tested on gloo/CPU; NCCL/GPU is unverified (not run).
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
