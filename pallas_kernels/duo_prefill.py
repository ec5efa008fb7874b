"""DuoAttention's prefill chunk in one Pallas launch: retrieval heads over their cache, streaming heads over their
ring followed by the chunk, forward only.

The grid is (batch, query block, query head) over every head of the layer, heads in the caches' order: the
retrieval heads first, so a GPU, which launches programs in grid order, starts the long programs (a retrieval head
reads the whole prefix) before the short ones (a streaming head reads its ring and the chunk), and the short ones
fill the tail. Each program runs `flash_attention.forward_program` over its head's keys, and its index maps route
it to the model's head of q and the output, so neither is gathered into the caches' order. A layer runs one launch
with the whole model's grid instead of two smaller ones (retrieval, streaming). The streaming heads' keys are the ring's
slots, all before the chunk, then the chunk's own in order: their key-block schedule stops at each query block's
diagonal (`Config.key_offset`) instead of visiting every block, and the chunk's tiles before it skip the mask.
Design: docs/kernels.md, "DuoAttention's prefill chunk in one launch".
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common
from pallas_kernels.duo_decode import lookup
from pallas_kernels.flash_attention import Config, _head_spec, forward_program, launch_forward


def _kernel(
    q_offset_ref,
    kv_len_ref,
    window_len_ref,
    q_ref,
    k_ref,
    v_ref,
    window_k_ref,
    window_v_ref,
    window_positions_ref,
    o_ref,
    lse_ref,
    *,
    retrieval: Config,
    streaming: Config,
    group: int,
    num_retrieval: int,
):
    # grid (batch, query block, query head in the caches' order); read here: the interpreter resolves program ids
    # only outside `pl.when`
    program = pl.program_id(0), pl.program_id(1)
    is_retrieval = pl.program_id(2) // group < num_retrieval

    def loader(key_ref, value_ref, block_k):
        def load_kv(kv_block):
            rows = pl.ds(kv_block * block_k, block_k)
            return [key_ref[rows, :]], [value_ref[rows, :]]

        return load_kv

    @pl.when(is_retrieval)
    def _retrieval():
        forward_program(
            q_offset_ref,
            kv_len_ref,
            q_ref,
            loader(k_ref, v_ref, retrieval.block_k),
            o_ref,
            lse_ref,
            cfg=retrieval,
            program=program,
        )

    @pl.when(jnp.logical_not(is_retrieval))
    def _streaming():
        forward_program(
            q_offset_ref,
            window_len_ref,
            q_ref,
            loader(window_k_ref, window_v_ref, streaming.block_k),
            o_ref,
            lse_ref,
            cfg=streaming,
            program=program,
            load_positions=lambda kv_block: window_positions_ref[
                pl.ds(kv_block * streaming.block_k, streaming.block_k)
            ],
        )


def duo_prefill_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    window_k: jax.Array,
    window_v: jax.Array,
    window_positions: jax.Array,
    *,
    kv_order: tuple[int, ...],
    q_offset,
    kv_len,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
) -> jax.Array:
    """A chunk of T new tokens per sequence over a cache split by KV heads.

    Args:
      q: [B, T, Hq, D] in the model's head order, query t at position q_offset + t; Hq = G * K.
      k, v: [B, C, n, D] the retrieval heads' cache, the chunk already written; query t sees keys j <= q_offset
        + t with j < kv_len.
      window_k, window_v: [B, R + T, K - n, D] the streaming heads' keys and values: R ring slots, each holding a
        token before the chunk (or empty), then the chunk's own T tokens in order.
      window_positions: int32 [B, R + T], each window slot's position (-1: empty); query t sees slot j iff its
        position is >= 0 and <= q_offset + t. The layout above is a promise: the kernel visits no slot past R +
        t for query t.
      kv_order: the model's K KV heads in the caches' order (retrieval cache heads 0..n-1, then the window's
        heads), the layer's `CacheLayout.kv_order`.
      q_offset, kv_len: int, int32 scalar or int32 [B].
      scale: softmax scale, default 1 / sqrt(D).
      block_q, block_k: tile sizes (shrunk for short sequences; T, C and R + T are padded and masked).
      interpret: None = interpret mode exactly when running on CPU.

    Returns:
      [B, T, Hq, D] like q, in the model's head order. Queries that see no key get 0.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    num_retrieval, num_streaming = k.shape[2], window_k.shape[2]
    num_kv_heads = num_retrieval + num_streaming
    if num_retrieval == 0 or num_streaming == 0:
        raise ValueError(
            "duo_prefill_attention needs retrieval and streaming heads; with one kind, use flash_attention "
            "(retrieval) or flash_attention with k_positions (streaming)"
        )
    for name, (key, value) in {"k / v": (k, v), "window_k / window_v": (window_k, window_v)}.items():
        if key.ndim != 4 or value.shape != key.shape or key.shape[0] != batch or key.shape[3] != head_dim:
            raise ValueError(
                f"{name} must both be [B={batch}, slots, heads, D={head_dim}], got {key.shape} and {value.shape}"
            )
    window = window_k.shape[1]
    if window < seq_q or tuple(window_positions.shape) != (batch, window):
        raise ValueError(
            f"window_k / window_v must hold R ring slots then the chunk's {seq_q} tokens, with window_positions "
            f"int32 [B, R + T] = {(batch, window)}; got {window} slots and positions {tuple(window_positions.shape)}"
        )
    if sorted(kv_order) != list(range(num_kv_heads)):
        raise ValueError(f"kv_order must list the {num_kv_heads} KV heads once each, got {kv_order}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not group over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    _common.check_block("block_q", block_q)
    _common.check_block("block_k", block_k)
    interpret = _backend.resolve_interpret(interpret)
    block_q, block_k = _backend.fit_tiles(block_q, block_k, q.dtype, interpret)
    block_q = _common.fit_block(block_q, seq_q)
    cache_block = _common.fit_block(block_k, k.shape[1])
    window_block = _common.tiling_block(block_k, window)  # no padded copy of the window where a block tiles it
    common = dict(
        seq_q=seq_q, sink=None, recent=None, scale=_common.default_scale(head_dim, scale), interpret=interpret
    )
    retrieval = Config(causal=True, block_q=block_q, block_k=cache_block, **common)
    streaming = Config(
        causal=True, block_q=block_q, block_k=window_block, k_positions=True, key_offset=window - seq_q, **common
    )
    q_offset = _common.per_batch(q_offset, batch, 0)
    kv_len = jnp.minimum(_common.per_batch(kv_len, batch, k.shape[1]), k.shape[1])
    window_len = jnp.full((batch,), window, jnp.int32)

    pad = _common.pad_to_block
    k, v = pad(k, cache_block), pad(v, cache_block)
    window_k, window_v = pad(window_k, window_block), pad(window_v, window_block)
    window_positions = pad(window_positions.astype(jnp.int32), window_block, value=-1)  # padded slots: empty
    # Grid head h is query head h % group of the caches' KV head s = h // group: the retrieval cache's head s, or
    # the ring's head s - n. It reads and writes the model's query head kv_order[s] * group + h % group.
    model_head = lambda h: lookup(tuple(kv_order), h // group) * group + h % group  # noqa: E731
    cache_spec = _head_spec(k.shape[1], head_dim, lambda h: jnp.minimum(h // group, num_retrieval - 1), tiled=False)
    window_spec = _head_spec(
        window_k.shape[1], head_dim, lambda h: jnp.maximum(h // group - num_retrieval, 0), tiled=False
    )
    positions_spec = pl.BlockSpec((None, window_k.shape[1]), lambda b, h, i: (b, 0))
    kernel = functools.partial(
        _kernel, retrieval=retrieval, streaming=streaming, group=group, num_retrieval=num_retrieval
    )
    o, _ = launch_forward(
        kernel,
        pad(q, block_q),
        [q_offset, kv_len, window_len],
        [k, v, window_k, window_v, window_positions],
        [cache_spec, cache_spec, window_spec, window_spec, positions_spec],
        retrieval,
        name="duo_prefill_attention",
        head_of=model_head,
        heads_last=True,
    )
    return o[:, :seq_q]
