"""PNG plots at the end of a run (matplotlib, from `dropless[train]`): loss curves and a
per-layer expert-load heatmap over the logged steps."""

# L MoE layers, E experts, N log records

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..run.atomic import atomic_file


def _plt():
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "plots need matplotlib: pip install 'dropless[train]' (or --set log.plots=false)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_losses(records: list[dict], out: Path) -> Path:
    """Training loss and held-out loss (nats/token) against the step; bits/byte on the right."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [(r["step"], r["loss_avg"]) for r in records if r.get("loss_avg") is not None]
    ev = [
        (r["step"], r["eval_loss"], r["eval_bpb"])
        for r in records
        if r.get("eval_loss") is not None
    ]
    if tr:
        ax.plot(*zip(*tr), label="train loss (mean since last log)", marker=".")
    if ev:
        ax.plot([e[0] for e in ev], [e[1] for e in ev], label="held-out loss", marker="o")
        # bits/byte is the held-out loss times a constant (targets / ln 2 / bytes): a second scale
        k = ev[0][2] / ev[0][1] if ev[0][1] else 0.0
        if k > 0:
            ax2 = ax.secondary_yaxis("right", functions=(lambda x: x * k, lambda y: y / k))
            ax2.set_ylabel("held-out bits per byte")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("dropless train: loss")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_file(out) as f:  # never through a symlink, never half a file
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return out


def plot_expert_load(records: list[dict], out: Path, balancing: str | None = None) -> Path | None:
    """One heatmap per MoE layer: expert (rows) x logged step (columns), load / mean load;
    the title names the run's `balancing` (`metrics.balancing`)."""
    rows = [
        (r["step"], np.asarray(r["tokens_per_expert"], dtype=np.float64))
        for r in records
        if r.get("tokens_per_expert")
    ]
    if not rows:
        return None
    plt = _plt()
    steps = [s for s, _ in rows]
    load_NLE = np.stack([c for _, c in rows])
    load_NLE = load_NLE / np.maximum(load_NLE.mean(-1, keepdims=True), 1e-9)
    n_layers = load_NLE.shape[1]
    cols = min(n_layers, 4)
    nrows = -(-n_layers // cols)
    fig, axes = plt.subplots(
        nrows,
        cols,
        figsize=(3.2 * cols + 1, 2.6 * nrows + 0.6),
        squeeze=False,
        layout="constrained",
    )
    vmax = max(2.0, float(load_NLE.max()))
    # one column per logged step, centred on it (a single log point still gets a width)
    half = (steps[-1] - steps[0]) / max(len(steps) - 1, 1) / 2 or 0.5
    im = None
    for i in range(nrows * cols):
        ax = axes[i // cols][i % cols]
        if i >= n_layers:
            ax.axis("off")
            continue
        im = ax.imshow(load_NLE[:, i, :].T, aspect="auto", cmap="magma", vmin=0, vmax=vmax, interpolation="nearest",
                       extent=(steps[0] - half, steps[-1] + half, load_NLE.shape[2] - 0.5, -0.5))  # fmt: skip
        ax.set_title(f"MoE layer {i}", fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.set_ylabel("expert", fontsize=8)
    fig.colorbar(im, ax=axes, shrink=0.8, label="load / mean load")
    how = f"; balancing: {balancing}" if balancing else ""
    fig.suptitle(f"tokens per expert (1.0 = balanced){how}")
    with atomic_file(out) as f:  # never through a symlink, never half a file
        fig.savefig(f, dpi=110, format="png")
    plt.close(fig)
    return out
