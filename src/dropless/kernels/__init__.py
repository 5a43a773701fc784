"""Triton kernels for the expert path on CUDA GPUs.

Importing this package registers the "triton" grouped-GEMM backend in `dropless.ops`
and never imports Triton: the kernel modules load on first use
(attribute access such as `dropless.kernels.permute`). `available(t)` says whether the
kernels can run on a tensor (a CUDA tensor and an importable triton); CPU tensors are
never routed here at run time. Tests run the kernels on CPU under `TRITON_INTERPRET=1`
(set before triton is imported), calling the functions below directly.

Public functions (each raw kernel wrapper has no autograd; the autograd wrappers own
their backward and save only what it needs):

- `permute(x_TD, token_S, slot_TK) -> x_SD` (autograd); `gather_rows(x_TD, index_S,
  scale=None, scale_index_S=None) -> x_SD` (raw);
- `unpermute(y_SN, token_S, pair_S, slot_TK, weights_TK=None) -> out_TN` (autograd);
  `gather_sum(rows_SN, slot_TK, weights_TK=None) -> out_TN` and
  `pair_dot(g_TN, y_SN, slot_TK) -> dots_TK` (raw);
- `swiglu(h_S2F, prob_S=None, *, activation="swiglu", interleaved=False, alpha, limit)
  -> a_SF` (autograd, as `dropless.ops.swiglu`; alpha/limit default to
  `ActivationConfig`'s; `activation` any gated kind of `activations.KINDS`);
  `swiglu_fwd(...)`, `swiglu_bwd(...)` (raw; the backward can also recompute the
  activation);
- `activations`: every activation kind's forward and derivative as `@triton.jit` device
  functions (`elementwise`, `glu`, `glu_fwd`), which every kernel applying an
  activation calls;
- `route(logits_TE, top_k, routing, expert_bias_E=None) -> (weights_TK, ids_TK,
  scores_TE)` (autograd, as `dropless.ops.route`) and `sort_pairs(flat_P, num_buckets,
  K)` (raw: the stable counting sort behind `dropless.ops.sort_by_expert`), registered
  as the "triton" routing kernels;
- `grouped_mm(a, b, counts, trans_b, out=None)`, `grouped_wgrad(a, b, counts)` (raw;
  counts may be a device tensor: no host sync), also registered as the "triton"
  grouped-GEMM backend by `register_backend()`;
- `ce_rows(logits_CV, labels_C, scale_C, *, ignore_index, smoothing, grad) -> loss_C`
  (raw): the cross-entropy row op of `dropless.ops.linear_cross_entropy`'s "fused"
  backend, registered as the "triton" `dropless.ops.cross_entropy_rows.CERows`;
- `up_act`, `down_dact`, `gathered_wgrad` (raw): grouped GEMMs that gather their rows
  and fuse the activation (`gather_gemm_kernels.py`), registered for the "gathered"
  expert path of `dropless.ops.gathered_mlp`.

`python -m dropless.bench.aot_check` compiles every kernel for sm_80/sm_90 without a GPU.
See docs/kernels.md.
"""

# T tokens, D model dim, N features, F expert hidden dim, S sorted pairs, K top-k

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from ..ops.dispatch import GemmBackend, register_gemm_backend

_EXPORTS = {
    "permute": "permute_kernels",
    "unpermute": "permute_kernels",
    "gather_rows": "permute_kernels",
    "gather_sum": "permute_kernels",
    "pair_dot": "permute_kernels",
    "swiglu": "swiglu_kernels",
    "swiglu_fwd": "swiglu_kernels",
    "swiglu_bwd": "swiglu_kernels",
    "grouped_mm": "gemm_kernels",
    "grouped_wgrad": "gemm_kernels",
    "up_act": "gather_gemm_kernels",
    "down_dact": "gather_gemm_kernels",
    "gathered_wgrad": "gather_gemm_kernels",
    "route": "routing_kernels",
    "sort_pairs": "routing_kernels",
}

_TRITON_OK: bool | None = None


def triton_importable() -> bool:
    """Whether `import triton` works here (checked once, on first call)."""
    global _TRITON_OK
    if _TRITON_OK is None:
        if importlib.util.find_spec("triton") is None:
            _TRITON_OK = False
        else:
            try:
                import triton  # noqa: F401
                import triton.language  # noqa: F401

                _TRITON_OK = True
            except Exception:  # a broken install is as good as none
                _TRITON_OK = False
    return _TRITON_OK


def available(t: torch.Tensor | None = None) -> bool:
    """Whether the Triton kernels can run on tensor `t` (default: on this machine's GPU).

    True only for CUDA tensors (or, with t=None, when CUDA is available) and an
    importable triton. Always False for CPU tensors, even under TRITON_INTERPRET=1:
    the interpreter is for tests, never picked at run time.
    """
    on_cuda = torch.cuda.is_available() if t is None else t.is_cuda
    return bool(on_cuda) and triton_importable()


def _supports(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.is_cuda
        and b.is_cuda
        and a.dtype == b.dtype
        and a.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and a.dim() == 2
        and b.dim() == 3
        and triton_importable()
    )


def _mm(a, b, counts, trans_b, out=None):
    from .gemm_kernels import grouped_mm

    return grouped_mm(a, b, counts, trans_b, out=out)


def _wgrad(a, b, counts):
    from .gemm_kernels import grouped_wgrad

    return grouped_wgrad(a, b, counts)


# below torch._grouped_mm ("grouped_mm", 10) where that runs, above the per-expert loop
TRITON_PRIORITY = 5


def _lazy(module: str, fn: str):
    """fn of kernel module `module`, imported (with triton) on first call."""

    def call(*args, **kwargs):
        return getattr(importlib.import_module(f"{__name__}.{module}"), fn)(*args, **kwargs)

    call.__name__ = fn
    return call


def _supports_rows(t: torch.Tensor) -> bool:
    return (
        t.is_cuda
        and t.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and (triton_importable())
    )


def _supports_routing(t: torch.Tensor) -> bool:
    if not (t.is_cuda and triton_importable()):
        return False
    from torch._subclasses.fake_tensor import is_fake

    # a fake CUDA tensor (a FakeTensorMode trace) holds no data for a kernel to read
    return not is_fake(t)


_ROW_OPS = None


def triton_row_ops():
    """The Triton kernels as a `dropless.ops.row_ops.RowOps` ("triton"): the gathers of
    permute / combine and the SwiGLU (and gpt_oss) activation x prob, forward and
    backward. Building it does not import triton."""
    global _ROW_OPS
    if _ROW_OPS is None:
        from dropless.ops.row_ops import RowOps

        _ROW_OPS = RowOps(
            "triton",
            _lazy("permute_kernels", "gather_rows"),
            _lazy("permute_kernels", "gather_sum"),
            _lazy("permute_kernels", "pair_dot"),
            _lazy("swiglu_kernels", "swiglu_fwd"),
            _lazy("swiglu_kernels", "swiglu_bwd"),
            # the kinds `dropless.ops.swiglu` hands to row ops; the kernels compute
            # every gated kind of `activations.KINDS`
            ("swiglu", "gpt_oss"),
            supports=_supports_rows,
            priority=10,
            zero_groups=_lazy("group_kernels", "zero_groups"),
        )
    return _ROW_OPS


def register_backend() -> None:
    """Register the "triton" grouped-GEMM backend in `dropless.ops.dispatch`, the
    "triton" row ops (permute / combine / activation) in `dropless.ops.row_ops` and the
    "triton" routing kernels (routing, metadata sort) in `dropless.ops.routing` and the
    "triton" cross-entropy row op in `dropless.ops.cross_entropy_rows` (idempotent; done
    when this package is imported, which `import dropless` does).

    Does not import triton: `supports` checks for it, and only for CUDA operands.
    """
    from ..ops.cross_entropy_rows import CERows, register_ce_rows
    from ..ops.gathered_mlp import register_gather_kernels
    from ..ops.routing import RoutingKernels, register_routing_kernels
    from ..ops.row_ops import register_row_ops

    register_gemm_backend(
        GemmBackend(
            "triton", _mm, _wgrad, supports=_supports, priority=TRITON_PRIORITY, device_counts=True
        )
    )
    register_row_ops(triton_row_ops())
    ce = _lazy("cross_entropy_kernels", "ce_rows")
    register_ce_rows(CERows("triton", ce, supports=_supports_rows, priority=10))
    register_routing_kernels(
        RoutingKernels(
            "triton",
            _lazy("routing_kernels", "route"),
            _lazy("routing_kernels", "sort_by_expert"),
            supports=_supports_routing,
            priority=10,
            route_with_aux=_lazy("routing_kernels", "route_with_aux"),
        )
    )
    register_gather_kernels(triton_gather_kernels())


# the gated kinds the epilogues compute: `activations.KINDS` (not imported: it loads triton)
GATHER_KINDS = ("swiglu", "gelu", "gelu_tanh", "relu2", "swiglu_clamp", "gpt_oss")


def triton_gather_kernels():
    """The grouped GEMMs that gather their rows (`gather_gemm_kernels.py`) as a
    `dropless.ops.gathered_mlp.GatherKernels` for CUDA operands, for the "gathered"
    expert path (building it does not import triton)."""
    from dropless.ops.gathered_mlp import GatherKernels

    return GatherKernels(
        _lazy("gather_gemm_kernels", "up_act"),
        _lazy("gather_gemm_kernels", "down_dact"),
        _lazy("gather_gemm_kernels", "gathered_wgrad"),
        supports=_supports,
        kinds=GATHER_KINDS,
    )


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        if not triton_importable():
            raise ImportError(
                f"dropless.kernels.{name} needs Triton, which is not installed here; "
                "install it with `pip install 'dropless[triton]'` (GPU machines only)"
            )
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


register_backend()

__all__ = [
    "available",
    "register_backend",
    "triton_importable",
    "triton_row_ops",
    *sorted(_EXPORTS),
]
