"""How the command line speaks: every Python warning as one line naming the command (no
source file and line: the user did not write that code), and an optional dependency
that is not installed as one error line with the install command (exit status 2, as
for other bad input), not a traceback."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings


def warning_line(prog: str, message, category) -> str:
    text = " ".join(str(message).split())
    kind = "" if category is UserWarning else f" ({category.__name__})"
    return f"{prog}: warning{kind}: {text}"


@contextlib.contextmanager
def one_line_warnings(prog: str = "dropless"):
    """While active, warnings print as `dropless: warning: <message>` on stderr."""
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        print(warning_line(prog, message, category), file=file or sys.stderr, flush=True)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = previous


def is_missing_extra(e: ModuleNotFoundError) -> bool:
    """A third-party module; one of dropless's own missing is a broken install (traceback)."""
    return not (e.name or "").split(".")[0] == "dropless"


#: the extra of pyproject.toml that installs each optional module (the smallest one)
EXTRA_OF = {
    "transformers": "hf", "safetensors": "hf",
    "tokenizers": "train", "rich": "train", "tensorboard": "train", "matplotlib": "train",
    "pyarrow": "train", "tomli_w": "train", "tomli": "train",
    "peft": "lora", "jinja2": "lora",
    "triton": "triton", "jax": "jax",
}  # fmt: skip


def missing_module_line(command: str, e: ModuleNotFoundError) -> str:
    """Ours name the extra to install; a bare one ("No module named 'x'") gets the extra
    that has it (EXTRA_OF), or the module's name."""
    text = str(e).strip().splitlines()[0] if str(e) else f"No module named {e.name!r}"
    if "pip install" not in text:
        name = e.name or "it"
        extra = EXTRA_OF.get(name.split(".")[0])
        text += f"; install {name}" + (f" (pip install 'dropless[{extra}]')" if extra else "")
    return f"dropless {command}: error: {text}"


def say_error(text: str) -> None:
    """On stderr, once: under torchrun every rank has the same message."""
    if os.environ.get("RANK", "0") == "0":
        print(text, file=sys.stderr, flush=True)
