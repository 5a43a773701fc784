"""What ships works on its own: a wheel built from this checkout (not the editable install),
installed `--no-deps` into a fresh venv that sees the test venv's packages (torch,
transformers, ...) but not its editable dropless, runs `dropless train examples/tiny.toml
--set train.steps=2`, `dropless bench e2e --quick` (one
round, one step, stock and patched) and the public imports, from a folder
outside the checkout with no PYTHONPATH: nothing reaches `src/`, `tests/` or `tools/`."""

import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from harness import ROOT

PUBLIC = (
    "import dropless, dropless.nn, dropless.ops, dropless.quant, dropless.parallel, "
    "dropless.train, dropless.bench, dropless.cli.main; "
    "from dropless import MoE, patch, autocast, parallelize; "
    "assert 'site-packages' in dropless.__file__, dropless.__file__; print(dropless.__file__)"
)


def _run(cmd, cwd, timeout=600):
    # not through the harness: its children see this checkout's src, which this test must not
    env = {"PATH": str(Path(cmd[0]).parent), "HOME": str(cwd), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def wheel_python(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"  # a copy of what the build reads: the checkout keeps no build files
    tree.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "--wheel-dir", str(tmp / "dist"), str(tree)], tmp)  # fmt: skip
    (whl,) = (tmp / "dist").glob("dropless-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp)
    py = venv / "bin" / "python"
    own = Path(_run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], tmp).strip())
    # the test venv's packages as a path only: its .pth files (the editable dropless) stay off
    (own / "test_venv.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
          "--no-index", str(whl)], tmp)  # fmt: skip
    return py, tmp


def test_the_built_wheel_trains_benches_and_imports(wheel_python):
    py, tmp = wheel_python
    out = _run([str(py), "-c", PUBLIC], tmp)
    assert str(ROOT) not in out, out
    dropless = str(py.parent / "dropless")  # the console script the wheel installed
    _run([dropless, "train", str(ROOT / "examples" / "tiny.toml"), "--set", "train.steps=2",
          "--run-dir", str(tmp / "run")], tmp)  # fmt: skip
    assert (tmp / "run" / "metrics.jsonl").is_file()
    # one timed step per row, stock and patched: the smoke, not a figure
    out = _run([dropless, "bench", "e2e", "--quick", "--rounds", "1", "--steps", "1",
                "--no-memory", "--impls", "grouped_mm,dropless"], tmp)  # fmt: skip
    assert "dropless.patch()" in out, out[-2000:]
