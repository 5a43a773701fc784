"""FP8 / MXFP8 quantization: the quantizer reference (`reference.py`, the specification
every cast is tested against bit for bit) and the one-pass Triton casts
(`triton_quant.py`, with the E4M3 / E8M0 bit arithmetic of `triton_fp8.py`).

The formats, recipes and quantized GEMMs that use them are `dropless.quant`'s; it loads
the casts only for CUDA tensors with triton installed. The fused SwiGLU + FP8 kernels
live with the activation (`ops/activation/swiglu_quant_kernels.py`,
`swiglu_bwd_quant_kernels.py`): they return raw bytes and scales, which `quant/mlp.py`
wraps in its `QTensor`, and take their encoders from `triton_fp8.py` here.
This `__init__` imports nothing.
"""
