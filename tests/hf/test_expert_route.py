"""The route of one CPU expert forward of a patched Qwen3-MoE (fp32), traced
(tests/route_trace.py: first calls of the package's functions): from the experts module's
forward to its output it enters at most 10 files of the package."""

# D model dim, K top-k, E experts

from pathlib import Path

import torch
from families import build

import dropless
from route_trace import RouteTrace

MAX_FILES = 10


def test_a_cpu_expert_forward_enters_at_most_ten_files():
    model = dropless.hf.patch_model(build("qwen3_moe")).float()
    experts = model.model.layers[0].mlp.experts
    D, K, E = model.config.hidden_size, model.config.num_experts_per_tok, experts.num_experts
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, D, generator=g, requires_grad=True)
    ids = torch.rand(9, E, generator=g).topk(K).indices
    w = torch.rand(9, K, generator=g)
    with RouteTrace(Path(dropless.__file__).parent) as trace:
        out = experts(x, ids, w)
    assert out.shape == x.shape
    files = sorted(trace.visits)
    assert "src/dropless/ops/expert_mlp/engine.py" in files, files
    assert len(files) <= MAX_FILES, f"{len(files)} files: {files}"
