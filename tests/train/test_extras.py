"""Each command names the extra it needs: the README's table lists every extra of
pyproject.toml, a missing module's message names the extra that installs it, and the
benchmarks that run children check their modules before starting one."""

import importlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from dropless.bench import common
from dropless.cli import bench as cli_bench
from dropless.cli.main import main
from dropless.cli.messages import EXTRA_OF, missing_module_line

ROOT = Path(__file__).resolve().parents[2]


def _extras() -> dict[str, set[str]]:
    """pyproject's extras -> the distributions each installs (self-references resolved)."""
    raw = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]

    def names(extra: str) -> set[str]:
        out = set()
        for req in raw[extra]:
            own = re.fullmatch(r"dropless\[([\w,]+)\]", req)
            if own:
                for e in own.group(1).split(","):
                    out |= names(e)
            else:
                out.add(re.match(r"[A-Za-z0-9_.-]+", req).group(0).lower().replace("_", "-"))
        return out

    return {e: names(e) for e in raw}


def test_the_readme_table_lists_every_extra():
    text = (ROOT / "README.md").read_text()
    table = text.split("### What to install", 1)[1].split("\n\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
    assert sorted(rows) == sorted(e for e in _extras() if e != "all")
    assert "finetune.method=lora --set finetune.lora_rank=16" in text
    lora_line = next(
        t for t in text.splitlines() if "finetune.method=lora --set finetune.lora_rank" in t
    )
    assert "'.[train,lora]'" in lora_line


def test_each_module_maps_to_an_extra_that_installs_it():
    extras = _extras()
    for module, extra in EXTRA_OF.items():
        assert module.replace("_", "-") in extras[extra], (module, extra)


def test_a_bare_missing_module_names_its_extra():
    line = missing_module_line("bench", ModuleNotFoundError("No module named 'peft'", name="peft"))
    assert (
        line
        == "dropless bench: error: No module named 'peft'; install peft (pip install 'dropless[lora]')"
    )
    line = missing_module_line("x", ModuleNotFoundError("No module named 'liger'", name="liger"))
    assert line == "dropless x: error: No module named 'liger'; install liger"


@pytest.mark.parametrize(
    ("bench", "missing", "extra"),
    [
        ("e2e", "transformers", "hf"),
        ("memory", "transformers", "hf"),
        ("lora", "peft", "lora"),
        ("jax", "jax", "jax"),
    ],
)
def test_a_bench_without_its_extra_says_so_before_a_child_starts(
    bench, missing, extra, monkeypatch, capsys
):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == missing else real(name, *a)
    )
    module = importlib.import_module(cli_bench.BENCHES[bench][0])

    class Recorder:  # each benchmark starts its record before its first child: stop there
        @staticmethod
        def start(args):
            raise AssertionError(f"dropless bench {bench} started without {missing}")

    for m in (module, common):
        monkeypatch.setattr(m, "Recorder", Recorder, raising=False)
    assert main(["bench", bench]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == f"dropless bench: error: dropless bench {bench} needs {missing}: pip install 'dropless[{extra}]'\n"
    )


def test_the_layer_bench_names_the_extra_of_its_hugging_face_rows(monkeypatch):
    from dropless.bench.layer import hf_block

    for name in list(sys.modules):
        if name == "transformers" or name.startswith("transformers."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModuleNotFoundError) as e:
        hf_block({}, "grouped_mm", None, None, None)
    assert e.value.name == "transformers" and "pip install 'dropless[hf]'" in str(e.value)
