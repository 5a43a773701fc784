"""dropless.jax: the dropless MoE layer for JAX (optional extra ``dropless[jax]``).

    from dropless.jax import MoE
    moe = MoE(hidden_size=512, moe_intermediate_size=256, num_experts=8, top_k=2)
    params, state = moe.init(jax.random.key(0))
    out, aux = moe(params, x, state)          # aux.dropped == 0, always

Pure functions over plain pytrees, so params go straight into `jax.grad`, optax and
orbax; expert parallelism: `moe_apply_ep`. `import dropless` never imports JAX.
"""

from __future__ import annotations

try:
    import jax  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dropless.jax needs JAX, which is not installed: pip install 'dropless[jax]' "
        "(or pip install jax for the CPU build)"
    ) from e

from .gemm import BACKENDS, grouped_gemm
from .layer import MoE, MoEAux, MoEConfig, init_params, moe_apply, params_from_torch
from .parallel import ep_bucket, moe_apply_ep
from .permute import SortedPairs, combine, permute, sort_by_expert
from .routing import load_balancing_loss_global, route, update_expert_bias, z_loss
from .swiglu import swiglu

__all__ = [
    "BACKENDS",
    "MoE",
    "MoEAux",
    "MoEConfig",
    "SortedPairs",
    "combine",
    "ep_bucket",
    "grouped_gemm",
    "init_params",
    "load_balancing_loss_global",
    "moe_apply",
    "moe_apply_ep",
    "params_from_torch",
    "permute",
    "route",
    "sort_by_expert",
    "swiglu",
    "update_expert_bias",
    "z_loss",
]
