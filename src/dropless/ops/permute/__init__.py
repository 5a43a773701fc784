"""Sort (token, expert) pairs by expert, permute tokens into that order and combine them
back: everything about the op in one folder.

- `reference.py`: `permute_reference`, `unpermute_reference`, the specification (loops);
- `eager.py`: `SortedPairs`, `sort_by_expert` (a routing kernel's sort, or the torch one,
  `torch_sort_by_expert`), `permute` and `unpermute` with their autograd Functions;
- `eager_rows.py`: the torch forms of the row ops (gathers, pair dot, empty groups);
- `row_ops.py`: the registry `ROW_OPS` of row-op implementations (`RowOps`: gathers and
  the gated activations), which every autograd Function of the expert path takes;
- `permute_kernels.py`: the Triton gathers and their autograd wrappers;
- `gpu.py`: the "triton" row ops, registered on the first pick for a CUDA tensor.
"""

from .eager import SortedPairs, permute, sort_by_expert, unpermute
from .eager_rows import gather_sum
from .gpu import register_gpu
from .row_ops import ROW_OPS

ROW_OPS.on_first_cuda(register_gpu)

__all__ = ["SortedPairs", "gather_sum", "permute", "sort_by_expert", "unpermute"]
