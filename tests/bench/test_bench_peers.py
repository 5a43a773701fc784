"""The peer rows of `dropless bench layer` / `e2e` (tools/peers.py): how a row that cannot
run is reported, and the wiring the rows add around a peer's kernel, checked on CPU with a
plain torch kernel in its place (the peers' own kernels need CUDA)."""

from __future__ import annotations

import os

import pytest
import torch
from tools import peers
from tools.layer_paths import grouped_mm_plain

from harness import tiny_moe_config


@pytest.fixture(autouse=True)
def _liger_env(monkeypatch):
    """row_status sets LIGER_FUSED_MOE_AUTOTUNE for its process: restored after each test."""
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "0")


def test_a_missing_package_is_not_installed_with_the_version_looked_for(monkeypatch):
    missing = peers.Peer("no-such-peer", "no_such_peer_module", "1.2.3", needs_cuda=False)
    monkeypatch.setitem(peers.PEERS, "liger", missing)
    st = peers.row_status("liger-moe", "cuda")
    assert st == {
        "package": "no-such-peer", "wanted": "1.2.3", "version": None, "ok": False,
        "status": "not installed: looked for no-such-peer 1.2.3",
    }  # fmt: skip


def test_an_installed_cuda_only_peer_needs_cuda_on_cpu(monkeypatch):
    # torch stands in for a peer that is installed: its real version is reported
    monkeypatch.setitem(peers.PEERS, "cce", peers.Peer("torch", "torch", "9.9", needs_cuda=True))
    st = peers.row_status("cce", "cpu")
    assert st["ok"] is False and st["version"] == peers.installed_version(peers.PEERS["cce"])
    assert st["status"] == f"needs CUDA (torch {st['version']})" and st["wanted"] == "9.9"
    assert peers.row_status("cce", "cuda")["ok"] is True


def test_liger_moe_runs_one_kernel_config_unless_autotuning_is_asked_for(monkeypatch):
    monkeypatch.delenv("LIGER_FUSED_MOE_AUTOTUNE", raising=False)
    peers.row_status("liger-moe", "cpu")
    assert os.environ["LIGER_FUSED_MOE_AUTOTUNE"] == "0"
    monkeypatch.setenv("LIGER_FUSED_MOE_AUTOTUNE", "1")
    peers.row_status("liger-moe", "cpu")
    assert os.environ["LIGER_FUSED_MOE_AUTOTUNE"] == "1"


def test_every_row_names_a_peer_with_a_pinned_version():
    for row, peer in {**peers.LAYER_ROWS, **peers.E2E_ROWS}.items():
        assert peers.PEERS[peer].wanted.count(".") == 2, row
    assert set(peers.LAYER_PATHS) == set(peers.LAYER_ROWS)


def _grouped(a, w_t, offs):
    return torch._grouped_mm(a, w_t, offs=offs)


def _routes(case: str, T: int, E: int, K: int, g) -> torch.Tensor:
    """K distinct experts per token; "empty-expert": never expert 0; "all-on-one": every
    token on expert 3."""
    allowed = list(range(1, E)) if case == "empty-expert" else list(range(E))
    rows = []
    for _ in range(T):
        perm = [allowed[i] for i in torch.randperm(len(allowed), generator=g)]
        if case == "all-on-one":
            perm = [3] + [e for e in perm if e != 3]
        rows.append(perm[:K])
    return torch.tensor(rows)


@pytest.mark.parametrize(
    "case", ["uniform", "empty-expert", "all-on-one", "T=1", "k=E", "E=5"]
)  # fmt: skip
def test_padded_rows_give_the_plain_layers_output_and_grads(case):
    """torchao's row pads each expert's rows to 16: with a plain grouped GEMM in place of
    its FP8 one, the layer equals the unpadded one to fp32 rounding (1e-5 relative)."""
    T, E, K = {"T=1": (1, 4, 2), "k=E": (20, 4, 4), "E=5": (37, 5, 2)}.get(case, (40, 6, 2))
    D, F = 32, 16
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, D, generator=g, requires_grad=True)
    gate_up = torch.randn(E, 2 * F, D, generator=g).requires_grad_()
    down = torch.randn(E, D, F, generator=g).requires_grad_()
    ids, w = _routes(case, T, E, K, g), torch.rand(T, K, generator=g)
    if case == "empty-expert":
        assert not (ids == 0).any()
    order, dest, offs, P = peers.padded_sort(ids, E)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert (offs % 16 == 0).all() and int(offs[-1]) <= P
    assert torch.equal(torch.diff(offs, prepend=offs.new_zeros(1)), (counts + 15) // 16 * 16)
    assert dest.unique().numel() == dest.numel()  # one padded row per pair
    y = peers.padded_grouped_mlp(x, ids, w, gate_up, down, _grouped)
    ref = grouped_mm_plain(x, ids, w, gate_up, down)
    gy = torch.randn(y.shape, generator=g)
    got = torch.autograd.grad(y, (x, gate_up, down), gy)
    want = torch.autograd.grad(ref, (x, gate_up, down), gy)
    for name, a, b in zip(("y", "dx", "dgate_up", "ddown"), (y, *got), (ref, *want)):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max(), name


def _torch_linear_ce(e, c, targets, shift=True):
    """A plain stand-in for Cut Cross-Entropy's linear_cross_entropy(e, c, targets, shift)."""
    logits = (e @ c.t()).float()
    if shift:
        logits, targets = logits[:, :-1], targets[:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, c.shape[0]), targets.reshape(-1))


def test_cce_row_loss_is_the_stock_loss_with_the_router_aux_loss():
    import transformers as tf

    cfg = tiny_moe_config(
        vocab_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
        intermediate_size=32, norm_topk_prob=False, output_router_logits=True,
        router_aux_loss_coef=0.25, pad_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm").float()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))
    forward = peers._cce_forward(model, _torch_linear_ce)
    with torch.no_grad():
        stock = float(model(input_ids=ids, labels=ids).loss)
        loss = float(forward(input_ids=ids, labels=ids).loss)
        model.config.output_router_logits = False
        without_aux = float(forward(input_ids=ids, labels=ids).loss)
    assert abs(loss - stock) <= 1e-5 * stock
    # the aux term is a sizeable part of the loss here (coef 0.25): dropping it would fail
    assert abs(without_aux - stock) > 1e-3


def _layer_record(tmp_path, impls: str) -> dict:
    import json

    from dropless.cli.main import main

    hist = tmp_path / "h.jsonl"
    argv = ["bench", "layer", "--shape", "tiny", "--device", "cpu", "--no-skewed", "--no-memory"]
    argv += [
        "--rounds",
        "1",
        "--steps",
        "1",
    ]  # one child per row: what is asked is the peer's status
    assert main([*argv, "--impls", impls, "--history", str(hist)]) == 0
    return json.loads(hist.read_text().splitlines()[-1])["figures"]


def test_a_peer_row_that_fails_its_first_step_is_named_and_the_others_are_timed(
    tmp_path, monkeypatch
):
    def broken(*args):
        raise RuntimeError("no kernel image for this device")

    # torch stands in for an installed CPU peer whose kernel raises
    monkeypatch.setitem(peers.PEERS, "liger", peers.Peer("torch", "torch", "0.0.1", False))
    monkeypatch.setitem(peers.LAYER_PATHS, "liger-moe", broken)
    f = _layer_record(tmp_path, "dense,grouped_mm-plain,liger-moe")
    assert [r["impl"] for r in f["rows"]] == ["dense", "grouped_mm-plain"]
    st = f["peers"]["liger-moe"]
    assert st["ok"] is False
    assert st["status"] == "failed: RuntimeError: no kernel image for this device"


def test_an_e2e_peer_child_that_fails_costs_its_row_only(monkeypatch, capsys):
    from types import SimpleNamespace

    from dropless.bench import e2e

    def child(module, args, timeout=1800):  # a timing child; the cce one breaks
        if args["impl"] == "cce":
            raise RuntimeError("benchmark child failed:\nValueError: cce needs triton")
        return {"impl": args["impl"], "tokens_per_s": 1.0, "step_s": 1.0, "first_loss": 5.0}

    monkeypatch.setattr(e2e, "run_child", child)
    args = SimpleNamespace(rounds=2, steps=1, optimizer="fused", eager_rounds=None, threads=None)
    failed: dict = {}
    out = e2e.timing_rounds(args, ["dropless", "cce"], e2e.QUICK, "cpu", failed)
    assert list(out) == ["dropless"] and len(out["dropless"]) == 2
    assert failed == {"cce": "ValueError: cce needs triton"}
    assert capsys.readouterr().out.count("cce: failed") == 1  # not retried in round 2
    with pytest.raises(RuntimeError, match="cce needs triton"):  # a dropless row's failure
        monkeypatch.setattr(e2e, "run_child", lambda *a, **k: child("m", {"impl": "cce"}))
        e2e.timing_rounds(args, ["dropless"], e2e.QUICK, "cpu", {})


def test_e2e_with_only_peer_rows_that_cannot_run_is_refused(capsys):
    from dropless.cli.main import main

    assert main(["bench", "e2e", "--quick", "--device", "cpu", "--impls", "cce"]) == 2
    assert "--impls: no row can run here" in capsys.readouterr().err


def test_rows_from_tools_need_a_checkout(monkeypatch):
    """An installed wheel has no tools/: asking for such a row says where it runs."""
    from dropless.bench import common

    monkeypatch.setattr(common, "find_checkout", lambda package_dir=None: None)
    with pytest.raises(
        ValueError, match=r"the row liger-moe: runs from a dropless checkout \(tools/peers"
    ):
        common.from_checkout("peers", "the row liger-moe")


def test_a_section_writer_from_tools_is_refused_before_measuring(monkeypatch, tmp_path):
    from argparse import Namespace

    from dropless.bench import common

    monkeypatch.setattr(common, "find_checkout", lambda package_dir=None: None)
    args = Namespace(bench="memory", section=str(tmp_path / "m.md"), history=None)
    with pytest.raises(ValueError, match=r"--section: runs from a dropless checkout"):
        common.Recorder.start(args)
