"""Fixtures of the benchmark tests."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture
def load_script():
    """-> load(name): scripts/NAME.py as a fresh module (scripts/ is not a package)."""

    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def layer_in_process(monkeypatch):
    """`dropless bench layer`'s row children run in this process (JSON in and out, as a
    child's would be): at the tiny shape a child costs mostly its torch import."""
    from dropless.bench import layer

    def child(module, cfg, timeout=1800):
        assert module == "dropless.bench.layer"
        return json.loads(json.dumps(layer._child(json.loads(json.dumps(cfg)))))

    monkeypatch.setattr(layer, "run_child", child)
