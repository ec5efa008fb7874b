"""TPU (Mosaic) attention kernels, with the signatures of the GPU kernels one level up.

* `flash_attention`: dense (causal) attention with q_offset / kv_len, forward
  and backward.
* `lambda_attention`: streaming heads' Λ mask (sinks + recent window), forward
  and backward.
* `decode_attention`: split-K single-token attention over a contiguous
  [B, S, Hkv, D] cache, forward only.
* `paged_decode_attention`: the same over pages [Hkv, N, P, D] through block
  tables: JAX's TPU paged attention (`jax.experimental.pallas.ops.tpu`), adapted.

Static masks run JAX's splash attention (`splash`); traced per-sequence offsets
and lengths, and decode, run our own scalar-prefetch Mosaic kernels
(`block_sparse`, `decode_attention`). ``interpret=None`` runs them in TPU
interpret mode off TPU (how they are tested on CPU) and compiles them on TPU.
"""

from pallas_kernels.tpu._mosaic import LANES
from pallas_kernels.tpu.decode_attention import decode_attention
from pallas_kernels.tpu.flash_attention import flash_attention
from pallas_kernels.tpu.lambda_attention import lambda_attention
from pallas_kernels.tpu.paged_attention import paged_decode_attention

__all__ = ["LANES", "decode_attention", "flash_attention", "lambda_attention", "paged_decode_attention"]
