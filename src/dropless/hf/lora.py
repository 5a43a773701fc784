"""PEFT LoRA on fused experts, run as dropless's low-rank path.

PEFT (0.21) reaches the 3-D expert weights of Transformers v5 with
`LoraConfig(target_parameters=["experts.gate_up_proj", "experts.down_proj"])`: a
`ParamWrapper` registers, for the duration of each forward, a parametrization whose
`_LoraFactorsProxy` folds `W + scaling * lhs @ rhs` with `torch.baddbmm` when the weight
is read. That is a weight-sized tensor per projection per step, kept for backward, and
a weight-sized gradient reduced to the factors.

The dropless experts forward never reads the parametrized weight: `experts_weights`
finds the proxy, takes the base weight (`parametrizations[name].original`) and the
proxy's factors, and hands them to the fused expert Function as `LowRank` updates
(two thin grouped GEMMs per projection). Autograd carries the factors' gradients back to
PEFT's `lora_A` / `lora_B` weights through PEFT's own reshapes.

PEFT's layout (`ParamWrapper.get_delta_factors`): `lora_A.weight [E*r, in]` reshapes to
(E, r, in); `lora_B.weight [out, r*E]` to (out, r, E), expert index fastest. For
weights stored [E, out, in] (`is_transposed=False`) the proxy holds lhs = B [E, out, r],
rhs = A [E, r, in]; for [E, in, out] it holds lhs = A^T, rhs = B^T.

Registering PEFT's parametrization runs the fold once more (torch checks the shape and
dtype of its output unless `unsafe=True`). While dropless is patched in,
`ParamWrapper._activate_lora` is replaced, for experts modules on the dropless path with
one active adapter, by the same registration with `unsafe=True`: no fold at all. It is
installed by `dropless.patch()` / `patch_model()` when peft is imported, or by the first
adapted experts forward, and removed by `dropless.unpatch()`.

Anything else (several active adapters, whose delta PEFT sums into one tensor; a
low-precision base weight; another parametrization) runs PEFT's own fold, with one
`DroplessLoRAFallbackWarning` per family and reason. Merged or disabled adapters leave
no parametrization: the plain path runs.
"""

# E experts, r rank, I in features, O out features

from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from ..ops import LowRank


class DroplessLoRAFallbackWarning(UserWarning):
    """An adapted experts module runs PEFT's own fold of the LoRA update into its weights."""


def _factors_proxy_class():
    try:
        from peft.tuners.lora.layer import _LoraFactorsProxy
    except ImportError:  # a peft without it: every parametrization is foreign
        return None
    return _LoraFactorsProxy


def is_parametrized(module: nn.Module, name: str) -> bool:
    plist = getattr(module, "parametrizations", None)
    return plist is not None and name in plist


def raw_weight(module: nn.Module, name: str) -> torch.Tensor | None:
    """The stored tensor `name` of `module`, without running a parametrization on it."""
    if is_parametrized(module, name):
        return module.parametrizations[name].original
    w = getattr(module, name, None)
    return w if isinstance(w, torch.Tensor) else None


def _lowrank(module: nn.Module, name: str, trans_w: bool) -> LowRank | str:
    plist = module.parametrizations[name]
    proxy_cls = _factors_proxy_class()
    if len(plist) != 1 or proxy_cls is None or not isinstance(plist[0], proxy_cls):
        kinds = ", ".join(type(p).__name__ for p in plist)
        return (
            f"{name} carries parametrizations ({kinds}) other than one LoRA adapter's factors "
            "(several active adapters, a low-precision weight, or a foreign parametrization)"
        )
    return _lowrank_of_proxy(plist[0], trans_w)


def _lowrank_of_proxy(proxy, trans_w: bool) -> LowRank:
    lhs, rhs, scale = proxy.lhs, proxy.rhs, float(proxy.scaling)
    # contiguous: PEFT's B is a permuted view, which grouped-GEMM backends may refuse
    if trans_w:  # W [E, out, in]: delta = lhs @ rhs = B @ A
        return LowRank(rhs.contiguous(), lhs.contiguous(), scale)
    # W [E, in, out]: delta = A^T @ B^T
    return LowRank(lhs.transpose(1, 2).contiguous(), rhs.transpose(1, 2).contiguous(), scale)


def experts_weights(
    module: nn.Module, names: tuple[str, str], trans_w: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[LowRank | None, LowRank | None] | None, str]:
    """(w1, w2, lora, reason) for the two projections `names` of an experts module.

    Without a parametrization: the weights and lora None. With PEFT's single-adapter
    factors on one or both: the base weights and their `LowRank` updates. With any
    other parametrization: the weights as read (PEFT folds them), lora None, and
    `reason` saying why (the caller warns)."""
    if not any(is_parametrized(module, n) for n in names):
        return getattr(module, names[0]), getattr(module, names[1]), None, ""
    parts = [_lowrank(module, n, trans_w) if is_parametrized(module, n) else None for n in names]
    reasons = [p for p in parts if isinstance(p, str)]
    if reasons:
        return getattr(module, names[0]), getattr(module, names[1]), None, reasons[0]
    install_lean_activation()  # later steps register the factors without a fold
    w1, w2 = (raw_weight(module, n) for n in names)
    return w1, w2, (parts[0], parts[1]), ""


def folded_weights(module: nn.Module, names: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights as PEFT's parametrization produces them (the fold runs here)."""
    return getattr(module, names[0]), getattr(module, names[1])


# --- registration without the fold ------------------------------------------------------

_STATE: dict = {"original": None}
_FULL_PRECISION = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _runs_lean(wrapper, adapters: list[str]) -> bool:
    base = wrapper.get_base_layer()
    config = getattr(base, "config", None)
    return (
        len(adapters) == 1
        and getattr(wrapper, "num_experts", 1) > 1
        and getattr(config, "_experts_implementation", None) == "dropless"
        and wrapper.get_param().dtype in _FULL_PRECISION
    )


@contextlib.contextmanager
def _activate_lora_lean(self, active_adapters):
    adapters = [a for a in active_adapters or [] if a in self.lora_A]
    if not _runs_lean(self, adapters):
        with _STATE["original"](self, active_adapters):
            yield
        return
    proxy_cls = _factors_proxy_class()
    base, name = self.get_base_layer(), self.parameter_name
    requires_grad = self.get_param().requires_grad
    proxy = proxy_cls(*self.get_delta_factors(adapters[0]))
    # unsafe=True: torch would otherwise fold once to check the output's shape and dtype
    nn.utils.parametrize.register_parametrization(base, name, proxy, unsafe=True)
    base.parametrizations[name].original.requires_grad_(requires_grad)
    try:
        with nn.utils.parametrize.cached():
            yield
    finally:
        self._remove_parametrizations()


def install_lean_activation() -> bool:
    """Make PEFT register its LoRA factors on dropless experts without folding them.
    Idempotent; returns whether it is installed (False when peft is not imported)."""
    if _STATE["original"] is not None:
        return True
    if "peft" not in sys.modules or _factors_proxy_class() is None:
        return False
    from peft.tuners.lora.layer import ParamWrapper

    _STATE["original"] = ParamWrapper._activate_lora
    ParamWrapper._activate_lora = _activate_lora_lean
    return True


def uninstall_lean_activation() -> None:
    """Restore PEFT's own `ParamWrapper._activate_lora`."""
    if _STATE["original"] is None:
        return
    from peft.tuners.lora.layer import ParamWrapper

    ParamWrapper._activate_lora = _STATE["original"]
    _STATE["original"] = None


# --- factors owned by the experts module (dropless's own expert parallelism) ------------
#
# PEFT's B [out, r*E] cannot be sharded by expert with a Shard placement (the expert index
# varies fastest). Under `dropless.hf.parallel.shard_hf_experts` the factors live instead as
# parameters of the experts module, A [E, r, in] and B [E, out, r], sharded with the
# experts (Shard(0) over "ep"), and are converted to and from PEFT's layout on save/load.

LORA_PARAMS = ("lora_A_first", "lora_B_first", "lora_A_down", "lora_B_down")


def peft_to_experts(lora_a_w: torch.Tensor, lora_b_w: torch.Tensor, num_experts: int):
    """PEFT's `lora_A.weight [E*r, in]`, `lora_B.weight [out, r*E]` -> A [E, r, in],
    B [E, out, r] (in/out of the projection as applied, whatever `is_transposed` is)."""
    E = num_experts
    a = lora_a_w.reshape(E, -1, lora_a_w.shape[-1])
    b = lora_b_w.reshape(lora_b_w.shape[0], -1, E).permute(2, 0, 1)
    return a, b


def experts_to_peft(a_ERI: torch.Tensor, b_EOR: torch.Tensor):
    """The inverse of `peft_to_experts`: (lora_A.weight [E*r, in], lora_B.weight [out, r*E])."""
    E, r, n_in = a_ERI.shape
    return a_ERI.reshape(E * r, n_in), b_EOR.permute(1, 2, 0).reshape(b_EOR.shape[1], r * E)


def attach_expert_lora(
    module: nn.Module, rank: int, alpha: float, generator: torch.Generator | None = None
) -> None:
    """Give an experts module its own LoRA factors as parameters (A with PEFT's default
    init, B random too when `generator` is given, else zeros), base weights frozen.

    For dropless's expert parallelism: `shard_hf_experts` shards them with the experts.
    The single-process dropless path runs them the same way."""
    if rank < 1:
        raise ValueError(f"attach_expert_lora: rank={rank} must be >= 1")
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    trans_w = not module.is_transposed
    for which, name in zip(("first", "down"), names):
        w = raw_weight(module, name)
        w.requires_grad_(False)
        E, n_out, n_in = (w.shape[0], w.shape[1], w.shape[2]) if trans_w else (
            w.shape[0], w.shape[2], w.shape[1],
        )  # fmt: skip
        bound = 1.0 / n_in**0.5
        a = (torch.rand(E, rank, n_in, generator=generator, dtype=w.dtype) * 2 - 1) * bound
        b = (
            torch.randn(E, n_out, rank, generator=generator, dtype=w.dtype) * 0.1
            if generator is not None
            else torch.zeros(E, n_out, rank, dtype=w.dtype)
        )
        module.register_parameter(f"lora_A_{which}", nn.Parameter(a.to(w.device)))
        module.register_parameter(f"lora_B_{which}", nn.Parameter(b.to(w.device)))
    module.__dict__["_dropless_lora_scale"] = float(alpha) / rank


def attached_lowrank(module: nn.Module):
    """(gate_up LowRank, down LowRank) from factors `attach_expert_lora` registered (local
    shards under expert parallelism), or None."""
    scale = module.__dict__.get("_dropless_lora_scale")
    if scale is None:
        return None

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    A1, B1, A2, B2 = (local(getattr(module, n)) for n in LORA_PARAMS)
    return LowRank(A1, B1, scale), LowRank(A2, B2, scale)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def save_expert_lora_as_peft(model: nn.Module, out_dir) -> None:
    """Write the factors `attach_expert_lora` gave the experts modules of `model` (gathered
    when sharded over ep; every rank calls this, rank 0 writes) as a PEFT adapter
    directory (adapter_config.json + adapter_model.safetensors) that
    `PeftModel.from_pretrained(stock_model, out_dir)` loads."""
    from pathlib import Path

    import peft
    import torch.distributed as dist
    from safetensors.torch import save_file

    from .layers import moe_layers

    layers = [x for x in moe_layers(model) if "_dropless_lora_scale" in x.experts.__dict__]
    if not layers:
        raise ValueError(
            "save_expert_lora_as_peft: no experts module carries attach_expert_lora factors"
        )
    first = layers[0].experts
    rank = first.lora_A_first.shape[1]
    names = ("gate_up_proj" if first.has_gate else "up_proj", "down_proj")
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=first.__dict__["_dropless_lora_scale"] * rank,
        target_parameters=[
            f"{x.name.rpartition('.')[2]}.experts.{n}" for x in layers[:1] for n in names
        ],
        target_modules=[],
    )
    where = _peft_paths(model, config)
    state = {}
    for x in layers:
        owner = next(n for n, m in model.named_modules() if m is x.experts)
        for which, name in zip(("first", "down"), names):
            a = _full(getattr(x.experts, f"lora_A_{which}")).detach()
            b = _full(getattr(x.experts, f"lora_B_{which}")).detach()
            a_w, b_w = experts_to_peft(a, b)
            path = where[(owner, name)]
            state[f"{path}.lora_A.weight"] = a_w.contiguous().cpu()
            state[f"{path}.lora_B.weight"] = b_w.contiguous().cpu()
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out)
    save_file(state, out / "adapter_model.safetensors")


def _peft_paths(model: nn.Module, config) -> dict:
    """{(experts module path, weight name): the ParamWrapper path PEFT would give it},
    from PEFT itself wrapping a weightless (meta) copy of the model's structure."""
    import copy

    import peft
    from peft.tuners.lora.layer import ParamWrapper

    with torch.device("meta"):
        skeleton = type(model)(copy.deepcopy(model.config))
    wrapped = peft.get_peft_model(skeleton, copy.deepcopy(config))
    where = {}
    for path, mod in wrapped.named_modules():
        if isinstance(mod, ParamWrapper):
            owner = path.removeprefix("base_model.model.")
            while owner.endswith(".base_layer"):
                owner = owner[: -len(".base_layer")]
            where[(owner, mod.parameter_name)] = path
    return where


def load_peft_into_experts(model: nn.Module, adapter_dir) -> int:
    """Copy a PEFT adapter's expert factors (saved by PEFT or `save_expert_lora_as_peft`)
    into the factors `attach_expert_lora` registered (this rank's shard under ep).
    Returns the number of projections loaded."""
    from pathlib import Path

    import peft
    from safetensors.torch import load_file

    from .layers import moe_layers

    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    state = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    where = _peft_paths(model, config)
    n = 0
    with torch.no_grad():
        for x in moe_layers(model):
            if "_dropless_lora_scale" not in x.experts.__dict__:
                continue
            owner = next(k for k, m in model.named_modules() if m is x.experts)
            names = ("gate_up_proj" if x.experts.has_gate else "up_proj", "down_proj")
            for which, name in zip(("first", "down"), names):
                path = where.get((owner, name))
                if path is None or f"{path}.lora_A.weight" not in state:
                    raise ValueError(f"{adapter_dir}: no LoRA factors for {owner}.{name}")
                a, b = peft_to_experts(
                    state[f"{path}.lora_A.weight"], state[f"{path}.lora_B.weight"], x.num_experts
                )
                for t, full in (
                    (getattr(x.experts, f"lora_A_{which}"), a),
                    (getattr(x.experts, f"lora_B_{which}"), b),
                ):
                    local = t.to_local() if hasattr(t, "to_local") else t
                    lo = _shard_offset(t)
                    local.copy_(full[lo : lo + local.shape[0]])
                n += 1
            x.experts.__dict__["_dropless_lora_scale"] = float(config.lora_alpha) / config.r
    return n


def _shard_offset(t: torch.Tensor) -> int:
    """First expert of this rank's Shard(0) slice (0 for a plain tensor)."""
    if not hasattr(t, "to_local"):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return int(offset[0])
