"""The training configuration's schema: one dataclass per TOML section, each validating
itself in `__post_init__` with a `ValueError` that names the key, the value and what is
allowed. `config.py` reads TOML files and `--set` overrides into these classes; the
`[parallel]` section is the parallel layer's own `ParallelConfig`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ...ops.expert_mlp.plan import EXPERT_PATHS
from ...parallel.mesh import ParallelConfig
from ...quant.recipe import RECIPES as RECIPE_CLASSES

RECIPES = tuple(RECIPE_CLASSES)  # "none" and the FP8 / MXFP8 recipes of dropless.quant
DTYPES = ("auto", "fp32", "bf16")
PARAM_DTYPES = ("fp32", "bf16")
SCHEDULES = ("cosine", "wsd", "constant")
PROGRESS = ("auto", "rich", "plain", "none")
IMPLEMENTATIONS = ("dropless", "stock")

FINETUNE_METHODS = ("full", "lora")
LORA_TARGETS = ("experts", "attention")
LOSS_ON = ("completion", "all")
# Transformers' attention registry ("eager" is built in)
ATTENTION = (
    "eager",
    "sdpa",
    "flex_attention",
    "flash_attention_2",
    "flash_attention_3",
    "flash_attention_4",
)
NONFINITE_POLICIES = ("stop", "skip")
BALANCE_LOSSES = ("per_layer", "family", "sequence")  # dropless.hf RouterLosses(balance=)
DECODE_ERRORS = ("strict", "replace")
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "loop")


#: torch and numpy hold counts, sizes and seeds in int64: a larger int fails deep inside them
INT64_END = 2**63


def _in_range(section: str, name: str, v) -> None:
    if isinstance(v, int) and v >= INT64_END:
        raise ValueError(
            f"{section}.{name}={v!r}: must be below 2**63 (torch counts in int64); use a smaller value"
        )
    if isinstance(v, float) and not math.isfinite(v):
        raise ValueError(f"{section}.{name}={v!r}: must be a finite number")


def _positive(section: str, **values) -> None:
    for name, v in values.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{section}.{name}={v!r}: must be an integer >= 1")
        _in_range(section, name, v)


def _non_negative(section: str, **values) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"{section}.{name}={v!r}: must be a number >= 0")
        _in_range(section, name, v)


def _choice(section: str, name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(
            f"{section}.{name}={value!r}: allowed values are {', '.join(map(repr, allowed))}"
        )


@dataclass
class ModelConfig:
    """The model: a local HF checkpoint to fine-tune (`path`), a local HF config to train
    from scratch (`config`), or (both empty) a Qwen3-MoE built from the fields below."""

    path: str = ""
    config: str = ""
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    num_experts: int = 8
    top_k: int = 2
    moe_intermediate_size: int = 256
    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    max_position_embeddings: int = 2048
    tie_embeddings: bool = True
    init_std: float = 0.02
    implementation: str = "dropless"  # experts path: "dropless" (patched) or "stock" Transformers
    expert_path: str = "auto"  # the dropless engine's schedule (dropless.patch(expert_path=))
    attn_implementation: str = "sdpa"
    # parameter storage: "fp32", or "bf16" (half the bytes; see optim.master_weights)
    dtype: str = "fp32"

    def __post_init__(self):
        if self.path and self.config:
            raise ValueError(
                "model.path and model.config are both set: give a checkpoint to fine-tune OR a config to train from scratch"
            )
        _positive(
            "model", hidden_size=self.hidden_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, num_experts=self.num_experts,
            top_k=self.top_k, moe_intermediate_size=self.moe_intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
        )  # fmt: skip
        if self.top_k > self.num_experts:
            raise ValueError(
                f"model.top_k={self.top_k} exceeds model.num_experts={self.num_experts}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model.num_heads={self.num_heads} must be a multiple of model.num_kv_heads={self.num_kv_heads}"
            )
        _non_negative("model", vocab_size=self.vocab_size, init_std=self.init_std)
        _choice("model", "implementation", self.implementation, IMPLEMENTATIONS)
        _choice("model", "expert_path", self.expert_path, EXPERT_PATHS)
        _choice("model", "attn_implementation", self.attn_implementation, ATTENTION)
        _choice("model", "dtype", self.dtype, PARAM_DTYPES)


@dataclass
class DataConfig:
    """Text data. `path` empty: the embedded corpus (this Python's standard library
    sources). Otherwise .txt/.jsonl/.parquet files or a directory of them."""

    path: str = ""
    eval_path: str = ""  # empty: hold out `eval_fraction` of the documents
    text_field: str = "text"  # for .jsonl / .parquet
    eval_fraction: float = 0.05
    max_bytes: int = 4_000_000  # cap on training text read (0: no cap)
    eval_tokens: int = 16384  # held-out tokens scored at each log step
    # "auto" (model.path's own tokenizer when model.path is set, else "bpe"), "bpe" (trained
    # on the data, cached in the run dir), "bytes", "dna" (nucleotides, for FASTA data) or a
    # tokenizer directory
    tokenizer: str = "auto"
    bpe_vocab_size: int = 2048
    reverse_complement: bool = False  # "dna": also train on each record's reverse complement
    errors: str = "strict"  # .txt not UTF-8: "strict" reports it, "replace" decodes with U+FFFD
    # supervised data (.jsonl with messages or prompt/completion): the tokens the loss covers
    loss_on: str = "completion"

    def __post_init__(self):
        _choice("data", "loss_on", self.loss_on, LOSS_ON)
        if not 0 < self.eval_fraction < 1:
            raise ValueError(f"data.eval_fraction={self.eval_fraction!r}: must be in (0, 1)")
        _non_negative("data", max_bytes=self.max_bytes)
        _positive("data", eval_tokens=self.eval_tokens)
        if not isinstance(self.bpe_vocab_size, int) or self.bpe_vocab_size < 300:
            raise ValueError(
                f"data.bpe_vocab_size={self.bpe_vocab_size!r}: must be an integer >= 300 (256 bytes + merges)"
            )
        if not self.tokenizer:
            raise ValueError(
                "data.tokenizer is empty: use 'auto', 'bpe', 'bytes', 'dna' or a tokenizer directory"
            )
        if self.reverse_complement and self.tokenizer != "dna":
            raise ValueError(
                f"data.reverse_complement=true needs data.tokenizer='dna' (got "
                f"{self.tokenizer!r}): reverse complements exist only for nucleotide data"
            )
        _choice("data", "errors", self.errors, DECODE_ERRORS)


@dataclass
class TrainSection:
    """The loop. `batch_size` is the GLOBAL number of sequences per optimizer step, split
    over processes and `grad_accum` micro-batches."""

    steps: int = 420
    seq_len: int = 256
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    aux_loss_coef: float = 0.01  # Switch load-balancing loss
    # which one: "per_layer" (each MoE layer's, averaged), "family" (the model's own: pooled
    # over layers for Transformers' families) or "sequence" (DeepSeek-V3's sequence-wise)
    balance_loss: str = "per_layer"
    z_loss_coef: float = 0.0  # router z-loss
    expert_bias_rate: float = 0.0  # > 0: aux-loss-free balancing, bias += rate * sign(mean - load)
    activation_checkpointing: bool = False  # per decoder layer, with routing replay
    fused_cross_entropy: bool = True  # LM head + loss in chunks, never the full [T, V] logits
    fused_rmsnorm: bool = True  # dropless's RMSNorm (Triton on CUDA, a lean torch op on CPU)
    on_nonfinite: str = "stop"  # NaN/Inf loss or gradient norm: "stop" the run or "skip" the step
    max_skipped_steps: int = 5  # on_nonfinite="skip": stop after more than this many in a row
    preflight: bool = True  # on GPUs: refuse a layout `dropless plan` predicts runs out of memory

    def __post_init__(self):
        _positive(
            "train",
            steps=self.steps,
            seq_len=self.seq_len,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
        )
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < INT64_END
        ):
            raise ValueError(
                f"train.seed={self.seed!r}: must be an integer in [0, 2**63) (torch.manual_seed's range)"
            )
        _non_negative(
            "train",
            aux_loss_coef=self.aux_loss_coef,
            z_loss_coef=self.z_loss_coef,
            expert_bias_rate=self.expert_bias_rate,
            max_skipped_steps=self.max_skipped_steps,
        )
        _choice("train", "on_nonfinite", self.on_nonfinite, NONFINITE_POLICIES)
        _choice("train", "balance_loss", self.balance_loss, BALANCE_LOSSES)
        if self.batch_size % self.grad_accum:
            raise ValueError(
                f"train.batch_size={self.batch_size} must be divisible by train.grad_accum={self.grad_accum}"
            )


@dataclass
class OptimConfig:
    """AdamW with linear warmup then cosine decay, WSD (warmup-stable-decay) or constant."""

    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 30
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # WSD: share of the steps spent decaying
    grad_clip: float = 1.0  # 0: off
    # AdamW kernel: "auto" = fused on one process, torch's own choice over DTensor
    # parameters (several processes); or "fused", "foreach", "loop" (one tensor at a time)
    implementation: str = "auto"
    # model.dtype=bf16: an fp32 master copy of every parameter (sharded like the optimizer
    # state), or (false) bf16 parameters updated with stochastic rounding
    master_weights: bool = True

    def __post_init__(self):
        _non_negative(
            "optim",
            lr=self.lr,
            weight_decay=self.weight_decay,
            eps=self.eps,
            warmup_steps=self.warmup_steps,
            grad_clip=self.grad_clip,
        )
        for name in ("min_lr_ratio", "decay_fraction"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ValueError(f"optim.{name}={v!r}: must be in [0, 1]")
        for name in ("beta1", "beta2"):  # AdamW divides by 1 - beta**step: 1 is refused by torch
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
                raise ValueError(
                    f"optim.{name}={v!r}: must be in [0, 1) (AdamW's moving-average decay, e.g. 0.9 or 0.95)"
                )
        _choice("optim", "schedule", self.schedule, SCHEDULES)
        _choice("optim", "implementation", self.implementation, ADAMW_IMPLEMENTATIONS)


def _recipe_fields() -> tuple[dict[str, tuple[str, ...]], list]:
    """Each init field of the FP8 recipe dataclasses (`dropless.quant.recipe`): the recipes
    that take it, and PrecisionConfig's field for it (the recipes' shared default, or ""
    where they differ: then each recipe keeps its own)."""
    takers: dict[str, tuple[str, ...]] = {}
    defaults: dict[str, set] = {}
    for name, cls in RECIPE_CLASSES.items():
        for f in dataclasses.fields(cls) if cls is not None else ():
            if f.init:
                takers[f.name] = (*takers.get(f.name, ()), name)
                defaults.setdefault(f.name, set()).add(getattr(f.default, "value", f.default))
    fields = []
    for name, values in defaults.items():
        default = values.pop() if len(values) == 1 else ""
        fields.append((name, type(default), field(default=default)))
    return takers, fields


#: the keys of `PrecisionConfig` besides dtype and recipe, each with the recipes it applies to
RECIPE_OPTIONS, _RECIPE_FIELDS = _recipe_fields()


@dataclass
class _PrecisionBase:
    dtype: str = "auto"
    recipe: str = "none"

    def __post_init__(self):
        _choice("precision", "dtype", self.dtype, DTYPES)
        _choice("precision", "recipe", self.recipe, RECIPES)
        defaults = PrecisionConfig.__dataclass_fields__
        for name, recipes in RECIPE_OPTIONS.items():
            value = getattr(self, name)
            if value == defaults[name].default:
                continue
            try:  # the value is checked by a recipe class that takes it
                RECIPE_CLASSES[recipes[0]](**{name: value})
            except (TypeError, ValueError) as e:
                raise ValueError(f"precision.{e}") from None
            if self.recipe not in recipes:
                raise ValueError(
                    f"precision.{name}={value!r} has no effect with "
                    f"precision.recipe={self.recipe!r}: it is an option of "
                    f"{' / '.join(map(repr, recipes))}; set such a recipe or leave it unset"
                )

    def recipe_options(self) -> dict:
        """Keyword arguments of the recipe's class (`dropless.quant.recipe_from_name`):
        the options this recipe takes, defaults of the class where the key is unset."""
        defaults = PrecisionConfig.__dataclass_fields__
        return {
            name: getattr(self, name)
            for name, recipes in RECIPE_OPTIONS.items()
            if self.recipe in recipes and getattr(self, name) != defaults[name].default
        }


PrecisionConfig = dataclasses.make_dataclass(
    "PrecisionConfig",
    _RECIPE_FIELDS,
    bases=(_PrecisionBase,),
    namespace={
        "__module__": __name__,
        "__doc__": """dtype: "auto" = bf16 autocast on GPU, fp32 on CPU. recipe: low-precision expert GEMMs.

    The other keys are generated from the options of the recipes' Python classes
    (`dropless.quant`): fp8_format ("" = the recipe's default), fp8_saved_activations,
    backend and, per recipe, scale_rule (mxfp8), margin (delayed, current), granularity
    (current), amax_history_len and amax_compute_algo (delayed). Setting one the chosen
    recipe does not take is an error; the recipe class checks the values.
    """,
    },
)


@dataclass
class CheckpointConfig:
    """A checkpoint every `every` steps (0: only at the end), keeping the last `keep`;
    `async_save`: the periodic ones are written in the background while training goes on."""

    every: int = 210
    keep: int = 2
    async_save: bool = True

    def __post_init__(self):
        _non_negative("checkpoint", every=self.every)
        _positive("checkpoint", keep=self.keep)


@dataclass
class LogConfig:
    """Metrics (JSONL + TensorBoard) and a held-out evaluation every `every` steps."""

    every: int = 60
    tensorboard: bool = True
    plots: bool = True
    progress: str = "auto"  # "auto": a rich bar on a terminal, plain lines otherwise
    peak_tflops: float = 0.0  # per process; 0: known GPU peak or a measured CPU matmul rate

    def __post_init__(self):
        _positive("log", every=self.every)
        _non_negative("log", peak_tflops=self.peak_tflops)
        _choice("log", "progress", self.progress, PROGRESS)


@dataclass
class FinetuneConfig:
    """How a checkpoint (model.path) is fine-tuned: every weight ("full") or LoRA adapters
    ("lora": base frozen, only the adapters trained and checkpointed) on `lora_targets`
    ("experts": the fused expert weights; "attention": the attention projections)."""

    method: str = "full"
    lora_rank: int = 16
    lora_alpha: float = 0.0  # 0: 2 x lora_rank
    lora_targets: list[str] = field(default_factory=lambda: ["experts", "attention"])

    def __post_init__(self):
        _choice("finetune", "method", self.method, FINETUNE_METHODS)
        _positive("finetune", lora_rank=self.lora_rank)
        _non_negative("finetune", lora_alpha=self.lora_alpha)
        bad = [t for t in self.lora_targets if t not in LORA_TARGETS]
        if bad or not self.lora_targets:
            raise ValueError(
                f"finetune.lora_targets={self.lora_targets!r}: give one or more of "
                f"{', '.join(map(repr, LORA_TARGETS))}"
            )

    @property
    def alpha(self) -> float:
        return self.lora_alpha or 2.0 * self.lora_rank


@dataclass
class Config:
    """A whole run. Build one with `load_config` or `recipes.default()`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainSection = field(default_factory=TrainSection)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)

    def __post_init__(self):
        if self.finetune.method == "lora" and not self.model.path:
            raise ValueError(
                "finetune.method='lora' needs a checkpoint to adapt: set model.path=DIR "
                "(a local Hugging Face directory)"
            )
