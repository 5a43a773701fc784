"""The generic registry every op's implementations sit in (`dropless.ops.registry`):
picking by priority and by name, the errors of a named entry, and the GPU hook that
registers the Triton entries on the first pick for a CUDA operand and never on CPU."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from dropless.ops.registry import Registry


@dataclass(frozen=True)
class Entry:
    name: str
    supports: object
    priority: int = 0


def _registry(calls: list) -> Registry:
    reg = Registry("test op")
    reg.register(Entry("torch", lambda t: True))
    reg.register(Entry("fast_cpu", lambda t: t.dtype == torch.float32, priority=5))

    def register_gpu():
        calls.append("gpu")
        reg.register(Entry("gpu", lambda t: t.is_cuda, priority=10))

    reg.on_first_cuda(register_gpu)
    return reg


def test_auto_takes_the_best_entry_that_runs_and_cpu_never_registers_the_gpu_one():
    calls = []
    reg = _registry(calls)
    assert reg.pick(None, torch.randn(2)).name == "fast_cpu"
    assert reg.pick("auto", torch.randn(2, dtype=torch.float64)).name == "torch"
    assert reg.names() == ["fast_cpu", "torch"] and calls == []


def test_a_named_entry_that_cannot_run_raises_and_never_falls_back():
    reg = _registry([])
    x = torch.randn(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="test op 'fast_cpu' cannot run on torch.float64"):
        reg.pick("fast_cpu", x)
    with pytest.raises(ValueError, match="test op 'nope' is not registered"):
        reg.pick("nope", x)
    assert reg.pick("torch", x).name == "torch"


def test_the_gpu_hook_runs_once_on_the_first_cuda_pick():
    calls = []
    reg = _registry(calls)
    with FakeTensorMode():
        x = torch.empty(2, device="cuda")
        assert reg.pick(None, x).name == "gpu"
        assert reg.pick(None, x).name == "gpu"
    assert calls == ["gpu"] and reg.names() == ["gpu", "fast_cpu", "torch"]


def test_naming_a_gpu_entry_on_cpu_registers_it_and_says_why_it_cannot_run():
    calls = []
    reg = _registry(calls)
    with pytest.raises(ValueError, match="'gpu' cannot run on torch.float32 tensors on cpu"):
        reg.pick("gpu", torch.randn(2))
    assert calls == ["gpu"]


def test_the_gpu_hook_is_not_run_while_compiling(monkeypatch):
    calls = []
    reg = _registry(calls)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode():
        assert reg.pick(None, torch.empty(2, device="cuda")).name == "fast_cpu"
    assert calls == []
