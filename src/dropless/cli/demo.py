"""`dropless demo`: run one MoE layer forward and backward on random data and report."""

from __future__ import annotations

import argparse
import time


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=512, help="tokens T (default 512)")
    p.add_argument("--hidden", type=int, default=256, help="model dim D (default 256)")
    p.add_argument("--ffn", type=int, default=128, help="expert hidden dim F (default 128)")
    p.add_argument("--experts", type=int, default=16, help="experts E (default 16)")
    p.add_argument("--top-k", type=int, default=4, help="experts per token K (default 4)")
    p.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    import torch

    from ..nn import MoE

    torch.manual_seed(args.seed)
    moe = MoE(args.hidden, args.ffn, args.experts, args.top_k)
    x = torch.randn(args.tokens, args.hidden, requires_grad=True)
    t0 = time.perf_counter()
    out, aux = moe(x)
    (out.square().mean() + 0.01 * aux.lb_loss).backward()
    ms = (time.perf_counter() - t0) * 1e3
    counts = aux.tokens_per_expert.tolist()
    print(
        f"MoE layer: T={args.tokens} D={args.hidden} F={args.ffn} E={args.experts} K={args.top_k}"
    )
    print(f"forward+backward: {ms:.1f} ms on {x.device.type}, output {tuple(out.shape)}")
    print(f"pairs computed: {sum(counts)} of {args.tokens * args.top_k}, dropped: {aux.dropped}")
    print(
        f"tokens per expert: min {min(counts)}, max {max(counts)}, mean {sum(counts) / len(counts):.1f}"
    )
    print(
        f"load-balancing loss {aux.lb_loss.item():.4f} (K={args.top_k} when perfectly balanced), z-loss {aux.z_loss.item():.3f}"
    )
    print(f"grad norm of the expert weights: {moe.experts.gate_up_proj.grad.norm():.4f}")
    return 0
