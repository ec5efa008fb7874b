"""Pallas attention kernels for duo-jax (GPU via Triton, CPU via interpret mode).

* `lambda_attention`: streaming heads' Λ mask (sinks + recent window),
  block-sparse, forward and backward kernels.
* `flash_attention`: dense (causal) attention with q_offset / kv_len, forward
  and backward kernels.
* `decode_attention`: split-K single-token attention over a cache, forward only.
* `duo_decode_attention`: DuoAttention's decode step, retrieval heads over their cache and streaming heads over
  their ring + the new token, in one launch, forward only.
* `paged_decode_attention`, `paged_flash_attention`: decode and a prefill chunk over
  pages of a pool read through block tables, forward only.

`reference` holds dense pure-jnp versions of all three with explicit masks.
`tpu` holds the same three functions for TPU (splash attention and Mosaic
kernels), tested in TPU interpret mode on CPU. `cpu` holds flash attention for
CPU, in C++ through XLA's FFI (Pallas has no CPU compiler), built on first use.
"""

from pallas_kernels import cpu, duo_decode, reference, tpu
from pallas_kernels._common import check_block, check_qkv, check_window
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.duo_decode import duo_decode_attention
from pallas_kernels.flash_attention import flash_attention
from pallas_kernels.lambda_attention import causal_visited_blocks, lambda_attention, lambda_visited_blocks
from pallas_kernels.paged_attention import paged_decode_attention, paged_flash_attention

__all__ = [
    "causal_visited_blocks",
    "check_block",
    "cpu",
    "check_qkv",
    "check_window",
    "decode_attention",
    "duo_decode",
    "duo_decode_attention",
    "flash_attention",
    "lambda_attention",
    "lambda_visited_blocks",
    "paged_decode_attention",
    "paged_flash_attention",
    "reference",
    "tpu",
]
