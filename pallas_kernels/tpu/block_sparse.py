"""Block-sparse causal / Λ attention as our own Mosaic TPU kernels (forward and backward).

For what splash attention cannot take: traced, per-sequence ``q_offset`` / ``kv_len`` (int32 [B], chunked
prefill), queries and keys at explicit positions (``q_positions`` [B, T], ``k_positions`` [B, S], -1 empty) and
a quantized cache (``kv_quant``, forward only). Offsets and lengths are scalar-prefetched so each query block
fetches only the key blocks its mask touches (`_common.kv_block_schedule`). Layout [B, H, T, D] (the wrapper
transposes). Design: docs/kernels.md, "Own block-sparse kernels (traced masks)".
"""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import _common
from pallas_kernels.tpu import _mosaic


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static description of one call (hashable: a custom_vjp nondiff arg)."""

    seq_q: int  # True number of queries; the arrays are padded past it.
    causal: bool
    sink: int | None  # Λ window; None for dense attention.
    recent: int | None
    scale: float
    block_q: int
    block_k: int
    group: int  # Query heads per KV head.
    interpret: object  # See `_mosaic.interpret_mode`.
    positions: bool = False  # Explicit query and key positions (two operands), not q_offset + i and j.
    kv_quant: str | None = None  # k / v are int8 codes with scales ("int8", "int4"): forward only

    @property
    def window(self) -> dict:
        return dict(causal=self.causal, sink=self.sink, recent=self.recent)

    @property
    def schedule(self) -> dict:
        """The window the block schedules follow: with explicit key positions any slot may hold any
        position, so every block up to kv_len is visited (the mask alone decides)."""
        return dict(causal=False, sink=None, recent=None) if self.positions else self.window

    def kv_steps(self, num_kv_blocks: int) -> int:
        """Static length of the inner KV axis: the most KV blocks one query block visits."""
        if self.recent is None or self.positions:
            return num_kv_blocks
        band = _common.cdiv(self.block_q + self.recent - 1, self.block_k) + 1
        return min(num_kv_blocks, _common.cdiv(self.sink, self.block_k) + band)

    def q_steps(self, num_q_blocks: int) -> int:
        """Static length of the inner query axis of dk/dv: the most query blocks one KV block meets."""
        if self.recent is None or self.sink > 0 or self.positions:
            return num_q_blocks
        return min(num_q_blocks, _common.cdiv(self.block_k + self.recent - 1, self.block_q) + 1)

    def params(self):
        return _mosaic.compiler_params(("parallel", "parallel", "parallel", "arbitrary"), self.interpret)


def _dot(a, b, contract: str):
    """float32-accumulated matmul; `contract` is an einsum string."""
    return jnp.einsum(contract, a, b, preferred_element_type=jnp.float32)


def _tile_mask(q_block, kv_block, q_offset, kv_len, pos, cfg: _Config, *, keys_major: bool = False):
    """[bq, bk] mask of one tile ([bk, bq] when keys_major: the dk/dv kernel's orientation); pos:
    None, or the tile's (query positions, key positions), a [bq, 1] column and a [1, bk] row
    (a [1, bq] row and a [bk, 1] column when keys_major)."""
    q_pos, k_pos = (None, None) if pos is None else pos
    shape, q_axis = ((cfg.block_k, cfg.block_q), 1) if keys_major else ((cfg.block_q, cfg.block_k), 0)
    rows = q_block * cfg.block_q + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    cols = kv_block * cfg.block_k + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
    return _common.attention_mask(
        rows, cols, q_offset=q_offset, kv_len=kv_len, seq_q=cfg.seq_q, q_pos=q_pos, k_pos=k_pos, **cfg.window
    )


def _kv_visit(q_block, step, q_offset, kv_len, cfg: _Config, num_kv_blocks: int):
    """(KV block that query block `q_block` visits at inner step `step`, whether that step is real).

    Steps past the schedule repeat its last block (no new DMA); an empty schedule points at block 0.
    """
    sink_end, band_start, end = _common.kv_block_schedule(
        q_block,
        q_offset=q_offset,
        kv_len=kv_len,
        seq_q=cfg.seq_q,
        block_q=cfg.block_q,
        block_k=cfg.block_k,
        **cfg.schedule,
    )
    count = sink_end + end - band_start
    clamped = jnp.clip(step, 0, jnp.maximum(count - 1, 0))
    block = jnp.where(clamped < sink_end, clamped, clamped - sink_end + band_start)
    return jnp.clip(block, 0, num_kv_blocks - 1), step < count


def _q_visit(kv_block, step, q_offset, kv_len, cfg: _Config, num_q_blocks: int):
    """(Query block that KV block `kv_block` meets at inner step `step`, whether the step is real)."""
    start, end = _common.q_block_schedule(
        kv_block,
        q_offset=q_offset,
        kv_len=kv_len,
        num_q_blocks=num_q_blocks,
        block_q=cfg.block_q,
        block_k=cfg.block_k,
        **cfg.schedule,
    )
    block = start + jnp.clip(step, 0, jnp.maximum(end - start - 1, 0))
    return jnp.clip(block, 0, num_q_blocks - 1), step < end - start


def _probabilities(a, b, lse, q_block, kv_block, q_offset, kv_len, pos, cfg: _Config, *, keys_major: bool = False):
    """P = exp(scale q k^T - lse), zero where masked: a = q, b = k gives [bq, bk] (lse a column);
    keys_major, a = k, b = q gives P^T [bk, bq] (lse a row), so every matmul here is A B or A B^T."""
    s = _dot(a, b, "ad,bd->ab") * cfg.scale
    mask = _tile_mask(q_block, kv_block, q_offset, kv_len, pos, cfg, keys_major=keys_major)
    return jnp.where(mask, jnp.exp(s - lse), 0.0)


def _split_positions(refs, cfg: _Config):
    """(the tile's positions, see `_tile_mask`, or None; the other refs): the kernels' refs after
    their inputs q, k, v (and those of the backward), where the query and key positions' operands
    come first when `cfg.positions`."""
    return ((refs[0][...], refs[1][...]), refs[2:]) if cfg.positions else (None, refs)


# ------------------------------------------------------------------- forward


def _fwd_kernel(
    q_offset_ref,
    kv_len_ref,  # scalar prefetch
    q_ref,
    k_ref,
    v_ref,  # inputs
    *refs,  # (k, v scales when quantized; query and key positions when cfg.positions); outputs o,
    cfg: _Config,
    num_kv_blocks: int,
):  # lse; scratch
    (k_scale_ref, v_scale_ref), refs = (refs[:2], refs[2:]) if cfg.kv_quant else ((None, None), refs)
    pos, (o_ref, lse_ref, m_scr, l_scr, acc_scr) = _split_positions(refs, cfg)
    parts = _common.kv_parts(cfg.kv_quant)
    part = (lambda ref, i: ref) if cfg.kv_quant is None else (lambda ref, i: ref.at[i])  # noqa: E731
    q_parts = [part(q_ref, i) for i in range(parts)]  # [bq, D / parts] each (quantized: a leading-dim index)
    acc_parts = [part(acc_scr, i) for i in range(parts)]
    b, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    kv_block, real = _kv_visit(q_block, step, q_offset, kv_len, cfg, num_kv_blocks)

    @pl.when(step == 0)
    def _init():
        m_scr[...] = jnp.full(m_scr.shape, _common.MASK_VALUE, jnp.float32)
        l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)

    @pl.when(real)
    def _accumulate():
        tile = lambda ref, scale_ref: _common.dequantize_tile(  # noqa: E731  [parts][bk, D / parts]
            ref[...], None if scale_ref is None else scale_ref[...], cfg.kv_quant, q_ref.dtype
        )
        s = (
            functools.reduce(
                operator.add, [_dot(q[...], k, "qd,kd->qk") for q, k in zip(q_parts, tile(k_ref, k_scale_ref))]
            )
            * cfg.scale
        )
        mask = _tile_mask(q_block, kv_block, q_offset, kv_len, pos, cfg)
        s = jnp.where(mask, s, _common.MASK_VALUE)
        m = m_scr[...]
        m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
        p = jnp.where(mask, jnp.exp(s - m_new), 0.0)
        correction = jnp.exp(m - m_new)  # Rescales what was summed under the old max.
        l_scr[...] = correction * l_scr[...] + p.sum(axis=-1, keepdims=True)
        for acc, v in zip(acc_parts, tile(v_ref, v_scale_ref)):
            acc[...] = correction * acc[...] + _dot(p.astype(v.dtype), v, "qk,kd->qd")
        m_scr[...] = m_new

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr[...]
        empty = l == 0.0  # Rows that see no key: output 0, lse +inf.
        for i, acc in enumerate(acc_parts):
            part(o_ref, i)[...] = (acc[...] / jnp.where(empty, 1.0, l)).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, jnp.inf, m_scr[...] + jnp.log(jnp.where(empty, 1.0, l)))


def _specs(cfg: _Config, head_dim: int, num_kv_blocks: int):
    """BlockSpecs for grid (b, h, i, t): query tiles at block i, KV tiles at the visited block, and
    with cfg.positions the query positions' [bq, 1] column of block i and the key positions' [1, bk]
    row of the visited block ([B, T, 1] and [B, 1, S] operands; `positions`: [] or both)."""

    def kv_map(b, h, i, t, q_offset_ref, kv_len_ref):
        block, _ = _kv_visit(i, t, q_offset_ref[b], kv_len_ref[b], cfg, num_kv_blocks)
        return b, lax.div(h, cfg.group), block, 0  # lax.div: `//` lowers through sign

    def row_map(*args):
        b, _, block, _ = kv_map(*args)
        return b, 0, block

    q_tile = pl.BlockSpec((None, None, cfg.block_q, head_dim), lambda b, h, i, t, *_: (b, h, i, 0))
    stats = pl.BlockSpec((None, None, cfg.block_q, 1), lambda b, h, i, t, *_: (b, h, i, 0))
    kv_tile = pl.BlockSpec((None, None, cfg.block_k, head_dim), kv_map)
    positions = (
        [
            pl.BlockSpec((None, cfg.block_q, 1), lambda b, h, i, t, *_: (b, i, 0)),
            pl.BlockSpec((None, 1, cfg.block_k), row_map),
        ]
        if cfg.positions
        else []
    )
    return q_tile, stats, kv_tile, positions


def _position_operands(pos, *, keys_major: bool = False) -> list:
    """The operands of (q_positions [B, T], k_positions [B, S]): a [B, T, 1] column and a [B, 1, S]
    row ([B, 1, T] and [B, S, 1] when keys_major); [] when pos is None."""
    if pos is None:
        return []
    q_pos, k_pos = pos
    if keys_major:
        return [q_pos[:, None, :], k_pos[:, :, None]]
    return [q_pos[:, :, None], k_pos[:, None, :]]


def _forward(q, k, v, q_offset, kv_len, pos, cfg: _Config, scales=()):
    """o [B, H, T, D], lse [B, H, T, 1]; with cfg.kv_quant, k / v are codes [B, Hkv, S, D or D/2] and `scales`
    their (k, v) scales [B, Hkv, S, 1]."""
    batch, num_heads, seq_q_padded, head_dim = q.shape
    num_q_blocks, num_kv_blocks = seq_q_padded // cfg.block_q, k.shape[2] // cfg.block_k
    q_tile, stats, kv_tile, positions = _specs(cfg, head_dim, num_kv_blocks)
    parts, acc = _common.kv_parts(cfg.kv_quant), (cfg.block_q, head_dim)
    if cfg.kv_quant is not None:  # codes' and scales' tiles at the same blocks as K / V's; q, o, acc in parts
        code_tile, scale_tile = (
            pl.BlockSpec((None, None, cfg.block_k, width), kv_tile.index_map) for width in (k.shape[-1], 1)
        )
        kv_tile = [code_tile, code_tile, scale_tile, scale_tile]
        width = head_dim // parts  # [B, H, T, D] -> [B, H, parts, T, D / parts]
        q = jnp.swapaxes(q.reshape(batch, num_heads, seq_q_padded, parts, width), 2, 3)
        q_tile = pl.BlockSpec((None, None, parts, cfg.block_q, width), lambda b, h, i, t, *_: (b, h, 0, i, 0))
        acc = (parts, cfg.block_q, width)
    else:
        kv_tile = [kv_tile, kv_tile]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(batch, num_heads, num_q_blocks, cfg.kv_steps(num_kv_blocks)),
        in_specs=[q_tile, *kv_tile, *positions],
        out_specs=[q_tile, stats],
        scratch_shapes=[
            pltpu.VMEM((cfg.block_q, 1), jnp.float32),
            pltpu.VMEM((cfg.block_q, 1), jnp.float32),
            pltpu.VMEM(acc, jnp.float32),
        ],
    )
    o, lse = pl.pallas_call(
        functools.partial(_fwd_kernel, cfg=cfg, num_kv_blocks=num_kv_blocks),
        grid_spec=grid_spec,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_q_padded, 1), jnp.float32),
        ],
        compiler_params=cfg.params(),
        interpret=cfg.interpret,
        name="tpu_block_sparse_attention_fwd",
    )(q_offset, kv_len, q, k, v, *scales, *_position_operands(pos))
    if cfg.kv_quant is not None:
        o = jnp.swapaxes(o, 2, 3).reshape(batch, num_heads, seq_q_padded, head_dim)
    return o, lse


# ------------------------------------------------------------------ backward
# With P = softmax(S), dO the output cotangent and delta = rowsum(dO * O):
#   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,  dK = scale dS^T Q.


def _dq_kernel(
    q_offset_ref,
    kv_len_ref,  # scalar prefetch
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,  # inputs
    *refs,  # (positions); output dq; scratch
    cfg: _Config,
    num_kv_blocks: int,
):
    pos, (dq_ref, dq_scr) = _split_positions(refs, cfg)
    b, q_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    kv_block, real = _kv_visit(q_block, step, q_offset, kv_len, cfg, num_kv_blocks)

    @pl.when(step == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, jnp.float32)

    @pl.when(real)
    def _accumulate():
        k = k_ref[...]
        p = _probabilities(q_ref[...], k, lse_ref[...], q_block, kv_block, q_offset, kv_len, pos, cfg)
        dp = _dot(do_ref[...], v_ref[...], "qd,kd->qk")
        ds = p * (dp - delta_ref[...])
        dq_scr[...] += _dot(ds.astype(k.dtype), k, "qk,kd->qd")

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = (dq_scr[...] * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_offset_ref,
    kv_len_ref,  # scalar prefetch
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,  # inputs
    *refs,  # (positions, keys-major); outputs dk, dv; scratch
    cfg: _Config,
    num_q_blocks: int,
):
    pos, (dk_ref, dv_ref, dk_scr, dv_scr) = _split_positions(refs, cfg)
    b, kv_block, step = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    q_block, real = _q_visit(kv_block, step, q_offset, kv_len, cfg, num_q_blocks)

    @pl.when(step == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, jnp.float32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, jnp.float32)

    @pl.when(real)
    def _accumulate():  # Keys-major: P^T and dS^T [bk, bq], lse and delta rows [1, bq].
        q, k, do = q_ref[...], k_ref[...], do_ref[...]
        p_t = _probabilities(k, q, lse_ref[...], q_block, kv_block, q_offset, kv_len, pos, cfg, keys_major=True)
        dv_scr[...] += _dot(p_t.astype(do.dtype), do, "kq,qd->kd")
        dp_t = _dot(v_ref[...], do, "kd,qd->kq")
        ds_t = p_t * (dp_t - delta_ref[...])
        dk_scr[...] += _dot(ds_t.astype(q.dtype), q, "kq,qd->kd")

    @pl.when(step == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_scr[...] * cfg.scale
        dv_ref[...] = dv_scr[...]


def _backward(cfg: _Config, residuals, do):
    q, k, v, q_offset, kv_len, pos, o, lse = residuals
    batch, num_heads, seq_q_padded, head_dim = q.shape
    num_kv_heads, seq_k_padded = k.shape[1], k.shape[2]
    num_q_blocks, num_kv_blocks = seq_q_padded // cfg.block_q, seq_k_padded // cfg.block_k
    # delta = rowsum(dO * O) [B, H, T, 1]: a cheap elementwise pass, left to XLA.
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1, keepdims=True)
    scratch = lambda length: pltpu.VMEM((length, head_dim), jnp.float32)  # noqa: E731
    rows = lambda x: x.reshape(batch, num_heads, 1, seq_q_padded)  # noqa: E731  [B, H, T, 1] -> rows

    q_tile, stats, kv_tile, positions = _specs(cfg, head_dim, num_kv_blocks)
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg, num_kv_blocks=num_kv_blocks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_heads, num_q_blocks, cfg.kv_steps(num_kv_blocks)),
            in_specs=[q_tile, kv_tile, kv_tile, q_tile, stats, stats, *positions],
            out_specs=q_tile,
            scratch_shapes=[scratch(cfg.block_q)],
        ),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=cfg.params(),
        interpret=cfg.interpret,
        name="tpu_block_sparse_attention_dq",
    )(q_offset, kv_len, q, k, v, do, lse, delta, *_position_operands(pos))

    # Grid (b, h, j, t): KV tiles at block j, query tiles at the visited query block.
    def q_map(b, h, j, t, q_offset_ref, kv_len_ref):
        block, _ = _q_visit(j, t, q_offset_ref[b], kv_len_ref[b], cfg, num_q_blocks)
        return b, h, block, 0

    def row_map(*args):  # [B, H, 1, T] rows of the statistics
        b, h, block, _ = q_map(*args)
        return b, h, 0, block

    q_visited = pl.BlockSpec((None, None, cfg.block_q, head_dim), q_map)
    stats_visited = pl.BlockSpec((None, None, 1, cfg.block_q), row_map)
    kv_own = pl.BlockSpec((None, None, cfg.block_k, head_dim), lambda b, h, j, t, *_: (b, lax.div(h, cfg.group), j, 0))
    dkv_own = pl.BlockSpec((None, None, cfg.block_k, head_dim), lambda b, h, j, t, *_: (b, h, j, 0))
    positions_own = (
        [  # the visited query block's positions (a row), this key block's (a column)
            pl.BlockSpec((None, 1, cfg.block_q), lambda *args: (args[0], 0, q_map(*args)[2])),
            pl.BlockSpec((None, cfg.block_k, 1), lambda b, h, j, t, *_: (b, j, 0)),
        ]
        if cfg.positions
        else []
    )
    per_q_head = jax.ShapeDtypeStruct((batch, num_heads, seq_k_padded, head_dim), jnp.float32)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, num_q_blocks=num_q_blocks),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_heads, num_kv_blocks, cfg.q_steps(num_q_blocks)),
            in_specs=[q_visited, kv_own, kv_own, q_visited, stats_visited, stats_visited, *positions_own],
            out_specs=[dkv_own, dkv_own],
            scratch_shapes=[scratch(cfg.block_k), scratch(cfg.block_k)],
        ),
        out_shape=[per_q_head, per_q_head],
        compiler_params=cfg.params(),
        interpret=cfg.interpret,
        name="tpu_block_sparse_attention_dkv",
    )(q_offset, kv_len, q, k, v, do, rows(lse), rows(delta), *_position_operands(pos, keys_major=True))

    def sum_groups(x):  # [B, Hkv * G, S, D] -> [B, Hkv, S, D]
        x = x.reshape(batch, num_kv_heads, cfg.group, seq_k_padded, head_dim)
        return x.sum(axis=2).astype(k.dtype)

    return dq, sum_groups(dk), sum_groups(dv), None, None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, q_offset, kv_len, pos, cfg: _Config):
    return _forward(q, k, v, q_offset, kv_len, pos, cfg)[0]


def _attention_fwd(q, k, v, q_offset, kv_len, pos, cfg: _Config):
    o, lse = _forward(q, k, v, q_offset, kv_len, pos, cfg)
    return o, (q, k, v, q_offset, kv_len, pos, o, lse)


_attention.defvjp(_attention_fwd, _backward)


def block_sparse_attention(
    q,
    k,
    v,
    *,
    causal: bool,
    sink: int | None,
    recent: int | None,
    q_offset,
    kv_len,
    scale: float,
    block_q: int,
    block_k: int,
    interpret,
    positions=None,
    scales=None,
    kv_quant: str | None = None,
):
    """q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D]; q_offset and kv_len int32 [B];
    positions None (query i at q_offset + i, key j at j) or (q_positions int32 [B, T],
    k_positions int32 [B, S], -1: an empty slot); q_offset is then unused. With `kv_quant`, k / v
    are int8 codes [B, S, Hkv, D or D/2] and `scales` their (k_scale, v_scale) [B, S, Hkv, 1].

    Transposes to [B, H, L, D], pads T and S to the blocks (padded rows and keys are masked),
    runs the custom-VJP kernels (quantized: the forward kernel alone) and undoes both.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    seq_k = k.shape[1]
    cfg = _Config(
        seq_q=seq_q,
        causal=causal,
        sink=sink,
        recent=recent,
        scale=scale,
        block_q=_mosaic.tpu_block(block_q, seq_q),
        block_k=_mosaic.tpu_block(block_k, seq_k),
        group=num_heads // k.shape[2],
        interpret=interpret,
        positions=positions is not None,
        kv_quant=kv_quant,
    )
    kv_len = jnp.minimum(kv_len, seq_k)
    q = _mosaic.pad_axis(_mosaic.heads_major(q), 2, cfg.block_q)
    k, v = (_mosaic.pad_axis(_mosaic.heads_major(x), 2, cfg.block_k) for x in (k, v))
    if positions is not None:  # padded key slots are empty (-1), as well as past kv_len
        q_pos, k_pos = (jnp.asarray(x, jnp.int32) for x in positions)
        positions = (
            _mosaic.pad_axis(q_pos, 1, cfg.block_q),
            jnp.pad(k_pos, ((0, 0), (0, k.shape[2] - seq_k)), constant_values=-1),
        )
    if kv_quant is not None:  # inference over codes: no gradient to define
        scales = tuple(_mosaic.pad_axis(_mosaic.heads_major(x), 2, cfg.block_k) for x in scales)
        o, _ = _forward(q, k, v, q_offset, kv_len, positions, cfg, scales)
    else:
        o = _attention(q, k, v, q_offset, kv_len, positions, cfg)
    return _mosaic.heads_major(o[:, :, :seq_q])
