"""HeadKV / HeadKV-R2: per-head KV budgets from head importance scores, SnapKV's selection inside each head.

`headkv_budgets` shares a budget out over the heads by their scores (`duo_jax.head_scores`); `make_headkv`
builds a `SnapKV` with those budgets. `DuoHeadKV` (`duo_headkv`) composes this with DuoAttention: streaming
heads keep sink + recent tokens, and only the retrieval heads are compressed after prefill, with HeadKV budgets
shared among them. The allocation, the deviations from the original, sliding windows and quantized caches:
docs/methods.md, "HeadKV and duo_headkv".
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.cache import CacheLayout, DuoLayerCache, make_layout, round_capacity
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, check_windows, kv_rotation_for, write_slots
from duo_jax.methods.duo import DuoAttention, StreamingWindow, fit_window, merge_heads, num_retrieval_heads, split_heads
from duo_jax.methods.registry import register
from duo_jax.methods.snapkv import (
    CompressedLayerCache,
    CompressedShared,
    SnapKV,
    base_budget,
    check_selection,
    compress_layer,
    compressed_attention,
    compressed_nbytes,
    decode_shape,
    empty_compressed,
    kv_array,
    slot_budgets,
)
from duo_jax.model import apply_rotary
from duo_jax.pattern import DEFAULT_SPARSITY, SCORES_KIND, Pattern, resolve_pattern
from duo_jax.quant import kv_bytes_per_vector

WINDOW = 8  # the observation window (the paper's alpha): the default of both builders and of duo_headkv's budget rule


def headkv_budgets(scores, base: int, beta: float) -> np.ndarray:
    """Tokens each head keeps besides the window, int, the shape of `scores` ([L, K] or any set of heads):
    round(S * B + b - b / beta) with S = scores / sum(scores), b = `base`, B = (b / beta) * (number of heads)."""
    scores = np.asarray(scores, np.float64)
    if not np.isfinite(scores).all() or (scores < 0).any() or scores.sum() <= 0:
        raise DuoJaxError("head scores must be finite and non-negative with a positive sum")
    if beta < 1:
        raise DuoJaxError(f"HeadKV's beta must be >= 1 (the pool is b / beta per head), got {beta}")
    share = scores / scores.sum()
    pool = base / beta * scores.size
    return np.round(share * pool + base - base / beta).astype(int)


def _score_grid(config: ModelConfig, scores: Pattern | np.ndarray) -> np.ndarray:
    grid = scores.gates if isinstance(scores, Pattern) else np.asarray(scores)
    if grid.shape != (config.num_layers, config.num_kv_heads):
        raise DuoJaxError(
            f"head scores have shape {'x'.join(map(str, grid.shape))} but the model has "
            f"{config.num_layers}x{config.num_kv_heads} (layers x kv_heads)"
        )
    return grid


def headkv_budget(config: ModelConfig, kv_budget: int, *, scores=None, **inputs) -> dict:
    return dict(kv_budget=kv_budget, scores=scores)


def duo_headkv_budget(
    config: ModelConfig,
    kv_budget: int,
    *,
    sink: int,
    recent: int,
    sparsity: float,
    pattern=None,
    scores=None,
    fitted: bool = True,
    **inputs,
) -> dict:
    """The pattern at `sparsity`, duo's window on the streaming heads (fitted to the budget as duo's), and the
    rest of N * budget shared by the R retrieval heads: (N * budget - (N - R) * window) / R tokens each, which
    must hold the observation window (`WINDOW`, the builder's default) that each retrieval head keeps whole."""
    if fitted:
        sink, recent = fit_window(kv_budget, sink, recent)
    heads = config.num_layers * config.num_kv_heads
    retrieval = num_retrieval_heads(config, sparsity)
    if retrieval == 0:
        raise DuoJaxError(
            f"duo_headkv at sparsity {sparsity} cannot meet a budget of {kv_budget} tokens per head: it has no "
            "retrieval head to hold what the streaming heads leave; lower the sparsity"
        )
    per_retrieval = (heads * kv_budget - (heads - retrieval) * (sink + recent)) // retrieval
    if per_retrieval < WINDOW:
        raise DuoJaxError(
            f"duo_headkv at sparsity {sparsity} cannot meet a budget of {kv_budget} tokens per head: with the "
            f"streaming heads' window of {sink + recent}, its {retrieval} retrieval heads would keep {per_retrieval} "
            f"tokens each, fewer than their observation window of {WINDOW}: raise the sparsity (fewer retrieval heads, "
            "each keeping more) or the budget"
        )
    return dict(pattern=pattern, sparsity=sparsity, sink=sink, recent=recent, scores=scores, kv_budget=per_retrieval)


@register(
    "headkv",
    budget=headkv_budget,
    summary="HeadKV: SnapKV with per-head budgets from head scores (scores=PATH, 'default' or a Pattern)",
)
def make_headkv(
    config: ModelConfig,
    *,
    context: int,
    scores=None,
    kv_budget: int | None = None,
    beta: float = 1.2,
    window: int = WINDOW,
    kernel: int = 7,
    pooling: str = "max",
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
    room: int | None = None,
) -> SnapKV:
    """HeadKV with `kv_budget` tokens per KV head on average (window included) shared out by `scores`
    ([layers, kv_heads]: a `Pattern` from `duo_jax.head_scores.score_heads`, a path to one, or 'default').
    `budget_slots`, `room`: as SnapKV's (each head's slots are its budget at budget_slots)."""
    grid = _score_grid(config, _required_scores(scores, config, "headkv"))

    def per_head(b):
        return tuple(map(tuple, headkv_budgets(grid, b, beta).tolist()))

    return SnapKV(
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        round_capacity(context),
        per_head(base_budget(kv_budget, window)),
        window,
        kernel,
        pooling,
        name="headkv",
        kv_dtype=kv_dtype,
        windows=config.layer_windows(),
        slot_budgets=slot_budgets(kv_budget, budget_slots, window, per_head),
        room=room,
    )


# --- DuoAttention with HeadKV inside its retrieval heads ------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DuoPrefillLayerCache:
    duo: DuoLayerCache  # DuoAttention's split cache: retrieval heads every token, streaming heads sink + recent
    queries: jax.Array  # [B, window, n_l * G, E]: the retrieval heads' latest queries after RoPE (slot p % window)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DuoCompressedLayerCache:
    retrieval: CompressedLayerCache  # the retrieval heads' kept prompt tokens and generated tokens
    streaming_k: jax.Array  # [B, sink + recent, K - n_l, E]
    streaming_v: jax.Array


@dataclasses.dataclass(frozen=True)
class DuoCompressedKV(Method):
    """Decode of `DuoHeadKV`: retrieval heads over their compressed cache, streaming heads over sink + recent."""

    layout: CacheLayout
    head_slots: tuple[tuple[int, ...], ...]  # [L][n_l]: kept prompt slots per retrieval head
    room: int

    name = "duo_headkv"

    def init_cache(self, batch: int, dtype) -> tuple[DuoCompressedLayerCache, ...]:
        E, K, kv_dtype = self.layout.head_dim, self.layout.num_kv_heads, self.layout.kv_dtype
        streaming = lambda n: kv_array((batch, self.layout.streaming_slots, K - n, E), dtype, kv_dtype)  # noqa: E731
        return tuple(
            DuoCompressedLayerCache(
                empty_compressed(batch, slots, self.room, E, dtype, kv_dtype), streaming(n), streaming(n)
            )
            for slots, n in zip(self.head_slots, self.layout.num_retrieval)
        )

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        E, K, S, kv_dtype = (
            self.layout.head_dim,
            self.layout.num_kv_heads,
            self.layout.streaming_slots,
            self.layout.kv_dtype,
        )
        vector = kv_bytes_per_vector(E, kv_dtype, bytes_per_elem)
        return sum(
            compressed_nbytes(batch, slots, self.room, E, bytes_per_elem, kv_dtype) + batch * 2 * (K - n) * S * vector
            for slots, n in zip(self.head_slots, self.layout.num_retrieval)
        )

    def state(self):
        return self.layout.window_state()  # the streaming window, where it is data (`CacheLayout.ring_slots`)

    def begin_step(self, step: Step):
        sink, recent = self.layout.window_of(step.state)
        window = StreamingWindow.build(step, sink, recent, slots=self.layout.streaming_slots)
        return CompressedShared.build(step, self.room), window

    def attend(self, layer, q, k, v, cache: DuoCompressedLayerCache, step: Step, shared):
        retrieval_shared, window = shared
        q, k = apply_rotary(q, step.rope), apply_rotary(k, step.rope)
        rotation = kv_rotation_for(self.layout.kv_dtype, self.layout.head_dim)
        q, k, v = rotation.into(q, k, v)  # a quantized cache holds k R and v R
        (qr, qs), (kr, ks), (vr, vs) = (split_heads(self.layout, layer, x) for x in (q, k, v))
        out_r, retrieval = qr, cache.retrieval
        if kr.shape[2]:
            out_r, retrieval = compressed_attention(
                qr, kr, vr, retrieval, self.head_slots[layer], step, retrieval_shared
            )
        out_s, sk, sv = window.attend_and_write(qs, ks, vs, cache.streaming_k, cache.streaming_v, step)
        out = merge_heads(self.layout, layer, out_r, out_s)
        return rotation.back(out), DuoCompressedLayerCache(retrieval, sk, sv)


@dataclasses.dataclass(frozen=True)
class DuoHeadKV(Method):
    """DuoAttention whose retrieval heads keep HeadKV budgets instead of every token.

    Prefill is DuoAttention's (retrieval heads exact, streaming heads sink + recent, chunk by chunk), plus the
    retrieval heads' observation-window queries. After prefill each retrieval head keeps its budget of prompt
    tokens by SnapKV selection (`duo_jax.methods.snapkv`); streaming heads go on with sink + recent tokens.
    `budgets[l]` lists layer l's retrieval heads in the model's order. Build one with `make_duo_headkv`.
    """

    layout: CacheLayout
    num_heads: int
    budgets: tuple[tuple[int, ...], ...]  # [L][n_l]: prompt tokens per retrieval head besides the window
    window: int = WINDOW
    kernel: int = 7
    pooling: str = "max"
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window (`ModelConfig.layer_windows`)

    name = "duo_headkv"

    def __post_init__(self):
        if tuple(map(len, self.budgets)) != self.layout.num_retrieval:
            raise DuoJaxError("DuoHeadKV needs one budget per retrieval head of every layer")
        check_selection(self.window, self.kernel, self.pooling)
        if self.windows is not None and len(self.windows) != len(self.budgets):
            raise DuoJaxError(f"windows must give each of the {len(self.budgets)} layers its sliding window")

    @property
    def duo(self) -> DuoAttention:
        return DuoAttention(self.layout)

    @property
    def retrieval_mask(self) -> np.ndarray:
        return self.layout.retrieval_mask

    def init_cache(self, batch: int, dtype) -> tuple[DuoPrefillLayerCache, ...]:
        G, E = self.num_heads // self.layout.num_kv_heads, self.layout.head_dim
        return tuple(
            DuoPrefillLayerCache(layer, jnp.zeros((batch, self.window, n * G, E), dtype))
            for layer, n in zip(self.duo.init_cache(batch, dtype), self.layout.num_retrieval)
        )

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        G = self.num_heads // self.layout.num_kv_heads
        rings = batch * self.window * G * sum(self.layout.num_retrieval) * self.layout.head_dim * bytes_per_elem
        return self.duo.expected_cache_bytes(batch, bytes_per_elem) + rings

    def state(self):
        return self.layout.window_state()  # the streaming window, where it is data (`CacheLayout.ring_slots`)

    def begin_step(self, step: Step):
        in_window = step.valid & (step.positions >= step.new_lengths[:, None] - self.window)
        return self.duo.begin_step(step), jnp.where(in_window, step.positions % self.window, self.window)

    def attend(self, layer, q, k, v, cache: DuoPrefillLayerCache, step: Step, shared):
        duo_shared, query_slots = shared
        check_windows(self, self.windows, layer, step)
        out, duo_cache = self.duo.attend(layer, q, k, v, cache.duo, step, duo_shared)
        q = apply_rotary(q, step.rope)
        (q,) = kv_rotation_for(self.layout.kv_dtype, self.layout.head_dim).into(q)  # votes: q R (k R)^T when quantized
        retrieval_q = split_heads(self.layout, layer, q)[0]
        return out, DuoPrefillLayerCache(duo_cache, write_slots(cache.queries, query_slots, retrieval_q))

    def decode_method(self, longest: int, lengths=()) -> DuoCompressedKV:
        """The decode method after a prefill whose longest prompt has `longest` tokens."""
        slots, room = decode_shape(self.budgets, self.window, self.layout.capacity, longest)
        return DuoCompressedKV(self.layout, slots, room)

    def after_prefill(self, cache, lengths):
        decode = self.decode_method(int(jnp.max(lengths)))
        return decode, _compress_retrieval(self, decode, cache, lengths)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _compress_retrieval(
    method: DuoHeadKV, decode: DuoCompressedKV, cache: tuple[DuoPrefillLayerCache, ...], lengths: jax.Array
):
    """The retrieval heads' full caches -> their kept tokens; the streaming caches carry over."""
    empty = decode.init_cache(lengths.shape[0], cache[0].queries.dtype)  # the model's dtype
    out = []
    windows = method.windows or (None,) * len(cache)
    for layer, new, slots, sliding_window in zip(cache, empty, decode.head_slots, windows):
        retrieval = new.retrieval
        if slots:
            retrieval = compress_layer(
                layer.queries,
                layer.duo.retrieval_k,
                layer.duo.retrieval_v,
                lengths,
                retrieval,
                slots,
                window=method.window,
                kernel=method.kernel,
                pooling=method.pooling,
                sliding_window=sliding_window,
            )
        out.append(DuoCompressedLayerCache(retrieval, layer.duo.streaming_k, layer.duo.streaming_v))
    return tuple(out)


@register(
    "duo_headkv",
    budget=duo_headkv_budget,
    summary="duo whose retrieval heads keep HeadKV budgets (kv_budget per retrieval head)",
)
def make_duo_headkv(
    config: ModelConfig,
    *,
    context: int,
    pattern: Pattern | None = None,
    sparsity: float | None = None,
    scores=None,
    kv_budget: int | None = None,
    beta: float = 1.2,
    sink: int = 64,
    recent: int = 256,
    window: int = WINDOW,
    kernel: int = 7,
    pooling: str = "max",
    kv_dtype: str | None = None,
) -> DuoHeadKV:
    """DuoAttention (`pattern` binarised at `sparsity`, streaming heads `sink` + `recent`) whose retrieval heads
    keep `kv_budget` tokens each on average (window included), shared out among the retrieval heads by their
    HeadKV `scores` (the formula of `headkv_budgets` over the retrieval heads only); `kv_dtype` "int8" / "int4"
    quantizes every partition (docs/methods.md, "HeadKV and duo_headkv")."""
    scores = _required_scores(scores, config, "duo_headkv")
    if pattern is None:
        raise DuoJaxError("method 'duo_headkv' needs a head pattern (pattern=PATH, a Pattern, or 'default')")
    pattern = resolve_pattern(pattern, config)
    grid = _score_grid(config, scores)
    mask = pattern.retrieval_mask(DEFAULT_SPARSITY if sparsity is None else sparsity)
    layout = make_layout(config, mask, sink=sink, recent=recent, context=context, kv_dtype=kv_dtype)
    base = base_budget(kv_budget, window)
    # grid[mask] lists the retrieval heads layer by layer in the model's order, as `split_heads` does.
    flat = headkv_budgets(grid[mask], base, beta) if mask.any() else np.zeros(0, int)
    budgets = tuple(tuple(b.tolist()) for b in np.split(flat, np.cumsum(layout.num_retrieval)[:-1]))
    return DuoHeadKV(layout, config.num_heads, budgets, window, kernel, pooling, config.layer_windows())


def resolve_scores(scores, config: ModelConfig) -> Pattern | None:
    """HeadKV head scores: a `Pattern`, a path, "default" (the model's shipped scores) or None."""
    if scores is None or isinstance(scores, Pattern):
        resolved = scores
    elif str(scores) == "default":
        resolved = Pattern.for_model(config.name, key="scores")
        if resolved is None:
            raise DuoJaxError(
                f"model {config.name!r} ships no HeadKV head scores (a named config may; a model loaded from a path "
                "has none): write them with python -m duo_jax.head_scores and pass scores=PATH (--scores PATH)"
            )
    else:
        resolved = Pattern.load(scores, "HeadKV scores", SCORES_KIND)
    if resolved is not None:
        resolved.validate(config)
    return resolved


def _required_scores(scores, config: ModelConfig, name: str):
    if isinstance(scores, np.ndarray):
        return scores
    resolved = resolve_scores(scores, config)
    if resolved is None:
        raise DuoJaxError(
            f"method {name!r} needs head scores: scores=PATH (written by python -m "
            "duo_jax.head_scores), 'default' (the model's shipped ones) or a Pattern"
        )
    return resolved
