"""FP8 / MXFP8 quantization: the quantizer reference (`reference.py`, the specification
every cast is tested against bit for bit) and the one-pass Triton casts (`triton_quant.py`,
bit arithmetic in `triton_fp8.py`, shared with the fused SwiGLU + FP8 kernels of
`ops/activation`). `dropless.quant` uses them. This `__init__` imports nothing.
"""
