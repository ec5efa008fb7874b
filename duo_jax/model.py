"""The Llama / Mistral decoder as pure functions over a parameter pytree.

One model covers Llama 2 / 3 / 3.1, Mistral and SmolLM2: the differences are config switches (GQA vs MHA,
RoPE scaling, tied embeddings, sliding window). Layers are stacked on a leading axis and run under
`lax.scan`. `forward` is the dense full-attention path: the reference every faster path is tested against.

Dimension letters used in einsum strings and shape comments:
  B batch, T query positions, S key positions, D model width (hidden_size), F MLP width,
  H query heads, K KV heads, G query heads per KV head (H = K * G), E head_dim, V vocabulary, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """Weights of all decoder layers, stacked on a leading layer axis L."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, H, E]
    wk: jax.Array  # [L, D, K, E]
    wv: jax.Array  # [L, D, K, E]
    wo: jax.Array  # [L, H, E, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [V, D]; None when the embeddings are tied

    @property
    def dtype(self):
        return self.embed.dtype


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every weight, as a `Params` of shape tuples (used by loaders to check what they read)."""
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    H, K, E, V = config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
    layers = LayerParams(
        attn_norm=(L, D), wq=(L, D, H, E), wk=(L, D, K, E), wv=(L, D, K, E), wo=(L, H, E, D),
        mlp_norm=(L, D), w_gate=(L, D, F), w_up=(L, D, F), w_down=(L, F, D))
    return Params(embed=(V, D), layers=layers, final_norm=(D,),
                  lm_head=None if config.tie_word_embeddings else (V, D))


def init_params(config: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random weights, normal * scale (norm weights around 1): for tests and shape-only benchmarks."""
    shapes = param_shapes(config)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(key, len(leaves))
    arrays = []
    for k, (path, shape) in zip(keys, leaves):
        noise = jax.random.normal(k, shape, jnp.float32)
        is_norm = "norm" in jax.tree_util.keystr(path)
        arrays.append((1.0 + 0.1 * noise if is_norm else scale * noise).astype(dtype))
    return jax.tree.unflatten(treedef, arrays)


# --- building blocks -------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm with the statistics in fp32, then cast back (as Hugging Face's LlamaRMSNorm)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def rope_inv_freq(config: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [E/2] (float32), with linear or llama3 scaling applied."""
    E = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, E, 2, dtype=np.float32) / E))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32)
    if scaling.kind == "linear":
        return (inv_freq / scaling.factor).astype(np.float32)
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate smoothly in between.
    old_len = scaling.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = np.where(wavelen > old_len / scaling.low_freq_factor, inv_freq / scaling.factor, inv_freq)
    medium = (wavelen >= old_len / scaling.high_freq_factor) & (wavelen <= old_len / scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, N, E] at absolute `positions` [B, T] (half-split layout, as Hugging Face Llama)."""
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, E/2]
    cos = jnp.cos(angles)[:, :, None, :].astype(x.dtype)
    sin = jnp.sin(angles)[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def causal_mask(q_positions: jax.Array, k_positions: jax.Array, sliding_window: int | None = None) -> jax.Array:
    """Bool [B, T, S]: query at position i sees key at position j iff j <= i (and i - j < window)."""
    i = q_positions[:, :, None]
    j = k_positions[:, None, :]
    mask = j <= i
    if sliding_window is not None:
        mask &= i - j < sliding_window
    return mask


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Softmax attention with an explicit boolean mask, GQA by grouping query heads.

    q [B, T, H, E], k / v [B, S, K, E], mask [B, T, S] or [B, K, T, S] (per KV head) -> [B, T, H, E].
    Scores and softmax in fp32. A query row with no visible key returns zeros.
    """
    B, T, H, E = q.shape
    K = k.shape[2]
    q = q.reshape(B, T, K, H // K, E)
    scores = jnp.einsum("btkge,bske->bkgts", q, k, preferred_element_type=jnp.float32) / math.sqrt(E)
    mask = mask[:, None, None] if mask.ndim == 3 else mask[:, :, None]  # -> [B, K|1, 1, T, S]
    scores = jnp.where(mask, scores, -jnp.inf)
    row_max = jnp.max(scores, axis=-1, keepdims=True)
    probs = jnp.exp(scores - jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    probs = probs / jnp.maximum(jnp.sum(probs, axis=-1, keepdims=True), 1e-30)
    out = jnp.einsum("bkgts,bske->btkge", probs.astype(v.dtype), v)
    return out.reshape(B, T, H, E)


def mlp(x: jax.Array, layer: LayerParams) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = jnp.einsum("btd,df->btf", x, layer.w_gate)
    up = jnp.einsum("btd,df->btf", x, layer.w_up)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, layer.w_down)


def project_qkv(x: jax.Array, layer: LayerParams):
    """Query [B, T, H, E], key and value [B, T, K, E] heads of one layer's normed input x [B, T, D], before RoPE."""
    q = jnp.einsum("btd,dhe->bthe", x, layer.wq)
    k = jnp.einsum("btd,dke->btke", x, layer.wk)
    v = jnp.einsum("btd,dke->btke", x, layer.wv)
    return q, k, v


def qkv_projection(x: jax.Array, layer: LayerParams, positions: jax.Array, inv_freq: np.ndarray):
    """`project_qkv` with queries and keys rotated at absolute `positions` [B, T]."""
    q, k, v = project_qkv(x, layer)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def output_projection(attn: jax.Array, layer: LayerParams) -> jax.Array:
    """Merge heads: attn [B, T, H, E] -> [B, T, D]."""
    return jnp.einsum("bthe,hed->btd", attn, layer.wo)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return params.embed[tokens]  # [B, T, D]


def unembed(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """Final RMSNorm then the LM head: x [B, T, D] -> logits float32 [B, T, V]."""
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    return jnp.einsum("btd,vd->btv", x, head, preferred_element_type=jnp.float32)


# --- the dense full-attention model ----------------------------------------------------------------


def hidden_states(params: Params, config: ModelConfig, tokens: jax.Array,
                  positions: jax.Array | None = None) -> jax.Array:
    """Residual stream after the last layer, before the final norm: tokens int32 [B, T] -> [B, T, D]."""
    B, T = tokens.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    inv_freq = rope_inv_freq(config)
    mask = causal_mask(positions, positions, config.sliding_window)

    def layer_step(x, layer: LayerParams):
        h = rms_norm(x, layer.attn_norm, config.rms_norm_eps)
        q, k, v = qkv_projection(h, layer, positions, inv_freq)
        x = x + output_projection(dense_attention(q, k, v, mask), layer)
        x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
        return x, None

    x, _ = jax.lax.scan(layer_step, embed(params, tokens), params.layers)
    return x


@functools.partial(jax.jit, static_argnames="config")
def forward(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Dense causal forward pass: tokens int32 [B, T] -> logits float32 [B, T, V]."""
    return unembed(params, config, hidden_states(params, config, tokens))


def greedy_reference(params: Params, config: ModelConfig, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by re-running `forward` over a fixed-size buffer (no KV cache, one compile).

    Quadratic and slow: the reference that cached decoding is tested against, not a way to generate.
    """
    total = len(prompt) + max_new_tokens
    buffer = np.zeros((1, total), np.int32)  # positions past the current length are masked out causally
    buffer[0, : len(prompt)] = prompt
    for t in range(len(prompt), total):
        logits = forward(params, config, jnp.asarray(buffer))
        buffer[0, t] = int(jnp.argmax(logits[0, t - 1]))
    return buffer[0, len(prompt):].tolist()
