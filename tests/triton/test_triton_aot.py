"""Every Triton kernel compiles for sm_90 (bf16, the launch configs the wrappers use;
the row-gathering GEMMs with plain loads and with TMA descriptors).

The interpreter checks results, not compilation; this builds the cubins with Triton's
own ptxas, no GPU needed (`python -m dropless.kernels.aot_check`). Run in a child
process without TRITON_INTERPRET, which would replace the compiler.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_kernels_compile_for_sm90_bf16():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'dropless[triton]'")
    env = dict(os.environ, OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "dropless.kernels.aot_check", "--arch", "90", "--dtype", "bf16"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if "No module named 'triton.backends.nvidia'" in proc.stderr:
        pytest.skip("this triton build has no NVIDIA backend")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.count("ok ") == 17 and "0 failures" in proc.stdout, proc.stdout
