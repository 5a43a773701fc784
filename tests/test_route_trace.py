"""tests/route_trace.py on a toy package: entries, re-entries, start and stop."""

import importlib
import sys

from route_trace import RouteTrace, outer_names, render_route

A = """
from . import b

def top():
    b.helper()
    own()
    b.helper()  # a second call: not a first call
    b.helper2()
    [x for x in range(2)]  # a comprehension: its file's own
    return b.back()

def own():
    pass

def called_back():
    pass
"""
B = """
def helper():
    pass

def helper2():
    pass

def back():
    from . import a
    a.called_back()
    list(map(lambda x: x, [1]))  # called from the standard library: still b's

class K:
    x = 1  # a class body is not a function
"""


def _toy(tmp_path):
    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(A)
    (pkg / "b.py").write_text(B)
    for name in ("toypkg", "toypkg.a", "toypkg.b"):  # another test's copy
        sys.modules.pop(name, None)
    sys.path.insert(0, str(tmp_path))
    try:
        return importlib.import_module("toypkg.a"), pkg
    finally:
        sys.path.remove(str(tmp_path))


def test_entries_count_first_calls_whose_nearest_caller_is_another_file(tmp_path):
    a, pkg = _toy(tmp_path)
    with RouteTrace(pkg, root=tmp_path) as trace:
        a.top()
    got = [(e.file, e.functions) for e in trace.entries]
    assert got == [
        ("toypkg/a.py", ["top", "own", "top.<locals>.<listcomp>"]),
        ("toypkg/b.py", ["helper"]),
        ("toypkg/b.py", ["helper2"]),
        ("toypkg/b.py", ["back", "back.<locals>.<lambda>"]),
        ("toypkg/a.py", ["called_back"]),
    ]
    assert trace.visits == {"toypkg/a.py": 2, "toypkg/b.py": 3}
    assert trace.re_entries == 3 and trace.summary()["most"] == 3
    assert outer_names(["top", "top.<locals>.<listcomp>", "<lambda>"]) == ["top"]
    doc = render_route({"entries": got[:2]})
    assert doc == "1. `toypkg/a.py` — `top`, `own`\n2. `toypkg/b.py` — `helper`\n"


def test_start_at_and_stop(tmp_path):
    a, pkg = _toy(tmp_path)
    b = sys.modules["toypkg.b"]
    with RouteTrace(pkg, root=tmp_path).start_at(b.back) as trace:
        a.top()
    assert [(e.file, e.functions[0]) for e in trace.entries] == [
        ("toypkg/b.py", "back"),
        ("toypkg/a.py", "called_back"),
    ]
    with RouteTrace(pkg, root=tmp_path) as trace:
        b.helper()
        trace.stop()
        b.helper2()
    assert trace.stopped and [e.functions for e in trace.entries] == [["helper"]]
    assert sys.getprofile() is None
