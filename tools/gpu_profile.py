"""Where a GPU step's time and host syncs go: `python -m tools.gpu_profile [CASE...]`.

For each case, one step after two warm-up steps runs under torch.profiler (with Python
stacks); printed: the CUDA kernels with the most device time, and every host
synchronization (cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize /
a blocking cudaMemcpy) with the operator and the dropless source line that made it.
Cases: layer_bf16, layer_fp8_row, layer_fp8_delayed, layer_mxfp8 (rows of
`dropless bench layer --shape qwen3-30b` at the T of the GPU check's layer table),
e2e_dropless, e2e_fused_ce (rows of `dropless bench e2e --shape qwen3-gpu`), ep1 (the
expert-parallel dispatcher over a 1-rank NCCL group at a small shape). GPU only.
"""

from __future__ import annotations

import os
import sys

import torch

LAYER_TOKENS = 16384  # the T of the GPU check's layer table (run.py)

SYNC_CALLS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cudaMemcpy",
)


def _layer_step(impl: str):
    """One step of a `dropless bench layer` row at the GPU table's shape."""
    from dropless.bench.layer import SHAPES, build_impl

    shape = {k: v for k, v in SHAPES["qwen3-30b"].items() if k != "T"}
    cfg = {**shape, "T": LAYER_TOKENS, "device": "cuda", "skewed": False, "threads": 1}
    step, params, _ = build_impl(impl, cfg)

    def run():
        for t in params:
            t.grad = None
        step()

    return run


def _e2e_step(impl: str):
    """One training step of a `dropless bench e2e --device cuda --shape qwen3-gpu` row."""
    from dropless.bench.e2e import SHAPES, build_row_model

    shape = SHAPES["qwen3-gpu"]
    model = build_row_model(impl, shape, "cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, shape["vocab_size"], (shape["batch"], shape["seq"]), generator=g)
    ids = ids.cuda()

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _ep_step():
    import socket

    import torch.distributed as dist

    import dropless
    from dropless.parallel import ExpertParallelDispatcher

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    moe = dropless.MoE(64, 32, 6, 2, dtype=torch.bfloat16, device="cuda")
    moe.dispatcher = ExpertParallelDispatcher(num_experts=6)
    x = torch.randn(24, 64, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = moe(x.detach().requires_grad_(True))
        out.sum().backward()

    return step


def _where(ev) -> str:
    """The op chain above a runtime event, and the Python frames of the nearest op that
    recorded a stack (outside torch itself: where our code or the model called it)."""
    chain, e = [], ev
    while e is not None and len(chain) < 6:
        chain.append(e.name)
        e = e.cpu_parent
    stack, e = [], ev
    while e is not None and not stack:
        stack = [s for s in (e.stack or []) if "site-packages/torch/" not in s]
        e = e.cpu_parent
    lines = stack[:5] or ["(no Python stack recorded: autograd engine thread?)"]
    return " <- ".join(chain[:5]) + "\n      " + "\n      ".join(lines)


def profile(name: str, step) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof_

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with prof_(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as p:
        step()
        torch.cuda.synchronize()
    print(f"\n===== {name}")
    print(
        p.key_averages().table(
            sort_by="self_cuda_time_total", row_limit=18, max_name_column_width=70
        )
    )
    syncs = [
        e
        for e in p.events()
        if any(e.name.startswith(s) for s in SYNC_CALLS) and "Async" not in e.name
    ]
    # the last synchronize is the profile's own
    print(f"host syncs: {len(syncs) - 1} (+1 the profiler's own)")
    for e in syncs[:-1][:12]:
        print("   ", e.name, "<-", _where(e))


CASES = {
    "layer_bf16": lambda: _layer_step("dropless"),
    "layer_fp8_row": lambda: _layer_step("dropless-fp8-current-row"),
    "layer_fp8_delayed": lambda: _layer_step("dropless-fp8-delayed"),
    "layer_mxfp8": lambda: _layer_step("dropless-mxfp8-saved"),
    "e2e_dropless": lambda: _e2e_step("dropless"),
    "e2e_fused_ce": lambda: _e2e_step("dropless-fused-ce"),
    "ep1": _ep_step,
}


def main(argv: list[str]) -> int:
    names = argv or list(CASES)
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        print(f"unknown case(s) {unknown}; cases: {list(CASES)}")
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    for n in names:
        try:
            profile(n, CASES[n]())
        except Exception as e:  # noqa: BLE001 - the other cases still run
            print(f"\n===== {n}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
