"""`dropless plan`: the memory per GPU and an estimate of tokens/s, before launch, from
the trainer's own code path (docs/plan.md, *How the memory is found*).

    p = make_plan(cfg, gpus=8, gpu_memory_gib=80, gpu="h100", skew=1.5)
    p.peak_gib_per_gpu, p.activation_peak_gib, p.fits, p.to_json()

The memory is traced, not computed: the model built and sharded as `dropless train` does
over a fake process group, materialized as fake tensors, and the trainer's own micro-batch
and optimizer step run under torch's memory tracker; the experts forward, which cannot run
on fake tensors, is replaced by what its op declares it keeps (`experts.py`). CPU autocast
and the CPU ops stand for the CUDA ones (the Triton row kernels return the same shapes).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..data.corpus import micro_batch_size
from ..model.build import param_dtype
from .attention import declare_attention
from .cost import Workload, cost_assumptions, gpu_kind, step_estimate
from .experts import declare_experts

GIB = 2**30
CONTEXT_GIB = 0.75  # CUDA context, cuBLAS workspaces, kernels' code
NCCL_GIB = 0.5  # NCCL communicators' buffers, several processes only
FRAGMENTATION = 0.05  # of the peak: the caching allocator's rounding and splits
#: the categories the activation peak sums: what forward keeps for backward and what
#: backward allocates as it goes (activation gradients, recomputed tensors, scratch)
ACTIVATIONS = ("activations", "temporaries")


@contextlib.contextmanager
def fake_world(world: int, force_distributed: bool = False):
    """A fake process group of `world` ranks (this process is rank 0): collectives return
    at once and move nothing, so the model can be sharded as on `world` GPUs (one rank
    too under parallel.force_distributed, which shards it at world 1)."""
    if world == 1 and not force_distributed:
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the planner needs a process without a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _prepare_probes(model: nn.Module) -> None:
    """Run, on real data and outside the fake mode, the one-time checks the patched modules
    do on their first call (the experts' fused form, RMSNorm agreement), which compare
    values and so cannot run on fake tensors."""
    from ...hf.experts import module_spec
    from ...hf.fusions.rmsnorm import STATE_ATTR
    from ...hf.layers import moe_layers

    for layer in moe_layers(model):
        module_spec(layer.experts)
    for m in model.modules():
        if STATE_ATTR in m.__dict__:
            m.__dict__[STATE_ATTR] = True  # the fused RMSNorm (its kernel agrees on the GPU)


def build_traced_model(cfg, hf_config, world: int, cdtype: torch.dtype):
    """(model, TrainParallel or None, fused-loss list or None) on the meta device, built
    and sharded as `Trainer` does; call inside `fake_world(world)`."""
    from ..model.build import adapt_and_shard, meta_model

    tc = cfg.train
    model = meta_model(cfg.model, hf_config, tc.expert_bias_rate > 0)
    model, par = adapt_and_shard(
        model, cfg.model, cfg.parallel, world, activation_checkpointing=tc.activation_checkpointing,
        fused_rmsnorm=tc.fused_rmsnorm, compute_dtype=cdtype, finetune=cfg.finetune,
        before_lora=_prepare_probes,
    )  # fmt: skip
    seen = None
    if tc.fused_cross_entropy:
        from ..model.lora import base_model
        from ..step import fuse_cross_entropy

        seen = fuse_cross_entropy(base_model(model))
    return model, par, seen


def _category(name: str) -> str:
    """Our breakdown's name for a tracker category."""
    n = name.lower()
    for key, ours in (
        ("unsharded param", "unsharded_buffers"), ("unsharded grad", "unsharded_buffers"),
        ("all gather", "unsharded_buffers"), ("reduce scatter", "unsharded_buffers"),
        ("param", "parameters"), ("grad", "gradients"), ("opt", "optimizer_states"),
        ("act", "activations"), ("buffer", "parameters"),
    ):  # fmt: skip
        if key in n:
            return ours
    return "temporaries"  # Temp, Inputs


@dataclass
class Traced:
    """What the traced step reads: bytes per category at the step's overall peak, and the
    most bytes activations held at one moment of forward and backward (activations and the
    backward's temporaries: at small micro-batches the overall peak is the optimizer step,
    when none is alive)."""

    per: dict[str, int]
    activation_peak: int
    peak_moment: str  # "forward/backward" or "optimizer step"


def trace_step(cfg, model, par, seen, world: int) -> Traced:
    """One micro-batch of the trainer's own step (`train.step.MicroStep`: forward under the
    precision recipe with the router outputs, loss with router losses, backward) then the
    optimizer step, on fake tensors under torch's memory tracker."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from ...hf.experts.router_losses import RouterLosses
    from ..model.precision import Precision
    from ..state import build_optimizer
    from ..step import MicroStep

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        model.to_empty(device="cpu")
        from ...hf.distributed.sharded_load import retie

        retie(model)  # to_empty gives tied weights separate storage
    params = [p for p in model.parameters() if p.requires_grad]
    opt = build_optimizer(params, cfg.optim)  # outside the mode: it reads the mesh's rank list
    tc = cfg.train
    cp = cfg.parallel.cp  # a group of cp ranks reads one micro-batch; this rank keeps 1/cp
    B, L = micro_batch_size(tc.batch_size, world // cp, tc.grad_accum), tc.seq_len
    V = int(model.config.vocab_size)
    # the compute dtype make_plan builds the model for; CPU autocast stands for CUDA's
    precision = Precision(cfg.precision, torch.device("cuda"), autocast_device="cpu")
    split = cp_group = None
    if cp > 1:
        from ..data.context_split import ContextSplit

        split, cp_group = ContextSplit(0, world // cp, 0, cp), par.pmesh.cp_group
    step = MicroStep.for_run(cfg, model, precision, RouterLosses(model), seen, split, cp_group)
    with mode, warnings.catch_warnings():
        # the tracker warns of each None it meets in the optimizer's state (no tensor: nothing to count)
        warnings.filterwarnings("ignore", "Expected a tensor or a traceable wrapper-subclass")
        _init_optimizer_state(opt)
        tracker = (
            _tracker(FSDPMemTracker)(model, opt) if par is not None else _tracker(MemTracker)()
        )
        if par is None:
            tracker.track_external(model, opt)
        with tracker:
            # the trainer's windows: L inputs, their targets shifted by one
            step(torch.randint(0, V, (B, L + 1)))
            loss_free = tracker.get_tracker_snapshot("current")  # after backward: the step's start
        peak = _breakdown(tracker.get_tracker_snapshot("peak"))
    at_step = _breakdown(loss_free)
    at_step["temporaries"] += _step_temporaries(opt)
    if sum(peak.values()) >= sum(at_step.values()):
        return Traced(peak, tracker.activation_peak, "forward/backward")
    return Traced(at_step, tracker.activation_peak, "optimizer step")


def _breakdown(snap) -> dict[str, int]:
    per = dict.fromkeys(("parameters", "gradients", "optimizer_states", "unsharded_buffers", "activations", "temporaries"), 0)  # fmt: skip
    for device_snap in snap.values():
        for name, b in device_snap.items():
            if str(name) != "Total":
                per[_category(getattr(name, "value", str(name)))] += int(b)
    return per


def _tracker(base):
    """torch's memory tracker, taught frozen parameters (it hooks every parameter to see
    its gradient, and a parameter without requires_grad, LoRA's frozen base, refuses a
    hook; those get none: they never have a gradient), keeping the device peak only."""
    from torch.distributed._tools.mem_tracker import _MemRefType

    class Tracker(base):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if not install_grad_hooks:
                return out
            hooks = self._param_to_grad_hook_handles

            def seen(g) -> None:
                self._update_and_maybe_create_winfos(g, _MemRefType.GRAD)

            def accumulated(q) -> None:
                seen(q.grad)

            for p in module.parameters():
                if p.requires_grad and hooks.get(p) is None:
                    hooks[p] = (p.register_hook(seen), p.register_post_accumulate_grad_hook(accumulated))  # fmt: skip
            return out

        activation_peak = 0  # the most bytes of activations and temporaries at one moment

        def _update_peak_stats(self, peak_state) -> None:
            # the whole-device peak only: torch's version also walks every module seen so
            # far on each allocation, which makes a 48-layer trace minutes long
            for dev, snap in self._curr_mem_snap.items():
                acts = sum(
                    int(b) for k, b in snap.items()
                    if str(k) != "Total" and _category(getattr(k, "value", str(k))) in ACTIVATIONS
                )  # fmt: skip
                self.activation_peak = max(self.activation_peak, acts)
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

    return Tracker


def _init_optimizer_state(opt) -> None:
    """Create the optimizer's state before the traced step: from the second step on,
    forward and backward run beside it. The step itself is not traced: a fake in-place
    fused kernel is traced as its out-of-place form, whose outputs the GPU never holds."""
    if hasattr(opt, "_state"):  # BF16AdamW creates its state per parameter
        for g in opt.param_groups:
            for p in g["params"]:
                opt._state(p)
        return
    for g in opt.param_groups:
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _step_temporaries(opt) -> int:
    """Bytes the optimizer step allocates beside the state: none for torch's fused AdamW
    (in place); BF16AdamW's elementwise update holds a few fp32 tensors of one parameter's
    local size (5 taken: the fp32 gradient, the denominator, the fp32 weight, the rounding
    noise and its result)."""
    if type(opt).__name__ != "BF16AdamW":
        return 0
    local = [p.to_local() if hasattr(p, "to_local") else p for g in opt.param_groups for p in g["params"]]  # fmt: skip
    return 5 * 4 * max((t.numel() for t in local), default=0)


@dataclass
class Plan:
    """The plan of one layout: the JSON contract's fields, plus what printed it."""

    gpus: int
    gpu: str
    gpu_memory_gib: float
    peak_gib_per_gpu: float
    reserve_gib: float
    fits: bool
    max_skew: float
    skew: float
    breakdown_gib: dict  # at the overall peak (the optimizer step at small micro-batches)
    tokens_per_s_per_gpu: float
    step_s_estimate: float
    activations_other_checkpointing_gib: float | None
    all_to_all_gib: float
    layout: dict
    assumptions: dict = field(default_factory=dict)
    #: the most activations (and backward temporaries) held at one moment of forward and
    #: backward, wherever the overall peak falls
    activation_peak_gib: float = 0.0
    #: the same with activation checkpointing flipped (None when not compared)
    activation_peak_other_checkpointing_gib: float | None = None
    #: where the overall peak (breakdown_gib) falls: "forward/backward" or "optimizer step"
    peak_moment: str = "forward/backward"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def _traced(cfg, hf_config, world, cdtype, ep: int, skew: float):
    with fake_world(world, cfg.parallel.force_distributed):
        model, par, seen = build_traced_model(cfg, hf_config, world, cdtype)
        declare_experts(model, ep, skew)
        declare_attention(model)
        traced = trace_step(cfg, model, par, seen, world)
        workload = _workload(cfg, model, par, world, cdtype)
    return traced, workload


def _workload(cfg, model, par, world: int, cdtype) -> Workload:
    from ...hf.layers import moe_layers
    from ..report.flops import FlopCounter

    layers = moe_layers(model)
    ex = layers[0].experts
    per_expert = sum(math.prod(p.shape[1:]) for p in ex.parameters(recurse=False) if p.dim() == 3)
    expert_total = sum(p.numel() for layer in layers for p in layer.experts.parameters())
    total = sum(p.numel() for p in model.parameters())
    flops = FlopCounter.from_model(model)
    ep, cp = cfg.parallel.ep, cfg.parallel.cp
    # the dense parameters' FSDP group: dp_shard x cp
    dp_shard = par.pmesh.config.dp_shard * cp if par is not None else 1
    tc = cfg.train
    return Workload(
        tokens=micro_batch_size(tc.batch_size, world // cp, tc.grad_accum) * tc.seq_len // cp,
        seq_len=tc.seq_len,
        top_k=int(getattr(model.config, "num_experts_per_tok", 1)), hidden=int(model.config.hidden_size),
        moe_layers=len(layers), expert_params=per_expert, dense_params=flops.dense_params,
        attn_per_seq_l2=flops.attn_per_seq_l2, dense_shard_params=total - expert_total,
        expert_fsdp_params=expert_total // ep, dp_shard=dp_shard, ep=ep,
        act_bytes=2 if cdtype == torch.bfloat16 else 4, frozen_base=cfg.finetune.method == "lora",
        checkpointing=cfg.train.activation_checkpointing, overlap=cfg.parallel.overlap_chunks > 1,
    )  # fmt: skip


def _skew_cap(hf_config, ep: int) -> float:
    """The largest load a rank can get over the mean: every token sends min(K, local
    experts) of its K pairs to it, from all ep ranks."""
    E = int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "n_routed_experts", 1))
    K = int(getattr(hf_config, "num_experts_per_tok", 1))
    return ep * min(K, max(E // ep, 1)) / K


def _max_skew(peak_at, skew: float, budget_gib: float, world: int, cap: float) -> float:
    """The skew at which peak + reserve reaches the budget (peak is linear in the skew:
    only the expert rows grow with it), at most `cap`; 0 when balanced routing does not fit."""
    room = (budget_gib - CONTEXT_GIB - (NCCL_GIB if world > 1 else 0.0)) / (1 + FRAGMENTATION)
    p1, ps = peak_at(1.0), peak_at(skew)
    if p1 > room:
        return 0.0
    slope = (ps - p1) / (skew - 1.0) if skew != 1.0 else 0.0
    if slope <= 0:
        return cap
    return round(min(cap, 1.0 + (room - p1) / slope), 2)


def plan_assumptions(cfg, cdtype, ep: int, skew: float, gpu) -> dict:
    mw = cfg.optim.master_weights
    return {
        "memory": "traced: the trainer's model build, sharding and one training step on fake "
        "tensors over a fake process group; torch's memory tracker reads the peak",
        "experts": "the expert MLP is not run on fake tensors (data-dependent counts, the counts "
        "exchange, Triton kernels): what its op declares it keeps for backward is allocated "
        "(h [rows, 2F] in the compute dtype, or in E4M3 with a scale per row under a recipe "
        "with fp8_saved_activations, and its indices), with the received rows and the send "
        "buffer under expert parallelism",
        "skew": f"the busiest expert-parallel rank computes {skew}x the mean rows"
        if ep > 1
        else "one expert-parallel rank holds every expert: routing skew does not change memory",
        "parameters": f"{str(param_dtype(cfg.model)).removeprefix('torch.')}; compute "
        f"{str(cdtype).removeprefix('torch.')} (autocast, FSDP2 param_dtype), fp32 reductions",
        "optimizer": "AdamW fp32 moments" + (
            (" + fp32 master copy" if mw else ", stochastic rounding, no master copy")
            if param_dtype(cfg.model) == torch.bfloat16 else ""
        ),
        "lora": "adapters on experts are counted as parameters and optimizer state; their "
        "gradients and the few [rows, rank] activations of the expert path are not traced",
        "router_losses": "traced: the trainer's step asks for the router logits when an aux "
        "or z loss is on",
        "precision": f"the trainer's autocast and recipe ({cfg.precision.recipe})",
        "gradient_clipping": "not traced (one norm per parameter group)",
        "reserve": f"{CONTEXT_GIB} GiB CUDA context and workspaces, {NCCL_GIB} GiB NCCL with "
        f"several processes, {FRAGMENTATION:.0%} of the peak for allocator fragmentation",
        "autocast": "CPU autocast and CPU ops stand for the CUDA ones (same output shapes)",
        "attention": "sdpa / FlashAttention: the output and fp32 log-sum-exp the GPU kernels "
        "keep (no [L, L] scores); eager and flex_attention traced as they run",
        **({"context_parallel": f"each sequence over {cfg.parallel.cp} ranks: a rank's "
            "tokens, its all-gathered keys and values (at their own heads) kept for "
            "backward, the output and log-sum-exp of its queries; the all-gather and "
            "reduce-scatter of K/V are not in the time estimate"} if cfg.parallel.cp > 1 else {}),
        **cost_assumptions(gpu),
    }  # fmt: skip


def resolve_hf_config(cfg):
    """The Transformers config `dropless train` would build (no weights are read)."""
    from ..data.tokenizer import vocab_size
    from ..model.build import hf_config

    return hf_config(cfg.model, 0 if (cfg.model.path or cfg.model.config) else vocab_size(cfg))


def make_plan(cfg, gpus: int, gpu_memory_gib: float, gpu: str = "h100", skew: float = 1.5, *, hf_config=None, compare_checkpointing: bool = True) -> Plan:  # fmt: skip
    """The plan of `cfg` on `gpus` GPUs of `gpu_memory_gib` GiB each (see the module)."""
    from ...parallel.mesh import resolve_sizes

    if skew < 1.0:
        raise ValueError(f"--skew {skew}: the busiest rank's load over the mean is at least 1.0")
    kind = gpu_kind(gpu)
    hf_config = hf_config if hf_config is not None else resolve_hf_config(cfg)
    resolve_sizes(cfg.parallel, gpus, getattr(hf_config, "num_experts", None))
    from ..model.precision import autocast_dtype

    cdtype = autocast_dtype(cfg.precision, on_gpu=True)  # the plan is for GPUs
    ep = cfg.parallel.ep
    cache: dict = {}

    def peak_at(s: float) -> float:
        if s not in cache:
            cache[s] = _traced(cfg, hf_config, gpus, cdtype, ep, s)
        return sum(cache[s][0].per.values()) / GIB

    peak = peak_at(skew)
    traced, work = cache[skew]
    per = traced.per
    cap = _skew_cap(hf_config, ep)
    max_skew = _max_skew(peak_at, skew, gpu_memory_gib, gpus, cap) if ep > 1 else cap
    other = other_peak = None
    if compare_checkpointing:
        flipped = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, activation_checkpointing=not cfg.train.activation_checkpointing))  # fmt: skip
        flipped_trace = _traced(flipped, hf_config, gpus, cdtype, ep, skew)[0]
        other = flipped_trace.per["activations"] / GIB
        other_peak = round(flipped_trace.activation_peak / GIB, 9)
    reserve = CONTEXT_GIB + (NCCL_GIB if gpus > 1 else 0.0) + FRAGMENTATION * peak
    est = step_estimate(work, kind, skew, cfg.train.grad_accum)
    rows = math.ceil(work.tokens * work.top_k * (skew if ep > 1 else 1.0))
    a2a = (work.tokens * work.top_k + rows) * work.hidden * work.act_bytes / GIB if ep > 1 else 0.0
    return Plan(
        gpus=gpus, gpu=gpu, gpu_memory_gib=gpu_memory_gib, peak_gib_per_gpu=round(peak, 9),
        reserve_gib=round(reserve, 6), fits=peak + reserve <= gpu_memory_gib, max_skew=max_skew,
        skew=skew, breakdown_gib={k: round(v / GIB, 9) for k, v in per.items()},
        tokens_per_s_per_gpu=round(est["tokens_per_s_per_gpu"], 1), step_s_estimate=round(est["step_s"], 4),
        activations_other_checkpointing_gib=None if other is None else round(other, 9),
        all_to_all_gib=round(a2a, 9), layout=_layout(cfg, gpus, work, cdtype),
        assumptions=plan_assumptions(cfg, cdtype, ep, skew, kind),
        activation_peak_gib=round(traced.activation_peak / GIB, 9),
        activation_peak_other_checkpointing_gib=other_peak, peak_moment=traced.peak_moment,
    )  # fmt: skip


def _layout(cfg, gpus: int, work: Workload, cdtype) -> dict:
    tc = cfg.train
    return {
        "dp_replicate": cfg.parallel.dp_replicate, "dp_shard": work.dp_shard // cfg.parallel.cp,
        "cp": cfg.parallel.cp, "ep": cfg.parallel.ep,
        "micro_batch": micro_batch_size(tc.batch_size, gpus // cfg.parallel.cp, tc.grad_accum),
        "seq_len": tc.seq_len, "tokens_per_gpu": work.tokens,
        "activation_checkpointing": cfg.train.activation_checkpointing,
        "finetune": cfg.finetune.method, "model_dtype": str(param_dtype(cfg.model)).removeprefix("torch."),
        "compute_dtype": str(cdtype).removeprefix("torch."), "master_weights": cfg.optim.master_weights,
    }  # fmt: skip
