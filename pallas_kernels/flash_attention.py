"""Block-sparse flash attention in Pallas: forward and backward kernels.

One implementation serves dense causal attention (`flash_attention`) and the streaming heads' Λ-shaped attention
(`lambda_attention.py`): a query block loops only over the key blocks its mask touches
(`_common.kv_block_schedule`). Layout: q [B, T, Hq, D], k and v [B, S, Hkv, D], Hq = G * Hkv (query head h reads
KV head h // G); softmax statistics in float32. Over a quantized cache (`kv_quant`) or keys at explicit positions
(`k_positions`) it is forward only. Design: docs/kernels.md, "Flash and Λ attention (GPU)".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _common


@dataclasses.dataclass(frozen=True)
class Config:
    """Static description of one attention call (hashable: a custom_vjp nondiff arg)."""

    seq_q: int  # True number of queries; the arrays may be padded past it.
    causal: bool
    sink: int | None  # Λ window; None for dense attention.
    recent: int | None
    scale: float
    block_q: int
    block_k: int
    interpret: bool
    kv_quant: str | None = None  # k / v are int8 codes with scales ("int8", "int4"): forward only
    k_positions: bool = False  # keys at explicit positions (an int32 [B, S] operand): forward only
    # With k_positions: the keys are `key_offset` slots that precede every query, then the queries' own keys in
    # order (a ring followed by the chunk), so slot j > key_offset + row is never visible and is not visited.
    key_offset: int | None = None
    num_warps: int | None = None  # Triton launch: None = 4 for head_dim <= 64, else 8
    num_stages: int = 2
    # The forward visits its tiles in one loop, masking each, instead of runs of masked and unmasked tiles: Λ's
    # four tiles per query block are otherwise four loops of one trip, which Triton's pipeliner cannot overlap.
    one_loop: bool = False

    @property
    def log2_scale(self) -> float:
        """The softmax scale times log2(e): the kernels take exp2 of scaled scores (e^x = 2^(x log2 e); one
        ex2 instruction on a GPU, where exp is a libdevice call), and keep the log-sum-exp in base 2."""
        return self.scale * math.log2(math.e)

    @property
    def window(self) -> dict:
        return dict(causal=self.causal, sink=self.sink, recent=self.recent)

    @property
    def schedule_window(self) -> dict:
        """The window the key-block schedule follows: keys at explicit positions give no causal cut-off (any
        slot may hold an early position), so every block up to kv_len is visited, unless `key_offset` says
        where the queries' own keys start."""
        return dict(self.window, causal=self.causal and (not self.k_positions or self.key_offset is not None))

    def schedule_offset(self, q_offset):
        """The first query's slot in the keys' order for the schedule: its position, or `key_offset`."""
        return q_offset if self.key_offset is None else self.key_offset

    def compiler_params(self, head_dim: int):
        return _backend.compiler_params(
            interpret=self.interpret,
            num_warps=self.num_warps or (4 if head_dim <= 64 else 8),
            num_stages=self.num_stages,
            dimension_semantics=("parallel", "parallel", "parallel"),
        )


def _dot(a, b, contract: str):
    """float32-accumulated matmul; `contract` is an einsum string."""
    return jnp.einsum(contract, a, b, preferred_element_type=jnp.float32)


def _tile_mask(q_block, kv_block, q_offset, kv_len, cfg: Config, k_pos=None):
    """The tile's mask; `k_pos` [bk]: the keys' positions when they are explicit (-1: empty slot)."""
    rows = q_block * cfg.block_q + lax.broadcasted_iota(jnp.int32, (cfg.block_q, cfg.block_k), 0)
    cols = kv_block * cfg.block_k + lax.broadcasted_iota(jnp.int32, (cfg.block_q, cfg.block_k), 1)
    return _common.attention_mask(
        rows,
        cols,
        q_offset=q_offset,
        kv_len=kv_len,
        seq_q=cfg.seq_q,
        k_pos=None if k_pos is None else k_pos[None, :],
        **cfg.window,
    )


def _visited_kv_block(step, sink_end, band_start):
    """Maps loop step t in [0, sink_end + end - band_start) to a KV block index."""
    return jnp.where(step < sink_end, step, step - sink_end + band_start)


# ------------------------------------------------------------------- forward


def _fwd_kernel(
    q_offset_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,  # inputs
    *refs,  # (k and v scales when quantized), (key positions); outputs o, lse
    cfg: Config,
):
    refs = list(refs)
    k_scale_ref, v_scale_ref = (None, None) if cfg.kv_quant is None else (refs.pop(0), refs.pop(0))
    k_pos_ref = refs.pop(0) if cfg.k_positions else None
    o_ref, lse_ref = refs

    def load_kv(kv_block):  # [parts][bk, D / parts] each
        kv_slice = pl.ds(kv_block * cfg.block_k, cfg.block_k)
        return (
            _common.load_tile(k_ref, k_scale_ref, kv_slice, cfg.kv_quant, q_ref.dtype),
            _common.load_tile(v_ref, v_scale_ref, kv_slice, cfg.kv_quant, q_ref.dtype),
        )

    load_positions = (
        None if k_pos_ref is None else (lambda kv_block: k_pos_ref[pl.ds(kv_block * cfg.block_k, cfg.block_k)])
    )
    forward_program(q_offset_ref, kv_len_ref, q_ref, load_kv, o_ref, lse_ref, cfg=cfg, load_positions=load_positions)


def forward_program(
    q_offset_ref, kv_len_ref, q_ref, load_kv, o_ref, lse_ref, *, cfg: Config, load_positions=None, program=None
):
    """One forward program (grid point (b, h, query block)): the query tile q_ref [bq, D] (quantized cache:
    [parts, bq, D / parts], int4's nibble halves on the leading dim) over the KV blocks its mask touches,
    `load_kv(kv_block)` giving block kv_block's keys and values as lists of parts [bk, D / parts] (a slice of
    a contiguous cache, or pages read through a block table: `pallas_kernels.paged_attention`), and with
    cfg.k_positions `load_positions(kv_block)` its keys' positions [bk]. Writes the normalised output (o_ref
    shaped as q_ref) and the base-2 log-sum-exp of the scaled scores (+inf for rows that see no key). `program`:
    (b, query block) when read by the caller (the interpreter resolves program ids only outside a `pl.when`)."""
    qs = [q_ref[...]] if cfg.kv_quant is None else [q_ref[i] for i in range(q_ref.shape[0])]  # [parts][bq, D / parts]
    b, q_block = (pl.program_id(0), pl.program_id(2)) if program is None else program
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    block_q = cfg.block_q
    schedule = _common.kv_block_schedule(
        q_block,
        q_offset=cfg.schedule_offset(q_offset),
        kv_len=kv_len,
        seq_q=cfg.seq_q,
        block_q=block_q,
        block_k=cfg.block_k,
        **cfg.schedule_window,
    )
    sink_end, band_start, end = schedule
    # The tiles every row sees whole skip the mask: dense, the blocks before the causal edge; Λ, the whole
    # sink blocks and the band's interior. Keys at explicit positions are masked, but for a ring + chunk
    # (`key_offset`) the chunk's blocks before the diagonal: each holds keys of earlier queries of the chunk.
    if cfg.k_positions and cfg.key_offset is None:
        sink_whole, lo, hi = 0, band_start, band_start
    else:
        sink_whole, lo, hi = _common.unmasked_kv_blocks(
            q_block,
            q_offset=cfg.schedule_offset(q_offset),
            kv_len=kv_len,
            seq_q=cfg.seq_q,
            block_q=block_q,
            block_k=cfg.block_k,
            schedule=schedule,
            **cfg.window,
        )
        if cfg.key_offset is not None:  # the ring's blocks may hold empty slots: masked
            lo = jnp.minimum(jnp.maximum(lo, _common.cdiv(cfg.key_offset, cfg.block_k)), hi)

    def body(step, carry, masked: bool):
        acc, m, l = carry  # [parts][bq, D / parts], [bq], [bq]
        kv_block = _visited_kv_block(step, sink_end, band_start)
        ks, vs = load_kv(kv_block)  # [parts][bk, D / parts]
        s = functools.reduce(operator.add, [_dot(q, k, "qd,kd->qk") for q, k in zip(qs, ks)]) * cfg.log2_scale
        if masked:
            k_pos = None if load_positions is None else load_positions(kv_block)
            mask = _tile_mask(q_block, kv_block, q_offset, kv_len, cfg, k_pos)
            s = jnp.where(mask, s, _common.MASK_VALUE)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp2(s - m_new[:, None])
        if masked:
            p = jnp.where(mask, p, 0.0)
        correction = jnp.exp2(m - m_new)  # Rescales what was summed under the old max.
        l = correction * l + p.sum(axis=-1)
        acc = tuple(correction[:, None] * a + _dot(p.astype(v.dtype), v, "qk,kd->qd") for a, v in zip(acc, vs))
        return acc, m_new, l

    init = (
        tuple(jnp.zeros(q.shape, jnp.float32) for q in qs),
        jnp.full((block_q,), _common.MASK_VALUE, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    # Loop steps as `_visited_kv_block` maps them (the sink blocks, then the band), in runs of one kind.
    band_step = lambda kv_block: sink_end + kv_block - band_start  # noqa: E731
    # (last step, masked): Λ's whole sinks and masked band start, or a ring + chunk's masked ring
    runs = [(sink_whole, False), (band_step(lo), True)] if cfg.recent is not None or cfg.key_offset is not None else []
    runs += [(band_step(hi), False), (band_step(end), True)]
    if cfg.one_loop:
        runs = [(band_step(end), True)]
    carry, first = init, 0
    for last, masked in runs:
        carry = lax.fori_loop(first, last, functools.partial(body, masked=masked), carry)
        first = last
    acc, m, l = carry

    empty = l == 0.0  # Rows that see no key at all: output 0, lse +inf.
    out = [(a / jnp.where(empty, 1.0, l)[:, None]).astype(o_ref.dtype) for a in acc]
    if cfg.kv_quant is None:
        o_ref[...] = out[0]
    else:
        for i, o in enumerate(out):
            o_ref[i] = o
    lse_ref[...] = jnp.where(empty, jnp.inf, m + jnp.log2(jnp.where(empty, 1.0, l)))


def _head_spec(block: int, head_dim: int, head_of, *, tiled: bool):
    """One head of a [B, L, H, D] array for grid point (b, h, i).

    tiled: the i-th [block, D] tile; otherwise the whole [L, D] axis (block = L).
    """
    return pl.BlockSpec((None, block, None, head_dim), lambda b, h, i: (b, i if tiled else 0, head_of(h), 0))


def _forward(q, k, v, q_offset, kv_len, cfg: Config, scales=(), k_positions=None):
    """o [B, T, Hq, D], base-2 lse [B, Hq, T]; with cfg.kv_quant, k / v are codes and `scales` their (k, v) scales;
    with cfg.k_positions, `k_positions` int32 [B, S] holds each key slot's position."""
    seq_k_padded, group = k.shape[1], q.shape[2] // k.shape[2]
    kv_spec = _head_spec(seq_k_padded, k.shape[-1], lambda h: h // group, tiled=False)  # D, or D/2 int4 codes
    scale_spec = _head_spec(seq_k_padded, 1, lambda h: h // group, tiled=False)  # k and v scales [B, S, Hkv, 1]
    positions = [] if k_positions is None else [k_positions]
    positions_spec = [pl.BlockSpec((None, seq_k_padded), lambda b, h, i: (b, 0))] * len(positions)
    return launch_forward(
        functools.partial(_fwd_kernel, cfg=cfg),
        q,
        [q_offset, kv_len],
        [k, v, *scales, *positions],
        [kv_spec, kv_spec] + [scale_spec] * len(scales) + positions_spec,
        cfg,
        name="block_sparse_attention_fwd",
    )


def launch_forward(
    kernel,
    q,
    scalars: list,
    kv: list,
    kv_specs: list,
    cfg: Config,
    *,
    name: str,
    head_of=lambda h: h,
    heads_last: bool = False,
):
    """The forward pallas_call over grid (batch, query head, query block): `kernel` gets the [B] scalar
    operands (whole), the query tile, then the KV operands with their specs (`kv_specs`), and writes the
    output tile and the base-2 log-sum-exp. With cfg.kv_quant the query and output tiles are [parts, bq, D / parts]
    (`forward_program`). Grid head h reads and writes q's head `head_of(h)`. With `heads_last` the grid is (batch,
    query block, query head), so a GPU launches every program of a head before the next head's; the specs' index
    maps still take (b, h, i). Returns (o like q, lse float32 [B, Hq, T])."""
    batch, seq_q_padded, num_heads, head_dim = q.shape
    num_q_blocks = seq_q_padded // cfg.block_q
    scalar_spec = pl.BlockSpec((batch,), lambda b, h, i: (0,))
    q_spec = _head_spec(cfg.block_q, head_dim, head_of, tiled=True)
    parts = _common.kv_parts(cfg.kv_quant)
    if cfg.kv_quant is not None:  # q (and o) as [parts, B, T, Hq, D / parts]: part i of every head on a leading dim
        q = jnp.moveaxis(q.reshape(batch, seq_q_padded, num_heads, parts, head_dim // parts), 3, 0)
        q_spec = pl.BlockSpec(
            (parts, None, cfg.block_q, None, head_dim // parts), lambda b, h, i: (0, b, i, head_of(h), 0)
        )
    lse_spec = pl.BlockSpec((None, None, cfg.block_q), lambda b, h, i: (b, head_of(h), i))
    in_specs = [scalar_spec] * len(scalars) + [q_spec] + kv_specs
    out_specs = [q_spec, lse_spec]  # o, lse
    grid = (batch, num_heads, num_q_blocks)
    if heads_last:
        grid = (batch, num_q_blocks, num_heads)
        in_specs, out_specs = ([_heads_last(spec) for spec in specs] for specs in (in_specs, out_specs))
    o, lse = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, num_heads, seq_q_padded), jnp.float32),
        ],
        compiler_params=cfg.compiler_params(head_dim),
        interpret=cfg.interpret,
        name=name,
    )(*scalars, q, *kv)
    if cfg.kv_quant is not None:
        o = jnp.moveaxis(o, 0, 3).reshape(batch, seq_q_padded, num_heads, head_dim)
    return o, lse


def _heads_last(spec: pl.BlockSpec) -> pl.BlockSpec:
    """`spec` on grid (b, i, h), its index map written for (b, h, i)."""
    index_map = spec.index_map
    return dataclasses.replace(spec, index_map=lambda b, i, h: index_map(b, h, i))


# ------------------------------------------------------------------ backward
# With P = softmax(S), dO the output cotangent and delta = rowsum(dO * O):
#   dV = P^T dO,  dP = dO V^T,  dS = P * (dP - delta),  dQ = scale dS K,
#   dK = scale dS^T Q.


def _dq_kernel(
    q_offset_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,  # inputs
    dq_ref,  # output
    *,
    cfg: Config,
):
    b, q_block = pl.program_id(0), pl.program_id(2)
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    block_k = cfg.block_k
    q, do = q_ref[...], do_ref[...]  # [bq, D]
    lse, delta = lse_ref[...], delta_ref[...]  # [bq]
    sink_end, band_start, end = _common.kv_block_schedule(
        q_block, q_offset=q_offset, kv_len=kv_len, seq_q=cfg.seq_q, block_q=cfg.block_q, block_k=block_k, **cfg.window
    )

    def body(step, dq):
        kv_block = _visited_kv_block(step, sink_end, band_start)
        kv_slice = pl.ds(kv_block * block_k, block_k)
        k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]  # [bk, D]
        s = _dot(q, k, "qd,kd->qk") * cfg.log2_scale  # [bq, bk]
        mask = _tile_mask(q_block, kv_block, q_offset, kv_len, cfg)
        p = jnp.where(mask, jnp.exp2(s - lse[:, None]), 0.0)
        dp = _dot(do, v, "qd,kd->qk")
        ds = p * (dp - delta[:, None])
        return dq + _dot(ds.astype(k.dtype), k, "qk,kd->qd")

    dq = lax.fori_loop(0, sink_end + end - band_start, body, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * cfg.scale).astype(dq_ref.dtype)


def _dkv_kernel(
    q_offset_ref,
    kv_len_ref,
    q_ref,
    k_ref,
    v_ref,
    do_ref,
    lse_ref,
    delta_ref,  # inputs
    dk_ref,
    dv_ref,  # outputs
    *,
    cfg: Config,
    num_q_blocks: int,
):
    b, kv_block = pl.program_id(0), pl.program_id(2)
    q_offset, kv_len = q_offset_ref[b], kv_len_ref[b]
    block_q = cfg.block_q
    k, v = k_ref[...], v_ref[...]  # [bk, D]
    start, end = _common.q_block_schedule(
        kv_block,
        q_offset=q_offset,
        kv_len=kv_len,
        num_q_blocks=num_q_blocks,
        block_q=block_q,
        block_k=cfg.block_k,
        **cfg.window,
    )

    def body(q_block, carry):
        dk, dv = carry  # [bk, D]
        q_slice = pl.ds(q_block * block_q, block_q)
        q, do = q_ref[q_slice, :], do_ref[q_slice, :]  # [bq, D]
        lse, delta = lse_ref[q_slice], delta_ref[q_slice]  # [bq]
        s = _dot(q, k, "qd,kd->qk") * cfg.log2_scale  # [bq, bk]
        mask = _tile_mask(q_block, kv_block, q_offset, kv_len, cfg)
        p = jnp.where(mask, jnp.exp2(s - lse[:, None]), 0.0)
        dv = dv + _dot(p.astype(do.dtype), do, "qk,qd->kd")
        dp = _dot(do, v, "qd,kd->qk")
        ds = p * (dp - delta[:, None])
        dk = dk + _dot(ds.astype(q.dtype), q, "qk,qd->kd")
        return dk, dv

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(start, jnp.maximum(start, end), body, (zeros, zeros))
    dk_ref[...] = (dk * cfg.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _backward(cfg: Config, residuals, do):
    q, k, v, q_offset, kv_len, o, lse = residuals
    batch, seq_q_padded, num_heads, head_dim = q.shape
    seq_k_padded, num_kv_heads = k.shape[1], k.shape[2]
    group = num_heads // num_kv_heads
    num_q_blocks = seq_q_padded // cfg.block_q
    num_kv_blocks = seq_k_padded // cfg.block_k
    # delta = rowsum(dO * O) [B, H, T]; a cheap elementwise pass, left to XLA.
    delta = jnp.einsum("bthd,bthd->bht", do.astype(jnp.float32), o.astype(jnp.float32))

    q_head, kv_head = (lambda h: h), (lambda h: h // group)
    scalar_spec = pl.BlockSpec((batch,), lambda b, h, i: (0,))
    stats_tile = pl.BlockSpec((None, None, cfg.block_q), lambda b, h, i: (b, h, i))
    stats_whole = pl.BlockSpec((None, None, seq_q_padded), lambda b, h, i: (b, h, 0))
    params = cfg.compiler_params(head_dim)

    dq = pl.pallas_call(
        functools.partial(_dq_kernel, cfg=cfg),
        grid=(batch, num_heads, num_q_blocks),
        in_specs=[
            scalar_spec,
            scalar_spec,
            _head_spec(cfg.block_q, head_dim, q_head, tiled=True),  # q
            _head_spec(seq_k_padded, head_dim, kv_head, tiled=False),  # k
            _head_spec(seq_k_padded, head_dim, kv_head, tiled=False),  # v
            _head_spec(cfg.block_q, head_dim, q_head, tiled=True),  # do
            stats_tile,  # lse
            stats_tile,  # delta
        ],
        out_specs=_head_spec(cfg.block_q, head_dim, q_head, tiled=True),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=params,
        interpret=cfg.interpret,
        name="block_sparse_attention_dq",
    )(q_offset, kv_len, q, k, v, do, lse, delta)

    # dk, dv per *query* head [B, S, Hq, D], summed over each GQA group below.
    per_q_head = jax.ShapeDtypeStruct((batch, seq_k_padded, num_heads, head_dim), jnp.float32)
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, cfg=cfg, num_q_blocks=num_q_blocks),
        grid=(batch, num_heads, num_kv_blocks),
        in_specs=[
            scalar_spec,
            scalar_spec,
            _head_spec(seq_q_padded, head_dim, q_head, tiled=False),  # q
            _head_spec(cfg.block_k, head_dim, kv_head, tiled=True),  # k
            _head_spec(cfg.block_k, head_dim, kv_head, tiled=True),  # v
            _head_spec(seq_q_padded, head_dim, q_head, tiled=False),  # do
            stats_whole,  # lse
            stats_whole,  # delta
        ],
        out_specs=[
            _head_spec(cfg.block_k, head_dim, q_head, tiled=True),  # dk
            _head_spec(cfg.block_k, head_dim, q_head, tiled=True),  # dv
        ],
        out_shape=[per_q_head, per_q_head],
        compiler_params=params,
        interpret=cfg.interpret,
        name="block_sparse_attention_dkv",
    )(q_offset, kv_len, q, k, v, do, lse, delta)

    def sum_groups(x):  # [B, S, Hkv * G, D] -> [B, S, Hkv, D]
        x = x.reshape(batch, seq_k_padded, num_kv_heads, group, head_dim)
        return x.sum(axis=3).astype(k.dtype)

    return dq, sum_groups(dk), sum_groups(dv), None, None


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _attention(q, k, v, q_offset, kv_len, cfg: Config):
    return _forward(q, k, v, q_offset, kv_len, cfg)[0]


def _attention_fwd(q, k, v, q_offset, kv_len, cfg: Config):
    o, lse = _forward(q, k, v, q_offset, kv_len, cfg)
    return o, (q, k, v, q_offset, kv_len, o, lse)


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
    scale,
    block_q: int,
    block_k: int,
    interpret: bool | None,
    k_scale=None,
    v_scale=None,
    kv_quant: str | None = None,
    k_positions=None,
    key_offset: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    one_loop: bool = False,
):
    """Shared entry point of `flash_attention` and `lambda_attention`.

    Pads T and S up to the block sizes (padded queries and keys are masked),
    runs the custom-VJP kernels (a quantized cache or keys at explicit positions: the forward kernel alone)
    and slices the padding off again.
    """
    _common.check_cache(q, k, v, k_scale, v_scale, kv_quant, q_ndim=4)
    _common.check_block("block_q", block_q)
    _common.check_block("block_k", block_k)
    if recent is not None:
        _common.check_window(sink, recent)
    if k_positions is not None and (
        recent is not None or not causal or tuple(k_positions.shape) != (k.shape[0], k.shape[1])
    ):
        raise ValueError(
            f"k_positions must be int32 [B, S] = {(k.shape[0], k.shape[1])} (got "
            f"{tuple(k_positions.shape)}), with causal attention and no Λ window"
        )
    if key_offset is not None and (k_positions is None or not 0 <= key_offset <= k.shape[1] - q.shape[1]):
        raise ValueError(
            f"key_offset (where the queries' own keys start among the {k.shape[1]} slots) needs k_positions and "
            f"0 <= key_offset <= S - T = {k.shape[1] - q.shape[1]}, got {key_offset}"
        )
    batch, seq_q, _, head_dim = q.shape
    seq_k = k.shape[1]
    interpret = _backend.resolve_interpret(interpret)
    block_q, block_k = _backend.fit_tiles(block_q, block_k, q.dtype, interpret)
    block_q = _common.fit_block(block_q, seq_q)
    # keys at explicit positions (a ring and a chunk, rarely a multiple of 128): a block that tiles them exactly
    # where there is one, so that they need no padded copy
    block_k = (_common.tiling_block if k_positions is not None else _common.fit_block)(block_k, seq_k)
    cfg = Config(
        seq_q=seq_q,
        causal=causal,
        sink=sink,
        recent=recent,
        scale=_common.default_scale(head_dim, scale),
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        kv_quant=kv_quant,
        k_positions=k_positions is not None,
        key_offset=key_offset,
        num_warps=num_warps,
        num_stages=num_stages,
        one_loop=one_loop,
    )
    q_offset = _common.per_batch(q_offset, batch, 0)
    kv_len = jnp.minimum(_common.per_batch(kv_len, batch, seq_k), seq_k)

    pad = _common.pad_to_block
    if kv_quant is not None or k_positions is not None:  # inference over a cache: no gradient to define
        scales = () if kv_quant is None else tuple(pad(x, block_k) for x in (k_scale, v_scale))
        # padded slots are empty (-1)
        positions = None if k_positions is None else pad(k_positions.astype(jnp.int32), block_k, value=-1)
        o, _ = _forward(pad(q, block_q), pad(k, block_k), pad(v, block_k), q_offset, kv_len, cfg, scales, positions)
    else:
        o = _attention(pad(q, block_q), pad(k, block_k), pad(v, block_k), q_offset, kv_len, cfg)
    return o[:, :seq_q]


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = True,
    q_offset=0,
    kv_len=None,
    scale: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
    interpret: bool | None = None,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
    kv_quant: str | None = None,
    k_positions: jax.Array | None = None,
    key_offset: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 2,
    one_loop: bool = False,
) -> jax.Array:
    """Dense (causal) flash attention with Pallas forward and backward kernels.

    Args:
      q: [B, T, Hq, D] queries; query i sits at absolute position q_offset + i.
      k, v: [B, S, Hkv, D] keys and values, key j at position j; Hq % Hkv == 0.
      causal: query at position p sees keys j <= p.
      q_offset: int, int32 scalar or int32 [B] (may be traced): position of the
        first query, e.g. a prefill chunk attending to a cache of S keys.
      kv_len: None (= S), int, int32 scalar or int32 [B] (may be traced): keys
        j >= kv_len are masked out, per sequence when given as [B]. Key blocks
        entirely past kv_len are skipped.
      scale: softmax scale, default 1 / sqrt(D).
      block_q, block_k: tile sizes (shrunk for short sequences; T and S need not
        be multiples, they are padded and masked).
      interpret: None = interpret mode exactly when running on CPU.
      k_scale, v_scale: with `kv_quant`, the codes' scales [B, S, Hkv, 1] (one per token and head).
      kv_quant: None (k / v are values), "int8" or "int4": k / v are the cache's int8 codes, [B, S, Hkv, D]
        ("int8") or [B, S, Hkv, D/2] ("int4", two per byte, `_common.unpack_int4_halves`), and each tile is
        dequantized in the kernel (codes * scale, in q's dtype) before its dots. Forward only.
      k_positions: None, or int32 [B, S]: the absolute position of each key slot (-1: empty), for keys not
        stored in position order (DuoAttention's streaming heads: a ring of sink + recent tokens followed
        by the chunk); causal then compares positions, and without `key_offset` every key block up to kv_len is
        visited (none is skipped or left unmasked). Queries stay at q_offset + i. Forward only.
      key_offset: with k_positions, None, or the slot where the queries' own keys start, when every slot before
        it holds a token before every query (or nothing) and slot key_offset + i holds query i's (or nothing): a
        ring followed by the chunk. The schedule then stops at key_offset + i instead of visiting every block, and
        the chunk's blocks before the diagonal skip the mask.
      num_warps, num_stages: the Triton launch of every kernel (GPU only; num_warps None = 4 for head_dim
        <= 64, else 8), for tuning (`benchmarks/kernels.py --sweep`).
      one_loop: the forward visits its key blocks in one loop, masking each, rather than the wholly visible ones
        unmasked in loops of their own (same values; for tuning, `--sweep`).

    Returns:
      [B, T, Hq, D] like q. Queries that see no key get 0.
    """
    return block_sparse_attention(
        q,
        k,
        v,
        causal=causal,
        sink=None,
        recent=None,
        q_offset=q_offset,
        kv_len=kv_len,
        scale=scale,
        block_q=block_q,
        block_k=block_k,
        interpret=interpret,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_quant=kv_quant,
        k_positions=k_positions,
        key_offset=key_offset,
        num_warps=num_warps,
        num_stages=num_stages,
        one_loop=one_loop,
    )
