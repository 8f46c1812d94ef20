"""MLA attention over the paged quantised KV cache: cache writer, attention, torch reference.

Product code calls `mla_eval.attention.dispatch` (`write_cache`, `mla_attention`): CUDA tensors go
to the CuTe DSL kernels (package `mla_eval_kernels`, imported lazily), everything else to the torch
reference in `mla_eval.attention.reference`, which has the same signatures and is the test oracle.
"""

from mla_eval.attention.dispatch import (
    kernel_status,
    mla_attention,
    mla_attention_dense,
    mla_attention_sparse,
    write_cache,
)

__all__ = ["kernel_status", "mla_attention", "mla_attention_dense", "mla_attention_sparse", "write_cache"]
