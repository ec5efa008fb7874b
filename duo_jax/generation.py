"""Batched generation with any KV-cache method: the model's `Engine` (weights prepared once) runs a chunked
prefill, then one compiled device loop decodes every new token."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
import warnings
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from duo_jax import attention, device_memory, methods, sharding
from duo_jax.cache import CAPACITY_BLOCK, capacity_bucket, full_cache_bytes, round_capacity
from duo_jax.chat import chat_prompts
from duo_jax.config import ModelConfig
from duo_jax.engine import (
    Engine,
    batch_bucket,
    bucket,
    cache_device_bytes,
    compiled_decode,
    compiled_extend,
    devices_of,
)
from duo_jax.errors import DuoJaxError, InvalidOption
from duo_jax.loading import Model
from duo_jax.methods import Method, cache_nbytes
from duo_jax.model import check_token_ids
from duo_jax.pattern import Pattern, exact_sparsity
from duo_jax.sampling import Sampling, argmax_tokens, check_number, check_sampling, row_seeds, sample_seeded
from duo_jax.tokenizer import generated_text, require


@dataclasses.dataclass
class Generation:
    tokens: list[list[int]]  # new token ids per prompt (up to and including EOS when it stopped there)
    text: list[str] | None  # decoded new text per prompt, when the model has a tokenizer
    stats: dict  # prefill_s, decode_s, decode_tokens_per_s, cache_bytes, full_cache_bytes, ...


def _prompt_ids(model: Model, prompts) -> list[list[int]]:
    """A text, a list of token ids, or a batch of either (a list, or a 2-D integer array) -> each prompt's token
    ids; anything else (None, floats, nested deeper) raises naming what was given."""
    try:
        return _host_prompt_ids(model, prompts)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as e:
        raise DuoJaxError(  # inside the caller's jax.jit / vmap: the prompts are tracers
            "generate runs on the host (its prompts are Python values, its loop plans and compiles its own steps) and "
            "cannot be traced inside jax.jit: call it outside, or from jitted code use duo_jax.engine's extend / "
            "decode steps, which take and return the cache (docs/engine.md)"
        ) from e


def _host_prompt_ids(model: Model, prompts) -> list[list[int]]:
    array = isinstance(prompts, (np.ndarray, jax.Array))
    if isinstance(prompts, str) or (array and prompts.ndim == 1):
        prompts = [prompts]
    elif isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], (int, float, np.number)):
        prompts = [prompts]  # one prompt of token ids (floats included, for `_token_ids` to name)
    if not (isinstance(prompts, (list, tuple)) or (array and prompts.ndim == 2)):
        raise DuoJaxError(f"prompts must be a text, token ids or a list of them; got {type(prompts).__name__}")
    if len(prompts) == 0:
        raise DuoJaxError("no prompts given")
    ids = []
    for prompt in prompts:
        ids.append(
            require(model.tokenizer, "a text prompt").encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        )
        if not ids[-1]:
            raise DuoJaxError("a prompt is empty; every prompt needs at least one token")
        check_token_ids(ids[-1], model.config.vocab_size, "prompt token ids")
    return ids


def _token_ids(prompt) -> list[int]:
    """A prompt of token ids (a sequence or 1-D array of integers) as a list; anything else raises."""
    if isinstance(prompt, dict):
        raise DuoJaxError(
            "a chat message alone in a batch: a conversation is a list of messages, so a batch of them is "
            "[[{'role': ..., 'content': ...}], ...]"
        )
    try:
        array = np.asarray(prompt)
    except ValueError:  # ragged nesting
        array = np.asarray(prompt, dtype=object)
    if array.size == 0 and array.ndim == 1:
        return []
    if array.ndim != 1 or array.dtype == bool or not np.issubdtype(array.dtype, np.integer):
        raise DuoJaxError(
            "a prompt must be a text or a list of integer token ids; got "
            f"{type(prompt).__name__} of {array.dtype} with shape {array.shape}"
        )
    return array.tolist()


def validate_options(
    *,
    sparsity: float | None,
    sink: int | None,
    recent: int | None,
    max_new_tokens: int,
    chunk_size: int,
    temperature: float,
    top_p: float,
    top_k: int,
    impl: str,
) -> dict[str, int | None]:
    """Clear errors for bad generation options, before any model work (the CLIs call it before loading). Returns
    the integer options (sink, recent, max_new_tokens, chunk_size) as Python ints: numpy integers pass the checks
    but not every int method (`capacity_bucket`)."""
    if sparsity is not None:
        exact_sparsity(sparsity)
    checked = {}
    for name, value in (("sink", sink), ("recent", recent)):
        hint = " (None: the method's default)"
        checked[name] = None if value is None else check_number(name, value, integer=True, minimum=0, hint=hint)
    checked["chunk_size"] = check_number("chunk_size", chunk_size, integer=True, minimum=1)
    checked["max_new_tokens"] = check_number("max_new_tokens", max_new_tokens, integer=True, minimum=1)
    check_sampling(temperature, top_p, top_k)
    if impl not in attention.IMPLS:
        raise DuoJaxError(
            f"impl (the attention implementation) must be one of {', '.join(attention.IMPLS)}, got {impl!r}"
        )
    return checked


def build_method(
    config: ModelConfig,
    method: str | Method | None,
    *,
    context: int,
    pattern=None,
    sparsity: float | None = None,
    sink: int | None = None,
    recent: int | None = None,
    model=None,
    **options,
) -> Method:
    """The KV-cache method generate() runs: a `Method`, or a registered name (`duo_jax.methods.METHODS`) with
    its options. method=None means "duo" when a pattern is given and "full" otherwise. `sink` / `recent` go
    to the method's own window options (StreamingLLM's `start` is `sink`); a method without windows (full)
    ignores them, another rejects the one it lacks. `model`: for methods that calibrate on it (InfiniGen)."""
    if isinstance(method, Method):
        given = [
            n for n, v in dict(pattern=pattern, sparsity=sparsity, sink=sink, recent=recent).items() if v is not None
        ]
        given += sorted(options)
        if given:  # they would be ignored: the method's own settings stand
            raise DuoJaxError(
                f"{', '.join(given)} configure the method generate builds, but method= is already built "
                f"({method.name}): build it with them (duo_jax.methods.make_method({method.name!r}, ..., "
                f"{given[0]}=...)), or pass its name, method={method.name!r}"
            )
        return method
    spec = methods.entry(_method_name(method, pattern))
    if spec.takes_pattern:
        options.update(pattern="default" if pattern is None else pattern)  # its builder resolves it
        if sparsity is not None:
            options.update(sparsity=sparsity)
    elif pattern is not None:
        raise DuoJaxError(f"method {spec.name!r} takes no head pattern")
    elif sparsity is not None:
        hint = "" if method else "; pass a pattern for DuoAttention"
        raise DuoJaxError(f"method {spec.name!r} has no head pattern, so no sparsity to set{hint}")
    for name, value in dict(sink=sink, recent=recent).items():
        if value is not None and spec.options:  # full attention has no windows: sink / recent do not apply
            own = spec.windows.get(name, name)  # make_method rejects a window the method lacks
            if own != name and options.get(own, value) != value:
                raise DuoJaxError(f"{name}={value} and {own}={options[own]} name one option of {spec.name!r}: pass one")
            options[own] = value
    return methods.make_method(spec.name, config, context=context, model=model, **options)


def _method_name(method: str | None, pattern) -> str:
    """The registered method generate runs for a name or None: "duo" with a pattern, else "full"."""
    return method or ("full" if pattern is None else "duo")


_argmax = jax.jit(argmax_tokens)  # a greedy first token


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    """What one `generate` call runs, decided and checked before any device work (`plan_generation`)."""

    ids: list[list[int]]  # the prompts' token ids (chat template applied)
    batch: int  # rows compiled and run: len(ids) up to a batch bucket (`_batch_rows`), the rest copies of a prompt
    method: Method  # the KV-cache method, built for `capacity`
    capacity: int  # the context the method is built for (its caches round it up to CAPACITY_BLOCK)
    chunk: int  # prompt tokens per prefill step
    tail_steps: int  # the prompts' last tokens run as decode steps (`prompt_tail_steps`)
    max_new_tokens: int
    sampling: Sampling
    eos_ids: tuple[int, ...]  # stop tokens (empty: never stop early)
    impl: str  # the attention implementation (`duo_jax.attention.IMPLS`)
    mesh: Mesh | None
    device_cache_bytes: int  # of the KV cache, on each device that holds part of it


def plan_generation(
    model: Model,
    prompts,
    *,
    method: str | Method | None = None,
    pattern: Pattern | str | None = None,
    sparsity: float | None = None,
    sink: int | None = None,
    recent: int | None = None,
    max_new_tokens: int = 128,
    chunk_size: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_at_eos: bool = True,
    context: int | None = None,
    impl: str = "auto",
    chat: bool | None = None,
    kv_dtype: str | None = None,
    mesh: Mesh | None = None,
    prompt_tail_steps: int = 0,
    pad_batch: bool = True,
    **method_options,
) -> GenerationPlan:
    """`generate`'s options checked, its prompts tokenized and its method built: everything `run_generation`
    needs, with a clear error for anything that cannot run. Arguments as `generate`."""
    impl = _deprecated_impl(impl, method_options)
    _check_method_options(method_options)
    mesh = None if mesh is None else sharding.auto_axes(mesh)
    checked = validate_options(
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        impl=impl,
    )
    for name, flag in (("stop_at_eos", stop_at_eos), ("pad_batch", pad_batch)):
        if not isinstance(flag, (bool, np.bool_)):
            raise InvalidOption(f"{name} must be True or False, got {flag!r}", name)
    sink, recent, max_new_tokens, chunk_size = (checked[n] for n in ("sink", "recent", "max_new_tokens", "chunk_size"))
    if context is not None:
        context = check_number("context", context, integer=True, minimum=1, hint=" (None: a bucket that fits)")
    config = model.config
    if mesh is not None:  # before anything reads its axes
        sharding.check_generation_mesh(mesh, config.num_heads, config.intermediate_size)
    ids = _prompt_ids(model, chat_prompts(model, prompts, chat))
    longest = max(len(p) for p in ids)
    needed = longest + max_new_tokens
    if context is not None and isinstance(method, Method) and (method.max_tokens or context) < context:
        raise DuoJaxError(
            f"context={context} asks for more than the built method's capacity of {method.max_tokens} tokens "
            f"(method= is already built, {method.name}): build it with context={context}, or leave context=None"
        )
    if context is not None and needed > context:
        raise DuoJaxError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
            f"cache capacity context={context}; raise context or shorten the prompt"
        )
    if kv_dtype is not None and kv_dtype != jnp.dtype(model.params.dtype).name:
        if isinstance(method, Method):
            raise DuoJaxError(
                "kv_dtype is a method option: build the method with it (make_method(..., "
                "kv_dtype=...)) rather than passing both"
            )
        method_options["kv_dtype"] = kv_dtype
    # Default capacity: a bucket (`capacity_bucket`) so that varied requests share compiled shapes; the bucket is
    # capped at the model's context, the capacity never below what the request needs.
    capacity = _on_mesh(context or max(needed, min(capacity_bucket(needed), config.max_position_embeddings)), mesh)
    build = lambda capacity: build_method(
        config,
        method,
        context=capacity,
        pattern=pattern,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        model=model,
        **method_options,
    )
    kv_method = build(capacity)
    if context and kv_method.absolute_positions and context > config.max_position_embeddings:
        raise DuoJaxError(
            f"context={context} is past the model's {config.max_position_embeddings} positions, which no sequence "
            f"can pass: its cache would be sized for tokens it never holds; pass context <= "
            f"{config.max_position_embeddings}"
        )
    if kv_method.max_tokens is not None and needed > kv_method.max_tokens:
        raise DuoJaxError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
            f"{kv_method.name} cache's capacity of {kv_method.max_tokens} tokens; build the method "
            "with a larger context or shorten the prompt"
        )
    if kv_method.absolute_positions and needed > config.max_position_embeddings:
        raise DuoJaxError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {needed} exceeds the "
            f"model's context of {config.max_position_embeddings} tokens; shorten the prompt, "
            "lower max_new_tokens, or use method='streaming_llm' (re-indexed positions)"
        )
    tail = check_number("prompt_tail_steps", prompt_tail_steps, integer=True, minimum=0)
    shortest = min(len(p) for p in ids)
    if tail and tail >= shortest:
        raise DuoJaxError(f"prompt_tail_steps must lie in [0, shortest prompt = {shortest}), got {prompt_tail_steps}")
    if tail and mesh is not None:
        raise DuoJaxError("prompt_tail_steps is not supported on a device mesh; pass mesh=None")
    room = kv_method.room_after_prompt
    if room is not None and max_new_tokens + tail > room:
        raise DuoJaxError(
            f"max_new_tokens ({max_new_tokens}) + prompt_tail_steps ({tail}) exceeds the {kv_method.name} cache's room "
            f"of {room} tokens after the prompt; build the method with room >= {max_new_tokens + tail} (or None: what "
            "the capacity leaves), or generate fewer tokens"
        )
    if mesh is not None:
        sharding.check_runs_on_a_mesh(kv_method)
    devices, dtype = devices_of(model.params, mesh), jnp.dtype(model.params.dtype).name
    apart = _rows_apart(kv_method, dtype)
    if mesh is not None and not apart:  # a shared page pool: no rows added, not even to split over data
        sharding.check_batch(mesh, len(ids))
    rows = _batch_rows(len(ids), mesh, bucketed=apart and bool(pad_batch))
    need = cache_device_bytes(kv_method, rows, dtype, mesh)
    exact = _on_mesh(round_capacity(needed), mesh)
    # The bucket's spare room does not fit the device: the request's own capacity may (one compile of its own). Not
    # where a kv_budget is fitted to the capacity (duo's sparsity): the tokens would depend on the memory free.
    fitted = (
        "kv_budget" in method_options
        and not isinstance(method, Method)
        and methods.entry(_method_name(method, pattern)).budget_fits_capacity
    )
    if context is None and exact < capacity and not fitted:
        if not device_memory.fits(need, devices):
            smaller = build(exact)
            if (smaller_need := cache_device_bytes(smaller, rows, dtype, mesh)) < need:
                capacity, kv_method, need = exact, smaller, smaller_need
    if rows > (least := _batch_rows(len(ids), mesh, bucketed=False)) and not device_memory.fits(need, devices):
        rows, need = least, cache_device_bytes(kv_method, least, dtype, mesh)  # the padding rows do not fit: none
    device_memory.check_fits(
        need,
        devices,
        f"the {kv_method.name} KV cache of {_sequences(len(ids), rows)} of {capacity} tokens",
        MEMORY_FIXES,
    )
    return GenerationPlan(
        ids=ids,
        batch=rows,
        method=kv_method,
        capacity=capacity,
        chunk=_prefill_chunk(kv_method, chunk_size, longest),
        tail_steps=tail,
        max_new_tokens=max_new_tokens,
        sampling=Sampling(float(temperature), float(top_p), int(top_k)),
        eos_ids=tuple(config.eos_token_ids) if stop_at_eos else (),
        impl=impl,
        mesh=mesh,
        device_cache_bytes=need,
    )


# What shrinks a generation's memory, for `duo_jax.device_memory`'s errors.
MEMORY_FIXES = (
    "generate fewer sequences at once, shorten the prompts or max_new_tokens (or pass a smaller context=), keep fewer "
    "tokens per head (pattern= with a higher sparsity, or a method with a kv_budget), store them as "
    "kv_dtype='int8' or 'int4', load the weights with weights='int8', or split the cache over devices (mesh=); "
    "`python -m duo_jax.plan --model NAME --hbm-gib G` finds the longest context that fits"
)


def _sequences(prompts: int, rows: int) -> str:
    """`prompts` sequences, and the rows they run as where padding adds some, for messages."""
    return f"{prompts} sequence(s)" + (f" (padded to {rows} rows)" if rows > prompts else "")


@functools.lru_cache(maxsize=256)  # per method spec: two cache_specs cost a warm call tens of ms
def _rows_apart(method: Method, dtype: str) -> bool:
    """Whether every array of `method`'s cache holds one row per sequence (batch first), so that padding rows can be
    added and their bytes told apart; a page pool shared by the sequences (`duo_jax.methods.paged`) cannot."""
    return all(
        all(leaf.shape[:1] == (batch,) for leaf in jax.tree.leaves(method.cache_spec(batch, dtype))) for batch in (2, 3)
    )


def _batch_rows(prompts: int, mesh: Mesh | None, *, bucketed: bool) -> int:
    """The rows a generation of `prompts` compiles: their batch bucket (`batch_bucket`) or, where that does not fit
    the device, their number; on a mesh either rounded up to a multiple of its `data` axis, which splits them."""
    rows = batch_bucket(prompts) if bucketed else prompts
    split = 1 if mesh is None else mesh.shape[sharding.DATA]
    return -(-rows // split) * split


def _on_mesh(capacity: int, mesh: Mesh | None) -> int:
    """`capacity` rounded up so that every `model` device of `mesh` holds a whole number of retrieval slots."""
    if mesh is None:
        return capacity
    multiple = math.lcm(CAPACITY_BLOCK, mesh.shape[sharding.MODEL])
    return -(-capacity // multiple) * multiple


def _prefill_chunk(method: Method, chunk_size: int, longest: int) -> int:
    """The prefill's chunk: `chunk_size`, or the bucket of the longest prompt where that is shorter; for duo with a
    `streaming_chunk` K that it exceeds, a multiple of K (its streaming heads see the chunk as chunks of K)."""
    chunk = min(chunk_size, bucket(longest))
    size = getattr(method, "streaming_chunk", None)
    if size is not None and chunk_size > size and chunk_size % size:  # whatever the prompts: a short one passed
        raise DuoJaxError(
            f"chunk_size ({chunk_size}) must be a multiple of duo's streaming_chunk ({size}), or at most it: its "
            f"streaming heads see each prefill chunk as chunks of {size}"
        )
    if size is None or chunk <= size:
        return chunk
    return -(-chunk // size) * size


def _check_method_options(options: dict) -> None:
    """Every keyword `generate` passes on to the method is some method's option: a name that is none (a typo, or an
    option of another library's generate, such as `stop`) is an error naming it, not one about the method."""
    known = set().union(*(methods.entry(name).options for name in methods.METHODS))
    unknown = sorted(set(options) - known)
    if unknown:
        raise DuoJaxError(
            f"generate() takes no option {', '.join(map(repr, unknown))}: neither one of its own nor a method's "
            "(duo_jax.methods.describe() lists those). It stops at the model's end-of-sequence tokens "
            "(stop_at_eos); stop strings are the server's (docs/serving.md)."
        )


def _deprecated_impl(impl: str, options: dict) -> str:
    """`impl`, or the value passed under its old name `attention_impl` (kept one release, with a warning)."""
    if "attention_impl" not in options:
        return impl
    # stacklevel 4: _deprecated_impl <- plan_generation <- generate <- the caller
    warnings.warn("generate(attention_impl=) is renamed generate(impl=)", DeprecationWarning, stacklevel=4)
    return options.pop("attention_impl")


def run_generation(model: Model, engine: Engine, plan: GenerationPlan, *, seed=0) -> Generation:
    """Run `plan` (from `plan_generation`) on `engine` (the engine of `model`'s weights, on the plan's mesh):
    compile the shapes it needs, prefill, then decode every new token in one device loop. Running out of device
    memory raises `DeviceMemoryError` naming the plan's cache and what shrinks it."""
    if not engine.serves(model.params, model.config, plan.mesh):
        raise DuoJaxError(
            "engine= was built from other weights, another config or another mesh than this call's; build it "
            "with Engine(model.params, model.config, mesh) (Engine.of(model, mesh)) or leave engine=None"
        )
    what = (
        f"generating {_sequences(len(plan.ids), plan.batch)} with a {plan.method.name} KV cache of "
        f"{plan.capacity} tokens ({device_memory.gib(plan.device_cache_bytes)} per device)"
    )
    with device_memory.explain_out_of_memory(what, MEMORY_FIXES):
        return _run(model, engine, plan, seed)


def compile_steps(engine: Engine, plan: GenerationPlan) -> None:
    """Compile the engine's steps `run_generation` runs for `plan` on `engine`: the prefill chunk's, the prompt
    tail's and the decode loop, with the method decoding continues with (`Method.decode_method`, known before the
    prefill). Each shape compiles once per process, whichever thread asks first (the engine's caches); so a caller
    that knows its next requests can compile them in a background thread while the device runs the current one.
    The small programs around them (an empty cache, SnapKV's compression after the prefill, the first token's
    argmax) still compile on their first use."""
    kv_method, B, mesh = plan.method, plan.batch, plan.mesh
    config, dtype, layout = engine.config, engine.dtype, engine.weight_layout
    compiled_extend(config, kv_method, B, plan.chunk, dtype, plan.impl, False, mesh, **layout)
    rows = [len(p) - plan.tail_steps for p in _batch_ids(plan)]
    decoding = kv_method.decode_method(max(rows), rows)
    if plan.tail_steps:  # the prompt's last tokens step the method decoding continues with
        compiled_extend(config, decoding, B, 1, dtype, plan.impl, False, mesh, **layout)
    greedy, buffer = plan.sampling.greedy, bucket(plan.max_new_tokens)
    compiled_decode(config, decoding, B, dtype, plan.impl, greedy, buffer, plan.eos_ids, mesh, **layout)


def _batch_ids(plan: GenerationPlan) -> list[list[int]]:
    """The prompts of each row the plan runs: its prompts, then copies of the shortest up to `plan.batch` (a
    padding row costs a prefill of the shortest prompt and starts its decode finished, `_finished`)."""
    shortest = min(plan.ids, key=len)
    return plan.ids + [shortest] * (plan.batch - len(plan.ids))


@jax.jit
def _finished(token: jax.Array, prompts: jax.Array, eos: jax.Array) -> jax.Array:
    """`token` with the padding rows' (those from `prompts` on) set to `eos`, so the decode loop counts them done."""
    return jnp.where(jnp.arange(token.shape[0]) < prompts, token, eos)


def host_array(x: jax.Array) -> np.ndarray:
    """x whole on this host; on a mesh spanning processes (whose `data` axis may split the batch between hosts)
    through an all-gather, which every process runs in the same order, as it runs the whole of `generate`."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _run(model: Model, engine: Engine, plan: GenerationPlan, seed) -> Generation:
    config, kv_method, impl, mesh = model.config, plan.method, plan.impl, plan.mesh
    ids, chunk, tail = _batch_ids(plan), plan.chunk, plan.tail_steps
    B, prompts, longest = plan.batch, len(plan.ids), max(len(p) for p in ids)
    padded = np.zeros((B, longest), np.int32)
    for b, p in enumerate(ids):
        padded[b, : len(p)] = p
    prompt_lengths = np.array([len(p) for p in ids], np.int32)
    seeds = row_seeds(seed, prompts)
    seeds = np.concatenate([seeds, np.repeat(seeds[:1], B - prompts)])

    start = time.perf_counter()
    compile_steps(engine, plan)
    compile_s = time.perf_counter() - start

    start = time.perf_counter()
    last_logits, cache, lengths = engine.prefill(kv_method, padded, prompt_lengths - tail, chunk=chunk, impl=impl)
    kv_method, cache = kv_method.after_prefill(cache, lengths)
    for i in range(tail):  # the prompt's last tokens, one decode step each
        column = np.array([p[len(p) - tail + i] for p in ids], np.int32)
        last_logits, cache, lengths = engine.step(kv_method, cache, lengths, column, impl=impl)
    if plan.sampling.greedy:
        token = _argmax(last_logits)
    else:
        token = sample_seeded(last_logits, *engine.put_batch((seeds, np.zeros(B, np.int32))), plan.sampling.rows(B))
    if B > prompts and plan.eos_ids:
        token = _finished(token, np.int32(prompts), np.int32(plan.eos_ids[0]))
    token.block_until_ready()
    prefill_s = time.perf_counter() - start

    start = time.perf_counter()
    tokens, steps, cache, lengths = engine.decode_loop(
        kv_method,
        cache,
        lengths,
        token,
        seeds,
        max_new_tokens=plan.max_new_tokens,
        sampling=plan.sampling,
        eos_ids=plan.eos_ids,
        impl=impl,
    )
    steps = int(steps)  # the one host sync of the decode
    generated = host_array(tokens)[:prompts, : steps + 1]  # [prompts, N]: the padding rows dropped
    decode_s = time.perf_counter() - start

    out = []
    for row in generated.tolist():
        hits = [i for i, t in enumerate(row) if t in plan.eos_ids]
        out.append(row[: hits[0] + 1] if hits else row)
    text = None
    if model.tokenizer is not None:
        text = [generated_text(model.tokenizer.decode, prompt, row) for prompt, row in zip(plan.ids, out)]
    bytes_per_elem = jnp.dtype(model.params.dtype).itemsize
    # the prompts' own: every cache array holds one row per sequence where padding rows were added (`_rows_apart`)
    stats = dict(
        method=kv_method.name,
        prompt_tokens=[len(p) for p in plan.ids],
        batch_rows=B,
        compile_s=compile_s,
        prefill_s=prefill_s,
        decode_s=decode_s,
        decode_steps=steps,
        decode_tokens_per_s=prompts * steps / decode_s if steps else float("nan"),
        cache_bytes=cache_nbytes(cache) * prompts // B,
        expected_cache_bytes=kv_method.expected_cache_bytes(prompts, bytes_per_elem),
        full_cache_bytes=full_cache_bytes(config, prompts, plan.capacity, bytes_per_elem),
        chunk_size=chunk,
    )
    if mesh is not None:  # what one device holds, from the arrays' shardings
        stats.update(
            mesh=sharding.format_mesh(mesh),
            device_weight_bytes=sharding.device_bytes(engine.params),
            device_cache_bytes=sharding.device_bytes(cache),
        )
    stats.update(kv_method.stats())
    return Generation(out, text, stats)


def generate(
    model: Model,
    prompts,
    *,
    method: str | Method | None = None,
    pattern: Pattern | str | None = None,
    sparsity: float | None = None,
    sink: int | None = None,
    recent: int | None = None,
    max_new_tokens: int = 128,
    chunk_size: int = 512,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | Sequence[int] = 0,
    stop_at_eos: bool = True,
    context: int | None = None,
    impl: str = "auto",
    chat: bool | None = None,
    kv_dtype: str | None = None,
    mesh: Mesh | None = None,
    prompt_tail_steps: int = 0,
    pad_batch: bool = True,
    engine: Engine | None = None,
    **method_options,
) -> Generation:
    """Generate from one or many prompts with a KV-cache method (DuoAttention by default when given a pattern).

    prompts: a string, a list of strings, a list of token ids, or a list of such lists (lengths may differ);
    an integer array (1-D: one prompt, 2-D: a batch); or a conversation (a list of {"role", "content"}
    messages), or a list of conversations. Anything else (None, float ids) is an error. A batch runs as a batch
    bucket (`duo_jax.engine.batch_bucket`: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, ...), so varied batch sizes share
    executables: the rows past the prompts repeat the shortest prompt, start their decode finished (with
    stop_at_eos=False every row runs to max_new_tokens) and are dropped. stats["batch_rows"] counts the rows run;
    the other statistics are the prompts' (the padding's cache is reserved as well, or no row is added where it
    would not fit the device; a shared page pool is never padded). pad_batch=False: exactly the prompts' rows (on a
    mesh, up to a multiple of `data`), for a caller whose batch size never varies, to whom padding is work without
    reuse.
    chat: None (default): conversations get the model's chat template (`duo_jax.chat`), a plain string is
    completion text, as in Hugging Face's text-generation pipeline and vLLM; True: plain strings are wrapped
    too (each one user message); False: no template (conversations are then an error). Token ids are never
    wrapped (in a batch with texts they pass as they are; chat=True with token ids alone, nothing to wrap, is an
    error).
    method: a name of `duo_jax.methods.METHODS` (`duo_jax.methods.describe()` lists them), or a built `Method`;
    None: "duo" when a pattern is given, else "full".
    method_options: that method's options (kv_budget, scores, window, ...; see `duo_jax.methods.make_method`).
    pattern: a `Pattern`, a path to one, or "default" (the model's own); binarised at `sparsity` (the
    fraction of streaming heads; 1 is StreamingLLM with absolute positions; None: 0.5, or for duo with a
    `kv_budget` the sparsity that meets it). A method without a head pattern refuses a sparsity.
    sink / recent: streaming heads keep the first `sink` and the last `recent` tokens (duo: 64 / 256;
    streaming_llm: 4 / 256). chunk_size: prompt tokens per prefill step. context: retrieval capacity in
    tokens, rounded up to duo_jax.cache.CAPACITY_BLOCK (default: longest prompt + max_new_tokens rounded up
    to a capacity bucket shared by varied requests, `duo_jax.cache.capacity_bucket`, which states its bound).
    impl: the attention implementation, "auto" | "pallas" | "cudnn" | "mosaic" | "cpu" | "xla" | "reference"
    (`duo_jax.attention.IMPLS`, docs/attention.md); `attention_impl=` is its deprecated name.
    kv_dtype: None or the model's dtype name (the cache in the model's dtype), "int8" or "int4" (quantized per
    token and head, `duo_jax.quant`; the methods of `duo_jax.methods.QUANTIZED_KV_METHODS`).
    mesh: a ("data", "model") mesh (`duo_jax.sharding.make_generation_mesh`): prompts split over `data` (padded
    to a multiple of it), weights tensor-parallel over `model`, the retrieval cache's capacity
    split over `model` (docs/training.md, "The generation mesh"); methods "full" and "duo" only. Each device's
    retrieval attention returns its log-sum-exp for the merge across devices: decode steps on a GPU run the Pallas
    split-K kernel, prefill chunks and every step on a TPU the blocked XLA path. A mesh from
    `jax.make_mesh` works as well, its axes Explicit or Auto (run as Auto: `sharding.auto_axes`).
    prompt_tail_steps: the last N tokens of every prompt go through decode steps one at a time (the method
    compresses after the prefill of the rest and at every step, as while generating) instead of the prefill:
    DuoAttention's appendix protocol for H2O and TOVA (N = 50). Every prompt needs more than N tokens.
    temperature / top_p / top_k: sampling (temperature 0: greedy); their values are runtime arguments of the compiled
    loop (a new value compiles nothing). seed: an int (row b draws with seed + b mod 2**32, so each row's tokens are
    those it gets alone with that seed, whatever else is in the batch) or one seed per prompt, each in [0, 2**32).
    engine: the `Engine` to run on, built and held by the caller (`Engine(model.params, model.config, mesh)`);
    None: `Engine.of(model, mesh)`, which keeps an engine holding a copy of the weights while they live.

    `generate` is `plan_generation` (checks and planning), then `run_generation` (the device work).
    """
    plan = plan_generation(
        model,
        prompts,
        method=method,
        pattern=pattern,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        max_new_tokens=max_new_tokens,
        chunk_size=chunk_size,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop_at_eos=stop_at_eos,
        context=context,
        impl=impl,
        chat=chat,
        kv_dtype=kv_dtype,
        mesh=mesh,
        prompt_tail_steps=prompt_tail_steps,
        pad_batch=pad_batch,
        **method_options,
    )
    start = time.perf_counter()
    if engine is None:
        # the engine's copy of the weights (fused q/k/v on a GPU, stacked weights, a mesh), made on their first use
        with device_memory.explain_out_of_memory("copying the weights for the engine", MEMORY_FIXES):
            engine = Engine.of(model, plan.mesh)
    prepare_s = time.perf_counter() - start
    out = run_generation(model, engine, plan, seed=seed)
    out.stats = dict(prepare_s=prepare_s, **out.stats)
    return out
