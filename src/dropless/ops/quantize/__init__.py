"""FP8 / MXFP8 quantization: the quantizer reference (`reference.py`, the specification
every cast is tested against bit for bit) and the one-pass Triton casts
(`triton_quant.py`, with the E4M3 / E8M0 bit arithmetic of `triton_fp8.py`).

The formats, recipes and quantized GEMMs that use them are `dropless.quant`'s; it loads
the casts only for CUDA tensors with triton installed. The fused SwiGLU + FP8 kernels
stay in `dropless.quant` (`triton_swiglu_quant.py`, `triton_swiglu_bwd_quant.py`): they
return `quant.formats.QTensor`, which `ops` may not import; they take their encoders from
`triton_fp8.py` here and the activation math from `ops/activation/activation_kernels.py`.
This `__init__` imports nothing.
"""
