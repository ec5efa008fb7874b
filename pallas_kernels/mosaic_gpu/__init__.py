"""Pallas Mosaic GPU kernels (Hopper), for where Pallas has no Triton backend: DuoAttention's decode step in one
launch (`duo_decode_attention`). Design: docs/kernels.md, "DuoAttention's decode step without Triton"."""

from pallas_kernels.mosaic_gpu.duo_decode import duo_decode_attention, unsupported

__all__ = ["duo_decode_attention", "unsupported"]
