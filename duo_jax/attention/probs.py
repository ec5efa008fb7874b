"""Attention with its probabilities, for the methods that score tokens by the attention they receive.

H2O, TOVA, SnapKV's window votes, HeadKV's head scores and InfiniGen's fetch need the softmax itself, which
neither the Pallas kernels nor the blocked XLA path (`duo_jax.attention.xla`) return. They score small key
sets (a budget of kept tokens, an observation window), so one dense masked softmax serves them all.

`attention_received` is the one that meets a long query set: H2O prefills a whole prompt in one chunk, and
needs only each key's attention summed over the queries, never the [T, S] probabilities. It runs
the same softmax over blocks of queries, so its memory is O(block x S), not O(T x S), and where the queries'
own keys follow the others in order, each block reads only the keys up to its own (the causal cut).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp

from duo_jax.attention.xla import merge_blocks, query_blocks

CUT_STAGES = 4  # `attention_received`'s query ranges under the causal cut


def masked_softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax over the last axis of fp32 `scores` where `mask` (broadcast) is True; rows with no True give 0."""
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    return probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)


def attention_probs(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array):
    """q [B, T, H, E], per-head keys k / v [B, K, S, E], mask [B, K, T, S] -> (out [B, T, H, E],
    probs float32 [B, K, G, T, S]). Rows with no visible key give zeros."""
    B, T, H, E = q.shape
    K = k.shape[1]
    q = q.reshape(B, T, K, H // K, E)
    scores = jnp.einsum("btkge,bkse->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(E)
    probs = masked_softmax(scores, mask[:, :, None])
    # the dot's batch axes lead its output, then one transpose: XLA:CPU has no bf16 x bf16 -> f32 kernel for the dot
    # that writes [B, T, K, G, E] directly at batch >= 2 (an H2O batch failed with "Unsupported element type")
    out = jnp.einsum("bkgts,bkse->bkgte", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, E).astype(q.dtype), probs


def attention_received(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    sees: Callable[[jax.Array], jax.Array],
    weights: jax.Array,
    *,
    block: int = 512,
    own_keys_at: int | None = None,
):
    """`attention_probs` with the probabilities summed over the queries, one block of `block` queries at a time.

    q [B, T, H, E] at positions q_positions int32 [B, T]; keys k / v [B, K, S, E]; sees(positions [B, Tb]) ->
    bool [B, K, Tb, S], the keys queries at those positions see; weights float32 [B, T] (0 for padding) ->
    (out [B, T, H, E], received float32 [B, K, S] = sum over t and the group's heads g of
    weights[b, t] * probs[b, k, g, t, s]).

    own_keys_at: where the queries' own keys start, when slot own_keys_at + t holds query t's key and no real
    query sees a slot past its own (H2O's chunk after its kept tokens). Then each of CUT_STAGES
    ranges of queries reads only the slots before its last query's own: the causal cut, which skips 3/8 of a
    whole-prompt chunk's scores. Padding queries (weight 0) may see less; their rows are not used."""
    T, S = q.shape[1], k.shape[2]
    if own_keys_at is None:
        return _received(q, k, v, q_positions, sees, weights, block)
    # CUT_STAGES ranges of queries, each over the slots up to its last query's own: a few static shapes (blocks
    # unrolled one by one would each hold their own buffers), and 5/8 of the uncut work for 4 ranges
    outs, received = [], jnp.zeros(k.shape[:3], jnp.float32)
    stage = -(-T // block // CUT_STAGES) * block if T > block else T
    for start in range(0, T, stage):
        queries = slice(start, min(start + stage, T))
        n = min(S, own_keys_at + queries.stop)
        out, stage_received = _received(
            q[:, queries],
            k[:, :, :n],
            v[:, :, :n],
            q_positions[:, queries],
            lambda positions, n=n: sees(positions)[..., :n],
            weights[:, queries],
            block,
        )
        outs.append(out)
        received = received.at[:, :, :n].add(stage_received)
    return jnp.concatenate(outs, axis=1), received


def _received(q, k, v, q_positions, sees, weights, block: int):
    """`attention_received` without the cut: lax.scan over blocks of `block` queries."""
    T = q.shape[1]

    def one(q, positions, weights):
        out, probs = attention_probs(q, k, v, sees(positions))
        return out, jnp.einsum("bkgts,bt->bks", probs, weights)

    if T <= block:
        return one(q, q_positions, weights)

    def step(received, xs):  # the sum is carried, not stacked per block
        out, block_received = one(*xs)
        return received + block_received, out

    # [blocks, B, block, ...]: padded queries weigh 0 and their rows are dropped
    blocks = query_blocks(q, block, 0), query_blocks(q_positions, block, None), query_blocks(weights, block, 0.0)
    received, out = jax.lax.scan(step, jnp.zeros(k.shape[:3], jnp.float32), blocks)
    return merge_blocks(out, T), received
