"""Import transformers lazily and check that its version is one we support."""

from __future__ import annotations

import re

_MIN, _MAX = (5, 17), (6, 0)


def _version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string ("5.24.0.dev0" -> (5, 24))."""
    m = re.match(r"(\d+)(?:\.(\d+))?", version)
    return (int(m[1]), int(m[2] or 0)) if m else (0, 0)


def check_version(version: str) -> None:
    """Raise ImportError when `version` is outside transformers>=5.17,<6."""
    vt = _version_tuple(version)
    if not _MIN <= vt < _MAX:
        raise ImportError(
            f"dropless.hf supports transformers>=5.17,<6 (its experts interface), but "
            f"transformers {version} is installed. Install a supported version: "
            f"pip install 'dropless[hf]'  (or: pip install 'transformers>=5.17,<6')."
        )


def require_transformers():
    """Return the transformers module, or raise an ImportError naming the extra to install."""
    try:
        import transformers
    except ModuleNotFoundError as e:
        raise ImportError(
            "dropless.hf needs Hugging Face Transformers: pip install 'dropless[hf]'"
        ) from e
    check_version(transformers.__version__)
    return transformers
