"""BENCHMARKS.md is assembled from generated sections only."""

from __future__ import annotations

import pytest


def test_sections_without_a_command_are_refused(tmp_path, load_script):
    md = load_script("benchmarks_md")
    sections = tmp_path / "benchmarks" / "sections"
    sections.mkdir(parents=True)
    (sections / "fp8.md").write_text("## FP8\n\nCommand: `dropless bench fp8`  \n| a |\n")
    text = md.build(tmp_path)
    assert "Command: `dropless bench fp8`" in text and text.startswith(md.HEADER)
    assert "No section yet: `dropless bench train --record` writes it" in text
    (sections / "layer.md").write_text("## Layer\n\nWe saw 2x on a quiet day.\n")
    with pytest.raises(SystemExit, match="layer.md: no 'Command:' line"):
        md.build(tmp_path)


def test_benchmarks_md_is_assembled_from_the_sections(load_script):
    assert load_script("benchmarks_md").main(["--check"]) == 0, (
        "run: python scripts/benchmarks_md.py"
    )
