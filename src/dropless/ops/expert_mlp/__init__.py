"""The routed expert MLP, everything about the op in one folder:

- `reference.py`: `expert_mlp_reference`, the specification (a loop over tokens);
- `eager.py`: the entries (`expert_mlp`, `grouped_mlp`) and the custom op they become
  under `torch.compile` / `torch.export`;
- `plan.py`: what a call runs (`Schedule`, kept per layer shape), the gathered path's
  tuning and the registration of its kernels;
- `engine.py`: the one autograd Function, what its backward reads (`Saved`) and the
  grouped schedule; `loop.py`: the per-expert loop schedule (the CPU default), spread
  over threads by `threads.py`;
- `gather_gemm_kernels.py`: the Triton GEMMs that gather their rows.
"""

from .eager import composed_mlp, expert_mlp, grouped_mlp
from .plan import EXPERT_PATHS, set_expert_path

__all__ = ["EXPERT_PATHS", "composed_mlp", "expert_mlp", "grouped_mlp", "set_expert_path"]
