"""Linear layer + cross-entropy without the full `[T, V]` logits: everything about the op
in one folder.

- `reference.py`: `linear_cross_entropy_reference`, the specification (the head, then
  cross-entropy, as Transformers computes them);
- `eager.py`: `linear_cross_entropy` with its backends ("fused", the
  entries of the registry `CE_BACKENDS`) and their autograd Functions; `fused_pass.py`: the chunked pass of "fused";
- `rows.py`: the registry `CE_ROWS` of the row op the "fused" backend runs on each chunk
  of logits, its torch form, and `cross_entropy`, the row op as an autograd Function on
  logits a caller holds (a Transformers model's loss: `dropless.hf.fusions.causal_lm_loss`);
- `cross_entropy_kernels.py`: the Triton row op;
- `gpu.py`: its registration as "triton", done on the first pick for a CUDA tensor;
- `custom_op.py`: `dropless::linear_cross_entropy`, the "fused" pass as one node of a
  compiled region or an exported program.
"""

from .eager import (
    CE_BACKENDS,
    LOGITS_BUFFER_BYTES,
    REDUCTIONS,
    fused_chunk_size,
    fused_linear_cross_entropy,
    linear_cross_entropy,
)
from .gpu import register_gpu
from .rows import CE_ROWS

CE_ROWS.on_first_cuda(register_gpu)

__all__ = [
    "CE_BACKENDS",
    "LOGITS_BUFFER_BYTES",
    "REDUCTIONS",
    "fused_chunk_size",
    "fused_linear_cross_entropy",
    "linear_cross_entropy",
]
