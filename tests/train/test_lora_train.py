"""`dropless train` LoRA fine-tuning of a saved tiny Qwen3-MoE: the loss goes down,
checkpoints hold only the adapters, resume is exact, stock PEFT loads the adapter the
run writes, and `dropless convert --merge` writes a merged stock model."""

import shutil

import pytest
import torch

from dropless.cli.main import main
from harness import read_metrics, tiny_args, tiny_moe_config

peft = pytest.importorskip("peft")

VOCAB = 264  # the byte tokenizer's 257 ids fit


def _saved(path):
    import transformers as tf

    cfg = tiny_moe_config(
        vocab_size=VOCAB, num_experts=4, norm_topk_prob=False, pad_token_id=None, bos_token_id=None
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    src = _saved(root / "src")
    run = root / "run"
    args = tiny_args(
        f"model.path={src}", "finetune.method=lora", "finetune.lora_rank=4", "train.steps=6",
        "train.seq_len=16", "train.batch_size=2", "optim.warmup_steps=1", "optim.lr=2e-2",
        "log.every=2", "checkpoint.every=2", "checkpoint.keep=3", "log.plots=false",
        "log.tensorboard=false",
    )  # fmt: skip
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # module fixtures run before the per-test one-thread fixture
    try:
        assert main(["train", "--run-dir", str(run), *args]) == 0
    finally:
        torch.set_num_threads(n)
    return src, run


def test_lora_run_trains_adapters_only(lora_run):
    import torch.distributed.checkpoint as dcp

    _, run = lora_run
    recs = read_metrics(run)
    assert [r["step"] for r in recs] == [0, 2, 4, 6]
    assert recs[-1]["eval_loss"] < recs[0]["eval_loss"] - 0.05
    meta = dcp.FileSystemReader(str(run / "checkpoints" / "step_00000006")).read_metadata()
    model_keys = [k for k in meta.state_dict_metadata if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), model_keys
    assert any("experts" in k for k in model_keys) and any("q_proj" in k for k in model_keys)


def test_resume_is_exact(lora_run, tmp_path):
    _, run = lora_run
    half = tmp_path / "half"
    shutil.copytree(run, half)
    for step in (4, 6):
        shutil.rmtree(half / "checkpoints" / f"step_{step:08d}")
    shutil.rmtree(half / "adapter")
    lines = (half / "metrics.jsonl").read_text().splitlines()
    (half / "metrics.jsonl").write_text("\n".join(lines[:2]) + "\n")
    assert main(["train", "--run-dir", str(half), "--resume"]) == 0
    for a, b in zip(read_metrics(run)[2:], read_metrics(half)[2:]):
        assert a["loss"] == b["loss"] and a["eval_loss"] == b["eval_loss"]
    from safetensors.torch import load_file

    want = load_file(run / "adapter" / "adapter_model.safetensors")
    got = load_file(half / "adapter" / "adapter_model.safetensors")
    assert want.keys() == got.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_stock_peft_loads_the_adapter_and_convert_merges(lora_run, tmp_path):
    import transformers as tf

    from dropless.train.generate import load_run

    src, run = lora_run
    _, _, ours, _ = load_run(run)
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ours(input_ids=ids).logits
    stock = tf.AutoModelForCausalLM.from_pretrained(
        src, dtype=torch.float32, experts_implementation="eager"
    )
    loaded = peft.PeftModel.from_pretrained(stock, run / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)
    out = tmp_path / "merged"
    assert main(["convert", str(run), str(out)]) == 2  # a LoRA run needs --merge
    assert main(["convert", str(run), str(out), "--merge"]) == 0
    merged = tf.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, rtol=1e-5, atol=1e-5)


def test_flops_of_a_frozen_base_count_no_weight_gradient():
    from dropless.train.report.flops import FlopCounter

    full = FlopCounter(dense_params=10, expert_params=5, attn_per_seq_l2=1.0)
    lora = FlopCounter(dense_params=10, expert_params=5, attn_per_seq_l2=1.0, frozen_base=True)
    assert lora.step_flops(2, 4, 16) == full.step_flops(2, 4, 16) * 2 / 3
