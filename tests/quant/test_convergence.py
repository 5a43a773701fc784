"""A tiny MoE language model trained 60 steps: MXFP8 (emulated) tracks fp32."""

# B batch, L sequence length, V vocabulary, D hidden

from __future__ import annotations

import torch
from torch import nn

import dropless
from dropless.quant import MXFP8BlockScaling, autocast, convert_linear

V, D, LAYERS, STEPS = 32, 64, 2, 60


class TinyMoELM(nn.Module):
    """Embeddings, 2 pre-norm residual MoE blocks (4 experts, top-2), a linear head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.norms = nn.ModuleList(nn.RMSNorm(D) for _ in range(LAYERS))
        self.moes = nn.ModuleList(dropless.MoE(D, 64, 4, 2) for _ in range(LAYERS))
        self.head = nn.Linear(D, V)

    def forward(self, ids_BL):
        x = self.embed(ids_BL)
        aux = 0.0
        for norm, moe in zip(self.norms, self.moes):
            y, a = moe(norm(x))
            x = x + y
            aux = aux + 0.01 * a.lb_loss
        return self.head(x), aux


def _batch(gen, B=16, L=32):
    """Next token = a fixed random map of the current one, or noise 20% of the time."""
    table = torch.randperm(V, generator=torch.Generator().manual_seed(123))
    ids = torch.empty(B, L + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(0, V, (B,), generator=gen)
    for t in range(L):
        noise = torch.randint(0, V, (B,), generator=gen)
        ids[:, t + 1] = torch.where(torch.rand(B, generator=gen) < 0.8, table[ids[:, t]], noise)
    return ids[:, :-1], ids[:, 1:]


def _train(recipe) -> list[float]:
    torch.manual_seed(0)
    model = TinyMoELM()
    if recipe is not None:
        convert_linear(model)  # the head follows the recipe too
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x, y = _batch(gen)
        with autocast(enabled=recipe is not None, recipe=recipe):
            logits, aux = model(x)
        loss = nn.functional.cross_entropy(logits.reshape(-1, V), y.reshape(-1))
        (loss + aux).backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def test_mxfp8_training_tracks_fp32():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only adds sync (4x slower on a busy box)
    try:
        fp32 = _train(None)
        mx = _train(MXFP8BlockScaling(fp8_saved_activations=True))
    finally:
        torch.set_num_threads(threads)
    end_fp32, end_mx = sum(fp32[-5:]) / 5, sum(mx[-5:]) / 5  # mean of the last 5 steps
    assert fp32[0] - end_fp32 >= 1.0, fp32
    assert abs(end_mx - end_fp32) <= 0.05, (end_mx, end_fp32)
    assert mx != fp32  # the recipe did run
