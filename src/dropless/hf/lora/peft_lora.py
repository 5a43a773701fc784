"""PEFT LoRA on fused experts, run as dropless's low-rank path (docs/lora.md, "How it
works", gives PEFT's factor layouts and what falls back to PEFT's own fold).

PEFT (0.21) reaches the 3-D expert weights of Transformers v5 (`target_parameters`) with a
parametrization whose `_LoraFactorsProxy` folds `W + scaling * lhs @ rhs` when the weight
is read: a weight-sized tensor per projection per step, kept for backward. The dropless
experts forward never reads the parametrized weight: `experts_weights` takes the base
weight and the proxy's factors and hands them to the fused expert Function as `LowRank`
updates (two thin grouped GEMMs per projection). For weights stored [E, out, in]
(`is_transposed=False`) the proxy holds lhs = B [E, out, r], rhs = A [E, r, in]; for
[E, in, out] it holds lhs = A^T, rhs = B^T.
"""

# E experts, r rank, I in features, O out features

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading

import torch
from torch import nn

from ...ops import LowRank


class DroplessLoRAFallbackWarning(UserWarning):
    """An adapted experts module runs PEFT's own fold of the LoRA update into its weights."""


def _factors_proxy_class():
    try:
        from peft.tuners.lora.layer import _LoraFactorsProxy
    except ImportError:  # a peft without it: every parametrization is foreign
        return None
    return _LoraFactorsProxy


def base_model(model: nn.Module) -> nn.Module:
    """The Transformers model inside a PEFT wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_parametrized(module: nn.Module, name: str) -> bool:
    plist = getattr(module, "parametrizations", None)
    return plist is not None and name in plist


def raw_weight(module: nn.Module, name: str) -> torch.Tensor | None:
    """The stored tensor `name` of `module`, without running a parametrization on it."""
    if is_parametrized(module, name):
        return module.parametrizations[name].original
    w = getattr(module, name, None)
    return w if isinstance(w, torch.Tensor) else None


def _lowrank(module: nn.Module, name: str, trans_w: bool) -> LowRank | str:
    plist = module.parametrizations[name]
    proxy_cls = _factors_proxy_class()
    if len(plist) != 1 or proxy_cls is None or not isinstance(plist[0], proxy_cls):
        kinds = ", ".join(type(p).__name__ for p in plist)
        return (
            f"{name} carries parametrizations ({kinds}) other than one LoRA adapter's factors "
            "(several active adapters, a low-precision weight, or a foreign parametrization)"
        )
    return _lowrank_of_proxy(plist[0], trans_w)


def _lowrank_of_proxy(proxy, trans_w: bool) -> LowRank:
    lhs, rhs, scale = proxy.lhs, proxy.rhs, float(proxy.scaling)
    # contiguous: PEFT's B is a permuted view, which grouped-GEMM backends may refuse
    if trans_w:  # W [E, out, in]: delta = lhs @ rhs = B @ A
        return LowRank(rhs.contiguous(), lhs.contiguous(), scale)
    # W [E, in, out]: delta = A^T @ B^T
    return LowRank(lhs.transpose(1, 2).contiguous(), rhs.transpose(1, 2).contiguous(), scale)


def experts_weights(
    module: nn.Module, names: tuple[str, str], trans_w: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[LowRank | None, LowRank | None] | None, str]:
    """(w1, w2, lora, reason) for the two projections `names` of an experts module.

    Without a parametrization: the weights and lora None. With PEFT's single-adapter
    factors on one or both: the base weights and their `LowRank` updates. With any
    other parametrization: the weights as read (PEFT folds them), lora None, and
    `reason` saying why (the caller warns)."""
    if not any(is_parametrized(module, n) for n in names):
        return getattr(module, names[0]), getattr(module, names[1]), None, ""
    parts = [_lowrank(module, n, trans_w) if is_parametrized(module, n) else None for n in names]
    reasons = [p for p in parts if isinstance(p, str)]
    if reasons:
        return getattr(module, names[0]), getattr(module, names[1]), None, reasons[0]
    w1, w2 = (raw_weight(module, n) for n in names)
    return w1, w2, (parts[0], parts[1]), ""


# --- registration without the fold ------------------------------------------------------

_STATE: dict = {"original": None, "class": None}
_LOCK = threading.RLock()  # the class attribute and the import hook change under it
_FULL_PRECISION = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@contextlib.contextmanager
def _activate_lora_lean(self, active_adapters):
    adapters = [a for a in active_adapters or [] if a in self.lora_A]
    config = getattr(self.get_base_layer(), "config", None)
    if not (
        len(adapters) == 1
        and getattr(self, "num_experts", 1) > 1
        and getattr(config, "_experts_implementation", None) == "dropless"
        and self.get_param().dtype in _FULL_PRECISION
    ):
        with _STATE["original"](self, active_adapters):
            yield
        return
    proxy_cls = _factors_proxy_class()
    base, name = self.get_base_layer(), self.parameter_name
    requires_grad = self.get_param().requires_grad
    proxy = proxy_cls(*self.get_delta_factors(adapters[0]))
    # unsafe=True: torch would otherwise fold once to check the output's shape and dtype
    nn.utils.parametrize.register_parametrization(base, name, proxy, unsafe=True)
    base.parametrizations[name].original.requires_grad_(requires_grad)
    try:
        with nn.utils.parametrize.cached():
            yield
    finally:
        self._remove_parametrizations()


_PEFT_LAYER = "peft.tuners.lora.layer"


def _install_on(module) -> bool:
    """Replace `ParamWrapper._activate_lora` of PEFT's layer module (idempotent)."""
    with _LOCK:
        if _STATE["original"] is not None:
            return True
        cls = getattr(module, "ParamWrapper", None)
        if cls is None or getattr(module, "_LoraFactorsProxy", None) is None:
            return False  # a peft without them: every parametrization is foreign
        _STATE["original"], _STATE["class"] = cls._activate_lora, cls
        cls._activate_lora = _activate_lora_lean
        return True


class _InstallAfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds PEFT's layer module as the path finder does and, once it has run, replaces
    its `ParamWrapper._activate_lora`: a peft imported after `patch()` is covered without
    `patch()` importing peft (~20 MiB) or a forward replacing a class attribute."""

    def find_spec(self, name, path, target=None):
        if name != _PEFT_LAYER:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        module.__loader__ = self.loader  # tracebacks and inspect read the source through it
        self.loader.exec_module(module)
        _install_on(module)
        with _LOCK:
            if self in sys.meta_path:
                sys.meta_path.remove(self)


_HOOK = _InstallAfterImport()


def install_lean_activation() -> bool:
    """Make PEFT register its LoRA factors on dropless experts without folding them: now
    when PEFT's LoRA layer module is imported, else as soon as it is (an import hook; peft
    is not imported here). Idempotent; returns whether it is installed now."""
    module = sys.modules.get(_PEFT_LAYER)
    if module is not None:
        return _install_on(module)
    with _LOCK:
        if _HOOK not in sys.meta_path and importlib.util.find_spec("peft") is not None:
            sys.meta_path.insert(0, _HOOK)
    return False


def uninstall_lean_activation() -> None:
    """Restore PEFT's own `ParamWrapper._activate_lora` and drop the import hook."""
    with _LOCK:
        if _HOOK in sys.meta_path:
            sys.meta_path.remove(_HOOK)
        if _STATE["original"] is None:
            return
        _STATE["class"]._activate_lora = _STATE["original"]
        _STATE["original"] = _STATE["class"] = None
