"""Every Triton kernel compiles for sm_90 (bf16, at the launch configurations the wrappers
use; the row-gathering GEMMs with plain loads and with TMA descriptors).

The interpreter checks results, not compilation; this builds the cubins with Triton's
own ptxas, no GPU needed (`python -m tools.aot_check`). Run in a child
process without TRITON_INTERPRET, which would replace the compiler. That the jobs cover
every kernel is `test_triton_aot_inventory.py`'s (fast) check.
"""

from __future__ import annotations

import importlib.util
import re

import pytest

from harness import run_python


@pytest.mark.slow
def test_kernels_compile_for_sm90_bf16():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: pip install 'dropless[triton]'")
    env = dict(OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1", TRITON_INTERPRET=None)
    # two compiling processes: 46 s instead of 60 s on two busy cores
    args = ["-m", "tools.aot_check", "--arch", "90", "--dtype", "bf16", "--workers", "2"]
    proc = run_python(args, env=env, timeout=300)
    if "No module named 'triton.backends.nvidia'" in proc.stderr:
        pytest.skip("this triton build has no NVIDIA backend")
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-4000:]
    summary = re.search(r"^(\d+) jobs, (\d+) failures", out, re.MULTILINE)
    assert summary and summary[2] == "0", out[-4000:]
    assert len(re.findall(r"^ok ", out, re.MULTILINE)) == int(summary[1]), out
