"""`dropless generate` runs Transformers' `generate` with its KV cache on the patched
model: after the prompt the model sees one new token per forward, greedy text equals the
former loop that re-ran the whole context for every token, and sampling is seeded."""

import torch

from dropless import hf
from dropless.cli.main import main
from dropless.train.generate import load_run, sample


@torch.no_grad()
def _no_cache_greedy(model, tok, prompt: str, n: int, context: int) -> str:
    """The former `sample` at temperature 0: the whole context through the model per token."""
    ids = tok.encode(prompt)
    out: list[int] = []
    for _ in range(n):
        x = torch.tensor([(ids + out)[-context:]])
        logits_V = model(input_ids=x, use_cache=False).logits[0, -1].float()
        logits_V[tok.vocab_size :] = -float("inf")
        out.append(int(logits_V.argmax()))
    return tok.decode(out)


def test_generate_uses_the_cache_and_keeps_the_greedy_text(finished_run):
    cfg, tok, model, _ = load_run(finished_run)
    assert hf.moe_layers(model) and "dropless" in model.get_experts_implementation().values()
    lengths = []
    handle = model.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]), with_kwargs=True
    )
    try:
        got = sample(model, tok, "import ", 20, temperature=0, context=cfg.train.seq_len)
    finally:
        handle.remove()
    assert lengths == [7] + [1] * 19  # prompt once, then one token per forward
    calls = hf.experts.CALLS["qwen3_moe"]
    want = _no_cache_greedy(model, tok, "import ", 20, cfg.train.seq_len)
    assert hf.experts.CALLS["qwen3_moe"] > calls  # the reference ran the same dropless path
    assert got == want and len(tok.encode(got)) == 20


def test_sampling_is_seeded_and_bounded(finished_run, capsys):
    cfg, tok, model, _ = load_run(finished_run)
    a = sample(model, tok, "def ", 16, temperature=1.0, top_k=5, top_p=0.9, seed=3)
    b = sample(model, tok, "def ", 16, temperature=1.0, top_k=5, top_p=0.9, seed=3)
    assert a == b and len(tok.encode(a)) == 16
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    sample(model, tok, "def ", 4, temperature=1.0, seed=9)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is left as it was
    args = [
        "generate",
        str(finished_run),
        "--prompt",
        "x",
        "--max-new-tokens",
        "3",
        "--top-p",
        "0.5",
    ]
    assert main(args) == 0 and capsys.readouterr().out.startswith("x")
    assert main([*args[:-1], "1.5"]) == 2
    assert "top_p in (0, 1]" in capsys.readouterr().err
