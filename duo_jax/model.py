"""The Llama / Mistral / Qwen decoder as pure functions over a parameter pytree.

Llama 2 / 3 / 3.1 / 3.2, Mistral, Qwen2 / Qwen3 and SmolLM2 differ only in config switches. `decoder_layer` is
the one layer body every path runs (its attention passed in); `forward` is full causal attention, tested against
Hugging Face transformers and the reference every cached path is tested against. Layers come in two layouts
(`LAYOUTS`): "per_layer" (`Params.layers` a tuple of `LayerParams`: what the engine's steps take; the default) and
"stacked" (one `LayerParams` with a leading layer axis: what `lax.scan` takes); `scan_layers` runs a layer body
over either, `stack_layers` / `unstack_layers` convert (a copy). Design: docs/engine.md.

Dimension letters used in einsum strings and shape comments:
  B batch, T query positions, S key positions, D model width (hidden_size), F MLP width,
  H query heads, K KV heads, G query heads per KV head (H = K * G), E head_dim, V vocabulary, L layers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention, quant
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.locks import KeyedLocks


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerParams:
    """Weights of decoder layers: all of them stacked on a leading layer axis L, or one layer's (no L axis)."""

    attn_norm: jax.Array  # [L, D]
    wq: jax.Array  # [L, D, H, E]
    wk: jax.Array  # [L, D, K, E]
    wv: jax.Array  # [L, D, K, E]
    wo: jax.Array  # [L, H, E, D]
    mlp_norm: jax.Array  # [L, D]
    w_gate: jax.Array  # [L, D, F]
    w_up: jax.Array  # [L, D, F]
    w_down: jax.Array  # [L, F, D]
    bq: jax.Array | None = None  # [L, H, E] q/k/v biases (config.qkv_bias)
    bk: jax.Array | None = None  # [L, K, E]
    bv: jax.Array | None = None  # [L, K, E]
    q_norm: jax.Array | None = None  # [L, E] per-head RMSNorm weights of queries and keys (config.qk_norm)
    k_norm: jax.Array | None = None  # [L, E]
    # [L, D, H + 2K, E]: wq, wk and wv as one weight (`fuse_qkv`), which then are None
    wqkv: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Params:
    embed: jax.Array  # [V, D]
    layers: LayerParams | tuple[LayerParams, ...]  # stacked [L, ...], or one LayerParams per layer (`LAYOUTS`)
    final_norm: jax.Array  # [D]
    lm_head: jax.Array | None = None  # [V, D]; None when the embeddings are tied

    @property
    def dtype(self):
        return self.embed.dtype


LAYOUTS = ("per_layer", "stacked")


def layout(params: Params) -> str:
    """ "per_layer" when `params.layers` is a tuple of one `LayerParams` per layer, else "stacked"."""
    return "per_layer" if isinstance(params.layers, tuple) else "stacked"


def check_layout(value: str) -> str:
    if value not in LAYOUTS:
        raise DuoJaxError(f"layout must be one of {', '.join(map(repr, LAYOUTS))}, got {value!r}")
    return value


def layer_at(params: Params, l: int) -> LayerParams:
    """Layer l's weights (a slice of each stacked array: a copy, outside a jitted function)."""
    if isinstance(params.layers, tuple):
        return params.layers[l]
    return jax.tree.map(lambda w: w[l], params.layers)


def unstack_layers(params: Params) -> Params:
    """`params` with per-layer layers (a tuple of `LayerParams`): stacked weights are sliced, a copy of every
    layer weight; per-layer weights are returned as they are."""
    if isinstance(params.layers, tuple):
        return params
    num_layers = jax.tree.leaves(params.layers)[0].shape[0]
    return dataclasses.replace(params, layers=tuple(layer_at(params, l) for l in range(num_layers)))


def stack_layers(params: Params) -> Params:
    """`params` with stacked layers: per-layer weights are stacked, a copy of every layer weight; stacked
    weights are returned as they are."""
    if not isinstance(params.layers, tuple):
        return params
    return dataclasses.replace(params, layers=jax.tree.map(lambda *w: jnp.stack(w), *params.layers))


def scan_layers(make_body: Callable, carry, config: ModelConfig, layers: LayerParams | tuple[LayerParams, ...], *xs):
    """Every layer in order: `make_body(window)` gives the body `(carry, layer, *x) -> (carry, y)` of the
    layers whose sliding window is `window` (static), x the layer's row of each of `xs` (arrays with a leading
    layer axis). Stacked layers run one `lax.scan` per run of consecutive layers sharing a window
    (`ModelConfig.window_runs`; one run unless the model windows some layers only); per-layer ones a Python
    loop (the same ops, unrolled). Returns (carry, ys stacked on a leading layer axis)."""
    runs = config.window_runs()
    if isinstance(layers, tuple):
        ys = []
        for first, stop, window in runs:
            body = make_body(window)
            for l in range(first, stop):
                carry, y = body(carry, layers[l], *(x[l] for x in xs))
                ys.append(y)
        return carry, jax.tree.map(lambda *y: jnp.stack(y), *ys)
    outputs = []
    for first, stop, window in runs:
        part = (layers, *xs) if len(runs) == 1 else jax.tree.map(lambda a, i=first, j=stop: a[i:j], (layers, *xs))
        body = make_body(window)
        carry, ys = jax.lax.scan(lambda c, inputs, body=body: body(c, *inputs), carry, part)
        outputs.append(ys)
    if len(outputs) == 1:
        return carry, outputs[0]
    return carry, jax.tree.map(lambda *ys: jnp.concatenate(ys, axis=0), *outputs)


# The one cache of what is derived from a set of weights: id of their first query weight -> a dict.
# Bounded by what is alive: an entry lives exactly as long as those weights (a finaliser drops it).
_MEMOS: dict[int, dict] = {}
_MEMOS_LOCK = threading.Lock()
_MEMO_BUILDS = KeyedLocks()


def weights_memo(params: Params) -> dict:
    """The dict for what is computed once per set of weights: `Engine.of`'s engine holding a copy of them (key
    ("engine", mesh)) and InfiniGen's skew matrices. The same dict while the weights live, dropped when they are
    garbage-collected. Nothing in it may hold the first layer's query weights (`layer_at(params, 0).wq` / the
    stacked `params.layers.wq`), which keep it; a caller that wants to own its engine builds one
    (`duo_jax.engine.Engine`) and passes it (`generate(engine=)`)."""
    layers = params.layers[0] if isinstance(params.layers, tuple) else params.layers
    anchor = jax.tree.leaves(layers.wq if layers.wqkv is None else layers.wqkv)[0]
    with _MEMOS_LOCK:  # one dict per set of weights, however many threads ask first
        memo = _MEMOS.get(id(anchor))
        if memo is None:
            memo = _MEMOS[id(anchor)] = {}
            weakref.finalize(anchor, _MEMOS.pop, id(anchor), None)
    return memo


@contextlib.contextmanager
def building(params: Params, key) -> Iterator[dict]:
    """`weights_memo(params)`, held for `key` while the caller looks its entry up and builds it on a miss: one
    thread builds it, the others asking at the same time wait and find it; other keys go on."""
    memo = weights_memo(params)
    with _MEMO_BUILDS.held((id(memo), key)):
        yield memo


def param_shapes(config: ModelConfig) -> Params:
    """The shape of every weight, as a `Params` of shape tuples (used by loaders to check what they read)."""
    L, D, F = config.num_layers, config.hidden_size, config.intermediate_size
    H, K, E, V = config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size
    bias, norm = config.qkv_bias, config.qk_norm
    layers = LayerParams(
        attn_norm=(L, D),
        wq=(L, D, H, E),
        wk=(L, D, K, E),
        wv=(L, D, K, E),
        wo=(L, H, E, D),
        mlp_norm=(L, D),
        w_gate=(L, D, F),
        w_up=(L, D, F),
        w_down=(L, F, D),
        bq=(L, H, E) if bias else None,
        bk=(L, K, E) if bias else None,
        bv=(L, K, E) if bias else None,
        q_norm=(L, E) if norm else None,
        k_norm=(L, E) if norm else None,
    )
    return Params(embed=(V, D), layers=layers, final_norm=(D,), lm_head=None if config.tie_word_embeddings else (V, D))


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


# The axes each weight's matmul contracts (of one layer's weights; stacked ones have the layer axis first);
# int8 weights keep one scale per output channel, the other axes (`quantize_weights`). The embedding's rows
# are its output channels for the tied LM head and its lookup alike.
CONTRACTED_AXES = dict(
    wq=(0,), wk=(0,), wv=(0,), wqkv=(0,), wo=(0, 1), w_gate=(0,), w_up=(0,), w_down=(0,), embed=(1,), lm_head=(1,)
)


WEIGHT_DTYPES = ("bfloat16", "float16", "float32", "float64")


def check_weight_dtype(dtype) -> np.dtype:
    """The weights' dtype: a floating type JAX computes in (float64 only with jax_enable_x64); anything else raises
    (a cast of the weights to an integer type, or JAX's silent float64 -> float32, would be another model)."""
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        resolved = None
    if resolved is None or resolved.name not in WEIGHT_DTYPES:
        raise DuoJaxError(
            f"dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {dtype!r}; for int8 weights pass weights='int8'"
        )
    if resolved == np.float64 and not jax.config.jax_enable_x64:
        raise DuoJaxError(
            "dtype float64 needs jax.config.update('jax_enable_x64', True) first (JAX computes in 32 bits)"
        )
    return resolved


def check_weight_format(weights: str | None) -> str | None:
    """None (the load dtype) or "int8"; anything else raises."""
    if weights not in (None, "int8"):
        raise DuoJaxError(f"weights must be None (the load dtype) or 'int8', got {weights!r}")
    return weights


def weight_format(params: Params) -> str | None:
    """ "int8" for weights from `quantize_weights`, None for weights in their dtype."""
    return "int8" if isinstance(params.embed, quant.QuantizedWeight) else None


def quantize_weights(params: Params, weights: str | None = "int8") -> Params:
    """`params` with every matmul weight int8 per output channel (`duo_jax.quant.QuantizedWeight`; norms and
    biases stay as they are). weights=None returns them unchanged."""
    if check_weight_format(weights) is None:
        return params

    def quantize(obj, shift=0):  # shift: 1 for stacked layers (the layer axis comes first)
        return dataclasses.replace(
            obj,
            **{
                f.name: quant.quantize_weight(getattr(obj, f.name), tuple(a + shift for a in CONTRACTED_AXES[f.name]))
                for f in dataclasses.fields(obj)
                if f.name in CONTRACTED_AXES and getattr(obj, f.name) is not None
            },
        )

    layers = (
        tuple(quantize(layer) for layer in params.layers)
        if isinstance(params.layers, tuple)
        else quantize(params.layers, shift=1)
    )
    return dataclasses.replace(quantize(params), layers=layers)


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


def _split_bits(x: np.ndarray, bits: int) -> np.ndarray:
    """x (float64) rounded to `bits` significant bits."""
    mantissa, exponent = np.frexp(x)
    return np.ldexp(np.round(mantissa * 2.0**bits), exponent - bits)


def rope_angles(positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """positions [...] (int) * inv_freq [E/2] reduced mod 2π to [-π, π], float32 [..., E/2], within ~2e-6 rad of
    the float64 product for every int32 position.

    The plain float32 product is off by up to |angle| * 2^-24 before any reduction: 0.1 rad at position 4M
    (tests/test_rope.py measures it). Instead the angle is counted in turns, position * inv_freq / 2π, with the
    per-pair constant split on the host into two 12-bit parts and a remainder, and the position into 12-bit
    pieces: each piece times each 12-bit part is exact in float32 (24 significant bits), so its fractional
    part is exact too, and only fractions in [0, 1) are summed."""
    turns = np.asarray(inv_freq, np.float64) / (2 * np.pi)  # the float32 frequencies the model uses, exactly
    c1 = _split_bits(turns, 12)
    c2 = _split_bits(turns - c1, 12)
    c3 = turns - c1 - c2  # < 2^-24 of the constant: its product needs no exactness
    p = positions.astype(jnp.int32)[..., None]
    pieces = [(p >> 24) << 24, ((p >> 12) & 0xFFF) << 12, p & 0xFFF]  # 7, 12 and 12 significant bits

    def frac(t):
        return t - jnp.floor(t)

    total = frac(p.astype(jnp.float32) * c3.astype(np.float32))
    for piece in pieces:
        for c in (c1, c2):
            total = frac(total + frac(piece.astype(jnp.float32) * c.astype(np.float32)))
    return (total - jnp.round(total)) * np.float32(2 * np.pi)  # centred: [-π, π], half the rounding


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Rotary:
    """RoPE's cos and sin at some positions, float32 [B, T, E/2] each (`rotary`): computed once per step and
    applied to every layer's queries and keys (`apply_rotary`)."""

    cos: jax.Array
    sin: jax.Array


def rotary(positions: jax.Array, inv_freq: np.ndarray) -> Rotary:
    """The `Rotary` table at `positions` [B, T] (int), from `rope_angles`.

    On XLA:CPU the table is held in memory once: left to itself, XLA fuses the whole angle computation into
    every layer's rotation (docs/engine.md, "RoPE"). `lax.optimization_barrier` does not stop that fusion there;
    a conditional does, so the table passes through one whose other branch (taken only for non-finite angles,
    which int32 positions never give) returns NaN. Other platforms compute it as written."""
    angles = rope_angles(positions, inv_freq)  # [B, T, E/2]
    table = (jnp.cos(angles), jnp.sin(angles))

    def held_once(table):
        return jax.lax.cond(
            jnp.all(jnp.isfinite(angles)),
            lambda t: t,
            lambda t: jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), t),
            table,
        )

    return Rotary(*jax.lax.platform_dependent(table, cpu=held_once, default=lambda t: t))


def apply_rotary(x: jax.Array, rope: Rotary) -> jax.Array:
    """Rotate x [B, T, N, E] by the `Rotary` table of its positions (half-split layout, as Hugging Face Llama)."""
    cos = rope.cos[:, :, None, :].astype(x.dtype)
    sin = rope.sin[:, :, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotate x [B, T, N, E] at absolute `positions` [B, T] by a table of its own (when several tensors share
    positions, build the `rotary` table once and `apply_rotary` it to each)."""
    return apply_rotary(x, rotary(positions, inv_freq))


def mlp(x: jax.Array, layer: LayerParams) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x))."""
    gate = quant.einsum("btd,df->btf", x, layer.w_gate)
    up = quant.einsum("btd,df->btf", x, layer.w_up)
    return quant.einsum("btf,fd->btd", jax.nn.silu(gate) * up, layer.w_down)


def fuse_qkv(layer: LayerParams) -> LayerParams:
    """`layer` with wq, wk and wv concatenated along the head axis into `wqkv` (a copy of them; int8 weights keep
    their per-channel scales), for one projection instead of three (docs/engine.md, "Fused q/k/v")."""
    if layer.wqkv is not None:
        return layer
    # leaf by leaf: an int8 weight's codes and its scales (size 1 on the input axis) concatenate alike
    wqkv = jax.tree.map(lambda *w: jnp.concatenate(w, axis=-2), layer.wq, layer.wk, layer.wv)
    return dataclasses.replace(layer, wq=None, wk=None, wv=None, wqkv=wqkv)


def project_qkv(x: jax.Array, layer: LayerParams, config: ModelConfig):
    """Query [B, T, H, E], key and value [B, T, K, E] heads of one layer's normed input x [B, T, D], before RoPE
    (with the layer's q/k/v biases and per-head q/k RMSNorm where the model has them). Every path's q, k and v come
    from here (the layer, InfiniGen's lookahead): a family's switch on them reads `config` here."""
    if layer.wqkv is None:
        q = quant.einsum("btd,dhe->bthe", x, layer.wq)
        k = quant.einsum("btd,dke->btke", x, layer.wk)
        v = quant.einsum("btd,dke->btke", x, layer.wv)
    else:
        H = layer.wo.shape[-3]  # wo [H, E, D]
        K = (layer.wqkv.shape[-2] - H) // 2
        q, k, v = jnp.split(quant.einsum("btd,dne->btne", x, layer.wqkv), (H, H + K), axis=2)
    if layer.bq is not None:
        q, k, v = q + layer.bq, k + layer.bk, v + layer.bv
    if layer.q_norm is not None:
        q, k = rms_norm(q, layer.q_norm, config.rms_norm_eps), rms_norm(k, layer.k_norm, config.rms_norm_eps)
    return q, k, v


def output_projection(attn: jax.Array, layer: LayerParams) -> jax.Array:
    """Merge heads: attn [B, T, H, E] -> [B, T, D], as one [B*T, H*E] x [H*E, D] matmul (contracting H and E as
    two axes, XLA:CPU copied wo transposed on every call: 1.3 MB a layer and chunk on SmolLM2)."""
    B, T, H, E = attn.shape
    wo = layer.wo
    if isinstance(wo, quant.QuantizedWeight):  # one scale per output channel: [1, 1, D] -> [1, D]
        wo = quant.QuantizedWeight(wo.codes.reshape(H * E, -1), wo.scale.reshape(1, -1))
    else:
        wo = wo.reshape(H * E, -1)
    return quant.einsum("btf,fd->btd", attn.reshape(B, T, H * E), wo)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return quant.take_rows(params.embed, tokens)  # [B, T, D]


def unembed(params: Params, config: ModelConfig, x: jax.Array) -> jax.Array:
    """Final RMSNorm then the LM head: x [B, T, D] -> logits float32 [B, T, V]."""
    x = rms_norm(x, params.final_norm, config.rms_norm_eps)
    head = params.embed if params.lm_head is None else params.lm_head
    return quant.einsum("btd,vd->btv", x, head, out_dtype=jnp.float32)


# --- one decoder layer, and the dense full-attention model ------------------------------------------


def decoder_layer(x: jax.Array, layer: LayerParams, config: ModelConfig, attend: Callable) -> tuple[jax.Array, Any]:
    """One pre-norm decoder layer over the residual stream x [B, T, D] -> (x, aux).

    `attend(q, k, v, h)` is the layer's attention: it gets the query [B, T, H, E] and key / value [B, T, K, E]
    heads before RoPE (each caller rotates them at the positions it means) and the normed layer input
    h [B, T, D], and returns (output [B, T, H, E], aux), aux being whatever the caller wants back (an updated
    cache, a teacher's attention output). Every path of duo-jax runs its layers through this function.
    """
    h = rms_norm(x, layer.attn_norm, config.rms_norm_eps)
    q, k, v = project_qkv(h, layer, config)
    out, aux = attend(q, k, v, h)
    x = x + output_projection(out, layer)
    x = x + mlp(rms_norm(x, layer.mlp_norm, config.rms_norm_eps), layer)
    return x, aux


def hidden_states(
    params: Params, config: ModelConfig, tokens: jax.Array, positions: jax.Array | None = None
) -> jax.Array:
    """Residual stream after the last layer, before the final norm: tokens int32 [B, T] -> [B, T, D].

    Query t sees keys s <= t (within the layer's sliding window, `config.layer_window`), by position order
    in the sequence."""
    B, T = tokens.shape
    contiguous = positions is None  # then the attention skips the key blocks past each query block
    if contiguous:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    rope = rotary(positions, rope_inv_freq(config))

    def make_body(window):
        if contiguous:
            spec = attention.prefix_spec(B, T, num_keys=T, window=window)
        else:
            spec = attention.MaskSpec(positions, jnp.full((B,), T, jnp.int32), positions, window=window)

        def attend(q, k, v, h):
            q, k = apply_rotary(q, rope), apply_rotary(k, rope)
            return attention.attend(q, k, v, spec), None

        return lambda x, layer: decoder_layer(x, layer, config, attend)

    x, _ = scan_layers(make_body, embed(params, tokens), config, params.layers)
    return x


def forward(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Dense causal forward pass: tokens int32 [B, T] -> logits float32 [B, T, V]. `params` in either layout
    (`LAYOUTS`): stacked layers compile one scanned layer, per-layer ones an unrolled loop (the same numbers;
    more compile time, no copy of the weights). Token ids outside the vocabulary raise where they can be read:
    given concrete (under a caller's jit they cannot, and the embedding gather would clamp them)."""
    if not isinstance(tokens, jax.Array):  # a nested list of ids too
        try:
            tokens = np.asarray(tokens)
        except ValueError:  # rows of different lengths
            raise DuoJaxError("tokens must be rows of one length (an array [batch, length]); pad them") from None
    check_tokens(tokens, config.vocab_size)
    return forward_jit(params, config, tokens)


@functools.partial(jax.jit, static_argnames="config")
def forward_jit(params: Params, config: ModelConfig, tokens: jax.Array) -> jax.Array:
    """`forward`'s compiled function, without the check of the tokens' values."""
    return unembed(params, config, hidden_states(params, config, tokens))


def check_tokens(tokens: jax.Array | np.ndarray, vocab_size: int) -> None:
    """Token ids: an integer array [B, T] with T >= 1, its values (where concrete) in [0, vocab_size)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise DuoJaxError(
            f"tokens must be an integer array [batch, length]; got {tokens.dtype} of shape {tokens.shape}"
        )
    if tokens.shape[1] == 0:
        raise DuoJaxError("tokens hold no positions (shape [batch, 0]); pass at least one token per row")
    if tokens.shape[0] == 0:
        raise DuoJaxError("tokens hold no rows (shape [0, length]); pass at least one sequence")
    if not isinstance(tokens, jax.core.Tracer):
        check_token_ids(tokens, vocab_size)


def check_token_ids(ids, vocab_size: int, what: str = "token ids") -> None:
    """Concrete ids (any shape) in [0, vocab_size); else an error naming `what` and the range given."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise DuoJaxError(f"{what} must lie in [0, {vocab_size}), got {ids.min()}..{ids.max()}")


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
    return buffer[0, len(prompt) :].tolist()
