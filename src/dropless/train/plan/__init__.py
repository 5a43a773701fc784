"""Before the run: `preflight.py` runs every check that needs no long work (on GPUs the
traced plan), `trace.py` traces one step on fake tensors at the target world size (`dropless
plan`) with `attention.py` and `experts.py` declaring what fake tensors cannot run and
`cost.py` estimating its time, and `memory_fit.py` checks host memory."""
