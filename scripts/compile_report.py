"""How a Transformers MoE model compiles and exports, stock and with `dropless.patch()`:
the table of docs/performance.md ("Compiled and exported, family by family"), measured.

For every family of the test suite's tiny models (tests/hf/families.py, fp32, CPU), stock
(Transformers' default experts path) and patched, one row each with:
- forward graphs / breaks: `torch._dynamo.explain` of the model's forward;
- fullgraph fwd+bwd: `torch.compile(model, fullgraph=True, backend="aot_eager")` of a
  training forward (labels given) and its backward, "ok" or the error's first words;
- recompiles: new graphs over three more same-shape forwards with other tokens;
- export: `torch.export.export` of the forward, "ok" with the number of dropless custom-op
  nodes, or the error's first words.
It writes only what it measured; `--doc` puts the table into docs/performance.md between
its `compile_report` markers:

    python scripts/compile_report.py [--families qwen3_moe mixtral] [--doc]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests" / "hf"))

from families import FAMILIES, MORE_FAMILIES, build  # noqa: E402

import dropless.hf as dh  # noqa: E402

DOC = ROOT / "docs" / "performance.md"
START, END = "<!-- compile_report:start -->", "<!-- compile_report:end -->"
BACKEND = "aot_eager"  # AOTAutograd without inductor's C++ compile: Dynamo traces the same


def _ids(seed: int) -> torch.Tensor:
    return torch.randint(2, 96, (2, 6), generator=torch.Generator().manual_seed(seed))


def _short(e: BaseException) -> str:
    words = f"{type(e).__name__}: {e}".split()
    return " ".join(words[:10]).replace("|", "/")


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _forward_breaks(model) -> str:
    torch._dynamo.reset()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(_ids(0), use_cache=False)
    return f"{ex.graph_count} / {ex.graph_break_count}"


def _fullgraph_train(model) -> tuple[str, str]:
    """(fwd+bwd verdict, recompiles over three more same-shape forwards)."""
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    try:
        ids = _ids(0)
        loss = compiled(ids, labels=ids, use_cache=False).loss
        loss.backward()
    except Exception as e:  # the verdict is the row's content
        return _short(e), "-"
    first = _graphs()
    with torch.no_grad():
        for seed in (1, 2, 3):
            compiled(_ids(seed), use_cache=False)
    model.zero_grad(set_to_none=True)
    return "ok", str(_graphs() - first - 1)  # the no-grad forward compiles one graph


def _export(model) -> str:
    try:
        with torch.no_grad():
            ep = torch.export.export(model, (_ids(0),), {"use_cache": False})
    except Exception as e:
        return _short(e)
    nodes = sum(str(n.target).startswith("dropless.") for n in ep.graph.nodes)
    return f"ok ({nodes} `dropless::` node{'s' * (nodes != 1)})" if nodes else "ok"


def row(family: str, patched: bool) -> list[str]:
    model = build(family, implementation=None).train()
    on_path = bool(dh.report().families) if patched else False
    cells = [family, "patched" if patched else "stock"]
    if patched and not on_path:
        return cells + ["(not on the dropless path)"] * 4
    cells.append(_forward_breaks(model))
    cells.extend(_fullgraph_train(model))
    cells.append(_export(model))
    return cells


HEADER = ["family", "model", "forward graphs / breaks", "fullgraph fwd+bwd", "recompiles",
          "export"]  # fmt: skip


def table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", nargs="*", default=FAMILIES + MORE_FAMILIES)
    ap.add_argument("--doc", action="store_true", help=f"write the table into {DOC}")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    stock = []
    for fam in args.families:  # stock rows first: patch() is process-wide
        stock.append(row(fam, patched=False))
        print(" | ".join(stock[-1]), flush=True)
    dh.patch()
    rows = []
    for fam, s in zip(args.families, stock):
        rows += [s, row(fam, patched=True)]
        print(" | ".join(rows[-1]), flush=True)
    md = table(rows)
    versions = f"torch {torch.__version__}, transformers {__import__('transformers').__version__}"
    cmd = "python scripts/compile_report.py" + (" --doc" if args.doc else "")
    out = f"Command: `{cmd}` ({versions}, CPU, backend `{BACKEND}`).\n\n{md}"
    if args.doc:
        write_doc(DOC, out)
    print(out)
    return 0


def write_doc(path: Path, text: str) -> None:
    """Replace what lies between the markers of `path` with `text`."""
    doc = path.read_text()
    head, rest = doc.split(START, 1)
    _, tail = rest.split(END, 1)
    path.write_text(f"{head}{START}\n{text}{END}{tail}")


if __name__ == "__main__":
    raise SystemExit(main())
