"""Collectives under train/ go through `train.collectives`, which puts their tensors on
the device of the process group's backend (NCCL takes no CPU tensor; gloo, which the
CPU tests run on, takes both, so only this walk catches a CPU tensor sent to NCCL).
The helper itself runs in real gloo processes in tests/parallel (`train_collectives`)."""

import ast
from pathlib import Path

import pytest

from dropless.train.run.collectives import backend_device_types

TRAIN = Path(__file__).resolve().parents[2] / "src" / "dropless" / "train"
COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "broadcast", "broadcast_object_list",
    "gather", "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv",
}  # fmt: skip


def direct_collective_calls(folder: Path) -> list[str]:
    """'file:line name' of every `dist.<collective>(...)` / `torch.distributed.<...>(...)`
    call and every `from torch.distributed import <collective>` outside collectives.py."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path.name == "collectives.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
                base = ast.unparse(node.value)
                if base in ("dist", "torch.distributed", "_dist"):
                    found.append(f"{path.name}:{node.lineno} {base}.{node.attr}")
            elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                found += [
                    f"{path.name}:{node.lineno} {a.name}"
                    for a in node.names
                    if a.name in COLLECTIVES
                ]
    return found


def test_nothing_under_train_calls_a_collective_directly():
    assert TRAIN.is_dir()
    calls = direct_collective_calls(TRAIN)
    assert not calls, "use dropless.train.run.collectives instead:\n" + "\n".join(calls)


def test_the_walk_sees_planted_calls(tmp_path):
    (tmp_path / "a.py").write_text(
        "import torch.distributed as dist\nfrom torch.distributed import barrier\n"
        "def f(t):\n    dist.all_reduce(t)\n    dist.get_rank()\n"
    )
    assert direct_collective_calls(tmp_path) == ["a.py:2 barrier", "a.py:4 dist.all_reduce"]


@pytest.mark.parametrize(
    "backend, kinds",
    [
        ("nccl", {"cuda": "nccl"}),
        ("gloo", {"cpu": "gloo", "cuda": "gloo"}),
        ("cpu:gloo,cuda:nccl", {"cpu": "gloo", "cuda": "nccl"}),
    ],
)
def test_backend_device_types(backend, kinds):
    assert backend_device_types(backend) == kinds
