"""Plain progress lines off a terminal. With `dropless train > log` the rich display is
off and a run may say nothing for minutes: while the data is read and tokenized, the
model built, a checkpoint loaded, or between two log steps of a slow run. A `Heartbeat`
prints one line saying what the run is doing whenever nothing was printed for
`INTERVAL_S` seconds; on a terminal it prints nothing (the progress bar covers that)."""

from __future__ import annotations

import sys
import threading
import time

#: seconds without output after which a line is printed (tests monkeypatch it)
INTERVAL_S = 30.0


class Heartbeat:
    """`Heartbeat.for_run(...)` starts a daemon thread that prints `dropless train:
    <beat.doing> (N s since the start)` after each INTERVAL_S of silence, until
    `beat.close()`; the run sets `beat.doing` to what it is doing, and `beat.printed()`
    tells it that the run printed a line itself. Disabled, it only keeps the state (no
    thread, no output)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.interval_s = INTERVAL_S
        self.doing = "starting"
        self.t0 = self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def for_run(cls, main: bool, progress: str) -> Heartbeat:
        """On rank 0, unless log.progress="none", when stdout is not a terminal; started."""
        beat = cls(main and progress != "none" and not sys.stdout.isatty())
        if beat.enabled:
            beat._thread = threading.Thread(
                target=beat._run, name="dropless-heartbeat", daemon=True
            )
            beat._thread.start()
        return beat

    def printed(self) -> None:
        self.last = time.monotonic()

    def _run(self) -> None:
        while not self._stop.wait(max(0.0, self.last + self.interval_s - time.monotonic())):
            now = time.monotonic()
            if now - self.last >= self.interval_s:
                # one write: no output of the main thread lands inside the line
                sys.stdout.write(
                    f"dropless train: {self.doing} ({now - self.t0:.0f} s since the start)\n"
                )
                sys.stdout.flush()
                self.last = now

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


__all__ = ["INTERVAL_S", "Heartbeat"]
