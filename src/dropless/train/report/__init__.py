"""What a run says: `metrics.py` (metrics file, rates, memory), `flops.py` (the FLOPs of a
step), `run_log.py` (progress lines and the summary), `summary.py` (summary.json and its
table), `plots.py` and `heartbeat.py` (a line while a long phase runs)."""
