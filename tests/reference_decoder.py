"""A float64 numpy decoder for the method tests: the model written out layer by layer from its weights, each
layer's attention dense over an explicit mask of the keys every query sees. It shares no code with duo_jax's
attention, cache or engine (only `rope_inv_freq`, the model's float32 frequencies, and `layer_at`), so a
method's test states what the method keeps as a mask and compares the engine's logits with `decode`'s.

A test passes `mask(layer)`, a function of the layer's `LayerInputs` (its index, weights, normed input and
rotated q / k / v) returning a boolean [T, T], [K, T, T] (per KV head) or [H, T, T] (per query head) array;
methods whose kept keys depend on the layer's own attention (H2O, SnapKV, InfiniGen...) compute them there,
with `attention` for the scores. Also: RoPE positions other than the absolute ones (StreamingLLM re-indexes
its cache) and a round trip applied to the keys and values (a quantized cache).
"""

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from duo_jax.model import layer_at, rope_inv_freq


def rms64(x, weight, eps):
    """RMSNorm over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope64(x, positions, inv_freq):
    """x [T, N, E] rotated at positions [T] (half-split layout, as Hugging Face Llama)."""
    angles = np.asarray(positions, np.float64)[:, None, None] * np.asarray(inv_freq, np.float64)
    x1, x2 = np.split(x, 2, axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def softmax64(scores, axis=-1):
    """Softmax of float64 scores; -inf entries get 0 (a row of only -inf is an error of the caller)."""
    e = np.exp(scores - scores.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def weights64(params):
    """The model's weights as float64 numpy arrays (a tree like `params`)."""
    return jax.tree.map(lambda a: np.asarray(a, np.float64), params)


def project(normed, weights, config, positions):
    """A layer's q [T, H, E], k and v [T, K, E] of its normed input [T, D], q and k rotated at `positions` [T]
    (with the layer's q / k / v biases and per-head q / k RMSNorm where the model has them)."""
    q = np.einsum("td,dhe->the", normed, weights.wq)
    k = np.einsum("td,dke->tke", normed, weights.wk)
    v = np.einsum("td,dke->tke", normed, weights.wv)
    if weights.bq is not None:
        q, k, v = q + weights.bq, k + weights.bk, v + weights.bv
    if weights.q_norm is not None:
        q, k = rms64(q, weights.q_norm, config.rms_norm_eps), rms64(k, weights.k_norm, config.rms_norm_eps)
    inv_freq = rope_inv_freq(config)
    return rope64(q, positions, inv_freq), rope64(k, positions, inv_freq), v


def per_query_head(mask, num_heads):
    """A [T, S], [K, T, S] or [H, T, S] mask as [H, T, S] (a KV head's row repeated for its query heads)."""
    mask = np.asarray(mask, bool)
    if mask.ndim == 2:
        mask = mask[None]
    return np.repeat(mask, num_heads // mask.shape[0], axis=0)


def attention(q, k, v, mask):
    """q [T, H, E], k / v [S, K, E], mask as `per_query_head` takes -> (out [T, H, E], probs [H, T, S]),
    scores scaled by 1/sqrt(E). Every query must see at least one key."""
    H, K = q.shape[1], k.shape[1]
    mask = per_query_head(mask, H)
    assert mask.any(axis=-1).all(), "a query sees no key"
    k, v = np.repeat(k, H // K, axis=1), np.repeat(v, H // K, axis=1)
    scores = np.einsum("the,she->hts", q, k) / math.sqrt(q.shape[-1])
    probs = softmax64(np.where(mask, scores, -np.inf))
    return np.einsum("hts,she->the", probs, v), probs


def causal(config, layer, T):
    """[T, T]: query i sees the keys j <= i within the layer's sliding window (`config.layer_window`)."""
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    window = config.layer_window(layer)
    return (j <= i) & (True if window is None else i - j < window)


@dataclasses.dataclass
class LayerInputs:
    """What a mask function sees of layer `index`: its weights (float64), its normed input [T, D] and its
    q [T, H, E], k and v [T, K, E], q and k rotated at the absolute positions 0..T-1 (k and v before any
    `kv_round_trip`)."""

    index: int
    weights: object
    normed: np.ndarray
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray


@dataclasses.dataclass
class Reference:
    """`decode`'s result: logits [T, V], the final normed hidden states [T, D], and each layer's attention
    probabilities [H, T, T] (0 on the keys a query does not see)."""

    logits: np.ndarray
    hidden: np.ndarray
    probs: list


def decode(
    params,
    config,
    tokens,
    mask: Callable[[LayerInputs], np.ndarray] | None = None,
    *,
    positions: tuple[np.ndarray, np.ndarray] | None = None,
    kv_round_trip: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]] | None = None,
) -> Reference:
    """One sequence of `tokens` through the model, every layer's query i attending to the keys j where
    mask(layer)[head, i, j] (default: `causal`, within the layer's sliding window). A mask must be causal.

    `positions`: (query positions [T], key positions [T, T]: the position key j is rotated at as query i sees
    it) for RoPE instead of 0..T-1 for both. `kv_round_trip(k, v)`: what the cache does to the rotated keys and
    values (say, quantize and dequantize), applied before the attention."""
    w = weights64(params)
    T = len(tokens)
    mask = mask or (lambda layer: causal(config, layer.index, T))
    absolute = np.arange(T)
    x = w.embed[np.asarray(tokens)]
    all_probs = []
    for l in range(config.num_layers):
        weights = layer_at(w, l)
        normed = rms64(x, weights.attn_norm, config.rms_norm_eps)
        q, k, v = project(normed, weights, config, absolute)
        seen = per_query_head(mask(LayerInputs(l, weights, normed, q, k, v)), config.num_heads)
        assert seen.shape == (config.num_heads, T, T), seen.shape
        assert not (seen & ~np.tri(T, dtype=bool)).any(), "the mask lets a query see a later key"
        if kv_round_trip is not None:
            assert positions is None, "a round trip of the keys rotated at other positions: not written"
            k, v = kv_round_trip(k, v)
        if positions is None:
            out, probs = attention(q, k, v, seen)
        else:
            out, probs = reindexed_attention(normed, weights, config, positions, v, seen)
        all_probs.append(probs)
        x = x + np.einsum("the,hed->td", out, weights.wo)
        m = rms64(x, weights.mlp_norm, config.rms_norm_eps)
        gate = m @ weights.w_gate
        x = x + (gate / (1 + np.exp(-gate)) * (m @ weights.w_up)) @ weights.w_down
    hidden = rms64(x, w.final_norm, config.rms_norm_eps)
    head = w.embed if w.lm_head is None else w.lm_head
    return Reference(hidden @ head.T, hidden, all_probs)


def reindexed_attention(normed, weights, config, positions, v, seen):
    """`attention` with query i rotated at positions[0][i] and key j, for query i, at positions[1][i, j]."""
    q_positions, k_positions = (np.asarray(p) for p in positions)
    T, H = len(q_positions), config.num_heads
    zero = np.zeros(T, int)
    q, k, _ = project(normed, weights, config, zero)  # not rotated
    inv_freq = rope_inv_freq(config)
    q = rope64(q, q_positions, inv_freq)
    out, probs = np.zeros_like(q), np.zeros((H, T, T))
    for i in range(T):
        k_i = rope64(k, k_positions[i], inv_freq)
        o, p = attention(q[i : i + 1], k_i, v, seen[:, i : i + 1])
        out[i], probs[:, i] = o[0], p[:, 0]
    return out, probs
