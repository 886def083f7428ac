"""The fused ops as JAX primitives (CUDA kernels through XLA FFI; the reference elsewhere)."""

from jax_w4a4.ops._library import compiled_targets, library_path, register_cuda_targets
from jax_w4a4.ops.primitives import ALL_OPS, act_quant, w4a4_gemm, w4a4_linear, w4a16_gemm

register_cuda_targets()

__all__ = ["ALL_OPS", "act_quant", "compiled_targets", "library_path", "register_cuda_targets", "w4a4_gemm", "w4a4_linear", "w4a16_gemm"]
