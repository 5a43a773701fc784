"""Find every experts class of the installed Transformers and build a small instance of it.

`experts_classes()` walks `transformers.models` and returns each class decorated with
`@use_experts_implementation` (recognised by its forward: the decorator's dispatcher),
with no hand-written list. `tiny_experts(cls)` finds a config class of the family that
builds it (the text sub-config for multimodal families), shrinks the sizes the class
reads from it, and returns a real module. `coverage()` says which dropless path each
class takes (see `dropless.hf.experts_spec`): it is what docs/hf.md lists.
"""

# D model dim, F expert hidden dim, E experts

from __future__ import annotations

import copy
import importlib
import inspect
import os
import pkgutil
import re
from dataclasses import dataclass

import torch
from torch import nn

from .._compat import require_transformers


@dataclass(frozen=True)
class ExpertsClass:
    """One decorated experts class: its family (the `transformers.models` package) and class."""

    family: str
    cls: type

    @property
    def name(self) -> str:
        return self.cls.__name__


def experts_classes() -> list[ExpertsClass]:
    """Every class of the installed transformers decorated with `@use_experts_implementation`,
    sorted by family then class name."""
    transformers = require_transformers()
    from transformers.integrations import moe

    root = os.path.dirname(transformers.models.__file__)
    found = []
    for info in pkgutil.iter_modules([root]):
        folder = os.path.join(root, info.name)
        if not info.ispkg:
            continue
        for fname in sorted(os.listdir(folder)):
            if not (fname.startswith("modeling_") and fname.endswith(".py")):
                continue
            with open(os.path.join(folder, fname), encoding="utf-8") as f:
                if "use_experts_implementation" not in f.read():
                    continue  # skip importing the other ~400 modeling modules
            name = f"transformers.models.{info.name}.{fname[:-3]}"
            module = importlib.import_module(name)
            for obj in vars(module).values():
                if inspect.isclass(obj) and obj.__module__ == name:
                    code = getattr(getattr(obj, "forward", None), "__code__", None)
                    if code is not None and code.co_filename == moe.__file__:
                        found.append(ExpertsClass(info.name, obj))
    return sorted(found, key=lambda c: (c.family, c.name))


def _shrink(config, keys, hidden: int, intermediate: int, experts: int):
    config = copy.deepcopy(config)
    for key in keys:
        low = key.lower()
        if "expert" in low:
            value = experts
        elif "intermediate" in low:
            value = intermediate
        elif low.endswith(("size", "_dim")):
            value = hidden
        else:
            continue
        current = getattr(config, key, None)
        setattr(config, key, [value] * len(current) if isinstance(current, list) else value)
    return config


def _defines(config, key: str) -> bool:
    try:
        return hasattr(config, key)
    except Exception:  # e.g. a per-layer attribute of a heterogeneous config
        return False


def _sub_configs(config, depth: int = 0):
    from transformers import PretrainedConfig

    yield config
    if depth > 3:
        return
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PretrainedConfig):
            yield from _sub_configs(sub, depth + 1)


def _candidate_configs(cls: type):
    """Config classes of the family's modeling module, the class's own annotation first."""
    from transformers import PretrainedConfig

    module = importlib.import_module(cls.__module__)
    found = [
        v
        for v in vars(module).values()
        if inspect.isclass(v) and issubclass(v, PretrainedConfig) and v is not PretrainedConfig
    ]
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    params = list(inspect.signature(init).parameters.values())
    ann = params[1].annotation if len(params) > 1 else None
    if inspect.isclass(ann) and ann in found:
        found.remove(ann)
        found.insert(0, ann)
    return found


def tiny_config(cls: type, *, hidden: int = 12, intermediate: int = 8, experts: int = 5):
    """A config of `cls`'s family, with the sizes `cls` reads shrunk, that builds `cls`.

    Raises ValueError listing what was tried when no config of the family builds it."""
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    keys = sorted(set(re.findall(r"config\.(\w+)", inspect.getsource(init))))
    tried, subs = [], []
    for config_cls in _candidate_configs(cls):
        try:
            subs += list(_sub_configs(config_cls()))
        except Exception as e:  # a config that needs arguments: try the next one
            tried.append(f"{config_cls.__name__}(): {e}")
    # configs that define every key the class reads first (a vision config may build a
    # text experts class once shrunk, but with the vision activation)
    subs.sort(key=lambda c: not all(_defines(c, k) for k in keys))
    for sub in subs:
        try:
            config = _shrink(sub, keys, hidden, intermediate, experts)
            with torch.device("meta"):
                _build(cls, config, intermediate)
        except Exception as e:
            tried.append(f"{type(sub).__name__}: {type(e).__name__}: {e}")
            continue
        return config
    raise ValueError(
        f"no config of {cls.__module__} builds {cls.__name__} (tried: {'; '.join(tried)})"
    )


def _build(cls: type, config, intermediate: int) -> nn.Module:
    # some classes take their hidden size as an argument (ernie4_5_vl_moe: text or vision)
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    if "intermediate_size" in inspect.signature(init).parameters:
        return cls(config, intermediate_size=intermediate)
    return cls(config)


def tiny_experts(
    cls: type,
    *,
    hidden: int = 12,
    intermediate: int = 8,
    experts: int = 5,
    dtype: torch.dtype = torch.float64,
) -> nn.Module:
    """A real instance of experts class `cls` with small sizes and random weights."""
    config = tiny_config(cls, hidden=hidden, intermediate=intermediate, experts=experts)
    config._experts_implementation = "eager"
    module = _build(cls, config, intermediate).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5)
    return module


@dataclass(frozen=True)
class Coverage:
    """The dropless path of one experts class: "fused", "generic" or "fallback", and why."""

    family: str
    name: str
    path: str
    detail: str


def coverage() -> list[Coverage]:
    """The path `dropless_experts_forward` takes for every decorated experts class."""
    from ..experts.forward import experts_spec

    rows = []
    for ec in experts_classes():
        spec = experts_spec(tiny_experts(ec.cls, dtype=torch.float32))
        if isinstance(spec, str):
            rows.append(Coverage(ec.family, ec.name, "fallback", spec))
        else:
            rows.append(Coverage(ec.family, ec.name, spec.path, spec.describe()))
    return rows


def coverage_table() -> str:
    """docs/hf.md's family table (markdown) for the installed transformers."""
    import transformers

    rows = coverage()
    families = {r.family for r in rows}
    ours = {r.family for r in rows if r.path != "fallback"}
    lines = [
        f"transformers {transformers.__version__}: families {len(families)}: ours {len(ours)}, "
        f"fallback {len(families - ours)}",
        "",
        "| family | experts class | path | what it computes |",
        "|---|---|---|---|",
    ]
    lines += [f"| `{r.family}` | `{r.name}` | {r.path} | {r.detail} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m dropless.hf.patching.discovery
    import warnings

    warnings.simplefilter("ignore")
    print(coverage_table())
