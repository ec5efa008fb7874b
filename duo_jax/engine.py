"""The engine: a model's weights in the steps' layout, and the compiled steps every KV-cache method runs on them.

`extend` runs T new tokens per sequence through the model, the method (`duo_jax.methods`) attending them to its
cache layer by layer (layers unrolled: a method's per-layer caches may differ in shape); `extend_row` does it for
one row of a batched cache; `decode` is a `lax.while_loop` of `extend` steps with sampling and EOS inside, one
compiled call per generation. `Engine` holds the weights in the layout the steps take and `prefill`, the one
chunked-prefill driver. Executables are compiled per shape bucket (`compiled_extend`, `compiled_extend_row`,
`compiled_decode`); weights and method state are arguments, never constants. Design: docs/engine.md.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from duo_jax import sharding
from duo_jax.cache import half_octave_bucket
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.locks import lru_cache_once
from duo_jax.methods.base import Method, Step
from duo_jax.model import (
    Params,
    building,
    decoder_layer,
    embed,
    fuse_qkv,
    param_shapes,
    quantize_weights,
    rope_inv_freq,
    rotary,
    unembed,
    unstack_layers,
    weight_format,
)
from duo_jax.sampling import Sampling, argmax_tokens, check_number, row_keys, row_seeds, sample_rows


def bucket(n: int) -> int:
    """The compiled size for n: the next power of two >= max(n, 16). Prefill chunks and the decode loop's token
    buffer come in these sizes, so varied prompt lengths and max_new_tokens reuse executables."""
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def batch_bucket(rows: int) -> int:
    """The compiled batch for `rows` sequences: the smaller of `half_octave_bucket(rows)` and the next multiple
    of 8 (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40, ...), so that varied batch sizes reuse executables; `generate` pads
    with copies of its shortest prompt, at most a third more rows up to 16 and at most 7 past it."""
    return min(half_octave_bucket(rows), -(-max(rows, 1) // 8) * 8)


class _CacheLayout(NamedTuple):
    """`method.cache_spec(batch, dtype)` flattened, for `_check_cache`."""

    treedef: Any
    leaves: tuple  # (shape, dtype) per leaf
    paths: tuple[str, ...]  # each leaf's path, as cache[0].retrieval_k
    free: tuple  # per leaf, the axes a row view (`Method.take_row`) sizes by the whole batch, not by its one row
    summary: str  # what the cache holds, for messages


@functools.lru_cache(maxsize=64)
def _cache_layout(method: Method, batch: int, dtype: str) -> _CacheLayout:
    spec = method.cache_spec(batch, dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(spec)
    leaves = tuple((tuple(x.shape), jnp.dtype(x.dtype)) for _, x in flat)
    free = ((),) * len(leaves)
    if batch == 1 and type(method).take_row is not Method.take_row:
        # A row of a batched cache keeps whole what all rows share (a paged cache's pools, sized by the batch).
        view = jax.tree.leaves(jax.eval_shape(lambda c: method.take_row(c, 0), method.cache_spec(2, dtype)))
        if len(view) == len(leaves):
            free = tuple(
                tuple(i for i, (a, b) in enumerate(zip(shape, v.shape)) if a != b)
                for (shape, _), v in zip(leaves, view)
            )
    paths = tuple("cache" + jax.tree_util.keystr(path) for path, _ in flat)
    return _CacheLayout(treedef, leaves, paths, free, _cache_summary(spec))


def _cache_summary(cache) -> str:
    """What a cache holds, in a few words: "a PagedCache", "a tuple of 2 DuoLayerCache"."""
    if isinstance(cache, (tuple, list)):
        kinds = sorted({type(layer).__name__ for layer in cache})
        return f"a {type(cache).__name__} of {len(cache)} {' / '.join(kinds) or 'entries'}"
    return f"a {type(cache).__name__}"


def _check_cache(method: Method, cache, batch: int) -> None:
    """Refuse a cache that is not `method`'s for `batch` sequences (another method's, capacity, window or batch
    size), naming what differs. From the pytree's structure, shapes and dtypes only: runs at trace time inside a
    jit, costs a flatten and a comparison eagerly (the expected layouts are cached). Passes a cache built in any
    float dtype, and a batch-1 row view of a paged cache (`extend_row`)."""
    leaves, treedef = jax.tree.flatten(cache)
    got = tuple((tuple(getattr(x, "shape", ())), jnp.dtype(getattr(x, "dtype", type(x)))) for x in leaves)
    # The dtype it was built in: one of its float leaves', else a usual one (a quantized cache's shows only in its
    # pytree's metadata).
    floats = [d.name for _, d in got if jnp.issubdtype(d, jnp.floating)]
    problem = None
    for dtype in dict.fromkeys([*floats, "float32", "bfloat16", "float16"]):
        want = _cache_layout(method, batch, dtype)
        if treedef != want.treedef:
            continue
        if got == want.leaves:
            return
        for (shape, kind), (expected, expected_kind), path, free in zip(got, want.leaves, want.paths, want.free):
            if kind != expected_kind or not (
                len(shape) == len(expected)
                and all(a == b or i in free for i, (a, b) in enumerate(zip(shape, expected)))
            ):
                problem = (
                    problem
                    or f"{path} is {kind.name}{list(shape)}, the method's is {expected_kind.name}{list(expected)}"
                )
                break
        else:
            return  # a row view
    fix = (
        f"; it was built for another method, capacity, window or batch size: build it with "
        f"engine.init_cache(method, {batch}) (or method.init_cache({batch}, dtype)) for the method and batch you "
        "step"
    )
    if problem is not None:
        raise DuoJaxError(f"the cache does not fit method {method.name!r} at batch {batch}: {problem}{fix}")
    held, summary = _cache_summary(cache), _cache_layout(method, batch, "float32").summary
    if held == summary:
        held += " of other fields (e.g. quantized where the method's is not, or the reverse)"
    raise DuoJaxError(f"the cache does not fit method {method.name!r}: it holds {held}, the method's {summary}{fix}")


def _check_token_ids(tokens, name: str, ndim: int) -> None:
    """Refuse token ids that are not an integer array of `ndim` dimensions (a float array would be truncated onto
    other tokens, a bool one read as ids 0 and 1). Static: dtype and shape only."""
    if hasattr(tokens, "dtype") and jnp.issubdtype(tokens.dtype, jnp.integer) and jnp.ndim(tokens) == ndim:
        return
    got = f"{jnp.dtype(tokens.dtype).name}{list(tokens.shape)}" if hasattr(tokens, "dtype") else type(tokens).__name__
    raise DuoJaxError(
        f"{name} must be an integer array of token ids {'[B]' if ndim == 1 else '[B, T]'}, got {got}: pass the ids "
        "as one (e.g. jnp.asarray(ids, jnp.int32)); a float or bool array is not cast"
    )


def _check_max_tokens(max_tokens, name: str) -> None:
    """Refuse a token buffer of no column: column 0 holds the first token, so at least 1."""
    check_number(
        name,
        max_tokens,
        integer=True,
        minimum=1,
        hint=" (the first new token counts; to generate nothing, skip the decode)",
    )


@functools.partial(
    jax.jit, static_argnames=("config", "method", "all_logits", "impl", "mesh"), donate_argnames=("cache",)
)
def extend(
    params: Params,
    cache,
    lengths: jax.Array,
    tokens: jax.Array,
    n_valid: jax.Array,
    state=None,
    *,
    config: ModelConfig,
    method: Method,
    all_logits: bool = False,
    impl: str = "auto",
    mesh: Mesh | None = None,
):
    """Feed tokens [B, T] at positions lengths[b] + t, of which the first n_valid[b] are real (rest padding).

    `params` have per-layer layers (`duo_jax.model.unstack_layers`; an `Engine`'s `.params`); `cache` from
    `method.init_cache`; `state` is the method's arrays (`method.state()`, e.g. InfiniGen's skew matrices;
    None for most methods).
    Returns (logits, cache, lengths): logits float32 [B, V] at each sequence's last real token ([B, T, V] for
    every token when all_logits), the updated cache, and lengths + n_valid. Traced values are the caller's to
    keep in range (nothing inside a jit can raise on them): 0 <= n_valid <= T, lengths + n_valid within the
    method's capacity (past it, writes clamp onto the last slots, as JAX indexing does), token ids below the
    vocabulary; `generate` and `Engine`'s host calls plan within them. `impl`: one of
    `duo_jax.attention.IMPLS`, "auto" resolved per backend (`resolve_impl`; docs/attention.md). `mesh`: a
    generation mesh (`duo_jax.sharding`) that params and cache are laid out on (`Engine` places them), or None.
    What can be checked from shapes is, at trace time: integer tokens, lengths and n_valid [B], and a cache that is
    `method`'s for B sequences (DuoJaxError naming what differs).
    """
    if not isinstance(params.layers, tuple):
        raise DuoJaxError(
            "the engine's steps take per-layer weights: pass an Engine's .params, or "
            "duo_jax.model.unstack_layers(params), or load with layout='per_layer' (the default)"
        )
    if not isinstance(method, Method):  # a name reached begin_step as an AttributeError
        raise DuoJaxError(
            f"method must be a built Method, got {type(method).__name__} {method!r:.40}: build it with "
            "duo_jax.methods.make_method(name, config, context=...)"
        )
    _check_token_ids(tokens, "tokens", 2)
    B, T = tokens.shape
    for name, x in (("lengths", lengths), ("n_valid", n_valid)):
        if list(jnp.shape(x)) != [B] or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            raise DuoJaxError(
                f"{name} must be integers [B] = [{B}] (one per row of tokens), got "
                f"{jnp.result_type(x).name}{list(jnp.shape(x))}"
            )
    _check_cache(method, cache, B)
    positions, inv_freq = lengths[:, None] + jnp.arange(T, dtype=jnp.int32), rope_inv_freq(config)
    step = Step(
        positions=positions,
        valid=jnp.arange(T)[None, :] < n_valid[:, None],
        lengths=lengths,
        new_lengths=lengths + n_valid,
        inv_freq=inv_freq,
        rope=rotary(positions, inv_freq),
        impl=impl,
        state=state,
        mesh=mesh,
    )
    shared = method.begin_step(step)

    x = embed(params, tokens)  # [B, T, D]
    layer_caches = method.layer_caches(cache)
    new_cache = []
    previous = [None]  # the attention input of the layer before (`Method.prepare`)
    for l, layer in enumerate(params.layers):

        def attend(q, k, v, h, l=l, layer=layer):
            extra = method.prepare(l, q, previous[0], layer, config, step)  # the method's per-layer hook
            previous[0] = h
            if mesh is not None:  # heads stay where the tensor-parallel projections put them (see sharding)
                q, k, v = (sharding.split_heads_over_model(a, mesh) for a in (q, k, v))
            layer_step = dataclasses.replace(step, sliding_window=config.layer_window(l))  # this layer's window
            out, layer_cache = method.attend(l, q, k, v, layer_caches[l], layer_step, shared, **extra)
            return (out if mesh is None else sharding.split_heads_over_model(out, mesh)), layer_cache

        x, layer_cache = decoder_layer(x, layer, config, attend)
        new_cache.append(layer_cache)

    if not all_logits:
        last = jnp.maximum(n_valid - 1, 0)
        x = jnp.take_along_axis(x, last[:, None, None], axis=1)  # [B, 1, D]
    logits = unembed(params, config, x)
    new_cache, new_lengths = method.with_layer_caches(cache, tuple(new_cache)), step.new_lengths
    if mesh is not None:  # the layout the next step is compiled for
        layout = sharding.named(sharding.cache_specs(method, new_cache, mesh), mesh)
        new_cache = jax.lax.with_sharding_constraint(new_cache, layout)
        new_lengths = jax.lax.with_sharding_constraint(new_lengths, NamedSharding(mesh, P(sharding.DATA)))
    return (logits if all_logits else logits[:, 0]), new_cache, new_lengths


@functools.partial(jax.jit, static_argnames=("config", "method", "impl"), donate_argnames=("cache",))
def extend_row(
    params: Params,
    cache,
    row: jax.Array,
    lengths: jax.Array,
    tokens: jax.Array,
    n_valid: jax.Array,
    state=None,
    *,
    config: ModelConfig,
    method: Method,
    impl: str = "auto",
):
    """`extend` for one sequence of a batched cache: tokens [1, T] and n_valid [1] fed to sequence `row` (an
    int32 scalar, an argument: one executable serves every row) of `cache` [B, ...] at lengths[row].

    The method cuts the row out (`method.take_row`: a paged cache's per-sequence parts, its page pools whole)
    and puts it back (`method.put_row`); with the cache donated, the pools are updated in place, not copied.
    This is how a scheduler prefills one sequence while the batch's other rows wait (`duo_jax.serve`).
    Returns (logits float32 [1, V], the cache, lengths with lengths[row] + n_valid[0]); other rows unchanged.
    """
    _check_cache(method, cache, lengths.shape[0])  # the batched cache; `extend` checks the row it is given
    part = method.take_row(cache, row)
    length = jax.lax.dynamic_slice_in_dim(lengths, row, 1)
    logits, part, length = extend(params, part, length, tokens, n_valid, state, config=config, method=method, impl=impl)
    return logits, method.put_row(cache, row, part), jax.lax.dynamic_update_slice_in_dim(lengths, length, row, 0)


@functools.partial(
    jax.jit,
    static_argnames=("config", "method", "greedy", "max_tokens", "eos_ids", "impl", "mesh"),
    donate_argnames=("cache",),
)
def decode(
    params: Params,
    cache,
    lengths: jax.Array,
    token: jax.Array,
    seeds: jax.Array,
    limit: jax.Array,
    rule: Sampling,
    state=None,
    *,
    config: ModelConfig,
    method: Method,
    greedy: bool,
    max_tokens: int,
    eos_ids: tuple[int, ...] = (),
    impl: str = "auto",
    mesh: Mesh | None = None,
):
    """Decode on the device: one `lax.while_loop` of `extend` steps with sampling inside, no host round trip.

    `token` int32 [B] is each sequence's first new token (sampled from the prefill's logits); the loop runs
    up to `limit` (int32 scalar, capped at max_tokens - 1) more steps and stops early once every sequence has
    produced one of `eos_ids` (() never stops early). `greedy` (static): argmax; else row b's token of output
    column i >= 1 is drawn by `rule` (a `Sampling` of arrays [B], runtime values) with `fold_in(key(seeds[b]), i)`
    (`duo_jax.sampling.sample_seeded`; seeds uint32 [B]), as `generate` draws `token` (column 0) with position 0. A
    pure function of its arguments (`state`: the method's arrays, `method.state()`): put it under your own
    `jax.jit` as it is.

    Returns (tokens int32 [B, max_tokens]: column 0 is `token`, columns 1..steps the new ones, zeros after;
    steps int32 scalar; the cache; lengths). Checked at trace time: an integer `token` [B], max_tokens >= 1, a cache
    that is `method`'s for B sequences and (sampling) a rule of arrays [B] (DuoJaxError naming what differs).
    """
    _check_token_ids(token, "token", 1)
    _check_max_tokens(max_tokens, "max_tokens")
    B = token.shape[0]
    _check_cache(method, cache, B)
    eos = jnp.asarray(eos_ids or (-1,), jnp.int32)
    ones = jnp.ones((B,), jnp.int32)
    limit = jnp.minimum(limit, max_tokens - 1)  # a larger one overwrote the buffer's last column each extra step

    def running(carry):
        step, _, _, _, done, _ = carry
        return (step < limit) & ~jnp.all(done)

    def step_once(carry):
        step, cache, lengths, token, done, tokens = carry
        logits, cache, lengths = extend(
            params, cache, lengths, token[:, None], ones, state, config=config, method=method, impl=impl, mesh=mesh
        )
        if greedy:
            token = argmax_tokens(logits)
        else:
            token = sample_rows(logits, row_keys(seeds, step + 1), rule)
        tokens = jax.lax.dynamic_update_slice_in_dim(tokens, token[:, None], step + 1, axis=1)
        return step + 1, cache, lengths, token, done | jnp.isin(token, eos), tokens

    tokens = jnp.zeros((B, max_tokens), jnp.int32).at[:, 0].set(token)
    carry = (jnp.zeros((), jnp.int32), cache, lengths, token, jnp.isin(token, eos), tokens)
    steps, cache, lengths, _, _, tokens = jax.lax.while_loop(running, step_once, carry)
    return tokens, steps, cache, lengths


def abstract_params(
    config: ModelConfig,
    dtype: str,
    mesh: Mesh | None = None,
    weight_format: str | None = None,
    fused_qkv: bool = False,
) -> Params:
    """The engine's weights as `ShapeDtypeStruct`s in their format (`weight_format`: None or "int8",
    `duo_jax.model.quantize_weights`; q/k/v as one weight when `fused_qkv`), with their tensor-parallel
    shardings on `mesh`."""
    stacked = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)
    )
    params = jax.eval_shape(lambda p: prepared(quantize_weights(p, weight_format), fused_qkv), stacked)
    return params if mesh is None else sharding.abstract(params, sharding.tensor_parallel_specs(params, mesh), mesh)


def fuses_qkv_by_default(mesh: Mesh | None = None) -> bool:
    """Whether an `Engine` holds q/k/v as one weight unless told: on a GPU, off a mesh (docs/engine.md, "Fused
    q/k/v")."""
    return mesh is None and jax.default_backend() == "gpu"


def prepared(params: Params, fused_qkv: bool) -> Params:
    """`params` in the layout the steps take: per-layer (`unstack_layers`), q/k/v as one weight when
    `fused_qkv` (`duo_jax.model.fuse_qkv`)."""
    params = unstack_layers(params)
    if not fused_qkv:
        return params
    return dataclasses.replace(params, layers=tuple(fuse_qkv(layer) for layer in params.layers))


def _abstract_inputs(method: Method, batch: int, dtype: str, mesh: Mesh | None, *shapes):
    """What a step is compiled for besides the weights: the cache, then an int32 array per shape in `shapes`
    (leading dimension: the batch, split over `data` on a mesh), then the method's state."""
    cache = method.cache_spec(batch, dtype)
    if mesh is not None:
        cache = sharding.abstract(cache, sharding.cache_specs(method, cache, mesh), mesh)
    return cache, *(_abstract_batch(shape, jnp.int32, mesh) for shape in shapes), _abstract(method.state())


def _abstract_batch(shape: tuple[int, ...], dtype, mesh: Mesh | None) -> jax.ShapeDtypeStruct:
    """Per-sequence values of `shape` (leading dimension: the batch) and `dtype`, split over `data` on a mesh."""
    x = jax.ShapeDtypeStruct(shape, dtype)
    return x if mesh is None else sharding.abstract(x, P(sharding.DATA), mesh)


def _renamed_weights(weight_format: str | None, renamed: dict) -> str | None:
    """`weight_format`, or the value passed under its old name `weights` (kept one release, with a warning)."""
    if set(renamed) - {"weights"}:
        raise TypeError(f"unexpected keyword arguments {', '.join(sorted(set(renamed) - {'weights'}))}")
    if "weights" not in renamed:
        return weight_format
    warnings.warn("the compiled steps' weights= is renamed weight_format=", DeprecationWarning, stacklevel=3)
    return renamed["weights"]


def _lowered_alone(jitted, args: tuple, **static):
    """`jitted.lower(*args, **static)` through a function object of its own (the static arguments bound; the cache
    donated, as `jitted` donates it). JAX's trace and lowering caches key weakly on the function, so they let go of
    this executable once the engine's cache drops it; lowered through the module's `jitted`, which never dies,
    they kept every executable the engine ever compiled."""
    alone = jax.jit(functools.partial(jitted.__wrapped__, **static), donate_argnames=("cache",))
    return alone.lower(*args)


def compiled_extend(
    config: ModelConfig,
    method: Method,
    batch: int,
    chunk: int,
    dtype: str,
    impl: str = "auto",
    all_logits: bool = False,
    mesh: Mesh | None = None,
    weight_format: str | None = None,
    fused_qkv: bool = False,
    **renamed,
):
    """`extend` compiled once per shape: later calls cannot recompile, however long the sequence grows. `method`
    is a spec (hashable; its arrays are the `state` argument), so methods differing only in state share it.
    However the arguments are passed (by position or keyword), one shape is one executable."""
    weight_format = _renamed_weights(weight_format, renamed)
    return _compiled_extend(config, method, batch, chunk, dtype, impl, all_logits, mesh, weight_format, fused_qkv)


@lru_cache_once(64)
def _compiled_extend(config, method, batch, chunk, dtype, impl, all_logits, mesh, weight_format, fused_qkv):
    _make_room_for_an_executable()
    cache, lengths, tokens, n_valid, state = _abstract_inputs(
        method, batch, dtype, mesh, (batch,), (batch, chunk), (batch,)
    )
    params = abstract_params(config, dtype, mesh, weight_format, fused_qkv)
    return _lowered_alone(
        extend,
        (params, cache, lengths, tokens, n_valid, state),
        config=config,
        method=method,
        all_logits=all_logits,
        impl=impl,
        mesh=mesh,
    ).compile()


compiled_extend.cache_clear = _compiled_extend.cache_clear


def compiled_extend_row(
    config: ModelConfig,
    method: Method,
    batch: int,
    chunk: int,
    dtype: str,
    impl: str = "auto",
    weight_format: str | None = None,
    fused_qkv: bool = False,
    **renamed,
):
    """`extend_row` compiled once per (batch, chunk): the row is an argument, never a recompile. One device only.
    A method without rows (`Method.take_row`'s default: every one but the paged ones) raises DuoJaxError."""
    weight_format = _renamed_weights(weight_format, renamed)
    return _compiled_extend_row(config, method, batch, chunk, dtype, impl, weight_format, fused_qkv)


@lru_cache_once(16)
def _compiled_extend_row(config, method, batch, chunk, dtype, impl, weight_format, fused_qkv):
    _make_room_for_an_executable()
    cache, lengths, tokens, n_valid, state = _abstract_inputs(method, batch, dtype, None, (batch,), (1, chunk), (1,))
    row = jax.ShapeDtypeStruct((), jnp.int32)
    params = abstract_params(config, dtype, None, weight_format, fused_qkv)
    return _lowered_alone(
        extend_row, (params, cache, row, lengths, tokens, n_valid, state), config=config, method=method, impl=impl
    ).compile()


def compiled_decode(
    config: ModelConfig,
    method: Method,
    batch: int,
    dtype: str,
    impl: str,
    greedy: bool,
    max_tokens: int,
    eos_ids: tuple[int, ...],
    mesh: Mesh | None = None,
    weight_format: str | None = None,
    fused_qkv: bool = False,
    **renamed,
):
    """`decode` compiled once per (batch, token buffer size, greedy or not); the step limit, the seeds and the
    sampling values are arguments (a new temperature compiles nothing)."""
    weight_format = _renamed_weights(weight_format, renamed)
    return _compiled_decode(
        config, method, batch, dtype, impl, bool(greedy), max_tokens, tuple(eos_ids), mesh, weight_format, fused_qkv
    )


@lru_cache_once(32)
def _compiled_decode(config, method, batch, dtype, impl, greedy, max_tokens, eos_ids, mesh, weight_format, fused_qkv):
    _make_room_for_an_executable()
    cache, lengths, token, state = _abstract_inputs(method, batch, dtype, mesh, (batch,), (batch,))
    rows = lambda dtype: _abstract_batch((batch,), dtype, mesh)  # noqa: E731
    seeds, rule = rows(jnp.uint32), Sampling(rows(jnp.float32), rows(jnp.float32), rows(jnp.int32))
    limit = jax.ShapeDtypeStruct((), jnp.int32)
    if mesh is not None:
        limit = sharding.abstract(limit, P(), mesh)
    params = abstract_params(config, dtype, mesh, weight_format, fused_qkv)
    return _lowered_alone(
        decode,
        (params, cache, lengths, token, seeds, limit, rule, state),
        config=config,
        method=method,
        greedy=greedy,
        max_tokens=max_tokens,
        eos_ids=eos_ids,
        impl=impl,
        mesh=mesh,
    ).compile()


@lru_cache_once(64)
def _empty_cache(method: Method, batch: int, dtype, mesh: Mesh | None):
    """`method.init_cache` as one program, compiled once per (method, batch): the zeros are written on the device
    (one program, not an op per array, and no value transferred from the host), on a mesh in place."""
    _make_room_for_an_executable()
    if mesh is None:
        return jax.jit(lambda: method.init_cache(batch, dtype))
    sharding.check_batch(mesh, batch)
    specs = sharding.cache_specs(method, method.cache_spec(batch, dtype), mesh)
    return jax.jit(lambda: method.init_cache(batch, dtype), out_shardings=sharding.named(specs, mesh))


def devices_of(params: Params, mesh: Mesh | None) -> list:
    """The devices a generation on `params` (over `mesh`) uses: the mesh's, or those holding the weights."""
    if mesh is not None:
        return list(mesh.devices.flat)
    leaf = jax.tree.leaves(params)[0]
    return list(leaf.devices()) if isinstance(leaf, jax.Array) else jax.devices()[:1]


def cache_device_bytes(method: Method, batch: int, dtype, mesh: Mesh | None = None) -> int:
    """Bytes of `method`'s empty cache of `batch` sequences that one device holds (its shard on `mesh`; arrays the
    method keeps in host memory not counted), from shapes: nothing is allocated."""
    abstract = (
        method.cache_spec(batch, dtype) if mesh is None else jax.eval_shape(_empty_cache(method, batch, dtype, mesh))
    )
    in_host = lambda x: getattr(getattr(x, "sharding", None), "memory_kind", None) in ("pinned_host", "unpinned_host")
    return sharding.device_bytes([x for x in jax.tree.leaves(abstract) if not in_host(x)])


@jax.jit
def _keep_last(ends_here: jax.Array, logits: jax.Array, last: jax.Array | None) -> jax.Array:
    """The prefill's logits at each sequence's last prompt token: `logits` [B, V] where ends_here [B], else `last`
    (zeros before any)."""
    return jnp.where(ends_here[:, None], logits, jnp.zeros_like(logits) if last is None else last)


MAPS_IN_USE_FRACTION = 0.75  # of Linux's vm.max_map_count: past it, a new compile first drops the cached executables


def _make_room_for_an_executable() -> None:
    """Drop every cached executable (`clear_compiled`, with a warning) when this process's memory mappings near the
    kernel's limit (Linux's vm.max_map_count). XLA:CPU maps each executable's code into the process, and a compile
    past the limit aborts it ("LLVM ERROR: Unable to allocate section memory"), as a long RULER run over six
    method x budget runs did."""
    try:
        with open("/proc/sys/vm/max_map_count") as limits:  # closed: an open handle warned on every compile
            limit = int(limits.read())
        with open("/proc/self/maps", "rb") as maps:
            in_use = sum(1 for _ in maps)
    except (OSError, ValueError):  # not Linux: no such limit to watch
        return
    if in_use > MAPS_IN_USE_FRACTION * limit:
        warnings.warn(
            f"{in_use} memory mappings of the {limit} the kernel allows (vm.max_map_count): dropping the compiled "
            "executables before compiling another (they are recompiled when needed). A long run over many "
            "methods or shapes reaches this on CPU; raising vm.max_map_count avoids the recompiles.",
            RuntimeWarning,
            stacklevel=2,
        )
        clear_compiled()


def clear_compiled() -> None:
    """Drop every executable the engine compiled (`compiled_extend`, `compiled_extend_row`, `compiled_decode`, and
    `_empty_cache`'s programs that build empty caches) and
    JAX's trace caches, so the next call traces and compiles afresh (after patching a function the steps call)
    and the executables' memory is released (each XLA:CPU executable maps its code into the process)."""
    for compiled in (_compiled_extend, _compiled_extend_row, _compiled_decode, _empty_cache, _cache_layout):
        compiled.cache_clear()
    jax.clear_caches()


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


ChunkCallback = Callable[[jax.Array, int, np.ndarray], None]


def _check_on_one_device(params: Params) -> None:
    """Weights spread over several devices (loaded with `shardings=` for a mesh) run on that mesh only: the steps
    without a mesh are compiled for one device."""
    devices = devices_of(params, None)
    if len(devices) > 1:
        raise DuoJaxError(
            f"the weights are laid out over {len(devices)} devices, as loaded for a mesh: generate on that mesh "
            "(mesh=, infer.py --mesh), or load them without shardings="
        )


class Engine:
    """One model ready to run every KV-cache method: its weights in the layout the steps take, the one prefill
    driver, and the device decode loop. `Engine.of(model)` is the engine of the model's weights, which is what
    `duo_jax.generate` runs.

    The steps take per-layer weights (`duo_jax.model.LAYOUTS`; slicing a stacked weight inside the compiled
    step copies it on every call on CPU: docs/engine.md, "Weight layouts"). Weights loaded per layer (the
    default of `duo_jax.load`) are used as they are: `params` holds the model's own arrays, there is one copy
    of the weights and nothing to prepare (except on a GPU, where q/k/v are fused into one weight: a copy, kept
    like the stacked one below). Stacked weights (`load(..., layout="stacked")`, the Flax front,
    gate training) are sliced into a per-layer copy once per set of weights (kept while they live and reused by
    every call and method; `copied` says so): a model used both for scanned work and for generation holds
    its weights twice. On a generation `mesh` (`duo_jax.sharding`: batch over `data`, tensor parallelism over
    `model`) the weights are placed sharded, each device receiving only its slices (a copy beside the model's
    unsharded arrays; none where they were loaded so, `duo_jax.sharding.tensor_parallel_shardings`), and every
    step runs on the mesh; only methods with a `cache_partition` (full, duo) run
    there. With `fuse_qkv` (the default on a GPU, off a mesh) each layer's query, key and value weights are held
    as one (`duo_jax.model.fuse_qkv`, a copy of them): XLA:GPU runs a one-token projection through a weight of
    fewer than 10M elements as a product and column sums instead of a matrix-vector product, which Llama-3-8B's
    k / v weights are (docs/engine.md, "Fused q/k/v").
    """

    def __init__(self, params: Params, config: ModelConfig, mesh: Mesh | None = None, *, fuse_qkv: bool | None = None):
        """`params` in either layout: per-layer weights are used as they are (off a mesh, q/k/v not fused),
        stacked ones sliced. `fuse_qkv`: hold q/k/v as one weight (None: on a GPU, off a mesh)."""
        mesh = None if mesh is None else sharding.auto_axes(mesh)  # jax.make_mesh's Explicit axes run as Auto
        self.config, self.mesh = config, mesh
        if fuse_qkv is None:
            fuse_qkv = fuses_qkv_by_default(mesh)
        if fuse_qkv and mesh is not None:
            raise DuoJaxError(
                "fuse_qkv=True is for one device: a tensor-parallel mesh splits q, k and v by head separately; "
                "leave fuse_qkv unset (or False) with a mesh"
            )
        self.fused_qkv = bool(fuse_qkv)
        if mesh is None:
            _check_on_one_device(params)
            self.params = prepared(params, self.fused_qkv)
        else:
            sharding.check_generation_mesh(mesh, config.num_heads, config.intermediate_size)
            specs = sharding.tensor_parallel_specs(jax.eval_shape(unstack_layers, params), mesh)
            if isinstance(params.layers, tuple):  # per layer: arrays already placed so are kept, not copied
                self.params = jax.device_put(params, sharding.named(specs, mesh))
            else:
                self.params = jax.jit(unstack_layers, out_shardings=sharding.named(specs, mesh))(params)
        self.dtype = jnp.dtype(params.dtype).name
        self.weight_format = weight_format(params)  # None, or "int8" (`duo_jax.load(..., weights="int8")`)
        # Whether `params` is a copy of the weights (rather than the very arrays it was built from).
        self.copied = any(a is not b for a, b in zip(jax.tree.leaves(self.params), jax.tree.leaves(params)))
        # Weak references: the engine must not keep the weights it was prepared from alive.
        self._source = [weakref.ref(x) for x in jax.tree.leaves(params)]

    def prepared_from(self, params: Params, config: ModelConfig) -> bool:
        leaves = jax.tree.leaves(params)
        return (
            config == self.config
            and len(leaves) == len(self._source)
            and all(ref() is x for ref, x in zip(self._source, leaves))
        )

    @property
    def weight_layout(self) -> dict:
        """What fixes the compiled steps' weights, as their keywords: `compiled_extend(..., **engine.weight_layout)`
        (and `compiled_extend_row`, `compiled_decode`) compiles for this engine's `params`."""
        return dict(weight_format=self.weight_format, fused_qkv=self.fused_qkv)

    @property
    def weights(self) -> str | None:
        """Deprecated name of `weight_format` (kept for one release)."""
        warnings.warn("Engine.weights is renamed Engine.weight_format", DeprecationWarning, stacklevel=2)
        return self.weight_format

    def serves(self, params: Params, config: ModelConfig, mesh: Mesh | None = None) -> bool:
        """Whether this engine runs `params` / `config` on `mesh` (what `generate(engine=...)` checks)."""
        mesh = None if mesh is None else sharding.auto_axes(mesh)
        return self.prepared_from(params, config) and self.mesh == mesh

    @classmethod
    def of(cls, model, mesh: Mesh | None = None) -> Engine:
        """The engine of `model`'s weights (on `mesh`). One over the model's own arrays (per-layer weights, no
        mesh, q/k/v not fused) costs nothing to build and is built per call; one holding a copy (stacked weights,
        fused q/k/v as on a GPU, or placed on a mesh) is built on the weights' first use, then kept while they live
        (`duo_jax.model.weights_memo`). A caller that wants to own the engine builds `Engine(model.params,
        model.config, mesh)` and passes it (`generate(engine=)`)."""
        with building(model.params, ("engine", mesh)) as memo:  # one copy, however many threads ask first
            engine = memo.get(("engine", mesh))
            if engine is None or not engine.prepared_from(model.params, model.config):
                engine = cls(model.params, model.config, mesh)
                if engine.copied:
                    memo[("engine", mesh)] = engine
        return engine

    def put_batch(self, x) -> jax.Array:
        """Host values [B, ...] onto the device(s): split by batch over `data` on a mesh."""
        if self.mesh is None:
            return jax.device_put(x)  # a transfer (jnp.asarray of host values runs a staging executable)
        return jax.device_put(x, NamedSharding(self.mesh, P(sharding.DATA)))

    def init_cache(self, method: Method, batch: int):
        """`method`'s empty cache for `batch` sequences, created in place on the mesh (never whole on one device)."""
        return _empty_cache(method, batch, self.dtype, self.mesh)()

    def prefill(
        self,
        method: Method,
        tokens: np.ndarray,
        prompt_lengths: np.ndarray,
        *,
        chunk: int,
        impl: str = "auto",
        on_chunk: ChunkCallback | None = None,
        cache=None,
        lengths=None,
    ):
        """Run prompts through `method`'s cache in chunks of `chunk` tokens: the one prefill driver.

        tokens int [B, >= max(prompt_lengths)] (padding after each prompt), prompt_lengths int [B]. Starts
        from an empty cache (or `cache` / `lengths`). With `on_chunk`, every chunk's logits [B, chunk, V] are
        computed and handed to `on_chunk(logits, start, n_valid)` (n_valid int [B]: the chunk's real tokens
        per sequence); otherwise only the last token's. Returns (logits float32 [B, V] at each sequence's last
        prompt token, the cache, lengths); the method's `after_prefill` is not applied.
        """
        _check_token_ids(tokens, "tokens", 2)
        B = tokens.shape[0]
        if cache is not None:
            _check_cache(method, cache, B)
        prompt_lengths = np.asarray(prompt_lengths, np.int32)
        longest = int(prompt_lengths.max())
        padded = np.zeros((B, -(-longest // chunk) * chunk), np.int32)
        padded[:, : min(tokens.shape[1], padded.shape[1])] = tokens[:, : padded.shape[1]]
        if cache is None:
            cache, lengths = self.init_cache(method, B), self.put_batch(np.zeros((B,), np.int32))
        step = compiled_extend(
            self.config, method, B, chunk, self.dtype, impl, on_chunk is not None, self.mesh, **self.weight_layout
        )
        state = method.state()
        last = None
        for start in range(0, longest, chunk):
            n_valid = np.clip(prompt_lengths - start, 0, chunk).astype(np.int32)
            logits, cache, lengths = step(
                self.params,
                cache,
                lengths,
                self.put_batch(padded[:, start : start + chunk]),
                self.put_batch(n_valid),
                state,
            )
            if on_chunk is not None:
                on_chunk(logits, start, n_valid)
                at = self.put_batch(np.maximum(n_valid - 1, 0)[:, None, None])
                logits = jnp.take_along_axis(logits, at, axis=1)[:, 0]
            # the sequences whose last prompt token is in this chunk (decided on the host: the chunks before a
            # prompt's last one add no device op)
            ends_here = (prompt_lengths > start) & (prompt_lengths <= start + chunk)
            if ends_here.all():
                last = logits
            elif ends_here.any():
                last = _keep_last(self.put_batch(ends_here), logits, last)
        if last is None:  # no prompt token at all
            last = jnp.zeros((B, self.config.vocab_size), jnp.float32)
        return last, cache, lengths

    def step(self, method: Method, cache, lengths, tokens: jax.Array, *, impl: str = "auto"):
        """One token per sequence (tokens int [B]) through `method`'s cache, compiled once per batch size:
        (logits float32 [B, V], cache, lengths). For callers that need every step on the host (teacher forcing,
        per-step timing); generation decodes on the device (`decode_loop`).
        Tokens already on the device (e.g. the argmax of the last logits) stay there: no host round trip."""
        _check_token_ids(tokens, "tokens", 1)
        B = tokens.shape[0]
        run = compiled_extend(self.config, method, B, 1, self.dtype, impl, False, self.mesh, **self.weight_layout)
        tokens = tokens.astype(jnp.int32) if isinstance(tokens, jax.Array) else np.asarray(tokens, np.int32)
        try:
            return run(
                self.params,
                cache,
                lengths,
                self.put_batch(tokens[:, None]),
                self.put_batch(np.ones((B,), np.int32)),
                method.state(),
            )
        except TypeError:  # an argument the executable was not compiled for: a cache not the method's, named
            _check_cache(method, cache, B)  # here, not before every step (per-step callers time the steps)
            raise

    def decode_loop(
        self,
        method: Method,
        cache,
        lengths,
        token: jax.Array,
        seed=0,
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        eos_ids: tuple[int, ...] = (),
        impl: str = "auto",
    ):
        """`decode` on this engine's weights, compiled per (batch, bucket(max_new_tokens), greedy or not, EOS ids):
        (tokens int32 [B, bucket], steps, cache, lengths); `token` is each sequence's first new token. `seed`: an
        int (row b draws with seed + b) or one per row (`duo_jax.sampling.row_seeds`); `sampling`: one rule for
        every row, its values runtime arguments (None: greedy)."""
        _check_token_ids(token, "token", 1)
        _check_max_tokens(max_new_tokens, "max_new_tokens")
        B, sampling = token.shape[0], Sampling() if sampling is None else sampling
        if any(np.ndim(value) for value in (sampling.temperature, sampling.top_p, sampling.top_k)):
            raise DuoJaxError(
                "decode_loop's sampling is one rule for every row (Python numbers, e.g. Sampling(0.8, 0.9, 40)); "
                "for a rule per row, call decode with the rule's arrays [B] (Sampling.stack)"
            )
        run = compiled_decode(
            self.config,
            method,
            B,
            self.dtype,
            impl,
            sampling.greedy,
            bucket(max_new_tokens),
            tuple(eos_ids),
            self.mesh,
            **self.weight_layout,
        )
        limit = jnp.asarray(max_new_tokens - 1, jnp.int32)
        seeds, rule = row_seeds(seed, B), sampling.rows(B)
        if self.mesh is not None:
            token, seeds = self.put_batch(token), self.put_batch(seeds)
            rule = jax.tree.map(self.put_batch, rule)
            limit = jax.device_put(limit, NamedSharding(self.mesh, P()))
        try:
            return run(self.params, cache, lengths, token, seeds, limit, rule, method.state())
        except TypeError:  # an argument the executable was not compiled for: a cache not the method's, named
            _check_cache(method, cache, B)
            raise
