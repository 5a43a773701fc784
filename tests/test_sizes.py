"""Size limits the project holds itself to (lines as `wc -l` counts them, after `ruff
format`): what ships, its benchmarks and the GPU acceptance runners stay small."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lines(*paths: Path) -> int:
    files = [f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*.py")))]
    return sum(len(f.read_text().splitlines()) for f in files)


def test_bench_in_the_wheel_is_at_most_3000_lines():
    assert _lines(ROOT / "src" / "dropless" / "bench") <= 3000


def test_the_gpu_check_runners_are_at_most_700_lines():
    """The runner package and its entry script; the report generator
    (`tools/gpu_report.py`) is not a runner."""
    assert _lines(ROOT / "tools" / "gpu_check", ROOT / "scripts" / "gpu_check.py") <= 700


def test_what_ships_is_at_most_29000_lines():
    """src/ (the wheel) with every feature; train/ no larger than 8,017."""
    assert _lines(ROOT / "src") <= 29000
    assert _lines(ROOT / "src" / "dropless" / "train") <= 8017
