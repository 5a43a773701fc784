"""The eager cost of the `dropless::expert_mlp` custom op (what torch.compile and
torch.export run for the routed expert MLP) against the same computation called directly.

Rows, forward (under no_grad, as in decoding) and forward + backward of one routed
expert MLP, interleaved within each round (median of the rounds, min-max):
- `custom-op`: `ops.expert_mlp.custom_op.run`, i.e. the torch.library op and its
  registered autograd (the backward is the second custom op);
- `direct`: `ops.expert_mlp(..., backend=<the op's backend>)`, the same fused Function
  on the same grouped-GEMM backend without the custom-op layer;
- `eager-default`: `ops.expert_mlp` as eager code calls it (on CPU: the per-expert loop).
custom-op / direct is the dispatch overhead; at T=1 (decode) it is nearly all overhead.

    python scripts/bench_expert_mlp_op.py [--tokens 1 16384] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dropless.ops import expert_mlp
from dropless.ops.expert_mlp import custom_op
from dropless.ops.mlp_plan import plan_grouped
from dropless.ops.specs import ActivationConfig

SWIGLU = ActivationConfig("swiglu", True, False, 1.702, 7.0)


def _operands(T, D, F, E, K, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=dtype).requires_grad_()
    gu = (torch.randn(E, 2 * F, D, generator=g, dtype=dtype) * 0.02).requires_grad_()
    dn = (torch.randn(E, D, F, generator=g, dtype=dtype) * 0.02).requires_grad_()
    return x, ids, w, gu, dn


def _rows(ops, backend):
    x, ids, w, gu, dn = ops
    return {
        "custom-op": lambda: custom_op.run(x, ids, w, gu, dn, None, None, SWIGLU, True)[0],
        "direct": lambda: expert_mlp(x, ids, w, gu, dn, backend=backend)[0],
        "eager-default": lambda: expert_mlp(x, ids, w, gu, dn)[0],
    }


def _time(fn, reps: int, backward: bool) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        if backward:
            fn().sum().backward()
        else:
            with torch.no_grad():  # decode: forward only
                fn()
    return (time.perf_counter() - t0) / reps


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 16384])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--shape", default="64,8,1024,384", help="E,K,D,F (default: bench layer's qwen3)"
    )
    args = p.parse_args(argv)
    E, K, D, F = (int(v) for v in args.shape.split(","))
    print(
        f"E={E} K={K} D={D} F={F} float32 {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print("| T | pass | row | ms median | min-max | vs direct |")
    print("|---|---|---|---|---|---|")
    for T in args.tokens:
        ops = _operands(T, D, F, E, K, torch.float32)
        backend = plan_grouped(ops[0], ops[3], ops[4], SWIGLU, None).backend.name
        rows = _rows(ops, backend)
        for backward in (False, True):
            _table(rows, T, backward, args.rounds)


def _table(rows: dict, T: int, backward: bool, rounds: int) -> None:
    warm = [_time(fn, 1, backward) for fn in rows.values() for _ in range(2)]
    reps = max(1, int(0.5 / min(warm)))  # about half a second per timing at least
    times = {name: [] for name in rows}
    for r in range(rounds):
        order = list(rows)[r % len(rows) :] + list(rows)[: r % len(rows)]  # rotate
        for name in order:
            times[name].append(_time(rows[name], reps, backward) * 1e3)
    direct = statistics.median(times["direct"])
    what = "fwd+bwd" if backward else "fwd (no_grad)"
    for name, ts in times.items():
        med = statistics.median(ts)
        print(
            f"| {T} | {what} | {name} | {med:.3f} | {min(ts):.3f}-{max(ts):.3f} | {med / direct:.2f} |"
        )


if __name__ == "__main__":
    main()
