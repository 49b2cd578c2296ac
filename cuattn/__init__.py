"""cuattn: exact, memory-efficient attention for any array framework.

Raw CUDA kernels compiled at run time with NVRTC through CuPy; arrays from CuPy, NumPy,
PyTorch, JAX or any DLPack producer. See README.md.
"""

from cuattn import block_mask, reference
from cuattn.attention import attention
from cuattn.backward import attention_backward
from cuattn.block_mask import BlockMask
from cuattn.chunked import attention_chunked, attention_chunked_backward
from cuattn.decode import append_kv, attention_with_kvcache
from cuattn.merge import merge, merge_
from cuattn.varlen import attention_varlen, attention_varlen_backward, check_varlen_offsets

__version__ = "0.1.0"
__all__ = [
    "attention", "attention_backward", "block_mask", "BlockMask", "attention_chunked", "attention_chunked_backward", "attention_varlen", "attention_with_kvcache", "append_kv", "attention_varlen_backward", "check_varlen_offsets", "merge", "merge_", "reference",
    "__version__",
]
