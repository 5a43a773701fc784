"""Checkpoints: `store.py` saves and loads them (DCP shards, RNG, trainer state),
`async_save.py` writes them in the background, `dcp_io.py` hashes and reads the shards
safely, `manifest.py` lists and verifies them, `resume.py` says what `--resume` may
change and finds the run to resume."""
