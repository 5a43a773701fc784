"""The route of a run, checked in the code: the README's tiny run traced (tests/route_trace.py)
from `train()` to the first optimizer step, in a child; docs/design.md's route is that trace
(written by `python tools/design_route.py`)."""

from pathlib import Path

import pytest

from route_trace import TINY_ARGS, design_block, doc_block, trace_in_child

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return trace_in_child(TINY_ARGS, tmp_path_factory.mktemp("route"), REPO)


def test_the_design_docs_route_is_the_traced_route(trace):
    doc = doc_block((REPO / "docs" / "design.md").read_text())
    assert doc == design_block(trace), (
        "docs/design.md's route is stale: python tools/design_route.py"
    )


def test_the_run_build_enters_each_file_of_train_at_most_3_times(trace):
    """train/ builds a run's parts once, in order, and asks each file in few visits: no
    file of src/dropless/train/ is entered more than 3 times before the first optimizer
    step. (The whole route's limits, <= 20 re-entries and no file of the package over 3,
    wait on the expert forward's files: ops/, hf/.)"""
    train = "src/dropless/train/"
    over = [f for f in trace["over_3"] if f.startswith(train)]
    assert not over, f"files of {train} entered more than 3 times: {over}"


def test_the_trainer_is_the_loop():
    """trainer.py runs the loop over the parts build.py makes: at most 200 lines and 10
    modules of the package imported."""
    import ast

    path = REPO / "src" / "dropless" / "train" / "trainer.py"
    text = path.read_text()
    tree = ast.parse(text)
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
    assert len(text.splitlines()) <= 200 and len(ours) <= 10, (len(text.splitlines()), ours)
