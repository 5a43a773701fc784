"""The timing group of `gpu_check.py` (GPU only): one MoE layer forward+backward at the
Qwen3-30B-A3B shape (E=128, K=8, D=2048, F=768, T=16384 tokens, bf16), CUDA events.

Rows, all with the same routing and weights:
- dense_bound: a dense bf16 GEMM chain with the expert compute's FLOPs ([T*K, D] x
  [D, 2F], SwiGLU, x [F, D]): the physical limit for the experts;
- dropless: `dropless.MoE` (router + experts);
- grouped_mm_plain: argsort + torch._grouped_mm with autograd + index_add, written plainly;
- hf_grouped_mm: Hugging Face `Qwen3MoeSparseMoeBlock` with experts_implementation
  "grouped_mm" (skipped when transformers is missing).
Each: median ms of `rounds` steps after warm-up, share of the bound, peak memory of a
step above what was allocated before it; dropless also: host syncs per step.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

import statistics
import warnings

import torch

SHAPE = dict(E=128, K=8, D=2048, F=768, T=16384)


def _time(step, rounds: int = 10, warmup: int = 3) -> tuple[float, float]:
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak


def _plain(x, w_r, gu, dn, K):
    E, F2 = gu.shape[0], gu.shape[1]
    probs = torch.softmax((x @ w_r.t()).float(), -1)
    topv, topi = probs.topk(K, -1)
    topv = (topv / topv.sum(-1, keepdim=True)).to(x.dtype)
    flat = topi.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    offs = torch.bincount(flat, minlength=E).cumsum(0).to(torch.int32)
    h = torch._grouped_mm(x.index_select(0, tok), gu.transpose(1, 2), offs=offs)
    a = torch.nn.functional.silu(h[:, : F2 // 2]) * h[:, F2 // 2 :]
    y = torch._grouped_mm(a, dn.transpose(1, 2), offs=offs)
    y = y * topv.reshape(-1).index_select(0, order).unsqueeze(1)
    return torch.zeros_like(x).index_add(0, tok, y)


def _hf(cfg, w_r, gu, dn):
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    conf = Qwen3MoeConfig(
        hidden_size=cfg["D"],
        moe_intermediate_size=cfg["F"],
        num_experts=cfg["E"],
        num_experts_per_tok=cfg["K"],
        norm_topk_prob=True,
        experts_implementation="grouped_mm",
    )
    block = Qwen3MoeSparseMoeBlock(conf).to(device=w_r.device, dtype=w_r.dtype)
    with torch.no_grad():
        block.gate.weight.copy_(w_r)
        block.experts.gate_up_proj.copy_(gu)
        block.experts.down_proj.copy_(dn)
    return block


def run_timing(G) -> dict:
    import dropless

    E, K, D, F, T = (SHAPE[k] for k in "EKDFT")
    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    moe = dropless.MoE(D, F, E, K, dtype=dt, device=dev)
    w_r = moe.router.weight.detach()
    gu, dn = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    x = torch.randn(T, D, device=dev, dtype=dt)
    g_out = torch.randn(T, D, device=dev, dtype=dt)
    x_dense = torch.randn(T * K, D, device=dev, dtype=dt)
    w1 = torch.randn(D, 2 * F, device=dev, dtype=dt, requires_grad=True)
    w2 = torch.randn(F, D, device=dev, dtype=dt, requires_grad=True)
    g_dense = torch.randn(T * K, D, device=dev, dtype=dt)

    def dense():
        h = x_dense @ w1
        y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2
        y.backward(g_dense)

    def ours():
        xi = x.detach().requires_grad_(True)
        out, aux = moe(xi)
        out.backward(g_out)

    leaves = [t.clone().requires_grad_(True) for t in (w_r, gu, dn)]

    def plain():
        xi = x.detach().requires_grad_(True)
        _plain(xi, *leaves, K).backward(g_out)

    rows: dict = {}
    steps = {"dense_bound": dense, "dropless": ours, "grouped_mm_plain": plain}
    try:
        block = _hf(SHAPE, w_r, gu, dn)

        def hf():
            xi = x.detach().view(1, T, D).requires_grad_(True)
            out = block(xi)
            (out[0] if isinstance(out, tuple) else out).backward(g_out.view(1, T, D))

        steps["hf_grouped_mm"] = hf
    except Exception as e:  # noqa: BLE001 - optional row
        rows["hf_grouped_mm"] = dict(status="skipped", note=f"{type(e).__name__}: {e}"[:200])
    for name, step in steps.items():
        with G.check(f"timing {name}"):
            ms, peak = _time(step)
            rows[name] = dict(ms=round(ms, 3), peak_gib=round(peak, 3))
            G.record(f"timing {name}", status="ok", note=f"{ms:.2f} ms, peak {peak:.2f} GiB")
    bound = rows.get("dense_bound", {}).get("ms")
    for r in rows.values():
        if bound and "ms" in r:
            r["share_of_bound"] = round(bound / r["ms"], 3)
    with G.check("timing dropless host syncs"):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours()
        torch.cuda.set_sync_debug_mode(0)
        n = sum("synchroniz" in str(c.message) for c in caught)
        rows.setdefault("dropless", {})["host_syncs_per_step"] = n
        G.record(
            "timing dropless host syncs", status="ok" if n == 0 else "fail", note=f"{n} per step"
        )
    return dict(shape=SHAPE, dtype="bf16", rows=rows)
