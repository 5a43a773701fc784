"""Memory-lean expert MLP: permute -> gate/up GEMM -> SwiGLU x prob -> down GEMM ->
combine as ONE autograd Function that owns its backward.

Saved for backward, per kept (token, expert) pair (S of them): the gate/up output
h [2F] in the activation dtype, the routing prob (one value) and two int64 indices
(token, pair). Plus x_TD, which the caller holds anyway, and nothing else: the
gathered input x[token_S] and the SwiGLU output are recomputed in backward, and the
expert outputs are never kept. The composed path (`grouped_gemm` + `swiglu` +
`unpermute` autograd nodes) keeps x_SD [D], h [2F], the activation [F] and y [D] per
pair: at D=1024, F=384 that is 2816 values per pair against 768 here (3.7x less).

Two implementations of the same Function, picked by `pick_mlp_path`:

- `_LoopMLP` (the CPU default): one pass per expert that gathers that expert's rows
  into a small buffer, runs both GEMMs with `torch.mm(out=)`, applies SwiGLU x prob in
  place and `index_add_`s the result into the output (an expert sees a token at most
  once, and experts are visited in order, so the sum is deterministic). Backward does
  the same per expert and writes the weight gradients straight into preallocated
  [E, ...] tensors. The working set of one expert stays in cache, and no [S, D]
  tensor is ever allocated. Needs the per-expert counts on the host (one sync per
  layer, in `sort_by_expert`). Runs any dtype, fp64 included.
- `_GroupedMLP`: whole-S gathers and grouped GEMMs through a registered backend
  (`grouped_mm`, `triton`, ...), with the same saved tensors. Given the counts as a
  device tensor and the `grouped_mm` backend (offsets computed on the device), it
  never syncs with the host: the path used on CUDA and under `torch.compile`.

Both handle biases (the down bias is scaled by the prob), `activation="gpt_oss"`,
interleaved gate/up, `trans_w=False` and dropped pairs (capacity mode: the caller's
SortedPairs leave them out). Low-precision recipes never come here (see expert_mlp.py).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted (kept) pairs

from __future__ import annotations

import torch

from .dispatch import pick_gemm_backend
from .loop_mlp import _LoopMLP
from .mlp_parts import _act_bwd, _act_fwd, _act_parts
from .permute import gather_sum
from .specs import ActivationConfig, as_activation
from .swiglu import check_supported

# --- whole-S grouped GEMMs through a backend (sync-free with device counts) ----------


def _expert_of_row(counts_E: torch.Tensor, S: int) -> torch.Tensor:
    """The expert of each sorted row, without a host sync (output_size is known)."""
    return torch.repeat_interleave(
        torch.arange(counts_E.numel(), device=counts_E.device), counts_E, output_size=S
    )


class _GroupedMLP(torch.autograd.Function):
    """Same contract as _LoopMLP; counts is a host list or a device tensor."""

    @staticmethod
    def forward(
        ctx, x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, counts, cfg, backend
    ):
        act, trans_w, num_out = cfg
        be = pick_gemm_backend(backend, x, gate_up)
        if isinstance(counts, torch.Tensor) and be.name != "grouped_mm":
            counts = counts.tolist()  # only grouped_mm takes device offsets
        x_SD = x.index_select(0, token_S) if token_S is not None else x
        S = x_SD.shape[0]
        rows_E = None
        if gu_bias is not None or d_bias is not None:
            counts_E = (
                counts
                if isinstance(counts, torch.Tensor)
                else torch.tensor(counts, device=x.device)
            )
            rows_E = _expert_of_row(counts_E, S)
        h = be.mm(x_SD, gate_up, counts, trans_w)
        del x_SD  # recomputed in backward
        if gu_bias is not None:
            h += gu_bias.index_select(0, rows_E)
        a = _act_fwd(h, prob_S, act)
        y = be.mm(a, down, counts, trans_w)
        del a
        if d_bias is not None:
            b_SD = d_bias.index_select(0, rows_E)
            y += b_SD if prob_S is None else b_SD * prob_S.unsqueeze(1)
        out = gather_sum(y, slot_TK) if token_S is not None else y
        ctx.save_for_backward(
            x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E
        )
        ctx.counts, ctx.cfg, ctx.be = counts, cfg, be
        return out

    @staticmethod
    def backward(ctx, g_out):
        x, prob_S, gate_up, down, gu_bias, d_bias, token_S, slot_TK, h, rows_E = ctx.saved_tensors
        act, trans_w, _ = ctx.cfg
        be, counts, need = ctx.be, ctx.counts, ctx.needs_input_grad
        E = gate_up.shape[0]
        g_out = g_out.contiguous()
        gy = g_out.index_select(0, token_S) if token_S is not None else g_out
        p = None if prob_S is None else prob_S.unsqueeze(1)
        a0, d_gate, d_up = _act_parts(h, act)
        gx = gp = ggu = gd = ggb = gdb = None
        if need[3]:
            ap = a0 if p is None else a0 * p
            gd = be.wgrad(gy, ap, counts) if trans_w else be.wgrad(ap, gy, counts)
            del ap
        if d_bias is not None and need[5]:
            gdb = d_bias.new_zeros(d_bias.shape).index_add_(0, rows_E, gy if p is None else gy * p)
        da = be.mm(gy, down, counts, not trans_w)
        if p is not None and need[1]:
            gp = (da * a0).sum(1)
            if d_bias is not None:
                gp += (gy * d_bias.index_select(0, rows_E)).sum(1)
        del a0
        if p is not None:
            da.mul_(p)
        dh = _act_bwd(da, d_gate, d_up, act.interleaved, torch.empty_like(h))
        del da, d_gate, d_up
        if gu_bias is not None and need[4]:
            ggb = gu_bias.new_zeros(gu_bias.shape).index_add_(0, rows_E, dh)
        if need[2]:
            x_SD = x.index_select(0, token_S) if token_S is not None else x
            ggu = be.wgrad(dh, x_SD, counts) if trans_w else be.wgrad(x_SD, dh, counts)
            del x_SD
        if need[0]:
            dx = be.mm(dh, gate_up, counts, not trans_w)
            gx = gather_sum(dx, slot_TK) if token_S is not None else dx
        if gd is not None and gd.shape[0] != E:  # pragma: no cover - backend contract
            raise AssertionError("wgrad returned the wrong number of groups")
        return gx, gp, ggu, gd, ggb, gdb, None, None, None, None, None


# --- entry point ----------------------------------------------------------------------

PATHS = ("loop", "grouped")


def pick_mlp_path(x: torch.Tensor, w: torch.Tensor, backend: str | None) -> str | None:
    """Which fused path runs these operands: "loop", "grouped", or None (composed path).

    auto: the per-expert loop on CPU (measured fastest there, see docs/performance.md),
    the grouped GEMM path elsewhere. backend="loop" forces the loop, "grouped_mm" the
    grouped path; other backends (e.g. "triton") use the grouped path with that backend.
    """
    if backend == "loop":
        return "loop"
    if backend in (None, "auto"):
        if x.device.type == "cpu" and not torch.compiler.is_compiling():
            return "loop"
        return "grouped"
    return "grouped"


def fused_mlp(
    x: torch.Tensor,
    prob_S: torch.Tensor | None,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    counts,
    *,
    token_S: torch.Tensor | None = None,
    slot_TK: torch.Tensor | None = None,
    num_out: int | None = None,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ActivationConfig | str | None = None,
    interleaved: bool | None = None,
    trans_w: bool = True,
    alpha: float | None = None,
    limit: float | None = None,
    path: str = "loop",
    backend: str | None = None,
) -> torch.Tensor:
    """The fused expert MLP (internal; callers use `expert_mlp` / `grouped_mlp`).

    With token_S/slot_TK (from SortedPairs), x is x_TD and the result is the combined
    out [num_out, D]; without, x is x_SD (sorted rows) and the result is y_SD.
    counts: host list (required by path "loop") or device tensor (path "grouped").
    `activation`: an ActivationConfig, or a kind name with interleaved/alpha/limit.
    """
    if prob_S is not None:
        prob_S = prob_S.to(x.dtype)
    act = check_supported(
        as_activation(activation, interleaved=interleaved, alpha=alpha, limit=limit)
    )
    cfg = (act, bool(trans_w), num_out)
    if path == "loop":
        if isinstance(counts, torch.Tensor):
            counts = counts.tolist()  # host sync: the loop needs the bounds on the host
        return _LoopMLP.apply(
            x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, list(counts), cfg
        )
    be = None if backend in (None, "auto", "loop") else backend
    return _GroupedMLP.apply(
        x, prob_S, gate_up, down, gate_up_bias, down_bias, token_S, slot_TK, counts, cfg, be
    )
