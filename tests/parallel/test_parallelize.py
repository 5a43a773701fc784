"""`dropless.parallelize` inside the trainers people use: each script of examples/ (`ep_*.py`)
under `torchrun --nproc-per-node 2` on gloo with ep=2 gives the losses and gradient norms
of the same script on one process (fp32, 6 steps, 2 micro-batches each, clipping active),
and the model it saves loads in stock `from_pretrained` with that run's weights; a LoRA run
through Transformers' Trainer writes the one-process adapter, which stock PEFT loads; TRL's
GRPOTrainer trains and saves, and on completions fixed to be the same for any number of
processes gives one process's gradient norms and weights. With `--cp 2` (each sequence
over both processes; ep=2 spanning them) the Trainer, SFTTrainer and accelerate scripts
equal their one-process runs too, both sides in float64 (`_equal_to_one_process_cp`).
Also: the refusals of `parallelize`.

Start-ups are shared (`_checks_parallelize_runs.py` runs several scripts' `main` in one
process): one child runs the refusals and the one-process references (the plain loop, the
Trainer, SFTTrainer and accelerate scripts, the Trainer with LoRA, the float64 references
of the cp runs), one torchrun of 2 the
Trainer-based scripts (Trainer, Trainer with LoRA, SFTTrainer, GRPOTrainer) and the cp
runs (accelerate's last: it ends its process group); the loop and accelerate scripts at
ep=2 have a torchrun each."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from dropless.hf.distributed.parallelize import check_sizes  # noqa: E402
from harness import run_python, torchrun  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENV = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, proc.stdout[-2000:]
    return json.loads(line[-1][len("RESULT ") :])


def _same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"experts_implementation": "eager"}  # stock, whatever this process patched
    ma, info = AutoModelForCausalLM.from_pretrained(a, output_loading_info=True, **kw)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    sa = ma.state_dict()
    sb = AutoModelForCausalLM.from_pretrained(b, **kw).state_dict()
    assert sa.keys() == sb.keys()
    # atol: Adam divides each element's step by its gradient's RMS, so an element whose
    # gradient is near zero turns a summation-order difference (2 processes vs 1) into a
    # visible one: TRL's SFT run moved one embedding element 2.5e-6 apart on one CPU. 1e-5
    # is a thousandth of one step at the scripts' lr 1e-2; a wrong gradient moves whole steps.
    for k in sa:
        msg = lambda m, k=k: f"{k}: {m}"  # noqa: E731
        torch.testing.assert_close(sa[k], sb[k], rtol=1e-5, atol=atol, msg=msg)


RUNS = Path(__file__).with_name("_checks_parallelize_runs.py")
GRPO_FIXED = str(Path(__file__).with_name("_grpo_fixed_completions.py"))
GRPO_ARGS = "--steps 3 --grad-accum 1"
ERRORS = Path(__file__).with_name("_checks_parallelize_errors.py")
LORA = "--lora 4 --max-grad-norm 0.15"  # LoRA's gradient norms are ~0.2: clipping active
#: the cp runs and their one-process references: float64 (`_equal_to_one_process_cp`)
F64 = "--dtype float64"


def _has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def _has_accelerate() -> bool:
    import importlib.util

    return importlib.util.find_spec("accelerate") is not None


def _runs(launch, out: Path, runs: dict, first: tuple = ()) -> tuple[dict, str]:
    """({name: (its result, its output dir)}, stdout) of `runs` ({name: (script, args)}),
    after the `first` (script, args) pairs, launched together by `launch(argv)`."""
    argv = [RUNS, *first]
    for name, (script, args) in runs.items():
        argv += [script, f"{args} --out {out / name}"]
    proc = launch(argv)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {n: (json.loads((out / n / "losses.json").read_text()), out / n) for n in runs}
    return got, proc.stdout


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    """The one-process runs, in one child: the refusals first (they need dropless not yet
    patched), then each script's one-process reference (the loop, Trainer, SFTTrainer and
    accelerate scripts compute the same steps: same data, AdamW without weight decay, the
    same clipping, fp32), the Trainer with LoRA, and the float64 references of the cp runs
    (the Trainer, SFTTrainer and accelerate scripts)."""
    out = tmp_path_factory.mktemp("one")
    runs = {
        "accelerate": ("ep_accelerate.py", ""),
        "accelerate_f64": ("ep_accelerate.py", F64),
        "loop": ("ep_torch_loop.py", ""),
        "trainer": ("ep_hf_trainer.py", ""),
        "trainer_f64": ("ep_hf_trainer.py", F64),
        "lora": ("ep_hf_trainer.py", LORA),
    }
    if _has_trl():
        runs["sft"] = ("ep_trl_sft.py", "")
        runs["sft_f64"] = ("ep_trl_sft.py", F64)
        runs["grpo_fixed"] = (GRPO_FIXED, GRPO_ARGS)  # last: it patches GRPOTrainer
    launch = lambda argv: run_python(argv, env=ENV, timeout=400)  # noqa: E731
    got, stdout = _runs(launch, out, runs, first=(str(ERRORS), ""))
    got["refusals"] = "OK" in stdout.splitlines()
    return got


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    """The Trainer-based scripts on 2 processes at ep=2, then the cp=2 runs, in one torchrun."""
    out = tmp_path_factory.mktemp("two")
    runs = {
        "trainer": ("ep_hf_trainer.py", "--save-steps 3"),  # resumable checkpoints
        "resumed": ("ep_hf_trainer.py", f"--resume {out / 'trainer' / 'checkpoint-3'}"),
        "lora": ("ep_hf_trainer.py", LORA),
    }
    if _has_trl():
        runs["sft"] = ("ep_trl_sft.py", "")
        runs["grpo"] = ("ep_trl_grpo.py", GRPO_ARGS)
        runs["sft_cp"] = ("ep_trl_sft.py", f"--cp 2 {F64}")
    runs["trainer_cp"] = ("ep_hf_trainer.py", f"--cp 2 {F64}")
    if _has_trl():  # after the GRPO and SFT runs: it patches GRPOTrainer
        runs["grpo_fixed"] = (GRPO_FIXED, GRPO_ARGS)
    if _has_accelerate():  # last: it ends the process group
        runs["accelerate_cp"] = ("ep_accelerate.py", f"--cp 2 {F64}")
    return _runs(lambda argv: torchrun(2, argv, env=ENV, timeout=500), out, runs)[0]


def _equal_to_one_process(got, ref, weights_atol: float = 1e-5) -> None:
    (got, two), (ref, one) = got, ref
    assert (ref["world"], got["world"]) == (1, 2)
    assert len(got["losses"]) == 6
    assert got["losses"][0] == pytest.approx(ref["losses"][0], rel=1e-6)
    assert got["grad_norms"][0] == pytest.approx(ref["grad_norms"][0], rel=1e-6)
    assert got["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert min(ref["grad_norms"]) > 0.5  # --max-grad-norm 0.5: clipping was active
    _same_weights(two / "final", one / "final", weights_atol)


def _equal_to_one_process_cp(got, ref) -> None:
    """A cp run against its one-process run, both in float64. The cp attention sums in
    another order (each chunk against the gathered prefix and against itself, merged by
    log-sum-exp: parallel/context/blockwise.py), and in fp32 Adam turns that rounding into
    visible weight differences where a gradient is near zero (one element of layer 1's
    expert 7 down_proj, first-step gradient 4.0e-9 against Adam's eps 1e-8, ended 1.10e-5
    from one process after the 6 steps under SFTTrainer, 1.21e-5 under accelerate); in
    float64 the same runs end within 1e-15 (Trainer, accelerate) and 1.1e-7 (SFTTrainer).
    So 1e-5 checks what cp must get right (the same samples, global positions, the loss
    over the whole sequences), not the fp32 rounding."""
    from safetensors import safe_open

    for _, out in (got, ref):
        for f in (out / "final").glob("*.safetensors"):
            with safe_open(f, "pt") as st:
                assert {st.get_slice(k).get_dtype() for k in st.keys()} == {"F64"}, f
    _equal_to_one_process(got, ref)


def _torchrun_alone(script: str, tmp_path: Path):
    two = tmp_path / "two"
    proc = torchrun(2, [EXAMPLES / script, "--out", two], env=ENV, timeout=300)
    return _result(proc), two


def test_torch_loop_ep2_equals_one_process(tmp_path, one):
    _equal_to_one_process(_torchrun_alone("ep_torch_loop.py", tmp_path), one["loop"])


def test_hf_trainer_ep2_equals_one_process(one, two):
    _equal_to_one_process(two["trainer"], one["trainer"])


def test_hf_trainer_resumes_exactly(one, two):
    """`--save-steps 3` (Trainer's `save_only_model` checkpoints plus the optimizer and the
    scheduler by `dropless.hf.trainer_checkpoints()`), then a new 2-process run with
    `--resume .../checkpoint-3`: steps 4-6 give the uninterrupted run's losses and gradient
    norms, and the final weights are the one-process ones."""
    (full, _), (resumed, out) = two["trainer"], two["resumed"]
    assert len(resumed["losses"]) == 3, resumed
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-6)
    assert resumed["grad_norms"] == pytest.approx(full["grad_norms"][3:], rel=1e-6)
    assert (out.parent / "trainer" / "checkpoint-3" / "dropless_optimizer").is_dir()
    _same_weights(out / "final", one["trainer"][1] / "final")


def test_accelerate_ep2_equals_one_process(tmp_path, one):
    pytest.importorskip("accelerate")
    _equal_to_one_process(_torchrun_alone("ep_accelerate.py", tmp_path), one["accelerate"])


def test_hf_trainer_lora_ep2_equals_one_process(one, two):
    """`--lora 4` (experts and attention, base frozen) under Transformers' Trainer: 2
    processes at ep=2 give one process's losses and gradient norms (clipping active) and
    the same adapter file, written by `trainer.save_model`; stock PEFT on the stock model
    loads it and gives the trained model's logits, which the adapter moved."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    (a_run, a_dir), (b_run, b_dir) = one["lora"], two["lora"]
    assert (a_run["world"], b_run["world"], len(b_run["losses"])) == (1, 2, 6)
    assert b_run["losses"] == pytest.approx(a_run["losses"], rel=1e-5)
    assert b_run["grad_norms"] == pytest.approx(a_run["grad_norms"], rel=1e-5)
    assert min(a_run["grad_norms"]) > 0.15  # clipping was active
    a = load_file(a_dir / "final" / "adapter_model.safetensors")
    b = load_file(b_dir / "final" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and any("experts" in k for k in a) and any("q_proj" in k for k in a)
    # atol as in `_same_weights` (Adam turns summation-order differences in near-zero
    # gradients into visible ones): the loss's own rounding moved one expert's lora_A
    # element 1.06e-5 apart, a thousandth of one step at lr 1e-2
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=2e-5, msg=k)
    ids = torch.arange(16).reshape(2, 8) % 128  # the examples' probe batch
    stock = AutoModelForCausalLM.from_pretrained(b_dir / "init", experts_implementation="eager")
    with torch.no_grad():
        before = stock(input_ids=ids).logits
        after = PeftModel.from_pretrained(stock, b_dir / "final")(input_ids=ids).logits
    for run in (a_run, b_run):
        torch.testing.assert_close(after, torch.tensor(run["probe_logits"]), rtol=1e-5, atol=1e-6)
    assert (after - before).abs().max() > 1e-2  # the adapter changed the logits


def test_trl_sft_ep2_equals_one_process(one, two):
    """TRL's SFTTrainer in fp32 (`bf16=False`: its SFTConfig defaults to bf16 autocast,
    whose rounding made 2 processes drift from one by ~1e-3)."""
    pytest.importorskip("trl")
    _equal_to_one_process(two["sft"], one["sft"])


def test_hf_trainer_cp2_equals_one_process(one, two):
    """Transformers' Trainer with `--cp 2` (ep=2 over the same 2 processes): both read the
    same samples (the data-parallel size accelerate's loader and Trainer's counts see is 1),
    each its half of every sequence. The data loader over dp x cp groups is checked at
    dp 2 x cp 2 in `_checks_cp.cp_whole_sequences`."""
    _equal_to_one_process_cp(two["trainer_cp"], one["trainer_f64"])


def test_trl_sft_cp2_ep2_equals_one_process(one, two):
    pytest.importorskip("trl")
    _equal_to_one_process_cp(two["sft_cp"], one["sft_f64"])


def test_accelerate_cp2_equals_one_process(one, two):
    pytest.importorskip("accelerate")
    _equal_to_one_process_cp(two["accelerate_cp"], one["accelerate_f64"])


def test_trl_grpo_ep2_trains_and_saves(two):
    """TRL's GRPOTrainer at ep=2 on 2 processes: completions from the model's own `generate`
    (each decoding step's all-to-all in lockstep across ranks), a reward, 3 optimizer steps
    with nonzero gradients and finite losses, and a saved model stock `from_pretrained` loads
    whole, moved from its initial weights. Not compared with one process: each rank samples
    its completions from its own random stream, so the completions depend on the number of
    processes (`test_trl_grpo_ep2_fixed_completions_equal_one_process` fixes them)."""
    pytest.importorskip("trl")
    import torch
    from transformers import AutoModelForCausalLM

    got, out = two["grpo"]
    assert got["world"] == 2 and len(got["losses"]) == 3, got
    assert all(abs(x) < 10 for x in got["losses"]) and max(got["grad_norms"]) > 0, got
    _same_weights(out / "final", out / "final")  # loads with no missing or unexpected key
    a = AutoModelForCausalLM.from_pretrained(out / "final").state_dict()
    b = AutoModelForCausalLM.from_pretrained(out / "init").state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a if "experts" in k)


def test_trl_grpo_ep2_fixed_completions_equal_one_process(one, two):
    """GRPOTrainer at ep=2 on completions that do not depend on the number of processes
    (`_grpo_fixed_completions.py`: generation replaced by a function of the prompt and the
    copy's index; the rest is TRL's: rewards, group advantages, the policy loss and its
    gradients): one process's gradient norms (clipping active), losses (on-policy GRPO's are
    ~0: the advantages of a group sum to zero) and final weights."""
    pytest.importorskip("trl")
    (got, two_dir), (ref, one_dir) = two["grpo_fixed"], one["grpo_fixed"]
    assert (ref["world"], got["world"], len(got["losses"])) == (1, 2, 3), got
    assert got["grad_norms"] == pytest.approx(ref["grad_norms"], rel=1e-5)
    assert min(ref["grad_norms"]) > 0.5  # --max-grad-norm 0.5: clipping was active
    assert got["losses"] == pytest.approx(ref["losses"], abs=1e-6)
    _same_weights(two_dir / "final", one_dir / "final")


def test_refusals(one):
    assert one["refusals"]  # the child's checks printed OK (`_checks_parallelize_errors.py`)
    # dropless train's checks (parallel.mesh.resolve_sizes), in parallelize's keywords
    with pytest.raises(ValueError, match=r"ep=4 must divide the processes of each replica .* = 2"):
        check_sizes(4, 1, 2, 8)
    with pytest.raises(ValueError, match=r"num_experts=6 .* ep=4.*pick ep from \[1, 2\]"):
        check_sizes(4, 1, 4, 6)
    with pytest.raises(
        ValueError, match=r"parallelize: dp_replicate=3 does not divide the world size 4"
    ):
        check_sizes(1, 3, 4, 8)
    check_sizes(2, 2, 8, 8)  # 2 replicas of 4 processes, 4 experts per rank


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
