"""The "gathered" expert-MLP path: six GEMMs, each either a kernel that gathers its rows
(and fuses the activation) or the unfused composition around a grouped-GEMM backend,
chosen per GEMM (`mlp_plan` asks `gemm_tuning`), and one backward schedule for both.

The six GEMMs of a layer (names are the keys of `GatheredGemms.choice`):

- "up":          h = x[token] @ gate_up^T, a = act(h) * prob (fused: gather in the
                 prologue, activation in the epilogue; unfused: gather_rows + mm + act);
- "down":        y = a @ down^T (a plain grouped GEMM; the combine follows);
- "down_dgrad":  da = dy[token] @ down, dh = d act(da), d prob, a recomputed (fused:
                 gather + activation backward in the epilogue);
- "down_wgrad":  d down = dy[token]^T a;  "up_wgrad": d gate_up = dh^T x[token]
                 (fused: the gathered rows read inside the K loop);
- "up_dgrad":    dx = dh @ gate_up (a plain grouped GEMM; the combine follows).

A fused implementation ("gathered", `gather_gemm_kernels.py`) registers here from
`gpu.py` on the first pick for CUDA operands (`register_gather_kernels`); the unfused one is named after the backend it runs on.

Saved for backward: x (the caller's), the prob, the indices and h [S, 2F], as
`fused_mlp`'s Functions. The backward schedule frees h once the activation backward has
read it (before any weight gradient runs) and the recomputed a once the down weight
gradient has read it, when the backward frees the graph as it goes (no retain_graph).
Gated experts without biases and without low-rank updates only (the plan keeps the
grouped path for the others; forcing path="gathered" for them raises).
"""

# T tokens, D model dim, F expert hidden dim, E experts, K top-k, S sorted pairs

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..compute_dtype import autocast_off
from ..grouped_gemm.backends import GemmBackend
from ..grouped_gemm.eager import bind_offsets, group_offsets
from ..permute.row_ops import EAGER, RowOps
from ..registry import Registry
from ..specs import ActivationConfig
from .expert_threads import python_modes_active
from .gemm_tuning import shape_key
from .loop_mlp import free_storage, graph_released
from .mlp_parts import Needs

GEMMS = ("up", "down", "down_dgrad", "down_wgrad", "up_wgrad", "up_dgrad")
FUSED = "gathered"  # the implementation name of the fused kernels in a choice


@dataclass(frozen=True)
class GatherKernels:
    """Raw kernels that gather their rows (see `gather_gemm_kernels.py`):
    up_act(x, index_S, gate_up, counts, prob_S, trans_w, interleaved, kind, alpha,
    limit) -> (h, a); down_dact(g, index_S, down, counts, h, prob_S, trans_w,
    interleaved, need_prob_grad, recompute, kind, alpha, limit) -> (dh, d prob, a);
    wgrad(a, b, counts, index_a, index_b) -> [E, M, N]. supports(x, w): whether they
    run these operands; kinds: the activation kinds the epilogues compute."""

    up_act: Callable
    down_dact: Callable
    wgrad: Callable
    supports: Callable[[torch.Tensor, torch.Tensor], bool]
    kinds: tuple[str, ...]
    name: str = "triton"
    priority: int = 10


GATHER_KERNELS = Registry("row-gathering GEMMs")


def register_gather_kernels(kernels: GatherKernels) -> None:
    """Register the fused kernels (replaces an earlier registration)."""
    GATHER_KERNELS.entries.clear()
    GATHER_KERNELS.register(kernels)


def gather_kernels(x: torch.Tensor, act: ActivationConfig, *weights) -> GatherKernels | None:
    """The registered fused kernels if they run these operands and activation, else None."""

    def runs(k: GatherKernels) -> bool:
        return act.gated and act.kind in k.kinds and all(k.supports(x, w) for w in weights)

    return GATHER_KERNELS.pick(None, x, *weights, runs=runs)


@dataclass(frozen=True)
class GatheredGemms:
    """The six GEMMs of one plan (signatures in `_fused` / `_unfused`); choice: (GEMM
    name, implementation name) pairs, in `GEMMS` order; row_ops: the combines' gathers.
    Each GEMM takes the groups' end offsets as a last argument `offs` (None: computed by the
    backend); offsets: whether some unfused GEMM's backend reads them."""

    up: Callable
    down: Callable
    down_dgrad: Callable
    down_wgrad: Callable
    up_wgrad: Callable
    up_dgrad: Callable
    choice: tuple[tuple[str, str], ...]
    row_ops: RowOps
    device_counts: bool
    offsets: bool = False

    def describe(self) -> str:
        return " ".join(f"{g}={impl}" for g, impl in self.choice)


def _fused(k: GatherKernels) -> dict[str, Callable]:
    # the kernels find each tile's group from the counts: `offs` is not read
    def up(x, idx, gate_up, counts, prob, act, trans_w, offs=None):
        return k.up_act(x, idx, gate_up, counts, prob, trans_w, act.interleaved, act.kind,
                        act.alpha, act.limit)  # fmt: skip

    def down_dgrad(g, idx, down, counts, h, prob, act, trans_w, need_gp, recompute, offs=None):
        return k.down_dact(g, idx, down, counts, h, prob, trans_w, act.interleaved, need_gp,
                           recompute, act.kind, act.alpha, act.limit)  # fmt: skip

    def down_wgrad(g, idx, a, counts, trans_w, offs=None):
        return k.wgrad(g, a, counts, idx, None) if trans_w else k.wgrad(a, g, counts, None, idx)

    def up_wgrad(dh, x, idx, counts, trans_w, offs=None):
        return k.wgrad(dh, x, counts, None, idx) if trans_w else k.wgrad(x, dh, counts, idx, None)

    return dict(up=up, down_dgrad=down_dgrad, down_wgrad=down_wgrad, up_wgrad=up_wgrad)


def _unfused(be: GemmBackend, rk: RowOps, act_rk: RowOps | None) -> dict[str, Callable]:
    """The same six GEMMs as separate passes: gather_rows, the backend's GEMM, the row
    ops' activation (the eager math for kinds they lack)."""
    ak = act_rk or EAGER

    def rows(t, idx):
        return rk.gather_rows(t, idx) if idx is not None else t

    def gemm(offs):
        return be if offs is None else bind_offsets(be, None, offs)

    def up(x, idx, gate_up, counts, prob, act, trans_w, offs=None):
        h = gemm(offs).mm(rows(x, idx), gate_up, counts, trans_w)
        return h, ak.act_fwd(h, prob, act.interleaved, act.kind, act.alpha, act.limit)

    def down_dgrad(g, idx, down, counts, h, prob, act, trans_w, need_gp, recompute, offs=None):
        da = gemm(offs).mm(rows(g, idx), down, counts, not trans_w)
        return ak.act_bwd(da, h, prob, act.interleaved, need_gp, recompute, act.kind,
                          act.alpha, act.limit)  # fmt: skip

    def down_wgrad(g, idx, a, counts, trans_w, offs=None):
        gy, b = rows(g, idx), gemm(offs)
        return b.wgrad(gy, a, counts) if trans_w else b.wgrad(a, gy, counts)

    def up_wgrad(dh, x, idx, counts, trans_w, offs=None):
        xs, b = rows(x, idx), gemm(offs)
        return b.wgrad(dh, xs, counts) if trans_w else b.wgrad(xs, dh, counts)

    def mm(a, w, counts, trans, offs=None):
        return gemm(offs).mm(a, w, counts, trans)

    return dict(up=up, down=mm, down_dgrad=down_dgrad, down_wgrad=down_wgrad,
                up_wgrad=up_wgrad, up_dgrad=mm)  # fmt: skip


def gathered_gemms(
    choice: dict[str, str],
    kernels: GatherKernels | None,
    backends: dict[str, GemmBackend],
    row_ops: RowOps,
    act_row_ops: RowOps | None,
) -> GatheredGemms:
    """The six GEMMs for `choice` ({GEMM: "gathered" or a backend name in `backends`})."""
    impls = {name: _unfused(be, row_ops, act_row_ops) for name, be in backends.items()}
    if kernels is not None:
        impls[FUSED] = _fused(kernels)
    picked = {}
    for g in GEMMS:
        name = choice[g]
        if name not in impls or g not in impls[name]:
            raise ValueError(f"GEMM {g!r}: no implementation {name!r}; have {sorted(impls)}")
        picked[g] = impls[name][g]
    unfused = [backends[n] for n in choice.values() if n != FUSED]
    dev, offs = all(b.device_counts for b in unfused), any(b.offsets for b in unfused)
    order = tuple((g, choice[g]) for g in GEMMS)
    return GatheredGemms(
        **picked, choice=order, row_ops=row_ops, device_counts=dev, offsets=offs
    )  # fmt: skip


# --- the autograd Function ------------------------------------------------------------


class _GatheredMLP(torch.autograd.Function):
    """fused_mlp's contract without biases or low-rank updates; `gemms` a GatheredGemms.
    token_S None: x is already sorted (x_SD) and the result is y_SD."""

    @staticmethod
    @autocast_off
    def forward(ctx, x, prob_S, gate_up, down, token_S, slot_TK, counts, offs, act, trans_w, gemms):  # fmt: skip
        if offs is None and gemms.offsets:  # one offsets tensor for all six GEMMs
            offs = group_offsets(counts, x.device)
        h, a = gemms.up(x, token_S, gate_up, counts, prob_S, act, trans_w, offs)
        y = gemms.down(a, down, counts, trans_w, offs)
        del a  # recomputed by the activation backward
        out = gemms.row_ops.gather_sum(y, slot_TK) if token_S is not None else y
        ctx.save_for_backward(x, prob_S, gate_up, down, token_S, slot_TK, h)
        ctx.counts, ctx.act, ctx.trans_w, ctx.gemms = counts, act, trans_w, gemms
        ctx.offs = offs
        return out

    @staticmethod
    @autocast_off
    def backward(ctx, g_out):
        x, prob_S, gate_up, down, token_S, slot_TK, h = ctx.saved_tensors
        need = Needs(*ctx.needs_input_grad[:4], gate_up_bias=False, down_bias=False)
        grads = backward_schedule(
            ctx.gemms, g_out.contiguous(), x, prob_S, gate_up, down, token_S, slot_TK, h,
            ctx.counts, ctx.act, ctx.trans_w, need, ctx.offs,
        )  # fmt: skip
        return (*grads, None, None, None, None, None, None, None)


def backward_schedule(G, g, x, prob_S, gate_up, down, token_S, slot_TK, h, counts, act,
                      trans_w, need, offs=None):  # fmt: skip
    """(dx, d prob, d gate_up, d down). Each of h and the recomputed a is freed right
    after its last reader (the activation backward; the down weight gradient), so
    neither is alive while the gate/up weight gradient and dx run."""
    compiling = torch.compiler.is_compiling()  # storage calls would break the graph
    release = not compiling and graph_released() and not python_modes_active()
    need_gp = prob_S is not None and need.prob
    dh, gp, a = G.down_dgrad(g, token_S, down, counts, h, prob_S, act, trans_w, need_gp,
                             need.down, offs)  # fmt: skip
    if release:
        free_storage(h)  # its storage is this Function's own (written by the "up" GEMM)
    del h
    gd = G.down_wgrad(g, token_S, a, counts, trans_w, offs) if need.down else None
    if release and a is not None:
        free_storage(a)
    del a
    ggu = G.up_wgrad(dh, x, token_S, counts, trans_w, offs) if need.gate_up else None
    gx = None
    if need.x:
        dx = G.up_dgrad(dh, gate_up, counts, not trans_w, offs)
        del dh
        gx = G.row_ops.gather_sum(dx, slot_TK) if token_S is not None else dx
    return gx, gp, ggu, gd


def gathered_mlp(x, prob_S, gate_up, down, counts, token_S, slot_TK, act, trans_w, gemms,
                 offsets_E=None):  # fmt: skip
    """Run the gathered Function (internal: `fused_mlp` calls it for a "gathered" plan).
    offsets_E: the counts' int32 end offsets (the sort's), or None."""
    if isinstance(counts, torch.Tensor) and not gemms.device_counts:
        counts = counts.tolist()
    elif gemms.device_counts and not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, device=x.device)
    return _GatheredMLP.apply(
        x, prob_S, gate_up, down, token_S, slot_TK, counts, offsets_E, act, bool(trans_w), gemms
    )


# --- the per-GEMM choice (tuned once per shape on CUDA) --------------------------------


def _tuning_inputs(x, gate_up, down, rows: int, trans_w: bool):
    """Stand-in operands at the layer's shape: balanced counts, random tokens and probs."""
    E, dev = gate_up.shape[0], x.device
    D, F = (down.shape[1], down.shape[2]) if trans_w else (down.shape[2], down.shape[1])
    base, extra = divmod(rows, E)
    counts = torch.full((E,), base, device=dev, dtype=torch.int64)
    counts[:extra] += 1
    gen = torch.Generator(device=dev).manual_seed(0)
    idx = torch.randint(0, x.shape[0], (rows,), device=dev, generator=gen)
    prob = torch.rand(rows, device=dev, dtype=x.dtype, generator=gen)
    g = torch.randn(x.shape, device=dev, dtype=x.dtype, generator=gen)
    h = torch.randn(rows, 2 * F, device=dev, dtype=x.dtype, generator=gen)
    a = torch.randn(rows, F, device=dev, dtype=x.dtype, generator=gen)
    return counts, idx, prob, g, h, a, D, F


@torch.no_grad()
def tune_gathered(x, gate_up, down, act, trans_w, rows, kernels, backends, row_ops,
                  act_row_ops, tuner, timing: bool = True) -> dict[str, str | None]:  # fmt: skip
    """{GEMM: implementation} timed by `tuner` (a `gemm_tuning.GemmTuner`) among the
    fused kernels and the unfused form on each of `backends` (device-count backends).
    No autograd graph is built (the weights may require grad). timing=False: only the
    cached picks (None where there is none)."""
    if timing:
        cnt, idx, p, g, h, a, D, F = _tuning_inputs(x, gate_up, down, rows, trans_w)
    else:  # nothing runs: no stand-in operands
        D, F = (down.shape[1], down.shape[2]) if trans_w else (down.shape[2], down.shape[1])
        cnt = idx = p = g = h = a = None
    impls = {name: _unfused(be, row_ops, act_row_ops) for name, be in backends.items()}
    if kernels is not None:
        impls[FUSED] = _fused(kernels)
    args = {
        "up": (x, idx, gate_up, cnt, p, act, trans_w),
        "down": (a, down, cnt, trans_w),
        "down_dgrad": (g, idx, down, cnt, h, p, act, trans_w, True, True),
        "down_wgrad": (g, idx, a, cnt, trans_w),
        "up_wgrad": (h, x, idx, cnt, trans_w),
        "up_dgrad": (h, gate_up, cnt, not trans_w),
    }
    choice = {}
    for gemm in GEMMS:
        cands = {
            name: (lambda f=fns[gemm], a=args[gemm]: f(*a)) for name, fns in impls.items() if gemm in fns
        }  # fmt: skip
        key = shape_key(gemm, x.dtype, gate_up.shape[0], rows, D, F, trans_w, act.kind)
        choice[gemm] = tuner.choose(key, cands) if timing else tuner.lookup(key, cands)
    return choice
