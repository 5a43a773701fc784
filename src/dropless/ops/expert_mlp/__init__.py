"""The routed expert MLP: `expert_mlp` (tokens in, tokens out) and `grouped_mlp` (rows
already sorted by expert). `eager.py` is the entry every caller uses; under
`torch.compile` / `torch.export` it hands the call to the custom op of `custom_op.py`."""

from .eager import _composed_mlp, expert_mlp, grouped_mlp

__all__ = ["_composed_mlp", "expert_mlp", "grouped_mlp"]
