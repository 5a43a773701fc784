"""What `patch()` / `patch_model()` did: which experts modules run which dropless path.

A `PatchReport` is a live view: `report = dropless.patch()` then building or loading
models makes them appear in `report` (it reads the models dropless switched, and the MoE
models built since `patch()` that run a stock implementation, when asked). Printing it
gives one line per model and the path it runs, one per family, one per module on a
fallback, and one for the RMSNorm modules `fused_rmsnorm` wired.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import nn

from ..experts.forward import module_spec
from ..fusions.rmsnorm import fused_rmsnorm_state
from ..layers import family_of, is_experts_module


@dataclass(frozen=True)
class ModelRecord:
    """One MoE model: its class, where it lives (`id`, to tell two of one class apart) and
    the experts implementation it runs ("dropless", or the stock one it asked for)."""

    model: str
    address: str
    implementation: str


@dataclass(frozen=True)
class ModuleRecord:
    """One experts module: its name in the model, family, path and what it computes.

    path: "fused" (the memory-lean fused expert MLP), "generic" (dropless grouped GEMMs
    with the module's own gate between them) or "fallback" (stock Transformers; detail
    says why)."""

    model: str
    name: str
    family: str
    path: str
    detail: str


def _records(model: nn.Module, seen: set) -> list[ModuleRecord]:
    if "dropless" not in model.get_experts_implementation().values():
        return []
    out = []
    for name, mod in model.named_modules():
        if not is_experts_module(mod) or id(mod) in seen:
            continue
        seen.add(id(mod))
        spec = module_spec(mod)
        if isinstance(spec, str):
            path, detail = "fallback", spec
        else:
            path, detail = spec.path, spec.describe()
        out.append(ModuleRecord(type(model).__name__, name, family_of(mod), path, detail))
    return out


class PatchReport:
    """Which experts modules of the patched models run which path (read on access).

    families: family -> its path(s), e.g. {"qwen3_moe": "fused"}; modules_ours: names
    of experts modules on a dropless path; generic: name -> why its gate runs as is;
    fallbacks: name -> why it runs stock Transformers. records: every module."""

    def __init__(
        self,
        action: str,
        models: Callable[[], Iterable[nn.Module]],
        stock_models: Callable[[], Iterable[nn.Module]] = list,
    ):
        self.action = action
        self._models = models
        self._stock_models = stock_models

    @property
    def models(self) -> list[ModelRecord]:
        """Each model (not its inner models), the patched ones first, and what it runs."""
        models = [*self._models(), *self._stock_models()]
        inner = {id(sub) for m in models for sub in m.modules() if sub is not m}
        return [
            ModelRecord(type(m).__name__, f"{id(m):#x}", _implementation(m))
            for m in models
            if id(m) not in inner
        ]

    @property
    def records(self) -> list[ModuleRecord]:
        # a model's inner models (e.g. `model.model`) are tracked too: outermost first
        models = sorted(self._models(), key=lambda m: -sum(1 for _ in m.modules()))
        seen: set = set()
        return [r for m in models for r in _records(m, seen)]

    @property
    def rmsnorm(self) -> dict[str, int]:
        """RMSNorm modules `fused_rmsnorm` wired, by what they run: "kernel" (dropless's
        RMSNorm), "stock" (their own forward: the first call's output differed or failed)
        or "unprobed" (not called yet)."""
        mods = {id(mod): mod for model in self._models() for mod in model.modules()}
        states = (fused_rmsnorm_state(mod) for mod in mods.values())
        return dict(Counter(state for state in states if state is not None))

    @property
    def families(self) -> dict[str, str]:
        paths: dict[str, set[str]] = {}
        for r in self.records:
            paths.setdefault(r.family, set()).add(r.path)
        return {f: "+".join(sorted(p)) for f, p in sorted(paths.items())}

    @property
    def modules_ours(self) -> list[str]:
        return [r.name for r in self.records if r.path != "fallback"]

    @property
    def generic(self) -> dict[str, str]:
        return {r.name: r.detail for r in self.records if r.path == "generic"}

    @property
    def fallbacks(self) -> dict[str, str]:
        return {r.name: r.detail for r in self.records if r.path == "fallback"}

    def __str__(self) -> str:
        records = self.records
        lines = [f"dropless: {self.action}"]
        if not records:
            lines.append("  no patched MoE model yet (models built or loaded afterwards count)")
        for m in self.models:
            path = "dropless" if m.implementation == "dropless" else f"stock {m.implementation!r}"
            lines.append(f"  model {m.model} at {m.address}: runs {path}")
        by_family = Counter((r.family, r.path, r.detail) for r in records)
        for (family, path, detail), n in sorted(by_family.items()):
            lines.append(f"  {family}: {n} experts module(s) on the {path} path ({detail})")
        for name, why in self.fallbacks.items():
            lines.append(f"  fallback {name}: {why}")
        norms = self.rmsnorm
        if norms:
            lines.append(
                f"  RMSNorm: {norms.get('kernel', 0)} module(s) on dropless's RMSNorm, "
                f"{norms.get('stock', 0)} on their own forward, "
                f"{norms.get('unprobed', 0)} not called yet"
            )
        return "\n".join(lines)

    __repr__ = __str__


def _implementation(model: nn.Module) -> str:
    values = set(model.get_experts_implementation().values())
    return "dropless" if "dropless" in values else "+".join(sorted(map(str, values)))


def model_report(model: nn.Module, action: str = "patched one model") -> PatchReport:
    """The report of one model (held weakly: the report does not keep it alive)."""
    ref = weakref.ref(model)

    def models():
        m = ref()
        return [] if m is None else [m]

    return PatchReport(action, models)
