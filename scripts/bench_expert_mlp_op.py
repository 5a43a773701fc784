"""The eager cost of the `dropless::expert_mlp` custom op (what torch.compile and
torch.export run for the routed expert MLP) against the same computation called directly.

Rows, forward (under no_grad, as in decoding) and forward + backward of one routed
expert MLP, back to back within each round, the order alternating:
- `custom-op`: the `dropless::expert_mlp` op and its registered autograd (the backward
  is the second custom op), each calling the engine's forward / backward directly;
- `direct`: eager `ops.expert_mlp`: the same sort and engine schedule (the plan of the
  device: CPU the per-expert loop, elsewhere the grouped path) through the engine's
  autograd Function.
The ratio is the median of the per-round ratios custom-op / direct, with their min-max:
the cost of the custom-op layer; at T=1 (decode) its fixed cost is largest.

    python scripts/bench_expert_mlp_op.py [--tokens 1 16384] [--rounds 5] [--section FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]  # tools/ and the package of this checkout

from tools.bench_sections import provenance  # noqa: E402

from dropless.bench.common import Recorder  # noqa: E402
from dropless.ops import expert_mlp  # noqa: E402
from dropless.ops.expert_mlp.eager import expert_mlp_op  # noqa: E402
from dropless.ops.specs import ActivationConfig  # noqa: E402

SWIGLU = ActivationConfig("swiglu", True, False, 1.702, 7.0)
OP_ACT = (SWIGLU.kind, SWIGLU.gated, SWIGLU.interleaved, float(SWIGLU.alpha), float(SWIGLU.limit))


def _operands(T, D, F, E, K, dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(T, D, generator=g, dtype=dtype).requires_grad_()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g, dtype=dtype).requires_grad_()
    gu = (torch.randn(E, 2 * F, D, generator=g, dtype=dtype) * 0.02).requires_grad_()
    dn = (torch.randn(E, D, F, generator=g, dtype=dtype) * 0.02).requires_grad_()
    return x, ids, w, gu, dn


def _rows(ops):
    x, ids, w, gu, dn = ops
    return {
        # keep_h: what a compiled graph passes (no h kept in a call that records no backward)
        "custom-op": lambda: expert_mlp_op(
            x, ids, w, gu, dn, None, None, *OP_ACT, True, torch.is_grad_enabled()
        )[0],
        "direct": lambda: expert_mlp(x, ids, w, gu, dn)[0],
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
    p.add_argument("--section", type=Path, default=None, help="also write the markdown here")
    args = p.parse_args(argv)
    rec = Recorder.start(argparse.Namespace(no_history=True))
    E, K, D, F = (int(v) for v in args.shape.split(","))
    lines = [
        f"E={E} K={K} D={D} F={F}, float32 on {torch.get_num_threads()} torch threads:",
        "",
        "| T | pass | custom-op ms | direct ms | ratio (median of rounds) | min-max |",
        "|---|---|---|---|---|---|",
    ]
    print("\n".join(lines), flush=True)
    for T in args.tokens:
        rows = _rows(_operands(T, D, F, E, K, torch.float32))
        for backward in (False, True):
            lines += _table(rows, T, backward, args.rounds)
    record = rec.finish("expert_mlp_op", {"table": lines})
    if args.section:
        head = [
            "## The expert MLP as a custom op, eager (`scripts/bench_expert_mlp_op.py`)",
            "",
            provenance(record),
            "",
            __doc__.split("\n\n")[1],
            "",
        ]
        args.section.write_text("\n".join(head + lines) + "\n")


def _table(rows: dict, T: int, backward: bool, rounds: int) -> list[str]:
    warm = [_time(fn, 1, backward) for fn in rows.values() for _ in range(2)]
    reps = max(1, int(0.5 / min(warm)))  # about half a second per timing at least
    times = {name: [] for name in rows}
    for r in range(rounds):
        order = list(rows) if r % 2 == 0 else list(rows)[::-1]  # alternate who goes first
        for name in order:
            times[name].append(_time(rows[name], reps, backward) * 1e3)
    ratios = [a / b for a, b in zip(times["custom-op"], times["direct"])]
    what = "fwd+bwd" if backward else "fwd (no_grad)"
    op, direct = (statistics.median(times[n]) for n in ("custom-op", "direct"))
    line = (
        f"| {T} | {what} | {op:.3f} | {direct:.3f} | {statistics.median(ratios):.3f} | "
        f"{min(ratios):.3f}-{max(ratios):.3f} |"
    )
    print(line, flush=True)
    return [line]


if __name__ == "__main__":
    main()
