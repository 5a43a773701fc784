"""The expert activation (SwiGLU and the other gated and elementwise kinds): everything
about the op in one folder.

- `reference.py`: `activation_reference`, `swiglu_reference`, the specification;
- `eager.py`: every kind's forward, the parts its backward recomputes and its backward
  in torch ops, which every torch path (loop, grouped, FP8, LoRA) calls;
- `swiglu.py`: `swiglu` / `expert_activation`, the activation x routing weight with its
  autograd Function, run by the registered row ops;
- `activation_kernels.py`: every kind's math as Triton device functions;
  `swiglu_kernels.py`: the Triton row kernels (forward, backward with recompute).
  They register as part of the "triton" row ops (`permute/gpu.py`) on the first pick
  for a CUDA tensor;
- `swiglu_quant_kernels.py`, `swiglu_bwd_quant_kernels.py`: SwiGLU x prob fused with the
  E4M3 / MXFP8 quantization of its output (forward) and of its recomputation (backward),
  which the FP8 recipes' MLP (`dropless.quant.mlp`) runs on CUDA.

This `__init__` imports nothing: the row-op registry (`permute/row_ops.py`) imports
`eager.py`, and `swiglu.py` imports the registry.
"""
