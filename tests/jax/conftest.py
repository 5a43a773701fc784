"""JAX tests compile many small programs: skip XLA's slow optimisation passes (the
numbers checked here do not depend on them; `dropless bench jax` runs fully optimised)."""

import os

os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

try:  # JAX already imported by an earlier test module: set the flag directly
    import sys

    if "jax" in sys.modules:
        sys.modules["jax"].config.update("jax_disable_most_optimizations", True)
except Exception:  # pragma: no cover - the flag is only a speed-up
    pass
