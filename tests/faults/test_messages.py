"""Every user-facing error message of dropless.train, dropless.cli and dropless.parallel
is triggered by a test. `TABLE` maps each raise site (file and a literal part of its
message) to that test; `test_every_message_is_in_the_table` scans the sources (AST) and
fails on a message missing from it, and on a table entry that no longer matches a site.
The triggers that are plain function calls live here (`TRIGGERS`)."""

import ast
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dropless.parallel import EPGroupedExperts, ExpertParallelDispatcher, ParallelConfig, build_mesh
from dropless.parallel import dispatcher as dispatcher_mod
from dropless.train.checkpoint import store as ckpt
from dropless.train.config.load import (
    DataConfig,
    ModelConfig,
    PrecisionConfig,
    dump_config,
    load_config,
)
from dropless.train.data.corpus import eval_windows, load_corpus, read_documents, stdlib_corpus
from dropless.train.data.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    _require_tokenizers,
    build_tokenizer,
)
from dropless.train.generate import convert, load_run, resolve_checkpoint, sample
from dropless.train.model.bf16_adamw import BF16AdamW, stochastic_round_to_bf16
from dropless.train.model.build import build_model, hf_config, require_transformers
from dropless.train.model.precision import recipe_context
from dropless.train.plan.cost import gpu_kind
from dropless.train.report.metrics import MetricsWriter
from dropless.train.report.plots import plot_losses
from dropless.train.run import collectives
from dropless.train.step import StepRunner, fuse_cross_entropy
from harness import tiny_moe_config

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "src" / "dropless" / pkg for pkg in ("train", "cli", "parallel")]
EXCEPTIONS = {
    "ValueError", "TypeError", "RuntimeError", "NotImplementedError", "ModuleNotFoundError",
    "OSError", "NonFiniteError", "DroppedTokensError", "Interrupted",
}  # fmt: skip
HERE = "tests/faults/test_messages.py::test_trigger"
FAULTS = "tests/faults"
GENOMICS = "tests/train/test_genomics.py"

# (file, literal part of the message, test that triggers it)
TABLE = [
    ("plan/trace.py", "the planner needs a process without a process group", "tests/train/test_plan.py::test_planner_refuses_a_process_in_a_process_group"),
    ("plan/trace.py", "the busiest rank's load over the mean", "tests/train/test_plan.py::test_bad_input_is_one_error_line"),
    ("plan.py", "expected at least one GPU and a positive memory size", "tests/train/test_plan.py::test_bad_input_is_one_error_line"),
    ("plan/cost.py", "allowed GPU kinds are", f"{HERE}[gpu-kind]"),
    ("plan/preflight.py", "the plan predicts this run does not fit", "tests/train/test_plan.py::test_preflight_refuses_a_predicted_oom_on_cuda_only"),
    ("model/bf16_adamw.py", "stochastic rounding takes fp32 input", f"{HERE}[sr-dtype]"),
    ("model/bf16_adamw.py", "out of range", f"{HERE}[bf16-adamw-betas]"),
    ("run/collectives.py", "all_reduce: op=", f"{HERE}[collective-op]"),
    ("checkpoint/store.py", "is not a complete dropless checkpoint (no .metadata)", f"{HERE}[no-metadata]"),
    ("checkpoint/store.py", "); pick another checkpoints/step_* directory", f"{HERE}[no-trainer-json]"),
    ("config/load.py", "(every key: docs/train.md, Configuration)", "tests/train/test_config.py::test_an_unknown_section_names_the_closest_not_every_key"),
    ("config/schema.py", ": allowed values are", "tests/train/test_config.py::test_bad_values"),
    ("config/load.py", ": expected ", "tests/train/test_config.py::test_bad_values"),
    ("config/load.py", ": must be a finite number", f"{FAULTS}/test_config_data.py::test_non_finite_numbers_are_refused"),
    ("config/schema.py", ": must be an integer >= 1", "tests/train/test_config.py::test_bad_values"),
    ("config/schema.py", ": must be a number >= 0", f"{HERE}[negative]"),
    ("config/schema.py", "model.path and model.config are both set", f"{HERE}[path-and-config]"),
    ("config/schema.py", "exceeds model.num_experts=", "tests/train/test_config.py::test_bad_values"),
    ("config/schema.py", "must be a multiple of model.num_kv_heads=", f"{HERE}[kv-heads]"),
    ("config/schema.py", ": must be in (0, 1)", f"{HERE}[eval-fraction]"),
    ("config/schema.py", ": must be an integer >= 300", f"{HERE}[bpe-vocab]"),
    ("config/schema.py", "data.tokenizer is empty", f"{HERE}[empty-tokenizer]"),
    ("config/schema.py", "must be divisible by train.grad_accum=", "tests/train/test_config.py::test_bad_values"),
    ("mesh.py", ": must be a number of seconds > 0", f"{HERE}[timeout]"),
    ("mesh.py", "must be true or false (true: take the parallel path", f"{HERE}[force-distributed]"),
    ("config/load.py", ": expected true or false", "tests/train/test_config.py::test_bad_values"),
    ("config/load.py", ": expected a string, got", f"{HERE}[string-type]"),
    ("config/load.py", ": expected an int (a whole number, e.g. ", f"{HERE}[whole-number]"),
    ("config/schema.py", ": must be below 2**63 (torch counts in int64)", f"{FAULTS}/test_config_checks.py::test_values_torch_would_reject_are_refused_naming_the_key"),
    ("config/schema.py", ": must be a finite number", f"{FAULTS}/test_config_checks.py::test_config_objects_check_the_same_ranges"),
    ("config/schema.py", "(torch.manual_seed's range)", f"{FAULTS}/test_config_checks.py::test_values_torch_would_reject_are_refused_naming_the_key"),
    ("config/schema.py", ": must be in [0, 1) (AdamW's moving-average decay", f"{FAULTS}/test_config_checks.py::test_values_torch_would_reject_are_refused_naming_the_key"),
    ("plan/memory_fit.py", "the run needs at least ", f"{FAULTS}/test_config_checks.py::test_a_model_this_machine_cannot_hold_is_refused_before_it_is_built"),
    ("mesh.py", "torch.distributed's limit is int64 nanoseconds", f"{FAULTS}/test_config_checks.py::test_values_torch_would_reject_are_refused_naming_the_key"),
    ("config/load.py", ": expected a list, e.g.", f"{HERE}[list-type]"),
    ("config/load.py", "does not exist; pass a TOML file", f"{HERE}[no-config-file]"),
    ("config/load.py", ": expected KEY=VALUE", "tests/train/test_config.py::test_bad_values"),
    ("config/load.py", "needs tomli-w", f"{HERE}[no-tomli-w]"),
    ("config/schema.py", ": must be in [0, 1]", f"{HERE}[beta]"),
    ("config/load.py", "is not valid TOML:", f"{HERE}[bad-toml]"),
    ("config/schema.py", "data.reverse_complement=true needs data.tokenizer='dna'", f"{GENOMICS}::test_dna_training_run_learns"),
    ("data/fasta.py", "does not exist", f"{GENOMICS}::test_bad_gzip_and_binary_and_missing"),
    ("data/fasta.py", "no FASTA records (no '>' header line)", f"{GENOMICS}::test_malformed_input_names_file_and_line"),
    ("data/fasta.py", "empty '>' header", f"{GENOMICS}::test_malformed_input_names_file_and_line"),
    ("data/fasta.py", "not a text FASTA file", f"{GENOMICS}::test_bad_gzip_and_binary_and_missing"),
    ("data/fasta.py", "unreadable compressed FASTA file", f"{GENOMICS}::test_bad_gzip_and_binary_and_missing"),
    ("data/fasta.py", "sequence data before the first '>' header", f"{GENOMICS}::test_malformed_input_names_file_and_line"),
    ("data/fasta.py", "is not an IUPAC nucleotide code", f"{GENOMICS}::test_malformed_input_names_file_and_line"),
    ("data/genomics.py", ": expected a positive int", f"{GENOMICS}::test_windows_stream_matches_one_stream"),
    ("data/genomics.py", ": expected a positive count", f"{GENOMICS}::test_bits_per_base"),
    ("data/genomics.py", ": not a DNA tokenizer", f"{GENOMICS}::test_tokenizer_vocabulary_and_round_trip"),
    ("data/genomics.py", ", not this DNA tokenizer (", f"{GENOMICS}::test_tokenizer_vocabulary_and_round_trip"),
    ("config/schema.py", "has no effect with precision.recipe=", "tests/train/test_precision_config.py::test_bad_precision_options"),
    ("config/schema.py", "precision.\x00", "tests/train/test_precision_config.py::test_bad_precision_options"),
    ("model/precision.py", "precision: ", f"{HERE}[recipe-option]"),
    ("step.py", "train.fused_cross_entropy=true: ", f"{HERE}[fused-ce]"),
    ("data/corpus.py", "the embedded corpus is empty", f"{HERE}[no-stdlib]"),
    ("data/corpus.py", "does not exist; pass a .txt/.jsonl/.parquet file", "tests/train/test_bad_input.py::test_missing_data_path"),
    ("data/corpus.py", "files; point it at your data", "tests/train/test_bad_input.py::test_empty_data_dir_and_file"),
    ("data/corpus.py", "(columns: ", "tests/train/test_data.py::test_parquet"),
    ("data/corpus.py", "file(s)); point it at non-empty data", "tests/train/test_bad_input.py::test_empty_data_dir_and_file"),
    ("data/corpus.py", "the held-out data has ", f"{HERE}[short-held-out]"),
    ("data/corpus.py", ": unsupported file type", "tests/train/test_data.py::test_txt_and_jsonl"),
    ("data/corpus.py", "are not valid UTF-8", f"{FAULTS}/test_config_data.py::test_txt_decode_errors_are_reported_unless_replace"),
    ("data/corpus.py", "needs pyarrow", f"{HERE}[no-pyarrow]"),
    ("data/corpus.py", "data.eval_path is set but data.path is empty", f"{HERE}[eval-without-path]"),
    ("data/corpus.py", "the training data has ", "tests/train/test_data.py::test_window_sampler_epochs_cover_every_window"),
    ("data/corpus.py", ": expected a JSON object with a", f"{FAULTS}/test_config_data.py::test_jsonl_errors_name_file_and_line"),
    ("data/corpus.py", "(fields: ", "tests/train/test_data.py::test_txt_and_jsonl"),
    ("data/corpus.py", ": not a JSON line (", f"{FAULTS}/test_config_data.py::test_jsonl_errors_name_file_and_line"),
    ("generate.py", "is not a directory; pass a run directory", "tests/train/test_run.py::test_generate_returns_text"),
    ("generate.py", "has no complete checkpoint (checkpoints/step_*)", f"{HERE}[generate-no-checkpoint]"),
    ("generate.py", ": not a dropless training run", f"{HERE}[no-run-config]"),
    ("generate.py", "temperature, top_k and max_new_tokens must be >= 0", f"{HERE}[temperature]"),
    ("generate.py", "is not empty; pass a new or empty directory", f"{HERE}[convert-not-empty]"),
    ("report/metrics.py", "log.tensorboard=true needs tensorboard", f"{HERE}[no-tensorboard]"),
    ("model/build.py", "expected a local Hugging Face directory with config.json", f"{HERE}[no-hf-dir]"),
    ("model/build.py", "tokenizer/model vocabulary mismatch", "tests/train/test_bad_input.py::test_vocabulary_mismatch"),
    ("model/build.py", "embeddings have", "tests/train/test_finetune_tokenizer.py::test_a_smaller_tokenizer_than_the_embeddings_is_refused"),
    ("data/tokenizer.py", "holds no tokenizer (", "tests/train/test_finetune_tokenizer.py::test_a_smaller_tokenizer_than_the_embeddings_is_refused"),
    ("model/build.py", "is above the model's maximum sequence length", "tests/train/test_bad_input.py::test_sequence_longer_than_the_model"),
    ("model/build.py", "has no Mixture-of-Experts layers", f"{HERE}[dense-model]"),
    ("model/build.py", "dropless train needs transformers", f"{HERE}[no-transformers]"),
    ("model/build.py", "needs routers with their own score bias", f"{HERE}[stock-expert-bias]"),
    ("report/plots.py", "plots need matplotlib", f"{HERE}[no-matplotlib]"),
    ("checkpoint/resume.py", "cannot continue with a changed", f"{FAULTS}/test_resume_checks.py::test_changed_fixed_key_is_refused_untouched"),
    ("checkpoint/resume.py", "--resume: the run was saved with parallel.ep=", f"{FAULTS}/test_resume_checks.py::test_saved_ep_that_does_not_fit_names_the_override"),
    ("run/rundir.py", "could not find a free run directory name", f"{HERE}[no-free-name]"),
    ("run/rundir.py", "is not writable (", "tests/train/test_bad_input.py::test_unwritable_run_dir"),
    ("run/rundir.py", "is an existing folder that is not a dropless run", f"{FAULTS}/test_resume_checks.py::test_foreign_folder_is_refused_untouched"),
    ("run/rundir.py", "cannot be locked (", f"{FAULTS}/test_run_lock.py::test_a_file_system_without_flock_is_named"),
    ("checkpoint/resume.py", "--resume without --run-dir: no run with a checkpoint", f"{HERE}[no-run-to-resume]"),
    ("plan/preflight.py", "is not divisible by the number of processes (", "tests/train/test_bad_input.py::test_batch_not_divisible_by_processes"),
    ("checkpoint/resume.py", "has no complete checkpoint to resume from", "tests/train/test_run.py::test_resume_refuses_finished_and_fresh_runs"),
    ("checkpoint/resume.py", "already holds checkpoints: pass --resume", "tests/train/test_run.py::test_resume_refuses_finished_and_fresh_runs"),
    ("checkpoint/resume.py", "verifies (", f"{FAULTS}/test_run_files.py::test_every_checkpoint_damaged_gives_one_way_out"),
    ("run/rundir.py", "does not exist (nothing was created)", f"{FAULTS}/test_run_files.py::test_no_folder_is_left_by_a_run_that_never_started"),
    ("run/atomic.py", "vanished during the run (deleted or moved)", f"{FAULTS}/test_run_files.py::test_a_vanished_run_directory_stops_the_run"),
    ("run/atomic.py", "is a symlink (to ", f"{FAULTS}/test_run_files.py::test_a_symlinked_metrics_or_config_file_is_refused"),
    ("checkpoint/store.py", "; the checkpoint is damaged or was edited", f"{FAULTS}/test_integrity.py::test_crafted_trainer_json_is_one_line"),
    ("checkpoint/store.py", "does not verify: ", f"{FAULTS}/test_integrity.py::test_a_flipped_byte_in_a_large_shard_is_caught"),
    ("checkpoint/manifest.py", "does not verify: ", f"{FAULTS}/test_integrity.py::test_a_flipped_byte_in_a_large_shard_is_caught"),
    ("checkpoint/store.py", "(or was removed while opening it)", f"{FAULTS}/test_integrity.py::test_a_checkpoint_without_a_manifest_is_not_loaded"),
    ("data/corpus.py", ", not a string; give every line text there", "tests/train/test_data_cap.py::test_jsonl_text_that_is_not_a_string_is_refused"),
    ("checkpoint/dcp_io.py", "is not DCP checkpoint metadata (", f"{FAULTS}/test_integrity.py::test_crafted_metadata_runs_no_code"),
    ("step.py", "were not computed by the experts", f"{HERE}[dropped]"),
    ("data/tokenizer.py", "the BPE tokenizer needs the `tokenizers` package", f"{HERE}[no-tokenizers]"),
    ("data/tokenizer.py", "pass a directory saved by a Hugging Face fast tokenizer", f"{HERE}[no-tokenizer-json]"),
    ("data/tokenizer.py", "or an existing tokenizer directory", f"{HERE}[tokenizer-dir]"),
    ("trainer.py", "written. Resume with: dropless train --run-dir", f"{FAULTS}/test_signals.py::test_sigint_sigterm_and_a_second_ctrl_c"),
    ("build.py", "raise train.steps to continue it", "tests/train/test_run.py::test_resume_refuses_finished_and_fresh_runs"),
    ("mesh.py", "is not implemented (planned); allowed:", "tests/parallel/test_mesh_config.py::test_deepep_is_not_a_choice_but_a_clear_error"),
    ("dispatcher.py", "must be an int >= 1", f"{HERE}[num-chunks]"),
    ("dispatcher.py", "is not divisible by the EP group size", f"{HERE}[ep-group-size]"),
    ("experts.py", "takes its weights from the full module", f"{HERE}[ep-experts-init]"),
    ("experts.py", "holds only this rank's experts", f"{HERE}[ep-experts-forward]"),
    ("experts.py", "experts must be a dropless GroupedExperts", f"{HERE}[ep-experts-type]"),
    ("experts.py", "is not divisible by parallel.ep=", f"{HERE}[ep-experts-split]"),
    ("fsdp.py", "FSDP2 takes one parameter dtype per unit", "tests/parallel/_checks_fp32_router.py::fsdp_refuses_unsplittable_dtypes"),
    ("fsdp.py", "are not sharded over the experts, and FSDP2", "tests/parallel/_checks_fp32_router.py::fsdp_refuses_unsplittable_dtypes"),
    ("mesh.py", "does not divide the world size", "tests/parallel/test_mesh_config.py::test_bad_sizes"),
    ("mesh.py", "parallel.dp_replicate x parallel.dp_shard =", "tests/parallel/test_mesh_config.py::test_bad_sizes"),
    ("mesh.py", "(expert parallelism borrows ranks from the FSDP shard dimension)", "tests/parallel/test_mesh_config.py::test_bad_sizes"),
    ("mesh.py", "every EP rank must own the same number of experts", "tests/parallel/test_mesh_config.py::test_bad_sizes"),
    ("mesh.py", "parallel.dp_replicate x parallel.dp_shard x parallel.cp =", "tests/parallel/test_context_parallel.py::test_cp_sizes_resolve_and_errors_name_the_fix"),
    ("plan/preflight.py", "is not divisible by the number of context-parallel", "tests/parallel/test_context_parallel.py::test_preflight_counts_cp_groups_in_the_batch"),
    ("context/sharding.py", "context parallel size cp=", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/sharding.py", "is not divisible by 2 x cp =", "tests/parallel/test_context_parallel.py::test_seq_len_error_names_the_fix"),
    ("context/sharding.py", " is outside 0..", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/sharding.py", "unshard_sequence needs ", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/sharding.py", "shard_batch needs `input_ids` or `labels`", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/sharding.py", " along the sequence, the batch has ", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/attention.py", " must be a multiple of key/value heads ", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/attention.py", " must be even (a head and a tail chunk)", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/hf.py", "needs the cp process group: call", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/hf.py", "(this layer has sliding_window=", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/hf.py", "in attention (attention sinks / soft-capping)", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/hf.py", "context parallelism takes a 2-D padding mask", "tests/parallel/test_context_parallel.py::test_argument_errors_say_what_to_do"),
    ("context/hf.py", "(config.sliding_window=", "tests/parallel/_checks_cp.py::cp_refusals"),
    ("mesh.py", "build_mesh needs torch.distributed initialised", f"{HERE}[no-process-group]"),
    ("mesh.py", "or -1 for world_size / dp_replicate", "tests/parallel/test_mesh_config.py::test_bad_fields"),
    ("mesh.py", "parallel.dispatcher=", "tests/parallel/test_mesh_config.py::test_bad_fields"),
    ("mesh.py", "must be an int >= 1", "tests/parallel/test_mesh_config.py::test_bad_fields"),
    ("config/schema.py", ": give one or more of ", f"{HERE}[lora-targets-config]"),
    ("config/schema.py", "finetune.method='lora' needs a checkpoint to adapt", f"{HERE}[lora-no-model-path]"),
    ("generate.py", "is a LoRA run: its checkpoints hold the adapters only", f"{HERE}[convert-lora-no-merge]"),
    ("generate.py", "is a full fine-tuning run (finetune.method='full')", f"{HERE}[convert-full-merge]"),
    ("generate.py", "trained with the aux-loss-free expert bias (train.expert_bias_rate=", "tests/train/test_balance.py::test_convert_refuses_a_bias_the_stock_family_cannot_hold"),
    ("model/lora.py", "no experts module and no attention projection found", f"{HERE}[lora-targets-nothing]"),
    ("model/lora.py", "finetune.method='lora' needs peft", f"{HERE}[no-peft]"),
    ("model/lora.py", "needs every experts module on dropless's fused expert MLP", f"{HERE}[lora-stock-experts-multi-process]"),
    ("data/sft.py", "cuts every sample before its completion tokens", f"{HERE}[sft-seq-len]"),
    ("data/sft.py", "chat-formatted data needs jinja2", f"{HERE}[no-jinja2]"),
    ("data/sft.py", "the chat template does not render a conversation as a prefix", f"{HERE}[chat-template-prefix]"),
    ("data/sft.py", "the supervised data has no records", f"{HERE}[sft-no-records]"),
]  # fmt: skip


def _literal(node) -> str:
    """The constant text of a message (f-string placeholders become a separator)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "\x00".join(v.value if isinstance(v, ast.Constant) else "" for v in node.values)
    if isinstance(node, ast.BinOp):
        return _literal(node.left) + _literal(node.right)
    return ""


def raise_sites() -> list[tuple[str, int, str]]:
    """(file, line, message text) of every exception built with a message in the sources."""
    out = []
    for pkg in SOURCES:
        for f in sorted(pkg.rglob("*.py")):
            for n in ast.walk(ast.parse(f.read_text())):
                if (
                    isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                    and n.func.id in EXCEPTIONS and n.args and _literal(n.args[0]).strip()
                ):  # fmt: skip
                    out.append((f.relative_to(pkg).as_posix(), n.lineno, _literal(n.args[0])))
    return out


def test_every_message_is_in_the_table():
    sites = raise_sites()
    assert len(sites) > 60  # the scan sees the sources
    missing = [
        f"{f}:{line}: {text!r}"
        for f, line, text in sites
        if not any(tf == f and frag in text for tf, frag, _ in TABLE)
    ]
    assert not missing, "messages with no test in TABLE:\n" + "\n".join(missing)
    stale = [e for e in TABLE if not any(f == e[0] and e[1] in t for f, _, t in sites)]
    assert not stale, f"TABLE entries matching no raise site: {stale}"


def test_every_table_entry_names_a_test():
    ids = {t[0] for t in TRIGGERS}
    for _, _, ref in TABLE:
        path, _, name = ref.partition("::")
        if path == "tests/faults/test_messages.py":
            assert name.startswith("test_trigger[") and name[13:-1] in ids, ref
            continue
        assert f"def {name}(" in (ROOT / path).read_text(), ref


# ---- triggers: (id, callable(tmp_path, monkeypatch, request), exception, text) ----------


def _hide(monkeypatch, *modules):
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def _dense(tmp, mp, rq):
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)  # fmt: skip
    build_model(ModelConfig(), cfg, expert_bias=False, seed=0, device="cpu")


def _stock_bias(tmp, mp, rq):
    mcfg = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8,
                       num_experts=2, top_k=1, moe_intermediate_size=8, implementation="stock")  # fmt: skip
    build_model(mcfg, hf_config(mcfg, 64), expert_bias=True, seed=0, device="cpu")


def _dropped(tmp, mp, rq):
    runner = StepRunner.__new__(StepRunner)
    runner.global_batch, runner.seq_len, runner.top_k, runner.layers = 2, 4, 2, [None]
    runner._check_dropped(7.0, step=5)  # the experts computed 7 of 16 pairs


def _ep_experts(kind):
    from dropless.nn import GroupedExperts

    class Mesh:
        def size(self):
            return 2

        def get_local_rank(self):
            return 0

    def go(tmp, mp, rq):
        if kind == "type":
            EPGroupedExperts.from_experts(torch.nn.Linear(2, 2), Mesh())
        elif kind == "split":
            EPGroupedExperts.from_experts(GroupedExperts(3, 4, 4), Mesh())
        elif kind == "init":
            EPGroupedExperts.__new__(EPGroupedExperts).reset_parameters()
        else:
            EPGroupedExperts.forward(None)

    return go


def _ep_group_size(tmp, mp, rq):
    mp.setattr(dispatcher_mod, "_group_size", lambda group: 2)
    ExpertParallelDispatcher(num_experts=3)._sizes(None)


def _no_free_name(tmp, mp, rq):
    from dropless.train.run import rundir

    def taken(self, *a, exist_ok=False, **k):  # every name is already taken
        if not exist_ok:
            raise FileExistsError(self)

    mp.setattr(rundir.Path, "mkdir", taken)
    rundir.new_run_dir(tmp / "runs")


def _convert_not_empty(tmp, mp, rq):
    (tmp / "out").mkdir()
    (tmp / "out" / "keep.txt").write_text("mine")
    convert(rq.getfixturevalue("finished_run"), tmp / "out")


def _no_run_config(tmp, mp, rq):
    ck = tmp / "run" / "checkpoints" / "step_00000001"
    ck.mkdir(parents=True)
    (ck / ".metadata").write_text("")
    (ck / ckpt.MANIFEST).write_text(json.dumps(ckpt.build_manifest(ck, 1)))  # verifies
    load_run(ck)


def _no_run_to_resume(tmp, mp, rq):
    from dropless.train.checkpoint.resume import latest_run

    latest_run(tmp / "runs")


def _toml(text):
    def go(tmp, mp, rq):
        (tmp / "c.toml").write_text(text)
        load_config(tmp / "c.toml")

    return go


def _recipe_option(tmp, mp, rq):
    import types

    recipe_context(types.SimpleNamespace(recipe="delayed", recipe_options=lambda: {"bogus": 1}))


def _lora_cfg(tmp):
    return load_config(None, ["finetune.method=lora", f"model.path={tmp}"])


def _convert_run(method, merge):
    from dropless.train import generate

    def go(tmp, mp, rq):
        cfg = _lora_cfg(tmp) if method == "lora" else load_config()
        mp.setattr(generate, "load_run", lambda path: (cfg, None, None, None))
        convert(tmp / "run", tmp / "out", merge=merge)

    return go


def _lora_stock_experts_multi_process(tmp, mp, rq):
    import transformers

    from dropless.train.model.lora import apply_lora

    cfg = tiny_moe_config(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=32, moe_intermediate_size=8, num_experts=2,
        num_experts_per_tok=1, norm_topk_prob=False, max_position_embeddings=32768,
        pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    stock = transformers.AutoModelForCausalLM.from_config(cfg)  # not patched: stock experts
    apply_lora(stock, _lora_cfg(tmp).finetune, world=2)


def _no_peft(tmp, mp, rq):
    from dropless.train.model.lora import require_peft

    _hide(mp, "peft")
    require_peft()


def _lora_targets_nothing(tmp, mp, rq):
    from dropless.train.model.lora import lora_targets

    lora_targets(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["experts", "attention"])


def _sft_seq_len(tmp, mp, rq):
    from dropless.train.data.sft import encode_rows

    recs = [{"prompt": "a prompt longer than the rows", "completion": "yes"}]
    encode_rows(recs, "prompt_completion", ByteTokenizer(), 4, "completion", "")


def _no_jinja2(tmp, mp, rq):
    from dropless.train.data.sft import FALLBACK_TEMPLATE, _renderer

    _hide(mp, "jinja2")
    _renderer(FALLBACK_TEMPLATE)


def _chat_template_prefix(tmp, mp, rq):
    from dropless.train.data.sft import encode_rows

    # renders only the number of turns: a conversation is no prefix of its longer turns
    recs = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    encode_rows(recs, "messages", ByteTokenizer(), 16, "completion", "{{ messages|length }}")


def _sft_no_records(tmp, mp, rq):
    from dropless.train.data.sft import RowSampler

    RowSampler(np.zeros((0, 5), np.int64), np.zeros((0, 4), np.int64), seed=0)


TRIGGERS = [
    ("gpu-kind", lambda t, m, r: gpu_kind("a100"), ValueError, "--gpu 'a100': allowed GPU kinds are h100, h200, b200"),
    ("sr-dtype", lambda t, m, r: stochastic_round_to_bf16(torch.zeros(2, dtype=torch.float64)), TypeError, "stochastic rounding takes fp32 input, got torch.float64"),
    ("bf16-adamw-betas", lambda t, m, r: BF16AdamW([torch.nn.Parameter(torch.zeros(2))], betas=(0.9, 1.0)), ValueError, "betas=(0.9, 1.0)"),
    ("collective-op", lambda t, m, r: collectives.all_reduce(torch.zeros(1), op="avg"), ValueError, "all_reduce: op='avg'; expected one of ['max', 'min', 'sum']"),
    ("margin-int", lambda t, m, r: PrecisionConfig(recipe="delayed", margin=1.5), ValueError, "precision.margin=1.5 must be an int >= 0"),
    ("recipe-option", _recipe_option, ValueError, "precision: DelayedScaling.__init__() got an unexpected keyword argument 'bogus'"),
    ("fused-ce", lambda t, m, r: fuse_cross_entropy(torch.nn.Linear(2, 2)), ValueError, "train.fused_cross_entropy=true: enable_fused_cross_entropy needs a Transformers causal LM"),
    ("no-metadata", lambda t, m, r: ckpt.load_checkpoint(t, None), ValueError, "is not a complete dropless checkpoint"),
    ("no-trainer-json", lambda t, m, r: ckpt.read_trainer_state(t), ValueError, "has no readable trainer.json"),
    ("negative", lambda t, m, r: load_config(None, ["train.z_loss_coef=-1"]), ValueError, "train.z_loss_coef=-1.0: must be a number >= 0"),
    ("path-and-config", lambda t, m, r: ModelConfig(path="a", config="b"), ValueError, "model.path and model.config are both set"),
    ("kv-heads", lambda t, m, r: load_config(None, ["model.num_kv_heads=3"]), ValueError, "model.num_heads=4 must be a multiple of model.num_kv_heads=3"),
    ("eval-fraction", lambda t, m, r: load_config(None, ["data.eval_fraction=1.5"]), ValueError, "data.eval_fraction=1.5: must be in (0, 1)"),
    ("bpe-vocab", lambda t, m, r: load_config(None, ["data.bpe_vocab_size=100"]), ValueError, "data.bpe_vocab_size=100: must be an integer >= 300"),
    ("empty-tokenizer", lambda t, m, r: load_config(None, ['data.tokenizer=""']), ValueError, "data.tokenizer is empty"),
    ("timeout", lambda t, m, r: load_config(None, ["parallel.timeout_s=0"]), ValueError, "parallel.timeout_s=0.0: must be a number of seconds > 0"),
    ("force-distributed", lambda t, m, r: ParallelConfig(force_distributed="yes"), ValueError, "parallel.force_distributed='yes' must be true or false"),
    ("string-type", _toml("[data]\npath = 3\n"), ValueError, "data.path=3: expected a string, got int"),
    ("whole-number", lambda t, m, r: load_config(None, ["train.steps=2.5"]), ValueError, "train.steps=2.5: expected an int (a whole number, e.g. 2)"),
    ("list-type", lambda t, m, r: __import__("dropless.train.config.load", fromlist=["_coerce"])._coerce("x.y", 3, list[str]), ValueError, "x.y=3: expected a list"),
    ("no-config-file", lambda t, m, r: load_config(t / "nope.toml"), ValueError, "nope.toml' does not exist; pass a TOML file"),
    ("no-tomli-w", lambda t, m, r: (_hide(m, "tomli_w"), dump_config(load_config(), t / "c.toml")), ModuleNotFoundError, "needs tomli-w: pip install 'dropless[train]'"),
    ("beta", lambda t, m, r: load_config(None, ["optim.decay_fraction=2"]), ValueError, "optim.decay_fraction=2.0: must be in [0, 1]"),
    ("bad-toml", _toml("[train\n"), ValueError, "is not valid TOML:"),
    ("no-stdlib", lambda t, m, r: (m.setattr("dropless.train.data.corpus.stdlib_files", lambda: []), stdlib_corpus(0.1, 100)), ValueError, "the embedded corpus is empty"),
    ("short-held-out", lambda t, m, r: eval_windows(np.arange(5), 8, 64), ValueError, "the held-out data has 5 tokens, fewer than train.seq_len + 1 = 9"),
    ("no-pyarrow", lambda t, m, r: ((t / "a.parquet").write_bytes(b"x"), _hide(m, "pyarrow", "pyarrow.parquet"), read_documents(str(t / "a.parquet"), "text")), ModuleNotFoundError, "needs pyarrow"),
    ("eval-without-path", lambda t, m, r: load_corpus(DataConfig(eval_path="x")), ValueError, "data.eval_path is set but data.path is empty"),
    ("generate-no-checkpoint", lambda t, m, r: resolve_checkpoint(t), ValueError, "has no complete checkpoint (checkpoints/step_*)"),
    ("no-run-config", _no_run_config, ValueError, ": not a dropless training run"),
    ("temperature", lambda t, m, r: sample(None, ByteTokenizer(), "x", temperature=-1), ValueError, "temperature, top_k and max_new_tokens must be >= 0"),
    ("convert-not-empty", _convert_not_empty, ValueError, "out' is not empty; pass a new or empty directory"),
    ("no-tensorboard", lambda t, m, r: (_hide(m, "torch.utils.tensorboard"), MetricsWriter(t, True, None)), ModuleNotFoundError, "log.tensorboard=true needs tensorboard"),
    ("no-hf-dir", lambda t, m, r: hf_config(ModelConfig(path=str(t)), 10), ValueError, "expected a local Hugging Face directory with config.json"),
    ("dense-model", _dense, ValueError, "Qwen3ForCausalLM has no Mixture-of-Experts layers"),
    ("no-transformers", lambda t, m, r: (_hide(m, "transformers"), require_transformers()), ModuleNotFoundError, "dropless train needs transformers"),
    ("stock-expert-bias", _stock_bias, ValueError, "train.expert_bias_rate > 0 with model.implementation='stock' needs routers with their own score bias"),
    ("no-matplotlib", lambda t, m, r: (_hide(m, "matplotlib"), plot_losses([], t / "l.png")), ModuleNotFoundError, "plots need matplotlib"),
    ("no-free-name", _no_free_name, ValueError, "could not find a free run directory name"),
    ("no-run-to-resume", _no_run_to_resume, ValueError, "--resume without --run-dir: no run with a checkpoint"),
    ("tokenizer-vocab-dir", lambda t, m, r: __import__("dropless.train.data.tokenizer", fromlist=["x"]).vocab_size(load_config(None, [f"data.tokenizer={t / 'nope'}"]), t), ValueError, "nope': not 'bpe', 'bytes', 'dna' or an existing tokenizer directory"),
    ("dropped", _dropped, RuntimeError, "step 5: 9 (token, expert) pairs of 16 were not computed by the experts"),
    ("no-tokenizers", lambda t, m, r: (_hide(m, "tokenizers"), _require_tokenizers()), ModuleNotFoundError, "the BPE tokenizer needs the `tokenizers` package"),
    ("no-tokenizer-json", lambda t, m, r: HFTokenizer.from_dir(t), ValueError, "has no tokenizer.json; pass a directory saved by a Hugging Face fast tokenizer"),
    ("tokenizer-dir", lambda t, m, r: build_tokenizer(str(t / "nope"), t / "tok", list, 300), ValueError, "nope': not 'bpe', 'bytes', 'dna' or an existing tokenizer directory"),
    ("num-chunks", lambda t, m, r: ExpertParallelDispatcher(num_chunks=0), ValueError, "num_chunks=0 must be an int >= 1"),
    ("ep-group-size", _ep_group_size, ValueError, "num_experts=3 is not divisible by the EP group size 2"),
    ("ep-experts-init", _ep_experts("init"), RuntimeError, "takes its weights from the full module"),
    ("ep-experts-forward", _ep_experts("forward"), RuntimeError, "holds only this rank's experts"),
    ("ep-experts-type", _ep_experts("type"), TypeError, "experts must be a dropless GroupedExperts, got Linear"),
    ("ep-experts-split", _ep_experts("split"), ValueError, "num_experts=3 is not divisible by parallel.ep=2"),
    ("no-process-group", lambda t, m, r: build_mesh(ParallelConfig()), RuntimeError, "build_mesh needs torch.distributed initialised"),
    ("lora-targets-config", lambda t, m, r: load_config(None, ['finetune.lora_targets=["mlp"]']), ValueError, "finetune.lora_targets=['mlp']: give one or more of 'experts', 'attention'"),
    ("lora-no-model-path", lambda t, m, r: load_config(None, ["finetune.method=lora"]), ValueError, "finetune.method='lora' needs a checkpoint to adapt: set model.path=DIR"),
    ("convert-lora-no-merge", _convert_run("lora", merge=False), ValueError, "run' is a LoRA run: its checkpoints hold the adapters only. Pass --merge"),
    ("convert-full-merge", _convert_run("full", merge=True), ValueError, "run' is a full fine-tuning run (finetune.method='full'), there is no adapter to merge; drop --merge"),
    ("lora-targets-nothing", _lora_targets_nothing, ValueError, "finetune.lora_targets=['experts', 'attention'] matches nothing in Sequential"),
    ("no-peft", _no_peft, ModuleNotFoundError, "finetune.method='lora' needs peft: pip install 'dropless[lora]'"),
    ("lora-stock-experts-multi-process", _lora_stock_experts_multi_process, ValueError, "finetune.method='lora' on 2 processes needs every experts module on dropless's fused expert MLP"),
    ("sft-seq-len", _sft_seq_len, ValueError, "train.seq_len=4 cuts every sample before its completion tokens"),
    ("no-jinja2", _no_jinja2, ModuleNotFoundError, "chat-formatted data needs jinja2: pip install 'dropless[lora]'"),
    ("chat-template-prefix", _chat_template_prefix, ValueError, "the chat template does not render a conversation as a prefix of its longer turns"),
    ("sft-no-records", _sft_no_records, ValueError, "the supervised data has no records; point data.path at .jsonl data"),
]  # fmt: skip


@pytest.mark.parametrize(
    "trigger, exc, text", [t[1:] for t in TRIGGERS], ids=[t[0] for t in TRIGGERS]
)
def test_trigger(trigger, exc, text, tmp_path, monkeypatch, request):
    with pytest.raises(exc) as e:
        trigger(tmp_path, monkeypatch, request)
    assert text in str(e.value)
