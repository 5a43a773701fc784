"""LoRA factors owned by the experts module: dropless's expert-parallel LoRA.

PEFT's B [out, r*E] cannot be sharded by expert with a Shard placement (the expert index
varies fastest). Under `dropless.hf.shard_hf_experts` the factors live instead as
parameters of the experts module, A [E, r, in] and B [E, out, r] (`attach_expert_lora`),
sharded with the experts (Shard(0) over "ep"); the dropless experts forward runs them as
`LowRank` updates (`attached_lowrank`). They are converted to and from PEFT's layout on
save (`hf.save_expert_lora_as_peft`, a directory `PeftModel.from_pretrained` loads) and load
(`load_peft_into_experts`). PEFT's own adapters on a single process are `dropless.hf.lora.peft_lora`.
"""

# E experts, r rank, I in features, O out features

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ...ops import LowRank
from ..layers import moe_layers
from .peft_lora import raw_weight

LORA_PARAMS = ("lora_A_first", "lora_B_first", "lora_A_down", "lora_B_down")
#: the key of the factors' scale in an experts module's `__dict__`: there only while the
#: module carries factors (what the dropless experts forward checks)
LORA_SCALE = "_dropless_lora_scale"


def peft_to_experts(lora_a_w: torch.Tensor, lora_b_w: torch.Tensor, num_experts: int):
    """PEFT's `lora_A.weight [E*r, in]`, `lora_B.weight [out, r*E]` -> A [E, r, in],
    B [E, out, r] (in/out of the projection as applied, whatever `is_transposed` is)."""
    return factor_from_peft("A", lora_a_w, num_experts), factor_from_peft(
        "B", lora_b_w, num_experts
    )


def experts_to_peft(a_ERI: torch.Tensor, b_EOR: torch.Tensor):
    """The inverse of `peft_to_experts`: (lora_A.weight [E*r, in], lora_B.weight [out, r*E])."""
    return factor_to_peft("A", a_ERI), factor_to_peft("B", b_EOR)


def factor_to_peft(kind: str, t: torch.Tensor) -> torch.Tensor:
    """One factor ("A" [E, r, in] or "B" [E, out, r]) in PEFT's layout (see `experts_to_peft`)."""
    E = t.shape[0]
    if kind == "A":
        return t.reshape(E * t.shape[1], t.shape[2])
    return t.permute(1, 2, 0).reshape(t.shape[1], t.shape[2] * E)


def factor_from_peft(kind: str, t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The inverse of `factor_to_peft`."""
    if kind == "A":
        return t.reshape(num_experts, -1, t.shape[-1])
    return t.reshape(t.shape[0], -1, num_experts).permute(2, 0, 1)


def attach_expert_lora(
    module: nn.Module,
    rank: int,
    alpha: float,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """Give an experts module its own LoRA factors as parameters (A with PEFT's default
    init, B random too when `generator` is given, else zeros), base weights frozen.
    dtype: the factors' (default: the base weight's); a bf16 base with fp32 factors
    computes the update in bf16 and keeps fp32 factors and gradients.

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
        dt = dtype or w.dtype
        a = (torch.rand(E, rank, n_in, generator=generator, dtype=dt) * 2 - 1) * bound
        b = (
            torch.randn(E, n_out, rank, generator=generator, dtype=dt) * 0.1
            if generator is not None
            else torch.zeros(E, n_out, rank, dtype=dt)
        )
        module.register_parameter(f"lora_A_{which}", nn.Parameter(a.to(w.device)))
        module.register_parameter(f"lora_B_{which}", nn.Parameter(b.to(w.device)))
    module.__dict__[LORA_SCALE] = float(alpha) / rank


def attached_lowrank(module: nn.Module):
    """(gate_up LowRank, down LowRank) from factors `attach_expert_lora` registered (local
    shards under expert parallelism), or None."""
    scale = module.__dict__.get(LORA_SCALE)
    if scale is None:
        return None

    base = raw_weight(module, "down_proj")
    dt = base.dtype  # fp32 factors on a bf16 base: the update runs in the base's dtype

    def local(t):
        t = t.to_local() if hasattr(t, "to_local") else t
        return t if t.dtype == dt or not dt.is_floating_point else t.to(dt)

    A1, B1, A2, B2 = (local(getattr(module, n)) for n in LORA_PARAMS)
    return LowRank(A1, B1, scale), LowRank(A2, B2, scale)


def fold_attached(w: torch.Tensor, lowrank: LowRank | None, trans_w: bool) -> torch.Tensor:
    """`w` (this rank's [E, out, in] or, trans_w False, [E, in, out]) with the update of
    `lowrank` folded in, differentiably: the factors owned by an experts module on a path
    that cannot run them as thin GEMMs (a low-precision recipe) still apply."""
    if lowrank is None:
        return w
    d = lowrank.delta().to(w.dtype)
    return w + (d if trans_w else d.transpose(1, 2))


def expert_factor_keys(model: nn.Module, where: dict) -> dict[str, tuple[str, str, int]]:
    """{name in `model.named_parameters()` of a factor `attach_expert_lora` registered:
    (its key in a PEFT adapter file, "A" or "B", num_experts)}; `where` from `peft_paths`."""
    out = {}
    for x in moe_layers(model):
        if LORA_SCALE not in x.experts.__dict__:
            continue
        owner = next(n for n, m in model.named_modules() if m is x.experts)
        names = ("gate_up_proj" if x.experts.has_gate else "up_proj", "down_proj")
        for which, name in zip(("first", "down"), names):
            path = where[(owner, name)]
            for kind in "AB":
                out[f"{owner}.lora_{kind}_{which}"] = (
                    f"{path}.lora_{kind}.weight",
                    kind,
                    x.num_experts,
                )
    return out


def peft_paths(model: nn.Module, config) -> dict:
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
    import peft
    from safetensors.torch import load_file

    config = peft.LoraConfig.from_pretrained(str(adapter_dir))
    state = load_file(Path(adapter_dir) / "adapter_model.safetensors")
    where = peft_paths(model, config)
    try:
        keys = expert_factor_keys(model, where)
    except KeyError as e:  # (experts module, weight) PEFT's config does not target
        raise ValueError(f"{adapter_dir}: no LoRA factors for {e.args[0]}") from None
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, (key, kind, E) in keys.items():
            if key not in state:
                raise ValueError(f"{adapter_dir}: no LoRA factors for {name}")
            t = params[name]
            local, lo = t, 0
            if hasattr(t, "to_local"):  # this rank's Shard(0) slice: its first expert
                from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

                local = t.to_local()
                _, offset = compute_local_shape_and_global_offset(
                    t.shape, t.device_mesh, t.placements
                )
                lo = int(offset[0])
            local.copy_(factor_from_peft(kind, state[key], E)[lo : lo + local.shape[0]])
    for x in moe_layers(model):
        if LORA_SCALE in x.experts.__dict__:
            x.experts.__dict__[LORA_SCALE] = float(config.lora_alpha) / config.r
    return len(keys) // 2
