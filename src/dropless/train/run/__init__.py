"""The run's plumbing: `setup.py` (the process group, rank and device), `rundir.py` (the
run directory and its lock), `atomic.py` (writes a crash cannot half-finish),
`collectives.py` (every collective of train/), `interrupts.py` (SIGINT / SIGTERM),
`errors.py` (the errors that stop a run), `hooks.py` (`TrainHooks`) and `lazy.py`
(`dropless.hf` imported on first use)."""
