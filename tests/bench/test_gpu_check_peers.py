"""The GPU check's peer handling (`tools.gpu_check.run`): the summary tables name each peer row's package,
version and status beside the contract rows, and carry the matmul rate and the kernel
tables; with no wheels carried it installs nothing."""

from __future__ import annotations

import importlib
from pathlib import Path


def _script():
    """The run module afresh (its list of installed peer folders empty)."""
    from tools.gpu_check import run

    return importlib.reload(run)


def test_layer_table_names_peers_and_carries_rate_and_profile():
    gc = _script()
    peer = dict(package="torchao", wanted="0.18.0", version="0.18.0", ok=True, status="ok")
    missing = dict(package="liger-kernel", wanted="0.8.5", version=None, ok=False,
                   status="not installed: looked for liger-kernel 0.8.5")  # fmt: skip
    row = dict(routing="uniform", T=16384, max_rel_diff=None, peak_mib=None)
    profile = {"T": 16384, "tables": {"dropless": {"rows": [], "total_ms": 0.0}}}
    record = {"figures": {
        "dims": dict(E=128, K=8, D=2048, F=768, dtype="bfloat16"),
        "matmul": {"bfloat16": dict(n=8192, ms=1.5, tflops=733.0004, how="cuBLAS (torch.matmul)")},
        "peers": {"torchao-fp8-row": peer, "liger-moe": missing},
        "profile": profile,
        "rows": [
            row | dict(impl="dense", ms=6.0, vs_bound=1.0, gflops=5e5, share_of_matmul_rate=0.68),
            row | dict(impl="torchao-fp8-row", ms=12.0, vs_bound=0.5, gflops=2.5e5,
                       share_of_matmul_rate=0.34, peer=peer),
        ],
    }}  # fmt: skip
    t = gc.layer_table(record)
    assert t["rows"]["torchao_fp8_row"]["version"] == "0.18.0"
    assert t["rows"]["torchao_fp8_row"]["share_of_matmul_rate"] == 0.34
    assert "version" not in t["rows"]["dense_bound"]  # the contract row keeps its fields
    assert t["peers"]["liger_moe"]["status"].startswith("not installed")
    assert t["peers"]["torchao_fp8_row"]["version"] == "0.18.0"
    assert t["matmul"]["bfloat16"] == dict(n=8192, tflops=733.0, how="cuBLAS (torch.matmul)")
    assert t["profile"] == profile and "six GEMMs" in t["bound"]


def test_no_wheels_carried_installs_nothing(tmp_path):
    gc = _script()
    res = gc.install_peers(tmp_path)
    assert res == dict(dir=str(tmp_path), wheels=[], status="none carried")
    assert gc.PEER_SITE == [] and str(tmp_path) not in gc.child_env(True)["PYTHONPATH"]


def _wheel(folder: Path, name: str, version: str) -> Path:
    """A minimal pure-Python wheel of a package `name` holding VERSION = version."""
    import zipfile

    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{dist}/RECORD"] = "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
    return path


def test_carried_wheels_are_installed_for_the_children(tmp_path):
    import shutil

    from harness import run_python

    gc = _script()
    _wheel(tmp_path, "gpu_check_fake_peer", "1.2.3")
    res = gc.install_peers(tmp_path)
    assert res["status"] == "installed", res
    assert res["wheels"] == ["gpu_check_fake_peer-1.2.3-py3-none-any.whl"]
    env = gc.child_env(True)
    assert res["site"] in env["PYTHONPATH"].split(":")
    code = "import importlib.metadata as m, gpu_check_fake_peer as p; print(p.VERSION, m.version(p.__name__))"
    out = run_python(["-c", code], env=env, timeout=60)
    shutil.rmtree(res["site"])
    assert out.stdout.split() == ["1.2.3", "1.2.3"], out.stderr


def test_gpu_report_renders_peers_rate_and_kernel_tables():
    from tools import gpu_report as report

    kernels = {"what": "CUDA kernels, device time", "total_ms": 9.5, "rows": [
        {"name": "nvjet_tst_128x256|x", "calls": 6, "total_ms": 6.2, "share": 0.653}]}  # fmt: skip
    peer = dict(package="torchao", wanted="0.18.0", version="0.18.0", status="ok")
    timing = dict(shape={}, dtype="bf16", bound="six GEMMs", rows={
        "dense_bound": dict(ms=6.5, share_of_bound=1.0, peak_gib=1.8, tflops=500.0,
                            share_of_matmul_rate=0.67),
        "torchao_fp8_row": dict(ms=9.0, share_of_bound=0.72, peak_gib=2.0, version="0.18.0"),
    }, matmul={"bfloat16": dict(n=8192, tflops=741.2, how="cuBLAS (torch.matmul)")},
        peers={"torchao_fp8_row": peer}, profile={"T": 16384, "tables": {"dropless": kernels}})  # fmt: skip
    e2e = dict(shape={}, dtype="bfloat16", rows={"cut_cross_entropy": dict(ms=40.0, version="25.1.1")},
               peers={}, profile={"dropless": kernels})  # fmt: skip
    s = dict(argv=[], ok=True, date="2026-12-01 16:00 UTC", groups={"timing": dict(status="ok", timing=timing),
                                       "e2e": dict(status="ok", e2e=e2e)})  # fmt: skip
    log = report.ROOT / "benchmarks" / "gpu" / "x.log"
    text = "\n".join(report.render_run(s, log, "abc1234"))
    assert (
        "| row | ms | share_of_bound | peak_gib | tflops | share_of_matmul_rate | version |" in text
    )
    assert "| torchao_fp8_row | 9.0 | 0.72 | 2.0 |  |  | 0.18.0 |" in text
    assert "Dense matmul rate in the same run: 741.2 TFLOP/s (bfloat16" in text
    assert "Peer row `torchao_fp8_row`: torchao 0.18.0 (looked for 0.18.0): ok." in text
    assert text.count("| `nvjet_tst_128x256/x` | 6 | 6.2 | 0.653 |") == 2  # layer and e2e
    assert "| cut_cross_entropy | 40.0 |" in text and "| 25.1.1 |" in text
