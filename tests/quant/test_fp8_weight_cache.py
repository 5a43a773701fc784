"""FP8 weights come from the one weight cache (`ops.weight_cache.cached_cast`): once per
optimizer step, also in a torch.distributed run (FSDP2), never stale after a step that
FSDP2-style re-gathers hide from the version counter, and stored column-major once
for the GEMMs that read them as b [E, K, N]."""

# S rows, D in features, N out features, E experts

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dropless.ops import weight_cache
from dropless.quant import (
    Float8CurrentScaling,
    MXFP8BlockScaling,
    autocast,
    convert_linear,
    formats,
)
from dropless.quant import gemm as qgemm

COUNTS = [5, 0, 11, 16]
S, D, N = sum(COUNTS), 64, 32


@pytest.fixture(autouse=True)
def _empty_cache():
    weight_cache.clear()
    yield
    weight_cache.clear()


def _w():
    return torch.nn.Parameter(torch.randn(len(COUNTS), N, D))


@pytest.mark.parametrize("make", [Float8CurrentScaling, MXFP8BlockScaling], ids=["current", "mx"])
def test_cached_in_a_distributed_run(make):
    """A real (world 1, gloo) process group: the FP8 weight is still made once per step."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        w, recipe = _w(), make()
        first = qgemm.quantize_operand(recipe, w, "w", 2, key=w)
        assert qgemm.quantize_operand(recipe, w, "w", 2, key=w) is first
    finally:
        dist.destroy_process_group()


def test_regather_with_restored_version_misses_after_the_optimizer_step():
    """FSDP2 writes each all-gather into the same unsharded parameter and restores its
    version counter: the optimizer step is what says the values are new."""
    w, shard, recipe = _w(), torch.nn.Parameter(torch.zeros(1)), Float8CurrentScaling()
    before = qgemm.quantize_operand(recipe, w, "w", 2, key=w)
    v = w._version
    with torch.no_grad():
        w.mul_(3)
    torch._C._autograd._unsafe_set_version_counter((w,), (v,))
    torch.optim.SGD([shard], lr=0.1).step()  # the sharded parameter's update
    after = qgemm.quantize_operand(recipe, w, "w", 2, key=w)
    torch.testing.assert_close(after.dequantize(), 3 * before.dequantize())


def test_converted_linear_weight_view_cached_on_its_parameter(monkeypatch):
    """Linear passes `weight.unsqueeze(0)`, a new view per call: cached on the weight."""
    calls = []
    real = qgemm.quantize_scaled

    def spy(t, *a, **k):
        calls.append(tuple(t.shape))
        return real(t, *a, **k)

    monkeypatch.setattr(qgemm, "quantize_scaled", spy)
    lin = convert_linear(torch.nn.Sequential(torch.nn.Linear(D, N)))[0]
    with autocast(recipe=Float8CurrentScaling()):
        for _ in range(3):
            lin(torch.randn(4, D)).sum().backward()
    # the inputs need no gradient (no dgrad): one forward-layout weight for three calls
    assert calls.count((1, N, D)) == 1, calls


def test_inference_tensor_weight_is_quantized_per_call():
    """A weight made under inference_mode has no version counter: not cached, no error."""
    with torch.inference_mode():
        w = torch.randn(len(COUNTS), N, D)
        q = qgemm.quantize_operand(Float8CurrentScaling(), w, "w", 2, key=w)
    torch.testing.assert_close(
        q.dequantize(), formats.quantize_current(w, "e4m3", (1, 2)).dequantize()
    )


def test_column_major_weight_reaches_the_gemm_without_a_copy(monkeypatch):
    """The dgrad weight stored column-major: torch._scaled_grouped_mm gets its storage
    as it is (the GEMM call transposes nothing), with the same result."""
    seen = []

    def scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, out_dtype=None, **kw):
        seen.append(b)
        outs, lo = [], 0
        for e, hi in enumerate(offs.tolist()):
            outs.append((a[lo:hi].float() * scale_a[lo:hi, None]) @ (b[e].float() * scale_b[e]))
            lo = hi
        return torch.cat(outs).to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", scaled_grouped_mm, raising=False)
    g = torch.Generator().manual_seed(1)
    gq = formats.quantize_current(torch.randn(S, N, generator=g), "e4m3", dims=1)
    wq = formats.quantize_current(torch.randn(len(COUNTS), N, D, generator=g), "e4m3", dims=1)
    cm = qgemm.column_major(wq)
    assert cm.data.transpose(1, 2).is_contiguous() and torch.equal(cm.dequantize(), wq.dequantize())
    y_cm = qgemm._torch_mm(gq, cm, COUNTS, False, torch.float32)
    y = qgemm._torch_mm(gq, wq, COUNTS, False, torch.float32)
    assert seen[0].data_ptr() == cm.data.data_ptr() and seen[1].data_ptr() != wq.data.data_ptr()
    assert torch.equal(y_cm, y)


def test_cached_cast_of_an_inference_tensor_converts_per_call():
    """`cached_cast` itself (the bf16 autocast cast too) on a tensor with no version counter."""
    with torch.inference_mode():
        w = torch.randn(3, 4)
        a = weight_cache.cached_cast(w, torch.bfloat16)
    assert torch.equal(a, w.to(torch.bfloat16)) and w not in weight_cache._CACHE
