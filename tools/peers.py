"""The other libraries a user would pick instead, as rows of `dropless bench layer` and
`dropless bench e2e` run from a checkout (not in the wheel; `bench.common.from_checkout`): Liger-Kernel (its fused MoE experts; its fused linear cross-entropy
and RMSNorm), Apple's Cut Cross-Entropy, and torchao's FP8 row-wise grouped GEMM for MoE
training. None of them is a dependency of dropless: a row runs only when its package
imports (and, for the CUDA-only ones, on a CUDA device); otherwise the bench reports it
as "not installed" or "needs CUDA", naming the version it looked for, and times the rest.

Each row gets the same inputs, weights and routes as every other row of its bench.
SonicMoE is no row: it pins torch <= 2.9.1 and needs a 74 MB CUTLASS DSL wheel, so it
cannot be carried to the GPU machine; BENCHMARKS.md quotes its published figures.
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, M = T*K rows,
# P padded rows (each expert's rows rounded up to a multiple of 16)

from __future__ import annotations

import importlib
import importlib.metadata
import os
import subprocess
import sys
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Peer:
    package: str  # its name on the package index
    module: str  # what `import` takes
    wanted: str  # the release the GPU run carries (see BENCHMARKS.md, "Peers")
    needs_cuda: bool  # its kernels are Triton/CUDA only


PEERS = {
    "liger": Peer("liger-kernel", "liger_kernel", "0.8.5", needs_cuda=True),
    "cce": Peer("cut-cross-entropy", "cut_cross_entropy", "25.1.1", needs_cuda=True),
    "torchao": Peer("torchao", "torchao", "0.18.0", needs_cuda=True),
}
# the GPU machine the wheels are carried to: its Python and the platforms its pip accepts
GPU_PYTHON = "3.12"
PLATFORMS = (
    "manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64", "manylinux2014_x86_64", "any",
)  # fmt: skip
# row name -> peer, for each bench
LAYER_ROWS = {"liger-moe": "liger", "torchao-fp8-row": "torchao"}
E2E_ROWS = {"liger": "liger", "liger-moe": "liger", "cce": "cce"}


def installed_version(peer: Peer) -> str | None:
    try:
        return importlib.metadata.version(peer.package)
    except importlib.metadata.PackageNotFoundError:
        return None


def row_status(row: str, device: str) -> dict:
    """{package, wanted, version, ok, status} for a peer row on `device`: ok when its
    package imports and the device is one it runs on."""
    peer = PEERS[{**LAYER_ROWS, **E2E_ROWS}[row]]
    out = {"package": peer.package, "wanted": peer.wanted, "version": installed_version(peer)}
    # Liger's fused MoE autotunes ~200 kernel variants at its first call (minutes of
    # compiling, past the GPU check's budget); its own switch, read when it is imported,
    # pins one config per kernel. Set in this process's environment, so the e2e children
    # inherit it; an explicit LIGER_FUSED_MOE_AUTOTUNE=1 keeps the autotuning.
    os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")
    try:
        importlib.import_module(peer.module)
    except ImportError as e:
        what = "not installed" if out["version"] is None else f"does not import ({e})"
        return out | {"ok": False, "status": f"{what}: looked for {peer.package} {peer.wanted}"}
    if peer.needs_cuda and device != "cuda":
        return out | {"ok": False, "status": f"needs CUDA ({peer.package} {out['version']})"}
    return out | {"ok": True, "status": "ok"}


# --- layer rows -----------------------------------------------------------------------------


def liger_moe(x_TD, ids_TK, w_TK, gate_up, down):
    """Liger-Kernel's fused MoE experts (Triton: gather + gate/up GEMM + SwiGLU, down GEMM,
    weighted combine), on the HF v5 weight layout it shares with dropless; one kernel
    config each unless LIGER_FUSED_MOE_AUTOTUNE=1 (see `row_status`)."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    return LigerFusedMoEFunction.apply(x_TD, gate_up, down, ids_TK.to(torch.int32), w_TK)


def padded_sort(ids_TK: torch.Tensor, num_experts: int, align: int = 16):
    """Pairs sorted by expert, each expert's rows padded to a multiple of `align` (what
    torchao's FP8 grouped GEMM takes), without a host sync: -> (order_M, dest_M, offs_E,
    P). Pair order_M[i] lands on padded row dest_M[i]; offs_E are the groups' padded ends;
    P = M + E*(align-1) rows bound every routing (rows past offs_E[-1] are never read)."""
    flat_M = ids_TK.reshape(-1)
    M = flat_M.numel()
    order_M = torch.argsort(flat_M, stable=True)
    counts_E = torch.bincount(flat_M, minlength=num_experts)
    padded_E = (counts_E + align - 1) // align * align
    start_E = counts_E.cumsum(0) - counts_E
    pad_end_E = padded_E.cumsum(0)
    e_M = flat_M.index_select(0, order_M)
    rank_M = torch.arange(M, device=flat_M.device) - start_E.index_select(0, e_M)
    dest_M = (pad_end_E - padded_E).index_select(0, e_M) + rank_M
    return order_M, dest_M, pad_end_E.to(torch.int32), M + num_experts * (align - 1)


def padded_grouped_mlp(x_TD, ids_TK, w_TK, gate_up, down, gemm):
    """The experts' SwiGLU MLP over expert-padded rows with `gemm(a_PK, w_t_EKN, offs_E)`
    for both projections (torchao's FP8 row-wise grouped GEMM on the GPU row)."""
    E, F, K = gate_up.shape[0], gate_up.shape[1] // 2, ids_TK.shape[1]
    order_M, dest_M, offs_E, P = padded_sort(ids_TK, E)
    tok_M = order_M // K
    x_PD = x_TD.new_zeros(P, x_TD.shape[1]).index_copy(0, dest_M, x_TD.index_select(0, tok_M))
    h_P2F = gemm(x_PD, gate_up.transpose(1, 2), offs_E)
    a_PF = torch.nn.functional.silu(h_P2F[:, :F]) * h_P2F[:, F:]
    y_PD = gemm(a_PF, down.transpose(1, 2), offs_E)
    y_MD = y_PD.index_select(0, dest_M) * w_TK.reshape(-1).index_select(0, order_M).unsqueeze(1)
    return torch.zeros_like(x_TD).index_add(0, tok_M, y_MD)


def _torchao_fp8_gemm(a, w_t, offs):
    from torchao.prototype.moe_training.fp8_grouped_mm import (
        _to_fp8_rowwise_then_scaled_grouped_mm,
    )

    # the rows are padded here already: torchao's own padding is not supported in 0.18
    return _to_fp8_rowwise_then_scaled_grouped_mm(
        a, w_t, offs, out_dtype=a.dtype, pad_token_groups_for_grouped_mm=False
    )


def torchao_fp8_row(x_TD, ids_TK, w_TK, gate_up, down):
    """torchao's FP8 row-wise grouped GEMM training op (E4M3, power-of-two row scales,
    `torch._scaled_grouped_mm`) for both expert projections, forward and backward."""
    return padded_grouped_mlp(x_TD, ids_TK, w_TK, gate_up, down, _torchao_fp8_gemm)


LAYER_PATHS = {"liger-moe": liger_moe, "torchao-fp8-row": torchao_fp8_row}


# --- e2e rows (a stock Transformers model, the peer applied to it) ------------------------


def apply_e2e(row: str, model) -> None:
    """Put the peer into a stock Qwen3-MoE causal LM (experts on `grouped_mm`)."""
    if row in ("liger", "liger-moe"):
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

        # what the row names: RMSNorm + fused linear cross-entropy (+ its MoE experts)
        apply_liger_kernel_to_qwen3_moe(
            rope=False, rms_norm=True, fused_linear_cross_entropy=True,
            swiglu=row == "liger-moe", model=model,
        )  # fmt: skip
    elif row == "cce":
        model.forward = _cce_forward(model)
    else:
        raise ValueError(f"no e2e peer row {row!r}; rows: {sorted(E2E_ROWS)}")


def _cce_forward(model, linear_cross_entropy=None):
    """The model's loss with Cut Cross-Entropy's `linear_cross_entropy(hidden, weight,
    labels, shift=True)` on the final hidden states (shifted as Transformers' causal-LM
    loss), plus the router auxiliary loss as the stock forward adds it. Cut Cross-Entropy
    25.1.1 ships no Qwen3-MoE patch."""
    from types import SimpleNamespace

    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    if linear_cross_entropy is None:
        from cut_cross_entropy import linear_cross_entropy

    cfg = model.config

    def forward(input_ids, labels, **kwargs):
        aux = bool(cfg.output_router_logits)
        out = model.model(input_ids=input_ids, output_router_logits=aux)
        loss = linear_cross_entropy(out.last_hidden_state, model.lm_head.weight, labels, shift=True)
        if aux:
            lb = load_balancing_loss_func(
                out.router_logits, cfg.num_experts, cfg.num_experts_per_tok
            )
            loss = loss + cfg.router_aux_loss_coef * lb.to(loss.device)
        return SimpleNamespace(loss=loss, logits=None)

    return forward


# --- carrying the wheels -------------------------------------------------------------------


def download_command(dest: str) -> list[str]:
    """`pip download` of each peer's pinned wheel for the GPU machine, no dependencies
    (each needs only torch and triton, which are there): ~4.3 MiB in all."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["--python-version", GPU_PYTHON, "--implementation", "cp", "-d", dest]
    for plat in PLATFORMS:
        cmd += ["--platform", plat]
    return cmd + [f"{p.package}=={p.wanted}" for p in PEERS.values()]


if __name__ == "__main__":  # python -m tools.peers download DIR
    if len(sys.argv) != 3 or sys.argv[1] != "download":
        sys.exit("usage: python -m tools.peers download DIR")
    sys.exit(subprocess.call(download_command(sys.argv[2])))
