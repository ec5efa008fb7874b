"""Batched generation with any KV-cache method: chunked prefill, then one jitted step per token."""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention
from duo_jax.cache import full_cache_bytes
from duo_jax.chat import chat_prompts
from duo_jax.config import ModelConfig
from duo_jax.engine import decode, extend, prepare_params
from duo_jax.errors import DuoJaxError
from duo_jax.loading import Model
from duo_jax.methods import DuoAttention, InfiniGen, Method, cache_nbytes, make_method
from duo_jax.methods.infinigen import DENSE_LAYERS, LLAMA_ALPHA, skew_on_text
from duo_jax.model import param_shapes, quantize_weights, weight_format
from duo_jax.pattern import Pattern, exact_sparsity
from duo_jax.sampling import Sampling, sample
from duo_jax.tokenizer import require


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new token ids per prompt (up to and including EOS when it stopped there)
    text: list[str] | None  # decoded new text per prompt, when the model has a tokenizer
    stats: dict  # prefill_s, decode_s, decode_tokens_per_s, cache_bytes, full_cache_bytes, ...


def resolve_pattern(pattern: Pattern | str | os.PathLike | None, config: ModelConfig) -> Pattern | None:
    """A Pattern, a path to one, "default" (the model's shipped pattern) or None (full attention)."""
    if pattern is None or isinstance(pattern, Pattern):
        resolved = pattern
    elif str(pattern) == "default":
        resolved = Pattern.for_model(config.name)
        if resolved is None:
            raise DuoJaxError(f"model {config.name!r} ships no default pattern; pass a pattern path")
    else:
        resolved = Pattern.load(pattern)
    if resolved is not None:
        resolved.validate(config)
    return resolved


def _prompt_ids(model: Model, prompts) -> list[list[int]]:
    if isinstance(prompts, str):
        prompts = [prompts]
    elif len(prompts) > 0 and isinstance(prompts[0], (int, np.integer)):
        prompts = [prompts]
    if len(prompts) == 0:
        raise DuoJaxError("no prompts given")
    ids = []
    for prompt in prompts:
        ids.append(require(model.tokenizer, "a text prompt").encode(prompt) if isinstance(prompt, str)
                   else [int(t) for t in prompt])
        if not ids[-1]:
            raise DuoJaxError("a prompt is empty; every prompt needs at least one token")
        if min(ids[-1]) < 0 or max(ids[-1]) >= model.config.vocab_size:
            raise DuoJaxError(f"prompt token ids must lie in [0, {model.config.vocab_size}), "
                              f"got {min(ids[-1])}..{max(ids[-1])}")
    return ids


def validate_options(*, sparsity: float, sink: int | None, recent: int | None, max_new_tokens: int,
                     chunk_size: int, temperature: float, top_p: float, top_k: int, attention_impl: str) -> None:
    """Clear errors for bad generation options, before any model work (the CLIs call it before loading)."""
    exact_sparsity(sparsity)
    if (sink or 0) < 0 or (recent or 0) < 0:
        raise DuoJaxError(f"sink and recent must be >= 0, got sink={sink}, recent={recent}")
    if chunk_size <= 0:
        raise DuoJaxError(f"chunk_size must be positive, got {chunk_size}")
    if max_new_tokens <= 0:
        raise DuoJaxError(f"max_new_tokens must be positive, got {max_new_tokens}")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise DuoJaxError(f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 0; got {temperature}, {top_p}, {top_k}")
    if attention_impl not in attention.IMPLS:
        raise DuoJaxError(f"attention_impl must be one of {', '.join(attention.IMPLS)}, got {attention_impl!r}")


def bucket(n: int, smallest: int = 16) -> int:
    """The compiled size for n: the next power of two >= max(n, smallest). Prefill chunks and the decode loop's
    token buffer come in these sizes, so varied prompt lengths and max_new_tokens reuse executables."""
    return max(smallest, 1 << (max(n, 1) - 1).bit_length())


def _abstract_params(config: ModelConfig, method: Method, dtype: str, weights: str | None = None):
    stacked = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config),
                           is_leaf=lambda s: isinstance(s, tuple))
    return jax.eval_shape(lambda p: prepare_params(quantize_weights(p, weights), config, method), stacked)


@functools.lru_cache(maxsize=32)
def compiled_decode(config: ModelConfig, method: Method, batch: int, dtype: str, impl: str, sampling: Sampling,
                    max_tokens: int, eos_ids: tuple[int, ...], weights: str | None = None):
    """`engine.decode` compiled once per (batch, token buffer size, sampling rule); the step limit is an argument."""
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
    key = jax.eval_shape(lambda: jax.random.key(0))
    return decode.lower(_abstract_params(config, method, dtype, weights), method.cache_spec(batch, dtype), ints,
                        ints, key, jax.ShapeDtypeStruct((), jnp.int32), config=config, method=method, sampling=sampling,
                        max_tokens=max_tokens, eos_ids=eos_ids, impl=impl).compile()


@functools.lru_cache(maxsize=32)
def compiled_extend(config: ModelConfig, method: Method, batch: int, chunk: int, dtype: str,
                    impl: str = "auto", all_logits: bool = False, weights: str | None = None):
    """`extend` compiled once per shape: later calls cannot recompile, however long the sequence grows."""
    cache = method.cache_spec(batch, dtype)
    ints = jax.ShapeDtypeStruct((batch,), jnp.int32)
    tokens = jax.ShapeDtypeStruct((batch, chunk), jnp.int32)
    return extend.lower(_abstract_params(config, method, dtype, weights), cache, ints, tokens, ints, config=config,
                        method=method, all_logits=all_logits, impl=impl).compile()


def build_method(config: ModelConfig, method: str | Method | None, *, context: int, pattern=None,
                 sparsity: float = 0.5, sink: int | None = None, recent: int | None = None, **options) -> Method:
    """The KV-cache method generate() runs: a `Method`, or a name with its options (see `duo_jax.methods`).

    method=None means "duo" when a pattern is given and "full" otherwise. `sink` is StreamingLLM's `start`.
    """
    if isinstance(method, Method):
        return method
    name = method or ("full" if pattern is None else "duo")
    windows = {k: v for k, v in dict(sink=sink, recent=recent).items() if v is not None}
    if name in ("duo", "duo_headkv"):
        options.update(pattern=resolve_pattern(pattern if pattern is not None else "default", config),
                       sparsity=sparsity, **windows)
    elif name == "streaming_llm":
        options.update({"start" if k == "sink" else k: v for k, v in windows.items()})
    elif pattern is not None:
        raise DuoJaxError(f"method {name!r} takes no head pattern")
    elif name != "full":  # full attention has no windows: sink / recent do not apply to it
        options.update(windows)  # make_method rejects a window the method does not have
    return make_method(name, config, context=context, **options)


def calibrate_infinigen(model: Model, *, context: int, kv_budget: int | None = None, alpha: float = LLAMA_ALPHA,
                        partial_ratio: float = 0.2, channel_rule: str = "qk", dense_layers: int = DENSE_LAYERS,
                        offload: str = "auto", **unknown) -> InfiniGen:
    """InfiniGen for `model` with the authors' Llama rules by default, skewed on a sample of the calibration
    essays (`duo_jax.methods.infinigen.skew_on_text`)."""
    if unknown:
        raise DuoJaxError(f"method 'infinigen' does not take {', '.join(sorted(unknown))} (its options: alpha, "
                          "channel_rule, dense_layers, kv_budget, offload, partial_ratio)")
    if kv_budget is None or not kv_budget > 0:
        raise DuoJaxError(f"method 'infinigen' needs a positive kv_budget (tokens fetched per KV head), got {kv_budget}")
    A, mask = skew_on_text(model.params, model.config, model.tokenizer, partial_ratio=partial_ratio,
                           channel_rule=channel_rule)
    return InfiniGen.from_skew(A, mask, context=context, kv_budget=int(kv_budget), alpha=alpha,
                               dense_layers=dense_layers, offload=offload)


_first_token = jax.jit(sample, static_argnums=2)  # from the prefill's logits; the rest are sampled on the device


def generate(model: Model, prompts, *, method: str | Method | None = None, pattern: Pattern | str | None = None,
             sparsity: float = 0.5, sink: int | None = None, recent: int | None = None, max_new_tokens: int = 128,
             chunk_size: int = 512, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int = 0,
             stop_at_eos: bool = True, context: int | None = None, attention_impl: str = "auto",
             chat: bool | None = None, kv_dtype: str | None = None, **method_options) -> Generation:
    """Generate from one or many prompts with a KV-cache method (DuoAttention by default when given a pattern).

    prompts: a string, a list of strings, a list of token ids, or a list of such lists (lengths may differ);
    or a conversation (a list of {"role", "content"} messages), or a list of conversations.
    chat: wrap text prompts (each one user message) and conversations in the model's chat template
    (`duo_jax.chat`); None: on for models with a template whose name says instruct / chat. Token ids are
    never wrapped.
    method: a name of `duo_jax.methods.METHODS` ("full", "duo", "streaming_llm", "h2o", "tova", "snapkv",
    "pyramidkv", "headkv", "duo_headkv"), "infinigen" (calibrated here on the calibration essays,
    `calibrate_infinigen`), or a built `Method`; None: "duo" when a pattern is given, else "full".
    method_options: that method's options (kv_budget, scores, window, ...; see `duo_jax.methods.make_method`).
    pattern: a `Pattern`, a path to one, or "default" (the model's own); binarised at `sparsity` (the
    fraction of streaming heads; 1 is StreamingLLM with absolute positions).
    sink / recent: streaming heads keep the first `sink` and the last `recent` tokens (duo: 64 / 256;
    streaming_llm: 4 / 256). chunk_size: prompt tokens per prefill step. context: retrieval capacity in
    tokens (default: longest prompt + max_new_tokens, rounded up to duo_jax.cache.CAPACITY_BLOCK).
    attention_impl: "auto" | "pallas" | "xla" | "reference" (see `duo_jax.attention`).
    kv_dtype: None or the model's dtype name (the cache in the model's dtype), "int8" or "int4" (quantized per
    token and head, `duo_jax.quant`; methods full, duo and streaming_llm).
    """
    validate_options(sparsity=sparsity, sink=sink, recent=recent, max_new_tokens=max_new_tokens,
                     chunk_size=chunk_size, temperature=temperature, top_p=top_p, top_k=top_k,
                     attention_impl=attention_impl)
    config = model.config
    ids = _prompt_ids(model, chat_prompts(model, prompts, chat))
    longest = max(len(p) for p in ids)
    needed = longest + max_new_tokens
    if context is not None and needed > context:
        raise DuoJaxError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
                          f"cache capacity context={context}; raise context or shorten the prompt")
    if kv_dtype is not None and kv_dtype != jnp.dtype(model.params.dtype).name:
        if isinstance(method, Method):
            raise DuoJaxError("kv_dtype is a method option: build the method with it (make_method(..., "
                              "kv_dtype=...)) rather than passing both")
        method_options["kv_dtype"] = kv_dtype
    if method == "infinigen":  # calibrates on the model's weights (pass a built InfiniGen to reuse one)
        kv_method = calibrate_infinigen(model, context=context or needed, **method_options)
    else:
        kv_method = build_method(config, method, context=context or needed, pattern=pattern, sparsity=sparsity,
                                 sink=sink, recent=recent, **method_options)
    if kv_method.max_tokens is not None and needed > kv_method.max_tokens:
        raise DuoJaxError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
                          f"{kv_method.name} cache's capacity of {kv_method.max_tokens} tokens; build the method "
                          "with a larger context or shorten the prompt")
    if kv_method.absolute_positions and needed > config.max_position_embeddings:
        raise DuoJaxError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
                          f"model's context of {config.max_position_embeddings} tokens; shorten the prompt, "
                          "lower max_new_tokens, or use method='streaming_llm' (re-indexed positions)")
    params = prepare_params(model.params, config, kv_method)

    B, dtype = len(ids), model.params.dtype
    chunk = min(chunk_size, bucket(longest))
    n_chunks = -(-longest // chunk)
    padded = np.zeros((B, n_chunks * chunk), np.int32)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = p
    prompt_lengths = np.array([len(p) for p in ids], np.int32)

    start = time.perf_counter()
    weights = weight_format(model.params)
    prefill_step = compiled_extend(config, kv_method, B, chunk, jnp.dtype(dtype).name, attention_impl, weights=weights)
    compile_s = time.perf_counter() - start

    cache = kv_method.init_cache(B, dtype)
    lengths = jnp.zeros((B,), jnp.int32)
    start = time.perf_counter()
    last_logits = jnp.zeros((B, config.vocab_size), jnp.float32)
    for c in range(n_chunks):
        n_valid = np.clip(prompt_lengths - c * chunk, 0, chunk).astype(np.int32)
        logits, cache, lengths = prefill_step(params, cache, lengths, jnp.asarray(padded[:, c * chunk:(c + 1) * chunk]),
                                              jnp.asarray(n_valid))
        last_logits = jnp.where(jnp.asarray(n_valid > 0)[:, None], logits, last_logits)
    kv_method, cache = kv_method.after_prefill(cache, lengths)
    key = jax.random.key(seed)
    sampling = Sampling(float(temperature), float(top_p), int(top_k))
    token = _first_token(last_logits, jax.random.fold_in(key, 0), sampling)
    token.block_until_ready()
    prefill_s = time.perf_counter() - start

    eos_ids = tuple(config.eos_token_ids) if stop_at_eos else ()
    start = time.perf_counter()
    decode_loop = compiled_decode(config, kv_method, B, jnp.dtype(dtype).name, attention_impl, sampling,
                                  bucket(max_new_tokens), eos_ids, weights)
    compile_s += time.perf_counter() - start

    start = time.perf_counter()
    tokens, steps, cache, lengths = decode_loop(params, cache, lengths, token, key,
                                                jnp.asarray(max_new_tokens - 1, jnp.int32))
    steps = int(steps)  # the one host sync of the decode
    generated = np.asarray(tokens)[:, : steps + 1]  # [B, N]
    decode_s = time.perf_counter() - start

    out = []
    for row in generated.tolist():
        hits = [i for i, t in enumerate(row) if t in eos_ids]
        out.append(row[: hits[0] + 1] if hits else row)
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode(row) for row in out]
    bytes_per_elem = jnp.dtype(dtype).itemsize
    stats = dict(
        method=kv_method.name, prompt_tokens=[len(p) for p in ids], compile_s=compile_s, prefill_s=prefill_s,
        decode_s=decode_s, decode_steps=steps, decode_tokens_per_s=B * steps / decode_s if steps else float("nan"),
        cache_bytes=cache_nbytes(cache), expected_cache_bytes=kv_method.expected_cache_bytes(B, bytes_per_elem),
        full_cache_bytes=full_cache_bytes(config, B, context or needed, bytes_per_elem), chunk_size=chunk)
    if isinstance(kv_method, DuoAttention):
        layout = kv_method.layout
        stats.update(retrieval_heads=sum(layout.num_retrieval), kv_heads=config.num_layers * config.num_kv_heads,
                     capacity=layout.capacity, sink=layout.sink, recent=layout.recent)
    return Generation(out, text, stats)
