"""Fixtures of the benchmark tests."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def layer_in_process(monkeypatch):
    """`dropless bench layer`'s row children run in this process (JSON in and out, as a
    child's would be): at the tiny shape a child costs mostly its torch import."""
    from dropless.bench import layer

    def child(module, cfg, timeout=1800):
        assert module == "dropless.bench.layer"
        return json.loads(json.dumps(layer._child(json.loads(json.dumps(cfg)))))

    monkeypatch.setattr(layer, "run_child", child)
