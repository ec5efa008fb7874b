"""Pallas attention kernels for duo-jax: Triton on GPU, interpret mode on CPU.

`flash_attention` (causal, with q_offset / kv_len, forward and backward), `lambda_attention` (the streaming
heads' Λ mask, forward and backward), `decode_attention` (split-K, one query per sequence), `duo_decode_attention`
and `duo_prefill_attention` (both DuoAttention partitions of a decode step, or of a prefill chunk, in one launch),
and `paged_decode_attention` / `paged_flash_attention` (pages read through block tables); all but the first two
are forward only. `reference`
holds dense jnp versions, `tpu` the same kernels for TPU (Mosaic), `mosaic_gpu` DuoAttention's decode step in Pallas
Mosaic GPU (Hopper, where Pallas has no Triton backend), `cpu` causal flash attention in C++ for CPU.
Design: docs/kernels.md.
"""

from pallas_kernels import cpu, duo_decode, duo_prefill, mosaic_gpu, reference, tpu
from pallas_kernels._common import check_block, check_qkv, check_window
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.duo_decode import duo_decode_attention
from pallas_kernels.duo_prefill import duo_prefill_attention
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
    "duo_prefill",
    "duo_prefill_attention",
    "flash_attention",
    "lambda_attention",
    "lambda_visited_blocks",
    "mosaic_gpu",
    "paged_decode_attention",
    "paged_flash_attention",
    "reference",
    "tpu",
]
