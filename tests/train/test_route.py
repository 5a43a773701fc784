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
    step."""
    train = "src/dropless/train/"
    over = [f for f in trace["over_3"] if f.startswith(train)]
    assert not over, f"files of {train} entered more than 3 times: {over}"


#: the whole route's limits reached so far (the target: 20 re-entries, no file over 3)
MAX_RE_ENTRIES, MAX_ENTRIES_PER_FILE = 39, 4


def test_the_route_goes_back_into_few_files(trace):
    """At most MAX_RE_ENTRIES entries into a file already entered and MAX_ENTRIES_PER_FILE
    entries into one file, over the whole route (ops/ and hf/ included)."""
    assert trace["re_entries"] <= MAX_RE_ENTRIES, (
        f"{trace['re_entries']} re-entries (at most {MAX_RE_ENTRIES}): docs/design.md's route "
        "(python tools/design_route.py) shows where the route goes back"
    )
    assert trace["most"] <= MAX_ENTRIES_PER_FILE, trace["over_3"]


def test_the_trainer_is_the_loop():
    """trainer.py runs the loop over the parts build.py makes: at most 200 lines and 10
    modules of the package imported."""
    import ast

    path = REPO / "src" / "dropless" / "train" / "trainer.py"
    text = path.read_text()
    tree = ast.parse(text)
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level > 0}
    assert len(text.splitlines()) <= 200 and len(ours) <= 10, (len(text.splitlines()), ours)
