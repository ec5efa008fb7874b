"""TPU (Mosaic) attention kernels, with the signatures of the GPU kernels one level up.

`flash_attention` and `lambda_attention` (forward and backward), `decode_attention` (split-K over a contiguous
cache) and `paged_decode_attention` (JAX's TPU paged attention, adapted). Static masks run JAX's splash attention
(`splash`), traced offsets, lengths and positions our own scalar-prefetch kernels (`block_sparse`,
`decode_attention`). ``interpret=None`` runs them in TPU interpret mode off TPU and compiles them on TPU.
Design: docs/kernels.md, "TPU kernels".
"""

from pallas_kernels.tpu._mosaic import LANES
from pallas_kernels.tpu.decode_attention import decode_attention
from pallas_kernels.tpu.flash_attention import flash_attention
from pallas_kernels.tpu.lambda_attention import lambda_attention
from pallas_kernels.tpu.paged_attention import paged_decode_attention

__all__ = ["LANES", "decode_attention", "flash_attention", "lambda_attention", "paged_decode_attention"]
