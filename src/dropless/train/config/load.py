"""Training configuration: TOML files and `--set KEY=VALUE` overrides read into the
schema's dataclasses (`schema.py`, re-exported here), and the resolved dump.

    cfg = load_config("run.toml", ["train.steps=100", "optim.lr=3e-4"])
    dump_config(cfg, run_dir / "config.toml")

Every section validates itself in `__post_init__` and raises `ValueError` naming the
field, the value and what is allowed. An unknown key is an error that suggests the
closest known one. The defaults are the `dropless train` demo run (see `recipes.py`).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import Any

from .schema import (
    ADAMW_IMPLEMENTATIONS,
    ATTENTION,
    DECODE_ERRORS,
    DTYPES,
    FINETUNE_METHODS,
    IMPLEMENTATIONS,
    LORA_TARGETS,
    LOSS_ON,
    NONFINITE_POLICIES,
    PROGRESS,
    RECIPE_OPTIONS,
    RECIPES,
    SCHEDULES,
    CheckpointConfig,
    Config,
    DataConfig,
    FinetuneConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainSection,
)

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser from PyPI (dropless[train])
    import tomli as tomllib


def known_keys() -> list[str]:
    """Every settable key as "section.field"."""
    return [
        f"{name}.{f.name}"
        for name, kind in _section_types().items()
        for f in dataclasses.fields(kind)
    ]


def _section_types() -> dict[str, type]:
    return {s.name: type(getattr(Config(), s.name)) for s in dataclasses.fields(Config)}


def _unknown(key: str) -> ValueError:
    """An unknown key or section: the closest known keys or sections and the list of
    sections (and, with no suggestion, the keys of its own section); never all ~80 keys."""
    types_ = _section_types()
    sections = list(types_)
    section, _, name = key.partition(".")
    keys = known_keys()
    if section in types_:
        what = f"unknown config key {key!r}"
        fields = [f.name for f in dataclasses.fields(types_[section])]
        close = [f"{section}.{f}" for f in difflib.get_close_matches(name, fields, n=1, cutoff=0.6)]
    else:
        what = f"unknown config section {section!r}" + (f" (in {key!r})" if name else "")
        close = []
        for near in difflib.get_close_matches(section, sections, n=2, cutoff=0.5):
            fields = [f.name for f in dataclasses.fields(types_[near])]
            field = difflib.get_close_matches(name, fields, n=1, cutoff=0.6) if name else []
            close.append(f"{near}.{field[0]}" if field else f"section [{near}]")
    # a field written alone or under another section: `batch_size` -> `train.batch_size`
    field = name or section
    close += [k for k in keys if k.partition(".")[2] == field and k not in close]
    hint = f"; did you mean {' or '.join(c if ' ' in c else repr(c) for c in close[:3])}?"
    rest = ""
    if not close and section in types_:
        own = [f.name for f in dataclasses.fields(types_[section])]
        rest = f"; the keys of [{section}]: {', '.join(own)}"
    return ValueError(
        f"{what}{hint if close else ''}{rest}; sections: {', '.join(sections)} (every key: "
        "docs/train.md, Configuration)"
    )


def _coerce_scalar(key: str, value: Any, kind: type) -> Any:
    if kind is bool:
        if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
            return False
        if value in (0, 1) and not isinstance(value, float):
            return bool(value)
        if not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: expected true or false")
        return value
    if kind is str:
        if not isinstance(value, str):
            raise ValueError(f"{key}={value!r}: expected a string, got {type(value).__name__}")
        return value
    what = "an int" if kind is int else "a number"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ValueError(f"{key}={value!r}: expected {what}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}={value!r}: expected {what}, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{key}={value!r}: must be a finite number (not NaN or infinity)")
    if kind is int:  # accept 1e5 or 100.0 for an int field when it is a whole number
        if not float(value).is_integer():
            raise ValueError(
                f"{key}={value!r}: expected an int (a whole number, e.g. {math.floor(value)})"
            )
        return int(value)
    return float(value)


def _coerce(key: str, value: Any, kind: Any) -> Any:
    """Convert a TOML or command-line value to the field's type (scalars and lists)."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        if isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()] if item is str else [value]
        if not isinstance(value, list):
            raise ValueError(f"{key}={value!r}: expected a list, e.g. {key}=[...]")
        return [_coerce_scalar(key, v, item) for v in value]
    return _coerce_scalar(key, value, kind)


def _apply(raw: dict[str, dict[str, Any]], key: str, value: Any) -> None:
    section, _, name = key.partition(".")
    types_ = _section_types()
    if (
        section not in types_
        or not name
        or name not in {f.name for f in dataclasses.fields(types_[section])}
    ):
        raise _unknown(key)
    raw.setdefault(section, {})[name] = _coerce(
        key, value, typing.get_type_hints(types_[section])[name]
    )


def _apply_cli(raw: dict[str, dict[str, Any]], key: str, text: str) -> None:
    """A --set value: a TOML value (list, bool, number, quoted string) or, failing that (or
    for a string field: a path like 2024 or a name like true), the text itself (so
    `--set data.path=/a/b` needs no quotes)."""
    section, _, name = key.partition(".")
    types_ = _section_types()
    kind = typing.get_type_hints(types_[section]).get(name) if section in types_ else None
    try:
        parsed = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = text
    _apply(raw, key, text if kind is str and not isinstance(parsed, str) else parsed)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Defaults <- TOML file at `path` (optional) <- `KEY=VALUE` overrides, validated."""
    raw: dict[str, dict[str, Any]] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ValueError(
                f"config file {str(p)!r} does not exist; pass a TOML file (see docs/train.md)"
            )
        try:
            doc = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        for section, table in doc.items():
            if not isinstance(table, dict):
                raise _unknown(section)
            for name, value in table.items():
                _apply(raw, f"{section}.{name}", value)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. --set train.steps=100")
        _apply_cli(raw, key.strip(), value.strip())
    types_ = _section_types()
    return Config(**{name: types_[name](**raw.get(name, {})) for name in types_})


def dump_config(cfg: Config, path: str | Path) -> Path:
    """Write the resolved config as TOML (every key, defaults included)."""
    try:
        import tomli_w
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "writing the run's config.toml needs tomli-w: pip install 'dropless[train]'"
        ) from None
    header = (
        "# resolved config of this run (dropless train); reload with `dropless train THIS_FILE`\n\n"
    )
    from ..run.atomic import (
        write_atomic,  # temp + fsync + rename: a crash leaves the old file whole
    )

    return write_atomic(path, header + tomli_w.dumps(dataclasses.asdict(cfg)))


__all__ = [
    "ADAMW_IMPLEMENTATIONS", "ATTENTION", "DECODE_ERRORS", "DTYPES",
    "FINETUNE_METHODS", "IMPLEMENTATIONS", "LORA_TARGETS",
    "LOSS_ON", "NONFINITE_POLICIES", "PROGRESS", "RECIPE_OPTIONS", "RECIPES",
    "SCHEDULES", "CheckpointConfig", "Config", "DataConfig", "FinetuneConfig", "LogConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "TrainSection",
    "dump_config", "known_keys", "load_config",
]  # fmt: skip
