"""Writes the route of one training step in docs/design.md from a traced run.

    python tools/design_route.py

runs the README's tiny run (`dropless train examples/tiny.toml`) in a child traced by
tests/route_trace.py from `train()` to the first optimizer step and replaces the block
between docs/design.md's route markers; tests/train/test_route.py compares the two.
"""

import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests"), str(REPO / "src")]

from route_trace import TINY_ARGS, design_block, doc_block, trace_in_child  # noqa: E402


def main() -> None:
    doc = REPO / "docs" / "design.md"
    with tempfile.TemporaryDirectory() as tmp:
        trace = trace_in_child(TINY_ARGS, Path(tmp), REPO)
    text = doc.read_text()
    doc.write_text(text.replace(doc_block(text), design_block(trace)))
    print(f"{doc}: {trace['n_entries']} entries, {trace['re_entries']} re-entries")


if __name__ == "__main__":
    main()
