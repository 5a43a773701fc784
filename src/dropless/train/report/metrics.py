"""Run metrics: memory, expert-load figures and the JSONL + TensorBoard writer (the live
display is `progress.py`; MFU's peak FLOP/s, `run_log.py`)."""

# L MoE layers, E experts

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from ..run.atomic import append_line, refuse_symlink, write_atomic


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return peak_rss_mib()


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM from /proc/self/status), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


#: an expert below this share of its layer's mean load counts as starved
STARVED = 0.1


def load_stats(counts_LE: torch.Tensor) -> dict:
    """Per-layer max/mean load (1.0 = perfectly balanced), the worst layer's, and the
    number of experts (all layers) below `STARVED` x their layer's mean load."""
    c = counts_LE.double()
    mean = c.mean(1).clamp_min(1e-9)
    ratio = (c.max(1).values / mean).tolist()
    starved = int((c < STARVED * mean[:, None]).sum())
    return {
        "max_mean_load": max(ratio),
        "max_mean_load_per_layer": ratio,
        "starved_experts": starved,
    }


def balancing(train) -> str:
    """The run's balancing in words (`train`: the config's train section)."""
    parts = []
    if train.aux_loss_coef > 0:
        parts.append(f"{train.balance_loss} aux loss x{train.aux_loss_coef:g}")
    if train.expert_bias_rate > 0:
        parts.append(f"expert bias rate {train.expert_bias_rate:g}")
    return ", ".join(parts) or "none"


class MetricsWriter:
    """metrics.jsonl (one record per log step) and TensorBoard scalars, on rank 0."""

    def __init__(self, run_dir: Path, tensorboard: bool, resume_step: int | None):
        self.path = run_dir / "metrics.jsonl"
        if resume_step is None:
            write_atomic(self.path, "")
        elif refuse_symlink(self.path) or self.path.is_file():  # later records are redone
            keep = [json.dumps(r) for r in read_metrics(run_dir) if r["step"] <= resume_step]
            write_atomic(self.path, "".join(x + "\n" for x in keep))
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ModuleNotFoundError:
                raise ModuleNotFoundError(
                    "log.tensorboard=true needs tensorboard: pip install 'dropless[train]' (or --set log.tensorboard=false)"
                ) from None
            self.tb = SummaryWriter(
                str(run_dir / "tensorboard"),
                purge_step=None if resume_step is None else resume_step + 1,
            )

    def write(self, record: dict) -> None:
        append_line(self.path, json.dumps(record))
        if self.tb is not None:
            for k, v in record.items():
                if (
                    isinstance(v, int | float)
                    and not isinstance(v, bool)
                    and k != "step"
                    and math.isfinite(v)
                ):
                    self.tb.add_scalar(k, v, record["step"])
            for i, r in enumerate(record.get("max_mean_load_per_layer", [])):
                self.tb.add_scalar(f"load/max_mean_layer{i}", r, record["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl; a line that is not a JSON record (a write cut short
    by a crash) is dropped with a warning."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            rec = None
        if not isinstance(rec, dict) or "step" not in rec:
            warnings.warn(f"{path}:{n}: dropping a truncated or invalid metrics line", stacklevel=2)
            continue
        out.append(rec)
    return out
