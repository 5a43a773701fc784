"""SIGINT (Ctrl-C) and SIGTERM (what schedulers and torchrun send before stopping a job)
during training: the first one asks the loop to stop after the current step and save;
a second SIGINT stops at once."""

from __future__ import annotations

import signal
import sys
import threading
from dataclasses import dataclass, field

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(eq=False)  # stateful: compared and hashed by identity
class StopRequests:
    """While active, records the first SIGINT/SIGTERM in `signum` instead of dying
    (`announce`: says so on stderr)."""

    announce: bool = True
    signum: int | None = field(default=None, init=False)
    _previous: dict = field(default_factory=dict, init=False, repr=False)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            if signum == signal.SIGINT:  # the second Ctrl-C: stop now
                raise KeyboardInterrupt
            return
        self.signum = signum
        if self.announce:
            print(
                f"\n{signal.Signals(signum).name}: finishing this step, then writing a checkpoint "
                "(Ctrl-C again to stop at once, losing the steps since the last checkpoint)",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> StopRequests:
        if threading.current_thread() is threading.main_thread():  # signals reach only it
            self._previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
