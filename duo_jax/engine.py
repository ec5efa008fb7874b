"""The forward pass over a KV-cache method's cache: one jitted function for prefill chunks and decode steps.

`extend` runs T new tokens per sequence through the model. Everything but attention is the model's own
(`duo_jax.model`); per layer, the method (`duo_jax.methods`) attends the new tokens to its cache and returns
the updated cache. The layers are unrolled (not scanned) because a method's per-layer caches may differ in
shape (DuoAttention's layers each have their own number of retrieval heads).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step
from duo_jax.model import Params, decoder_layer, embed, project_qkv, rope_inv_freq, unembed
from duo_jax.sampling import Sampling, sample


def unstack_layers(params: Params) -> Params:
    """`Params` whose `.layers` is a tuple of per-layer `LayerParams` (what `extend` takes).

    The engine unrolls its layers; slicing a stacked weight inside the jitted step copies it on every call
    on CPU (measured: 14x slower matmuls), so the layers are split once, outside the step.
    """
    num_layers = params.layers.wq.shape[0]
    layers = tuple(jax.tree.map(lambda w, l=l: w[l], params.layers) for l in range(num_layers))
    return dataclasses.replace(params, layers=layers)


def prepare_params(params: Params, config: ModelConfig, method: Method) -> Params:
    """The model's weights as `extend` takes them for `method`: as the method wants them, layers unstacked."""
    return unstack_layers(method.prepare_params(params, config))


@functools.partial(jax.jit, static_argnames=("config", "method", "all_logits", "impl"), donate_argnames=("cache",))
def extend(params: Params, cache, lengths: jax.Array, tokens: jax.Array, n_valid: jax.Array, *,
           config: ModelConfig, method: Method, all_logits: bool = False, impl: str = "auto"):
    """Feed tokens [B, T] at positions lengths[b] + t, of which the first n_valid[b] are real (rest padding).

    `params` come from `prepare_params(params, config, method)`; `cache` from `method.init_cache`.
    Returns (logits, cache, lengths): logits float32 [B, V] at each sequence's last real token ([B, T, V] for
    every token when all_logits), the updated cache, and lengths + n_valid. `impl` picks the attention
    kernels (`duo_jax.attention`: Pallas on GPU, the blocked XLA path elsewhere).
    """
    B, T = tokens.shape
    if config.sliding_window is not None and not method.supports_sliding_window:
        raise DuoJaxError(f"method {method.name!r} does not implement the model's sliding window "
                          f"(sliding_window={config.sliding_window}); use full, duo or streaming_llm")
    step = Step(positions=lengths[:, None] + jnp.arange(T, dtype=jnp.int32),
                valid=jnp.arange(T)[None, :] < n_valid[:, None],
                lengths=lengths, new_lengths=lengths + n_valid, inv_freq=rope_inv_freq(config), impl=impl,
                sliding_window=config.sliding_window)
    shared = method.begin_step(step)

    x = embed(params, tokens)  # [B, T, D]
    new_cache = []
    inputs = [None]  # the attention input of the layer before (for methods that look ahead)
    for l, layer in enumerate(params.layers):
        def attend(q, k, v, h, l=l, layer=layer):
            extra = {}
            if method.lookahead and step.is_decode:
                # InfiniGen: layer l's query from layer l-1's attention input (layer 0: its own query).
                extra["lookahead_q"] = q if inputs[-1] is None else project_qkv(inputs[-1], layer, config.rms_norm_eps)[0]
            inputs.append(h)
            return method.attend(l, q, k, v, cache[l], step, shared, **extra)

        x, layer_cache = decoder_layer(x, layer, config, attend)
        new_cache.append(layer_cache)

    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    logits = unembed(params, config, x)
    return (logits if all_logits else logits[:, 0]), tuple(new_cache), step.new_lengths


@functools.partial(jax.jit, static_argnames=("config", "method", "sampling", "max_tokens", "eos_ids", "impl"),
                   donate_argnames=("cache",))
def decode(params: Params, cache, lengths: jax.Array, token: jax.Array, key: jax.Array, limit: jax.Array, *,
           config: ModelConfig, method: Method, sampling: Sampling, max_tokens: int, eos_ids: tuple[int, ...] = (),
           impl: str = "auto"):
    """Decode on the device: one `lax.while_loop` of `extend` steps with sampling inside, no host round trip.

    `token` int32 [B] is each sequence's first new token (sampled from the prefill's logits); the loop runs
    up to `limit` (int32 scalar, at most max_tokens - 1) more steps and stops early once every sequence has
    produced one of `eos_ids` (() never stops early). Step i samples with `fold_in(key, i)`. A pure function
    of its arguments: put it under your own `jax.jit` as it is.

    Returns (tokens int32 [B, max_tokens]: column 0 is `token`, columns 1..steps the new ones, zeros after;
    steps int32 scalar; the cache; lengths).
    """
    B = token.shape[0]
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    ones = jnp.ones((B,), jnp.int32)

    def running(carry):
        step, _, _, _, done, _ = carry
        return (step < limit) & ~jnp.all(done)

    def step_once(carry):
        step, cache, lengths, token, done, tokens = carry
        logits, cache, lengths = extend(params, cache, lengths, token[:, None], ones, config=config, method=method,
                                        impl=impl)
        token = sample(logits, jax.random.fold_in(key, step + 1), sampling)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step + 1, axis=1)
        return step + 1, cache, lengths, token, done | jnp.isin(token, eos), tokens

    tokens = jnp.zeros((B, max_tokens), jnp.int32).at[:, 0].set(token)
    carry = (jnp.zeros((), jnp.int32), cache, lengths, token, jnp.isin(token, eos), tokens)
    steps, cache, lengths, _, _, tokens = jax.lax.while_loop(running, step_once, carry)
    return tokens, steps, cache, lengths
