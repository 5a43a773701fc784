"""The dropless MoE layer in JAX: config, params as a plain pytree, `moe_apply`, `MoE`.

Params are a dict of arrays (no module framework), laid out as the PyTorch layer's
(router weight [E, D], gate_up_proj [E, 2F, D], down_proj [E, D, F]). The expert bias of
aux-loss-free balancing lives in a separate `state` dict: `update_expert_bias` updates it,
never the optimizer.
"""

# T tokens, D model dim, F expert hidden dim, Fs shared expert hidden dim, E experts,
# K top-k, P rows of the sorted buffer (T*K + margin)

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..ops.specs import ActivationConfig, RoutingConfig, as_activation, as_routing
from .gemm import MARGIN, grouped_gemm
from .permute import combine, permute, sort_by_expert
from .routing import load_balancing_loss_global, route, z_loss
from .swiglu import swiglu

#: the PyTorch layer's routing defaults (renormalised top-k weights)
DEFAULT_ROUTING = RoutingConfig(renormalize=True)


@dataclass(frozen=True, init=False)
class MoEConfig:
    """Static configuration (hashable, so it can be a static jit argument).

    Same meaning as the arguments of `dropless.MoE`: `routing` is a `RoutingConfig`,
    or give its fields as keywords (score_func, renormalize, scaling_factor, n_group,
    topk_group, expert_bias; not both); `activation` an `ActivationConfig` (this layer
    computes the plain swiglu only). backend: grouped-GEMM backend ("tiled",
    "ragged_dot", or None for the default, "tiled").
    """

    hidden_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    routing: RoutingConfig
    activation: ActivationConfig
    shared_expert_intermediate_size: int
    shared_expert_gate: bool
    backend: str | None

    def __init__(
        self,
        hidden_size: int,
        moe_intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        routing: RoutingConfig | None = None,
        activation: ActivationConfig | str | None = None,
        shared_expert_intermediate_size: int = 0,
        shared_expert_gate: bool = False,
        backend: str | None = None,
        **routing_fields,
    ):
        fields = dict(
            hidden_size=hidden_size,
            moe_intermediate_size=moe_intermediate_size,
            num_experts=num_experts,
            top_k=top_k,
            routing=as_routing(routing, DEFAULT_ROUTING, **routing_fields),
            activation=as_activation(activation),
            shared_expert_intermediate_size=shared_expert_intermediate_size,
            shared_expert_gate=shared_expert_gate,
            backend=backend,
        )
        for name, v in fields.items():
            object.__setattr__(self, name, v)  # frozen: set once, here
        self._check()

    def _check(self):
        for name in ("hidden_size", "moe_intermediate_size", "num_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be a positive int")
        if self.shared_expert_intermediate_size < 0:
            raise ValueError("shared_expert_intermediate_size must be >= 0 (0: no shared expert)")
        self.routing.check(self.num_experts, self.top_k)
        if self.activation != ActivationConfig():
            raise ValueError(
                f"activation={self.activation}: the JAX layer computes the plain swiglu only "
                "(ActivationConfig())"
            )

    @property
    def expert_bias(self) -> bool:
        return self.routing.expert_bias


class MoEAux(NamedTuple):
    """lb_loss, z_loss (scalars); tokens_per_expert [E]; dropped: pairs not computed
    (always 0: the layer is dropless); router_logits [T, E]."""

    lb_loss: jax.Array
    z_loss: jax.Array
    tokens_per_expert: jax.Array
    dropped: jax.Array
    router_logits: jax.Array


def init_params(key, cfg: MoEConfig, dtype=jnp.float32) -> dict:
    """Random params with the PyTorch layer's scales."""
    E, D, F = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    Fs = cfg.shared_expert_intermediate_size
    k = jax.random.split(key, 7)

    def normal(key, shape, fan_in):
        return (jax.random.normal(key, shape, jnp.float32) * fan_in**-0.5).astype(dtype)

    params = {
        "router": {"weight": normal(k[0], (E, D), D)},
        "experts": {
            "gate_up_proj": normal(k[1], (E, 2 * F, D), D),
            "down_proj": normal(k[2], (E, D, F), F),
        },
    }
    if Fs:
        shared = {
            "gate_proj": normal(k[3], (Fs, D), D),
            "up_proj": normal(k[4], (Fs, D), D),
            "down_proj": normal(k[5], (D, Fs), Fs),
        }
        if cfg.shared_expert_gate:
            shared["gate"] = normal(k[6], (1, D), D)
        params["shared_expert"] = shared
    return params


def init_state(cfg: MoEConfig) -> dict:
    """Non-trained state: {"expert_bias": zeros [E] fp32} when cfg.expert_bias, else {}."""
    return {"expert_bias": jnp.zeros(cfg.num_experts, jnp.float32)} if cfg.expert_bias else {}


def router_forward(params: dict, state: dict | None, x_TD, cfg: MoEConfig):
    """Returns (logits_TE, weights_TK, ids_TK, scores_TE)."""
    logits_TE = x_TD @ params["router"]["weight"].T
    bias = (state or {}).get("expert_bias") if cfg.expert_bias else None
    if cfg.expert_bias and bias is None:
        raise ValueError("cfg.expert_bias=True needs state={'expert_bias': [E]} (see init_state)")
    weights_TK, ids_TK, scores_TE = route(logits_TE, cfg.top_k, cfg.routing, expert_bias_E=bias)
    return logits_TE, weights_TK, ids_TK, scores_TE


def expert_mlp_sorted(x_PD, counts_E, prob_P, experts: dict, backend=None):
    """Rows sorted by expert (with MARGIN spare rows): gate/up GEMM -> SwiGLU x prob -> down."""
    h = grouped_gemm(x_PD, experts["gate_up_proj"], counts_E, backend=backend, has_margin=True)
    a = swiglu(h, prob_P)
    return grouped_gemm(a, experts["down_proj"], counts_E, backend=backend, has_margin=True)


def shared_expert_forward(shared: dict, x_TD):
    y = (jax.nn.silu(x_TD @ shared["gate_proj"].T) * (x_TD @ shared["up_proj"].T)) @ shared[
        "down_proj"
    ].T
    if "gate" in shared:
        y = jax.nn.sigmoid(x_TD @ shared["gate"].T) * y
    return y


def moe_apply(params: dict, x, cfg: MoEConfig, state: dict | None = None, *, mask=None):
    """`out, aux = moe_apply(params, x, cfg, state)` for x [..., D]; jit with cfg static.

    Every (token, expert) pair is computed (`aux.dropped == 0`). `mask` [...] (bool)
    marks real tokens when x is padded: padded tokens are not routed to any expert,
    count in no statistic, and get a zero output.
    """
    D = cfg.hidden_size
    if x.shape[-1] != D:
        raise ValueError(f"x must be [..., hidden_size={D}], got {x.shape}")
    lead = x.shape[:-1]
    x_TD = x.reshape(-1, D)
    mask_T = None if mask is None else mask.reshape(-1)
    logits_TE, weights_TK, ids_TK, scores_TE = router_forward(params, state, x_TD, cfg)
    sp = sort_by_expert(ids_TK, cfg.num_experts, mask_T, MARGIN)
    x_PD = permute(x_TD, sp)
    prob_P = jnp.take(weights_TK.reshape(-1), sp.pair_P).astype(x.dtype)
    y_PD = expert_mlp_sorted(x_PD, sp.counts_E, prob_P, params["experts"], cfg.backend)
    out_TD = combine(y_PD, sp)
    if "shared_expert" in params:
        out_TD = out_TD + shared_expert_forward(params["shared_expert"], x_TD)
    n_tokens = x_TD.shape[0] if mask_T is None else mask_T.sum()
    if mask_T is not None:
        out_TD = jnp.where(mask_T[:, None], out_TD, 0)
    aux = MoEAux(
        lb_loss=load_balancing_loss_global(scores_TE, sp.counts_E, n_tokens, mask_T),
        z_loss=z_loss(logits_TE, mask_T),
        tokens_per_expert=sp.counts_E,
        dropped=n_tokens * cfg.top_k - sp.counts_E.sum(),
        router_logits=logits_TE,
    )
    return out_TD.reshape(*lead, D), aux


def params_from_torch(moe) -> tuple[dict, dict]:
    """(params, state) of a PyTorch `dropless.MoE` (swiglu, no expert biases) as jnp arrays."""
    if moe.experts.down_proj_bias is not None or moe.experts.activation != ActivationConfig():
        raise ValueError(
            "params_from_torch supports the plain swiglu activation with bias=False only"
        )

    def a(t):
        return jnp.asarray(t.detach().cpu().numpy())

    params = {
        "router": {"weight": a(moe.router.weight)},
        "experts": {
            "gate_up_proj": a(moe.experts.gate_up_proj),
            "down_proj": a(moe.experts.down_proj),
        },
    }
    if moe.shared_expert is not None:
        se = moe.shared_expert
        params["shared_expert"] = {
            "gate_proj": a(se.gate_proj.weight),
            "up_proj": a(se.up_proj.weight),
            "down_proj": a(se.down_proj.weight),
        }
        if se.gate is not None:
            params["shared_expert"]["gate"] = a(se.gate.weight)
    state = {} if moe.router.expert_bias is None else {"expert_bias": a(moe.router.expert_bias)}
    return params, state


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


class MoE:
    """A small stateless module: holds the config and a jitted apply; params are pytrees.

        moe = MoE(hidden_size=512, moe_intermediate_size=256, num_experts=8, top_k=2)
        params, state = moe.init(jax.random.key(0))
        out, aux = moe(params, x, state)

    `bucket_tokens=True` pads the token count to a power of two (masked) so inputs
    of varying length compile at most log2(T_max) + 1 times; routing never changes
    a shape, so varying routings never recompile.
    """

    def __init__(self, *args, bucket_tokens: bool = False, **kwargs):
        self.config = MoEConfig(*args, **kwargs)  # MoEConfig's arguments
        self.bucket_tokens = bucket_tokens
        cfg = self.config
        self._jit = jax.jit(lambda p, x, s, m: moe_apply(p, x, cfg, s, mask=m))

    @classmethod
    def from_torch(cls, moe, **kwargs) -> tuple[MoE, dict, dict]:
        """(jax MoE, params, state) equal to a PyTorch `dropless.MoE`."""
        se = moe.shared_expert
        layer = cls(
            moe.hidden_size,
            moe.experts.intermediate_size,
            moe.num_experts,
            moe.top_k,
            routing=moe.router.routing,
            shared_expert_intermediate_size=0 if se is None else se.up_proj.out_features,
            shared_expert_gate=se is not None and se.gate is not None,
            **kwargs,
        )
        return layer, *params_from_torch(moe)

    def init(self, key, dtype=jnp.float32) -> tuple[dict, dict]:
        init = jax.jit(init_params, static_argnames=("cfg", "dtype"))  # one compile, not one per op
        return init(key, cfg=self.config, dtype=dtype), init_state(self.config)

    def __call__(self, params: dict, x, state: dict | None = None):
        if not self.bucket_tokens:
            return self._jit(params, x, state or {}, None)
        D = self.config.hidden_size
        x_TD = x.reshape(-1, D)
        T = x_TD.shape[0]
        Tp = next_pow2(T)
        x_pad = jnp.pad(x_TD, ((0, Tp - T), (0, 0)))
        out, aux = self._jit(params, x_pad, state or {}, jnp.arange(Tp) < T)
        return out[:T].reshape(x.shape), aux._replace(router_logits=aux.router_logits[:T])

    def compilations(self) -> int:
        """How many times the jitted apply has been compiled (for recompile checks)."""
        return self._jit._cache_size()
