"""The route of a run, checked in the code: the README's tiny run traced (tests/route_trace.py)
from `train()` to the first optimizer step, in a child; docs/design.md's route is that trace
(written by `python tools/design_route.py`)."""

from pathlib import Path

from route_trace import TINY_ARGS, design_block, doc_block, trace_in_child

REPO = Path(__file__).resolve().parents[2]


def test_the_design_docs_route_is_the_traced_route(tmp_path):
    trace = trace_in_child(TINY_ARGS, tmp_path, REPO)
    doc = doc_block((REPO / "docs" / "design.md").read_text())
    assert doc == design_block(trace), (
        "docs/design.md's route is stale: python tools/design_route.py"
    )


def test_the_trainer_is_the_loop():
    """trainer.py runs the loop over the parts build.py makes: at most 200 lines and 10
    modules of the package imported."""
    import ast

    path = REPO / "src" / "dropless" / "train" / "trainer.py"
    text = path.read_text()
    tree = ast.parse(text)
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
    assert len(text.splitlines()) <= 200 and len(ours) <= 10, (len(text.splitlines()), ours)
