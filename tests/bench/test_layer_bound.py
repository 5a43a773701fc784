"""The dense bound of `dropless bench layer` is the six expert GEMMs and nothing else, the
rates every row reports, the machine's matmul rate and the `--profile` kernel tables."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from tools import bench_profile as profile
from torch.utils._python_dispatch import TorchDispatchMode

from dropless.bench import bound
from dropless.cli.main import main


class _Ops(TorchDispatchMode):
    """Every aten op that runs, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func, shapes))
        return func(*args, **(kwargs or {}))


def test_the_bound_runs_exactly_the_six_gemms_with_the_input_gradient():
    T, K, D, F, E = 12, 3, 16, 8, 4
    M = T * K
    x = torch.randn(T, D, requires_grad=True)  # as the layer's rows have it
    step = bound.dense_bound(
        x, torch.randn(E, 2 * F, D), torch.randn(E, D, F), torch.randn(T, D), K
    )
    with _Ops() as ops:
        step()
    gemms = [shapes for func, shapes in ops.calls if func is torch.ops.aten.mm.default]
    others = Counter(func for func, _ in ops.calls if func is not torch.ops.aten.mm.default)
    # nothing but the six GEMMs: the transposes are views, no elementwise op, no copy
    assert all(func.is_view for func in others), others
    assert gemms == [
        [(M, D), (D, 2 * F)],  # gate/up forward
        [(M, F), (F, D)],  # down forward
        [(M, D), (D, F)],  # down input gradient
        [(D, M), (M, F)],  # down weight gradient
        [(M, 2 * F), (2 * F, D)],  # gate/up input gradient: the layer's dx
        [(2 * F, M), (M, D)],  # gate/up weight gradient
    ]
    assert len(gemms) == len(bound.BOUND_GEMMS)
    flops = sum(2 * a[0] * a[1] * b[1] for a, b in gemms)
    assert flops == bound.layer_flops(T, K, D, F)
    assert x.grad is None  # no autograd inside the bound


def test_matmul_rate_is_a_measured_rate_of_the_asked_dtype():
    r = bound.matmul_rate("cpu", torch.float32, n=64, rounds=3)
    assert r["dtype"] == "float32" and r["n"] == 64 and r["how"] == "torch.matmul on CPU"
    assert r["ms"] > 0 and abs(r["tflops"] - 2 * 64**3 / r["ms"] / 1e9) < 1e-12


def test_layer_record_has_rates_matmul_peers_and_profile(tmp_path, monkeypatch, layer_in_process):
    # layer_in_process: the stand-in peer below lives in this process
    from tools import peers
    from tools.layer_paths import grouped_mm_plain

    # torch stands in for an installed CPU peer, the plain layer for its kernel; torchao's
    # row needs CUDA (or is not installed): it is not timed, and the record says why
    monkeypatch.setitem(peers.PEERS, "liger", peers.Peer("torch", "torch", "0.0.1", False))
    monkeypatch.setitem(peers.LAYER_PATHS, "liger-moe", grouped_mm_plain)
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")  # what the bench sets: restored after
    hist = tmp_path / "h.jsonl"
    argv = ["bench", "layer", "--shape", "tiny", "--device", "cpu", "--no-skewed", "--no-memory"]
    argv += ["--rounds", "3", "--steps", "1", "--warmup", "0"]
    argv += ["--impls", "dense,dropless,liger-moe,torchao-fp8-row"]
    assert main([*argv, "--profile", "--history", str(hist)]) == 0
    f = json.loads(hist.read_text())["figures"]
    rates = f["matmul"]
    assert set(rates) == {"bfloat16", "float32"} and all(r["tflops"] > 0 for r in rates.values())
    rows = {r["impl"]: r for r in f["rows"]}
    assert list(rows) == ["dense", "dropless", "liger-moe"]
    assert rows["liger-moe"]["peer"]["version"] == peers.installed_version(peers.PEERS["liger"])
    assert rows["liger-moe"]["max_rel_diff"] < 1e-5  # the same weights and routes as dropless
    st = f["peers"]["torchao-fp8-row"]
    assert st["ok"] is False and st["wanted"] == "0.18.0"
    assert st["status"].startswith(("needs CUDA", "not installed")), st
    for r in rows.values():
        assert r["ms"] > 0 and r["tflops"] == r["gflops"] / 1e3
        # the median over rounds of dense ms / row ms, the rows of a round side by side
        ratios = [d / m for d, m in zip(rows["dense"]["ms_all"], r["ms_all"])]
        assert r["share_of_bound"] == pytest.approx(sorted(ratios)[1])
        assert r["share_of_matmul_rate"] == r["tflops"] / rates["float32"]["tflops"]
    assert len(f["bound"]["gemms"]) == 6 and f["bound"]["flops"] == "18*T*K*D*F"
    tables = f["profile"]["tables"]
    assert list(tables) == ["dropless", "dropless-fp8-current-row"] and f["profile"]["T"] == 48
    for t in tables.values():
        names = [r["name"] for r in t["rows"]]
        assert "aten::mm" in names or "aten::_grouped_mm" in names, names
        assert all(set(r) == {"name", "calls", "total_ms", "share"} for r in t["rows"])
        # the shares are of the rows' sum (each rounded to 4 places)
        assert abs(sum(r["share"] for r in t["rows"]) - 1) < 1e-4 * len(t["rows"])


def test_kernel_table_counts_calls_and_keeps_the_top_rows():
    a, b = torch.randn(256, 256), torch.randn(4, 4)

    def step():
        for _ in range(3):
            torch.mm(a, a)  # ~0.1 GFLOP: far above the two small ops below
        b.relu().neg()

    t = profile.kernel_table(step, "cpu", warmup=0, top=1)
    assert t["device"] == "cpu" and t["rows"][0]["name"] == "aten::mm"
    assert t["rows"][0]["calls"] == 3
    assert t["rows"][-1]["name"] == "(other)" and len(t["rows"]) == 2
    assert abs(sum(r["total_ms"] for r in t["rows"]) - t["total_ms"]) < 1e-3
    text = profile.markdown("x", t)
    assert text.startswith("#### x: aten operators, self CPU time") and "| `aten::mm` | 3 |" in text


def test_kernel_table_sees_the_expert_worker_threads_ops():
    from dropless.ops.expert_mlp.threads import run_experts

    a = torch.randn(64, 64)

    def step():  # 6 items of one mm each on 2 worker threads (the caller runs none)
        assert run_experts(range(6), lambda item, scratch, buf: torch.mm(a, a), workers=2)

    t = profile.kernel_table(step, "cpu", warmup=1)
    mm = next(r for r in t["rows"] if r["name"] == "aten::mm")
    assert mm["calls"] == 6 and t["wall_ms"] > 0


def test_side_by_side_puts_each_operator_on_one_line_with_every_rows_time():
    def table(rows):
        total = sum(ms for _, ms in rows)
        return {
            "what": "aten operators, self CPU time",
            "total_ms": total,
            "rows": [
                {"name": n, "calls": 1, "total_ms": ms, "share": ms / total} for n, ms in rows
            ],
        }

    stock = table([("aten::_grouped_mm", 60.0), ("aten::mm", 30.0), ("(other)", 10.0)])
    patched = table([("aten::mm", 40.0), ("aten::bmm", 10.0), ("(other)", 5.0)])
    text = profile.side_by_side("step", {"grouped_mm": stock, "dropless": patched})
    lines = text.splitlines()
    assert lines[0].startswith("#### step, side by side") and "`grouped_mm` 100.0 ms" in lines[0]
    body = lines[4:]  # by the largest time over the rows, "(other)" last
    assert [ln.split("`")[1] for ln in body] == [
        "aten::_grouped_mm",
        "aten::mm",
        "aten::bmm",
        "(other)",
    ]
    assert body[0].endswith("| 60.0 (0.600) | - |") and body[1].endswith(
        "| 30.0 (0.300) | 40.0 (0.727) |"
    )


@pytest.mark.gpu
def test_the_bound_on_cuda_runs_gemm_kernels_only_and_the_rate_is_plausible():
    T, K, D, F, E = 1024, 8, 2048, 768, 2
    to = dict(device="cuda", dtype=torch.bfloat16)
    args = [torch.randn(*s, **to) for s in ((T, D), (E, 2 * F, D), (E, D, F), (T, D))]
    t = profile.kernel_table(bound.dense_bound(*args, K), "cuda")
    names = [r["name"].lower() for r in t["rows"]]
    # cuBLAS may add its own split-K reductions, but no elementwise, copy or fill kernel
    assert not any(w in n for n in names for w in ("elementwise", "copy", "fill", "silu")), names
    assert sum(r["calls"] for r in t["rows"]) >= 6
    rate = bound.matmul_rate("cuda", torch.bfloat16)
    assert 100 < rate["tflops"] < 1100, rate  # H200: ~990 peak dense bf16, ~790 measured
