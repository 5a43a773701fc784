"""The routed expert MLP: `expert_mlp` (tokens in, tokens out) and `grouped_mlp` (rows
already sorted by expert); everything about the op in one folder.

- `reference.py`: `expert_mlp_reference`, the specification (a loop over tokens);
- `eager.py`: the entry every caller uses; under `torch.compile` / `torch.export` it
  hands the call to the custom op of `custom_op.py`;
- `mlp_plan.py`: the plan of a call (which path, GEMM backend and row ops), made once;
- `fused_mlp.py` (the grouped path, one autograd Function), `loop_mlp.py` (the CPU
  per-expert loop, spread over threads by `expert_threads.py`), `gathered_mlp.py` (six
  GEMMs that gather their rows, tuned by `gemm_tuning.py`), `mlp_parts.py` (what their
  backwards share);
- `gather_gemm_kernels.py`: the Triton row-gathering GEMMs; `gpu.py`: their
  registration, done on the first pick for CUDA operands.
"""

from .eager import composed_mlp, expert_mlp, grouped_mlp
from .gathered_mlp import GATHER_KERNELS
from .gpu import register_gpu

GATHER_KERNELS.on_first_cuda(register_gpu)

__all__ = ["composed_mlp", "expert_mlp", "grouped_mlp"]
