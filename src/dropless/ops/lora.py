"""Low-rank (LoRA) updates of the expert projections, computed beside the base GEMMs:

    y = x_n W_e^T + scale * (x_n A_e^T) B_e^T      A [E, r, in], B [E, out, r]

B_e A_e is never formed: two thin GEMMs per expert, one [n, r] intermediate kept for
backward, no gradient for W. The expert engine calls the per-expert helpers from the loop
and the whole-S ones (`grouped_lowrank_*`) from the grouped path.
"""

# n rows of one expert, S sorted rows, I in features, O out features, R rank, E experts

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .grouped_gemm.backends import GemmBackend


@dataclass(frozen=True)
class LowRank:
    """The low-rank update `scale * B_e @ A_e` of one expert projection.

    a_ERI: [E, r, in]; b_EOR: [E, out, r] (in/out of the projection as it is applied,
    whatever the layout its base weight is stored in)."""

    a_ERI: torch.Tensor
    b_EOR: torch.Tensor
    scale: float

    def __post_init__(self):
        a, b = self.a_ERI, self.b_EOR
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[1] != b.shape[2]:
            raise ValueError(
                f"LowRank needs A [E, r, in] and B [E, out, r] with the same E and r, got "
                f"A {tuple(a.shape)} and B {tuple(b.shape)}"
            )

    @property
    def rank(self) -> int:
        return self.a_ERI.shape[1]

    def delta(self) -> torch.Tensor:
        """scale * B_e @ A_e as [E, out, in] (for references and merging, not the fast path)."""
        return torch.bmm(self.b_EOR, self.a_ERI) * self.scale


def check_lowrank(lr: LowRank | None, e: int, n_in: int, n_out: int, what: str) -> None:
    """Raise ValueError unless `lr` (when given) adapts a projection [e experts, n_in -> n_out]."""
    if lr is None:
        return
    want_a, want_b = (e, lr.rank, n_in), (e, n_out, lr.rank)
    if tuple(lr.a_ERI.shape) != want_a or tuple(lr.b_EOR.shape) != want_b:
        raise ValueError(
            f"the low-rank factors of {what} must be A {want_a} and B {want_b}, got "
            f"A {tuple(lr.a_ERI.shape)} and B {tuple(lr.b_EOR.shape)}"
        )


# --- the fused Functions' trailing inputs ------------------------------------------------


def lowranks(lora: tuple) -> tuple[LowRank | None, LowRank | None]:
    """The Functions' trailing inputs `(a1, b1, a2, b2, (scale1, scale2))` (or nothing) as
    the low-rank updates of gate_up and down."""
    if not lora:
        return None, None
    a1, b1, a2, b2, (s1, s2) = lora
    return (
        LowRank(a1, b1, s1) if a1 is not None else None,
        LowRank(a2, b2, s2) if a2 is not None else None,
    )


def lora_inputs(lora) -> tuple:
    """(gate_up LowRank | None, down LowRank | None) -> the Functions' trailing inputs."""
    if lora is None or (lora[0] is None and lora[1] is None):
        return ()
    lr1, lr2 = lora
    ab = [t for lr in (lr1, lr2) for t in ((lr.a_ERI, lr.b_EOR) if lr else (None, None))]
    return (*ab, (lr1.scale if lr1 else None, lr2.scale if lr2 else None))


# --- one expert (the per-expert loop) -----------------------------------------------


def lowrank_fwd(x_nI, a_RI, b_OR, scale: float, out_nO, u_nR):
    """out += scale * (x A^T) B^T in place; returns u = x A^T, written into u_nR."""
    u = torch.mm(x_nI, a_RI.t(), out=u_nR)
    out_nO.addmm_(u, b_OR.t(), alpha=scale)
    return u


def lowrank_bwd(g_nO, x_nI, u_nR, b_OR, scale: float, ga_RI=None, gb_OR=None):
    """Gradients of one expert's update given g = d loss / d out.

    Writes dB = scale * g^T u into gb_OR and dA = gu^T x into ga_RI (when given) and
    returns gu = scale * g B [n, r]; the input's gradient gets gu @ A added by the caller
    (into the buffer it already fills with g W)."""
    if gb_OR is not None:
        torch.mm(g_nO.t(), u_nR, out=gb_OR).mul_(scale)
    gu = torch.mm(g_nO, b_OR).mul_(scale)
    if ga_RI is not None:
        torch.mm(gu.t(), x_nI, out=ga_RI)
    return gu


# --- whole S (grouped GEMMs) ---------------------------------------------------------


def lowrank_backend(be: GemmBackend, x_SI, lr: LowRank, counts):
    """The backend for the thin GEMMs: `be` when it runs these shapes, else the loop
    (rank-wide operands may miss a backend's alignment); returns (backend, counts)."""
    u_probe = x_SI.new_empty(0, lr.rank)
    if be.supports(x_SI, lr.a_ERI) and be.supports(u_probe, lr.b_EOR):
        return be, counts
    # imported here: `compute_dtype` imports this module, and the grouped-GEMM package
    # imports `compute_dtype` (a module-level import would run them in a loop)
    from .grouped_gemm.backends import pick_gemm_backend

    loop = pick_gemm_backend("loop", x_SI, lr.a_ERI)
    return loop, counts.tolist() if isinstance(counts, torch.Tensor) else counts


def grouped_lowrank_fwd(be: GemmBackend, x_SI, lr: LowRank, counts, out_SO):
    """out += scale * (x A_e^T) B_e^T per group, in place; returns u_SR = x A_e^T."""
    be, counts = lowrank_backend(be, x_SI, lr, counts)
    u_SR = be.mm(x_SI, lr.a_ERI, counts, True)
    out_SO.add_(be.mm(u_SR, lr.b_EOR, counts, True), alpha=lr.scale)
    return u_SR


def grouped_lowrank_bwd(be: GemmBackend, g_SO, x_SI, u_SR, lr: LowRank, counts, need_a, need_b):
    """(gu_SR, dA [E, r, in] or None, dB [E, out, r] or None); gu = scale * g B_e, and the
    input's gradient is gu A_e (`grouped_lowrank_dx`)."""
    be, counts = lowrank_backend(be, x_SI, lr, counts)
    gb = be.wgrad(g_SO, u_SR, counts).mul_(lr.scale) if need_b else None
    gu_SR = be.mm(g_SO, lr.b_EOR, counts, False).mul_(lr.scale)
    ga = be.wgrad(gu_SR, x_SI, counts) if need_a else None
    return gu_SR, ga, gb


def grouped_lowrank_dx(be: GemmBackend, gu_SR, lr: LowRank, counts, out_SI):
    """out += gu A_e per group, in place (the update's share of the input gradient)."""
    be, counts = lowrank_backend(be, out_SI, lr, counts)
    out_SI.add_(be.mm(gu_SR, lr.a_ERI, counts, False))
    return out_SI
