"""The timing group of `gpu_check.py` (GPU only): one MoE layer forward+backward at the
Qwen3-30B-A3B shape (E=128, K=8, D=2048, F=768, T=16384 tokens, bf16), CUDA events.

Rows, all with the same routing and weights:
- dense_bound: a dense bf16 GEMM chain with the expert compute's FLOPs ([T*K, D] x
  [D, 2F], SwiGLU, x [F, D]): the physical limit for the experts;
- dropless: `dropless.MoE` (router + experts);
- grouped_mm_plain: argsort + torch._grouped_mm with autograd + index_add, written plainly;
- hf_grouped_mm: Hugging Face `Qwen3MoeSparseMoeBlock` with experts_implementation
  "grouped_mm" (skipped when transformers is missing).
- dropless_eager_row_ops: dropless with the eager row ops instead of the Triton kernels;
- dropless_fp8_current_row / dropless_fp8_delayed / dropless_mxfp8_saved: dropless under
  those recipes (E4M3; MXFP8 with FP8 saved activations).
Each: median ms of `rounds` steps after warm-up (every step starts with no gradients, as
after `zero_grad(set_to_none=True)`), share of the bound, peak memory of a step above what
was allocated before it; dropless also: host syncs per step.
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

    # every step starts from no gradients, as a training step after zero_grad(set_to_none)
    # does: otherwise autograd adds each step's weight gradients into the last ones (an
    # extra pass over every [E, ...] gradient that the dense rows' small weights hardly pay)
    def dense():
        w1.grad = w2.grad = None
        h = x_dense @ w1
        y = (torch.nn.functional.silu(h[:, :F]) * h[:, F:]) @ w2
        y.backward(g_dense)

    def ours():
        moe.zero_grad(set_to_none=True)
        xi = x.detach().requires_grad_(True)
        out, aux = moe(xi)
        out.backward(g_out)

    leaves = [t.clone().requires_grad_(True) for t in (w_r, gu, dn)]

    def plain():
        for t in leaves:
            t.grad = None
        xi = x.detach().requires_grad_(True)
        _plain(xi, *leaves, K).backward(g_out)

    def ours_eager_rows():
        # the same layer with the eager row ops (the reference) in place of the Triton ones
        from dropless.ops import row_ops

        saved = row_ops._ROW_OPS.pop("triton", None)
        try:
            ours()
        finally:
            if saved is not None:
                row_ops.register_row_ops(saved)

    def ours_recipe(recipe):
        def step():
            with dropless.autocast(recipe=recipe):
                ours()

        return step

    rows: dict = {}
    steps = {
        "dense_bound": dense,
        "dropless": ours,
        "dropless_eager_row_ops": ours_eager_rows,
        # E4M3 gradients too: torch's FP8 grouped GEMM takes no E5M2 operand (HYBRID's dgrad
        # would run emulated, see docs/fp8.md)
        "dropless_fp8_current_row": ours_recipe(
            dropless.Float8CurrentScaling(granularity="row", fp8_format="E4M3")
        ),
        "dropless_fp8_delayed": ours_recipe(dropless.DelayedScaling(fp8_format="E4M3")),
        "dropless_mxfp8_saved": ours_recipe(dropless.MXFP8BlockScaling(fp8_saved_activations=True)),
        "grouped_mm_plain": plain,
    }
    try:
        block = _hf(SHAPE, w_r, gu, dn)

        def hf():
            block.zero_grad(set_to_none=True)
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
    for row in ("dropless", "dropless_fp8_current_row", "dropless_fp8_delayed"):
        with G.check(f"timing {row} host syncs"):
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                steps[row]()
            torch.cuda.set_sync_debug_mode(0)
            n = sum("synchroniz" in str(c.message) for c in caught)
            rows.setdefault(row, {})["host_syncs_per_step"] = n
            G.record(
                f"timing {row} host syncs", status="ok" if n == 0 else "fail", note=f"{n} per step"
            )
    return dict(shape=SHAPE, dtype="bf16", rows=rows)


# the e2e model: the pinned CPU config scaled to a GPU (Qwen3-like layer shape E64 K8)
E2E = dict(
    vocab_size=32768, hidden_size=1024, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, head_dim=64, num_experts=64, num_experts_per_tok=8,
    moe_intermediate_size=384, intermediate_size=3072, tie_word_embeddings=False,
    batch=8, seq=2048,
)  # fmt: skip
E2E_CPU = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=6, num_experts_per_tok=2,
    moe_intermediate_size=32, intermediate_size=128, tie_word_embeddings=False,
    batch=2, seq=16,
)  # fmt: skip


def _e2e_step_fn(impl: str, shape: dict, dev, dt):
    import transformers as tf
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig

    import dropless

    dropless.unpatch()
    report = None
    if impl.startswith("dropless"):
        report = dropless.patch(fused_cross_entropy=impl == "dropless_fused_ce")
    conf = {k: v for k, v in shape.items() if k not in ("batch", "seq")}
    cfg = Qwen3MoeConfig(**conf, output_router_logits=True, router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    kw = {} if report is not None else dict(experts_implementation="grouped_mm")
    model = tf.AutoModelForCausalLM.from_config(cfg, **kw).to(device=dev, dtype=dt)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=dev.type == "cuda")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    ids = ids.to(dev)

    def step() -> float:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return step, report


def run_e2e(G) -> dict:
    """A Qwen3-MoE training step (forward, backward, fused AdamW), bf16 on the GPU:
    stock Transformers `grouped_mm` vs `dropless.patch()` (and with its fused linear +
    cross-entropy). The first-step losses must agree; tokens/s from the median step."""
    import dropless

    shape = E2E_CPU if G.cpu else E2E
    dev, dt = G.dev, (torch.float32 if G.cpu else torch.bfloat16)
    rows: dict = {}
    first: dict = {}
    for impl in ("grouped_mm", "dropless", "dropless_fused_ce"):
        with G.check(f"e2e {impl}"):
            step, _ = _e2e_step_fn(impl, shape, dev, dt)
            first[impl] = float(step())  # warm-up; AdamW allocates its state
            if G.cpu:
                G.record(f"e2e {impl}", status="ok", note=f"first loss {first[impl]:.4f}")
                continue
            ms, peak = _time(step, rounds=5, warmup=1)
            del step
            tok_s = shape["batch"] * shape["seq"] / (ms / 1e3)
            rows[impl] = dict(
                ms=round(ms, 2), tokens_per_s=round(tok_s), peak_step_gib=round(peak, 3)
            )
            G.record(
                f"e2e {impl}",
                status="ok",
                note=f"{ms:.1f} ms, {tok_s:.0f} tok/s, peak {peak:.2f} GiB",
            )
    dropless.unpatch()
    if "grouped_mm" in first:
        ref = first["grouped_mm"]
        for impl, loss in first.items():
            G.record(f"e2e first loss {impl} vs grouped_mm", abs(loss - ref) / abs(ref), 2e-2)
    base = rows.get("grouped_mm", {})
    for r in rows.values():
        if "ms" in r and base.get("ms"):
            r["speed_vs_grouped_mm"] = round(base["ms"] / r["ms"], 3)
            r["memory_vs_grouped_mm"] = round(r["peak_step_gib"] / base["peak_step_gib"], 3)
    return dict(shape=shape, dtype=str(dt), rows=rows)
