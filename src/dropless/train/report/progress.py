"""The live display of a run: a rich progress bar on a terminal (step, loss, tokens/s,
MFU, ETA), else plain lines; each line printed is told to the run's heartbeat
(`heartbeat.py`), which speaks only after a silence."""

from __future__ import annotations

import math
import sys


class Progress:
    """A rich progress bar on a terminal (step, loss, tokens/s, MFU, ETA), else plain lines."""

    def __init__(self, mode: str, total: int, start: int, enabled: bool, on_line=None):
        self.enabled = enabled and mode != "none"
        # the bar draws on stdout: `dropless train > log` gets plain lines
        self.rich = self.enabled and (mode == "rich" or (mode == "auto" and sys.stdout.isatty()))
        self.total, self.bar, self.on_line = total, None, on_line
        if self.rich:
            try:
                from rich.progress import BarColumn, TextColumn, TimeRemainingColumn
                from rich.progress import Progress as RichProgress
            except ModuleNotFoundError:
                self.rich = False
            else:
                self.bar = RichProgress(
                    TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  MFU {task.fields[mfu]}"),
                    TextColumn("ETA"), TimeRemainingColumn(), transient=False,
                )  # fmt: skip
                self.bar.start()
                self.task = self.bar.add_task(
                    "train", total=total, completed=start, loss="-", tps="-", mfu="-"
                )

    def update(self, step: int, loss: float, tps: float, mfu: float, eta_s: float) -> None:
        if self.bar is not None:
            mfu_s = f"{mfu:.1%}" if math.isfinite(mfu) else "n/a"
            self.bar.update(
                self.task, completed=step, loss=f"{loss:.3f}", tps=f"{tps:,.0f}", mfu=mfu_s
            )

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:  # one write: a heartbeat line (heartbeat.py) cannot split it
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
        if self.on_line is not None:
            self.on_line()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
