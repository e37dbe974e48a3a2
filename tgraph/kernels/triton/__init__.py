"""Triton kernels.

Conventions shared by every kernel module here:

- A kernel is exposed as a plain Python function taking torch tensors and writing into the
  ``out`` tensors it is given (never allocating its outputs), e.g.
  ``rms_norm(x, weight, eps, out)``.
- Leading dims are flattened by the caller; kernels take 2-D/3-D contiguous-last-dim tensors and
  read strides from the tensors, so row-strided views work.
- Math is done in fp32 and stored in the output dtype; fp32, fp16 and bf16 are supported.
- Every kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (CI) and on CUDA.
- Kernels are generic in the token/batch dims (those are runtime arguments, never ``constexpr``)
  so that one compiled kernel serves every batch size.
"""
