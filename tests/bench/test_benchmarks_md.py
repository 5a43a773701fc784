"""BENCHMARKS.md is assembled from generated sections only."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location(
        "benchmarks_md", ROOT / "scripts" / "benchmarks_md.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sections_without_a_command_are_refused(tmp_path):
    md = _script()
    sections = tmp_path / "benchmarks" / "sections"
    sections.mkdir(parents=True)
    (sections / "fp8.md").write_text("## FP8\n\nCommand: `dropless bench fp8`  \n| a |\n")
    text = md.build(tmp_path)
    assert "Command: `dropless bench fp8`" in text and text.startswith(md.HEADER)
    assert "No section yet: `dropless bench train --record` writes it" in text
    (sections / "layer.md").write_text("## Layer\n\nWe saw 2x on a quiet day.\n")
    with pytest.raises(SystemExit, match="layer.md: no 'Command:' line"):
        md.build(tmp_path)


def test_benchmarks_md_is_assembled_from_the_sections():
    assert _script().main(["--check"]) == 0, "run: python scripts/benchmarks_md.py"
