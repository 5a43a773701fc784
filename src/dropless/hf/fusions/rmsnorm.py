"""RMSNorm modules of a Transformers model on dropless's RMSNorm (docs/hf.md,
`fused_rmsnorm=True`): `enable_fused_rmsnorm(model)` / `disable_fused_rmsnorm(model)`.

Families normalise in different ways (Llama-style `w * x_hat`, Gemma-style `(1 + w) * x_hat`,
fp32 upcasts), so each module is probed when it is wired, per (dtype, device): dropless's
RMSNorm is kept only where it agrees with the module's own forward. Inside a compiled
region an unprobed module runs its own forward (a probe makes a Generator and reads values,
which a graph cannot hold), so the forward a compiler traces reads one dict entry and
writes nothing.
"""

# R rows, D normalised dim

from __future__ import annotations

import types
import warnings

import torch
from torch import nn

STATE_ATTR = "_dropless_rmsnorm"  # per module: None (not probed yet), True (dropless's) or False
_KEY = "_dropless_rmsnorm_key"  # the weight's (dtype, device) the answer holds for; None: any
_PRIOR = "_dropless_rmsnorm_prior"  # an instance forward set before ours (e.g. by accelerate)
_EPS_NAMES = ("variance_epsilon", "eps", "epsilon")


def _eps(module: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float | int) and not isinstance(value, bool):
            return float(value)
    return None


def is_rmsnorm_module(module: nn.Module) -> bool:
    """An RMSNorm by name with a vector weight and an epsilon (what the wiring takes)."""
    weight = getattr(module, "weight", None)
    return (
        type(module).__name__.endswith("RMSNorm")
        and isinstance(weight, torch.Tensor)
        and weight.dim() == 1
        and _eps(module) is not None
    )


def _kernel(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from ...ops.rmsnorm import rms_norm

    return rms_norm(x, weight, eps)


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t


def _agrees(module: nn.Module, stock) -> bool:
    """dropless's RMSNorm computes what `stock` does (output and input gradient) on a
    probe of the weight's dtype and device.

    The probe leaves no trace in the model's run: its random input comes from its own
    generator (the global RNG stream, which dropout and checkpointing's recompute rely on,
    is untouched), and what its autograd keeps goes past any saved-tensor hooks (a
    checkpointed forward would otherwise save more tensors than its recompute)."""
    w = module.weight
    D = w.shape[0]
    gen = torch.Generator(device=w.device).manual_seed(0)
    probe = torch.randn(4, D, generator=gen, device=w.device).to(w.dtype)
    g = torch.randn(4, D, generator=gen, device=w.device).to(w.dtype)
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
            xs, xk = probe.clone().requires_grad_(True), probe.clone().requires_grad_(True)
            want = stock(xs)
            got = _kernel(xk, w.detach(), _eps(module))
            if want.dtype != got.dtype or want.shape != got.shape:
                return False
            (gs,) = torch.autograd.grad(want, xs, g)  # no .grad of the module's weight
            (gk,) = torch.autograd.grad(got, xk, g)
    except Exception as e:  # a kernel that cannot run here must not stop the model
        warnings.warn(
            f"dropless: {type(module).__name__} keeps its own forward: dropless's RMSNorm "
            f"failed its probe on {w.dtype} {w.device.type} ({type(e).__name__}: {e})",
            UserWarning,
            stacklevel=4,
        )
        return False
    tol = 4 * torch.finfo(w.dtype).eps
    return all(
        torch.allclose(a.float(), b.float(), rtol=tol, atol=tol) for a, b in ((got, want), (gk, gs))
    )


def _run_stock(module: nn.Module, *args, **kwargs):
    # the class's forward called directly: a bound method made here would be a call that
    # Dynamo cannot trace
    prior = module.__dict__[_PRIOR]
    if prior is not None:
        return prior(*args, **kwargs)
    return type(module).forward(module, *args, **kwargs)


def _key(weight: torch.Tensor):
    return weight.dtype, weight.device


def _decision(module: nn.Module):
    """True / False for the weight as it is now, None when not probed for it."""
    state = module.__dict__.get(STATE_ATTR)
    key = module.__dict__.get(_KEY)
    if state is None or (key is not None and key != _key(module.weight)):
        return None
    return state


def _probeable(weight: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return weight.device.type != "meta" and not is_fake(weight)


def _probe(module: nn.Module) -> bool:
    """Probe `module` for its weight's dtype and device and keep the answer on it."""
    state = _agrees(module, lambda x: _run_stock(module, x))
    module.__dict__[STATE_ATTR] = state
    module.__dict__[_KEY] = _key(module.weight)
    return state


def _fused_forward(self, hidden_states: torch.Tensor, *args, **kwargs):
    # dropless's output has x's dtype: only where stock returns that dtype too
    x = hidden_states
    if args or kwargs or x.dtype != self.weight.dtype or not x.is_floating_point():
        return _run_stock(self, hidden_states, *args, **kwargs)
    state = _decision(self)
    if state is None:
        if torch.compiler.is_compiling() or not _probeable(self.weight):
            return _run_stock(self, hidden_states)  # probed at the first eager call on real data
        state = _probe(self)
    if not state:
        return _run_stock(self, hidden_states)
    return _kernel(hidden_states, self.weight, _eps(self))


def enable_fused_rmsnorm(model: nn.Module) -> int:
    """Wire every RMSNorm module of `model` to dropless's RMSNorm (Triton on CUDA) and probe
    it for its weight's dtype and device (idempotent: a module already probed for them is
    not probed again); returns how many modules carry the wiring."""
    n = 0
    for module in model.modules():
        if not is_rmsnorm_module(module):
            continue
        if STATE_ATTR not in module.__dict__:
            module.__dict__[STATE_ATTR] = None
            module.__dict__[_KEY] = None
            module.__dict__[_PRIOR] = vars(module).get("forward")
            module.forward = types.MethodType(_fused_forward, module)
        if _decision(module) is None and _probeable(module.weight):
            _probe(module)
        n += 1
    return n


def disable_fused_rmsnorm(model: nn.Module) -> None:
    """Give every RMSNorm module of `model` its own forward back."""
    for module in model.modules():
        if STATE_ATTR in module.__dict__:
            del module.__dict__[STATE_ATTR]
            module.__dict__.pop(_KEY, None)
            prior = module.__dict__.pop(_PRIOR, None)
            if prior is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = prior


def fused_rmsnorm_state(module: nn.Module):
    """None (not wired), "unprobed" (not for its weight's dtype and device yet), "kernel"
    (dropless's RMSNorm: the Triton kernel on CUDA, the lean torch op elsewhere) or "stock"
    for one module."""
    if STATE_ATTR not in module.__dict__:
        return None
    return {None: "unprobed", True: "kernel", False: "stock"}[_decision(module)]
