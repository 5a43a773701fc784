"""Switching Transformers models to the dropless experts path and back.

`patch.py`: `patch`, `patch_model`, `unpatch` (the one private touch-point of Transformers
and the options); `report.py`: what each model and experts module runs; `configs.py`: a
config object that already built a stock model; `routers.py`: the expert-bias router
forward; `discovery.py`: every experts class of the installed Transformers
(`python -m dropless.hf.patching.discovery` prints the family table of docs/hf.md).
"""
