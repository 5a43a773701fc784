"""The section files of `dropless bench ...` (benchmarks/sections/, from which BENCHMARKS.md is
made), written when a bench runs from a checkout with `--record` or `--section FILE` (not in
the wheel: `bench.common.write_section` hands over the run's record and printed text):
`layer`, `e2e`, `lora` and `memory` keep one block per shape (`replace_block`); the others
are their title, the run's provenance and the text the bench printed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from dropless.bench.common import HISTORY_IN_CHECKOUT, find_checkout, load_sentence


def date_of(record: dict) -> str:
    """'YYYY-MM-DD HH:MM UTC' of a record, for section headers."""
    return record["date"][:16].replace("T", " ") + " UTC"


def provenance(record: dict) -> str:
    """Command, commit (dirty or not), machine and date of a record, for a section header."""
    m = record["machine"]
    commit = record.get("commit") or "unknown commit"
    if record.get("dirty"):
        commit += " + uncommitted changes"
    gpu = f", {m['gpu']}" if "gpu" in m else ""
    return (
        f"Command: `{record['command']}`  \n"
        f"Commit {commit}; {m['cpu']}, {m['cores']} cores{gpu}, torch {m['torch']}, "
        f"python {m['python']}; {date_of(record)}.  \n"
        f"{load_sentence(record['load'])}"
    )


def section_path(section: str | None, name: str, rec) -> Path | None:
    """The section file a benchmark writes: the one given; by default the checkout's, and
    only with `--record` and when the run's history line went to the checkout's history
    (a section's figures always have their line)."""
    if section:
        return Path(section)
    root = find_checkout(rec.package_dir)
    if root is None or rec.path != root / HISTORY_IN_CHECKOUT:
        print(
            f"section: not written (--record writes benchmarks/sections/{name}.md, "
            "--section FILE writes FILE)",
            file=sys.stderr,
        )
        return None
    return root / "benchmarks" / "sections" / f"{name}.md"


def write_section(path: Path, text: str) -> None:
    """Write a whole section file and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"section: wrote {path}", file=sys.stderr)


def write(name: str, section: str | None, rec, record: dict, *text: str) -> None:
    """The section NAME of one run (`bench.common.write_section`), at `section_path`."""
    path = section_path(section, name, rec)
    if path is None:
        return
    if name in PLAIN:
        title, prose = PLAIN[name]
        head = f"{title}\n\n{provenance(record)}{prose(record['figures'])}\n\n"
        write_section(path, head + text[0])
    else:
        globals()[name](path, record, *text)


LAYER_TITLE = """## One MoE layer, forward + backward (`dropless bench layer`)

Each row in a fresh child process every round, the order rotated between rounds (a row's
ms: the median over rounds of its child's median step after a warm-up; its ratios: the
median of the per-round ratios, min-max and best-of-rounds; a table whose command has no
`--steps` ran the rows interleaved in one process): `dropless.MoE` (`dropless`: the default path for the device;
`dropless-grouped`: the same fused Function on `torch._grouped_mm`), two experts-path
variants with the same router, run from a checkout (`composed`: argsort + `grouped_mm` autograd nodes +
combine; `bmm-padded`: bmm over experts padded to the largest count), Hugging Face v5
`Qwen3MoeSparseMoeBlock` (`experts_implementation="grouped_mm"` and `"eager"`, same
weights, same routes), and the dense bound: exactly six dense `torch.mm` with M = T*K rows
(gate/up and down forward, both input gradients, the layer's dx included, and both weight
gradients: 18*T*K*D*F FLOPs), on operands allocated before the clock starts, with no
routing, gather, SwiGLU or combine. Each row's rate counts those FLOPs; the machine's
dense matmul rate (`torch.matmul`, square, the shape's dtype; cuBLAS on CUDA) is measured
in the same run. Rows asked for by name (the GPU tables): `grouped_mm-plain` (argsort +
`torch._grouped_mm` + index_add written plainly), `dropless` under a recipe
(`dropless-fp8-current-row`, `dropless-fp8-delayed`: E4M3; `dropless-mxfp8-saved`: MXFP8
with FP8 saved activations) and with the eager row ops (`dropless-eager-row-ops`), and the
peers (`liger-moe`: Liger-Kernel's fused MoE experts, one kernel config each unless
LIGER_FUSED_MOE_AUTOTUNE=1 asks for its autotuning; `torchao-fp8-row`: torchao's FP8
row-wise grouped GEMM on expert rows padded to 16), which run only from a checkout, where
their package imports and CUDA is there (otherwise named, with the version looked for). Peak
memory: on CPU each implementation once more in its own child process, VmHWM (reset
through /proc/self/clear_refs) minus VmRSS once inputs and weights are allocated; on CUDA
one more step in the same process, max_memory_allocated minus memory_allocated before it.
Skewed rows: a router bias sends about half the pairs to 4 experts. `--profile`: one bf16
(the shape's dtype) and one FP8 step (`dropless`, `dropless-fp8-current-row`) under
torch.profiler, a table per step of its kernels (on CPU: aten operators) with calls, total
ms and share. Tables written before the six-GEMM bound, the rate columns or the peer rows
existed show none of them; a row absent from a table has not run on that device.

Peers carried to the GPU machine as wheels (`python -m tools.peers download peers/`;
`scripts/gpu_check.py` installs them with `pip install --no-deps --target`):
Liger-Kernel 0.8.5, Cut Cross-Entropy 25.1.1 (both `py3-none-any`), torchao 0.18.0 (one
`abi3` wheel, built for torch >= 2.11). SonicMoE cannot be carried (sonic-moe 0.1.2 pins
torch <= 2.9.1 and needs a 74 MB CUTLASS DSL wheel); its published figures, not measured
here and not at this shape: on Hopper, 45% less activation memory and 1.86x the compute
throughput of ScatterMoE's bf16 MoE kernel for a fine-grained 7B MoE (Guo et al., "SonicMoE:
Accelerating MoE with IO and Tile-aware Optimizations", arXiv:2512.14080, abstract); 1.87-4.04x
the speed of ScatterMoE and MoMoE (Dao AI Lab, "SonicMoE" Blackwell blog post, 2026-04-22)."""

E2E_TITLE = """## End to end: a Qwen3-MoE training step, stock Transformers v5 vs `dropless.patch()`

Peer rows, on the stock `grouped_mm` model: `liger` (Liger-Kernel 0.8.5's RMSNorm and fused
linear cross-entropy), `liger-moe` (the same and its fused MoE experts), `cce` (Cut
Cross-Entropy 25.1.1's loss on the final hidden states, plus the router auxiliary loss as
stock adds it). They run only from a checkout (tools/peers.py), where their package
imports and CUDA is there; a run names the others with the version it looked for.
`--profile`: one training step each of the stock `grouped_mm` and the `dropless` rows under
torch.profiler, side by side (per operator or kernel: ms and share). A row absent from a
table has not run on that device."""

MEMORY_TITLE = """## Long sequences: peak step memory per token (`dropless bench memory`)

The pinned Qwen3-MoE model at batch 1 and long sequence lengths, one training step
(forward, backward, AdamW) per implementation and length, each in its own child
process, no warm-up. Peak step memory: VmHWM (reset through /proc/self/clear_refs)
minus VmRSS before the step (model, AdamW state and inputs allocated), with glibc
serving blocks >= 128 KiB by mmap from the child's start so RSS follows live tensors. Bytes per token = peak
step memory / sequence length. A run that exceeds the memory limit is recorded as out
of memory (OOM), not retried."""
LORA_TITLE = "## LoRA fine-tuning step: stock PEFT vs PEFT + `dropless.patch()`"


def replace_block(path: Path, key: str, block: str, name: str, title: str) -> None:
    """Write the section file as `title` plus its blocks (each delimited by
    <!-- name:key --> ... <!-- /name:key -->), `block` replacing the one of the same key.
    Only generated text survives: anything outside the blocks is dropped."""
    pattern = re.compile(
        rf"<!-- {re.escape(name)}:(\S+) -->\n.*?<!-- /{re.escape(name)}:\1 -->\n", re.S
    )
    old = path.read_text() if path.exists() else ""
    blocks = {m.group(1): m.group(0) for m in pattern.finditer(old)}
    blocks[key] = block if block.endswith("\n") else block + "\n"
    write_section(path, title + "\n\n" + "\n".join(blocks.values()))


def layer(path: Path, record: dict, table: str) -> None:
    f = record["figures"]
    key = f["shape"] + ("" if f.get("busy_core") is None else "-busy-core")
    block = f"<!-- layer:{key} -->\n{provenance(record)}\n\n{table}<!-- /layer:{key} -->\n"
    replace_block(path, key, block, "layer", LAYER_TITLE)


def model_line(s: dict) -> str:
    """The shape of a bench's model (`figures["shape"]`), as the e2e and memory sections open."""
    return (
        f"Model (config object, random weights): vocab {s['vocab_size']}, hidden {s['hidden_size']}, "
        f"{s['num_hidden_layers']} layers, {s['num_attention_heads']} heads / {s['num_key_value_heads']} KV "
        f"heads, head_dim {s['head_dim']}, {s['num_experts']} experts top-{s['num_experts_per_tok']}, "
        f"moe_intermediate_size {s['moe_intermediate_size']}, untied embeddings; "
    )


def e2e(path: Path, record: dict, table: str, summary: str) -> None:
    """Replace this shape's block of the section file (the other shape's block is kept)."""
    f = record["figures"]
    s = f["shape"]
    device = f.get("device", "cpu")
    key = f"{s['num_experts']}e-top{s['num_experts_per_tok']}" + ("-quick" if f["quick"] else "")
    key += "" if device == "cpu" else f"-{device}"
    where = "fp32 on CPU" if device == "cpu" else f"bf16 on {device.upper()}"
    memory = (
        "Peak step memory: separate children, VmHWM minus VmRSS before the step, with glibc "
        "serving blocks >= 128 KiB by mmap from the child's start so RSS follows live tensors."
        if device == "cpu"
        else "Peak step memory: the CUDA caching allocator's max_memory_allocated above "
        "memory_allocated before the step (weights and AdamW state), in the timing child."
    )
    block = "\n".join(
        [
            f"<!-- e2e:{key} -->",
            f"### {s['num_experts']} experts top-{s['num_experts_per_tok']}"
            + ("" if device == "cpu" else f", {device.upper()}"),
            "",
            provenance(record),
            "",
            model_line(s) + f"batch {s['batch']} x seq "
            f"{s['seq']}, {where}, {f['threads']} torch thread(s); forward + backward + "
            f"AdamW ({f['optimizer']}).  ",
            "Timing: each row in a fresh child process every round under the default allocator, "
            f"order rotated; rounds per row {f['rounds_per_impl']}, {f['steps']} timed "
            "step(s) each after a warm-up (tokens/s: median over rounds; best = the fastest step "
            "seen). "
            + (
                "Ratios: the median of the per-round ratios against the stock row of the same "
                "round with the same AdamW, min-max and best-of-rounds beside it. "
                if "verdict" in f
                else ""
            )
            + memory,
            "",
            table,
            "",
            summary + (" (--quick: a tiny smoke shape, not a result.)" if f["quick"] else ""),
            f"<!-- /e2e:{key} -->",
            "",
        ]
    )
    replace_block(path, key, block, "e2e", E2E_TITLE)


def memory_summary(figures: dict) -> str:
    ratios = figures.get("dropless_vs_stock_ckpt") or {}
    if not ratios:
        return "No dropless / stock-with-checkpointing ratio (a row is missing or out of memory)."
    shown = ", ".join(f"**{r:.2f}x** at {seq}" for seq, r in ratios.items())
    return f"dropless peak step memory vs stock with its activation checkpointing: {shown}."


def memory(path: Path, record: dict, table: str) -> None:
    f = record["figures"]
    s = f["shape"]
    key = "tiny" if f["tiny"] else "pinned"
    block = "\n".join(
        [
            f"<!-- memory:{key} -->",
            f"### Sequence lengths {', '.join(map(str, f['seq_lens']))}"
            + (
                " (--tiny: a smoke run, not a result; every row in one process)"
                if f["tiny"]
                else ""
            ),
            "",
            provenance(record),
            "",
            model_line(s) + "batch 1, fp32 on "
            f"CPU, {f['threads']} torch thread(s), AdamW (fused). Memory limit per child: "
            f"{f['max_rss_gib']:g} GiB. Step time: one step, no warm-up, under the memory-tracking "
            "allocator settings (an indication, not a speed figure).",
            "",
            table,
            "",
            memory_summary(f),
            f"<!-- /memory:{key} -->",
            "",
        ]
    )
    replace_block(path, key, block, "memory", MEMORY_TITLE)


def lora(path: Path, record: dict, table: str, summary: str) -> None:
    f = record["figures"]
    s = f["shape"]
    key = "lora" + ("-quick" if f["quick"] else "")
    block = "\n".join(
        [
            f"<!-- lora:{key} -->",
            provenance(record),
            "",
            f"Model (config object, random weights): vocab {s['vocab_size']}, hidden {s['hidden_size']}, "
            f"{s['num_hidden_layers']} layers, {s['num_experts']} experts top-{s['num_experts_per_tok']}, "
            f"moe_intermediate_size {s['moe_intermediate_size']}; batch {s['batch']} x seq {s['seq']}, fp32 "
            f"on CPU, {f['threads']} torch thread(s). LoRA r={f['rank']} (alpha {2 * f['rank']}) on the "
            f"experts (`target_parameters`) and q/k/v/o (`target_modules`); AdamW "
            f"({f.get('optimizer', 'fused')}) on the trainable parameters.  ",
            "Timing: each row in a fresh child process every round under the default allocator, "
            f"order rotated, {f['rounds']} rounds x {f['steps']} timed step(s) after a warm-up "
            "(median; ratios: the median of the per-round ratios against stock PEFT with the same "
            "AdamW). Peak step "
            "memory: separate children, VmHWM minus VmRSS before the step, glibc serving blocks "
            ">= 128 KiB by mmap from the child's start.",
            "",
            table,
            "",
            summary + (" (--quick: a tiny smoke shape, not a result.)" if f["quick"] else ""),
            f"<!-- /lora:{key} -->",
            "",
        ]
    )
    replace_block(path, key, block, "lora", LORA_TITLE)


# the sections whose body is the text the bench printed: (title, what follows the provenance)
PLAIN = {
    "fp8": (
        "## FP8 / MXFP8 saved activations (`dropless bench fp8`)",
        lambda f: (
            f"\n\nOne MoE layer, {', '.join(f'{k}={v}' for k, v in f['shape'].items())}, bf16 "
            "weights and input. Memory: the bytes of every tensor "
            "autograd keeps from forward to backward, counted with "
            "`torch.autograd.graph.saved_tensors_hooks` (each storage once; parameters and views "
            "of them left out), for the layer's whole forward (router, losses, experts), then a "
            "backward to check it runs; exact and allocator independent, so CPU measures it. "
            "FP8 rows: the recipe with `fp8_saved_activations=True`, through `dropless.MoE`, "
            "whose expert MLP is handed `x_TD` and the token indices under a recipe. Seconds: "
            "wall time of that forward+backward on this machine (emulated FP8 on CPU), not a "
            "speed claim."
        ),
    ),
    "train": (
        "## `dropless train` (the default config, briefly: `dropless bench train`)",
        lambda f: (
            "\n\nThe run's own summary; config overrides: "
            + ", ".join(f"`{o}`" for o in f["overrides"])
            + "."
        ),
    ),
    "parallel": (
        "## Expert parallelism: time split with and without overlap (`dropless bench ep`)",
        lambda f: (
            "\n\nOne expert-parallel MoE layer (fp32, forward + backward) in `--world` processes on "
            "this machine, gloo on loopback. Three settings side by side in the same processes: "
            "the plain dispatch (1 chunk), 4 chunks without overlap, 4 chunks with overlap. The "
            "split is forward wall time per phase; a phase that waits for a transfer counts the "
            "wait. Bytes: activations sent by rank 0 in the forward (dispatch + combine); the "
            "backward sends as many again."
        ),
    ),
    "jax": (
        "## JAX layer (CPU, fp32)",
        lambda f: (
            f"  \njax {f['rows'].get('dropless', {}).get('jax', '?')}. Shape: {f['shape']}. Median "
            "of the timed rounds after an AOT compile; each row in its own child process, peak RSS "
            "of that process (and above the runtime it imported before any array)."
        ),
    ),
    "tuning": ("## Expert GEMM tuning (`dropless bench tune`)", lambda f: ""),
}
