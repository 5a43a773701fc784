"""The grouped GEMMs that gather their rows and fuse the activation
(`gather_gemm_kernels.py`) as the "triton" `GatherKernels` of the "gathered" expert path,
registered by `register_gpu` on the first pick for CUDA operands. Building them imports
no triton: the kernel module loads on the first call."""

from __future__ import annotations

from ..grouped_gemm.gpu import supports_triton_gemm
from ..registry import lazy
from .gathered_mlp import GatherKernels, register_gather_kernels

_KERNELS = "dropless.ops.expert_mlp.gather_gemm_kernels"
# the gated kinds the epilogues compute: `activation_kernels.KINDS` (not imported: it
# loads triton)
GATHER_KINDS = ("swiglu", "gelu", "gelu_tanh", "relu2", "swiglu_clamp", "gpt_oss")


def triton_gather_kernels() -> GatherKernels:
    """The kernels as a `GatherKernels` for CUDA operands."""
    return GatherKernels(
        lazy(_KERNELS, "up_act"),
        lazy(_KERNELS, "down_dact"),
        lazy(_KERNELS, "gathered_wgrad"),
        supports=supports_triton_gemm,
        kinds=GATHER_KINDS,
    )


def register_gpu() -> None:
    """Register the row-gathering GEMMs."""
    register_gather_kernels(triton_gather_kernels())
