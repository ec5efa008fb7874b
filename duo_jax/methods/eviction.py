"""Score-based eviction with a fixed-size cache: H2O (heavy hitters) and TOVA.

Each KV head keeps `budget` tokens. A step's new tokens attend exactly to the kept tokens plus their chunk
(causal, within the layer's sliding window); then the cache keeps the `budget` candidates of highest `priority`
(H2O: attention received so far, plus the `recent` newest; TOVA: the newest query's attention, layer-wide) and
evicts the rest, once per chunk. Keys are cached after RoPE at absolute positions, beside each slot's position
and score. With `budget_slots` the cache holds that many slots and the budget (and H2O's `recent`) is runtime data,
so that budgets in one bucket share compiled steps. The rules, sliding windows and quantized caches: docs/methods.md,
"Eviction: H2O and TOVA".
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention
from duo_jax.attention import MaskSpec, attention_probs, attention_received
from duo_jax.cache import StaticSpec, check_slots, runtime_state
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, check_windows, kv_rotation_for
from duo_jax.methods.registry import kv_budget_only, register
from duo_jax.model import apply_rotary
from duo_jax.quant import as_stored, check_kv_dtype, dequantize, kv_bytes_per_vector, kv_zeros


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EvictionLayerCache:
    k: jax.Array  # [B, K, N, E]: slot s of KV head h holds the token at positions[b, h, s]
    v: jax.Array  # [B, K, N, E]
    positions: jax.Array  # int32 [B, K, N], -1 where empty
    scores: jax.Array  # float32 [B, K, N]: H2O's accumulated attention (unused by TOVA)


SCORES_FROM = ("all", "newest")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Budget:
    """An eviction budget as runtime data (`_Eviction.budget_slots`): tokens kept per KV head and H2O's recent
    tokens among them, int32 scalars."""

    tokens: jax.Array
    recent: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class _Eviction(StaticSpec, Method):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    budget: int
    kv_dtype: str | None = None  # "int8" / "int4": quantized K and V (`duo_jax.quant`)
    windows: tuple[int | None, ...] | None = None  # each layer's sliding window (`ModelConfig.layer_windows`)
    query_rows: int = 1024  # query rows (over the batch) whose probabilities are held at once (`attention_received`)
    # Slots per KV head (>= budget) with the budget as runtime data (`Budget`, the method's state; equality and hash
    # ignore it); None: `budget` slots, the budget compiled in.
    budget_slots: int | None = None
    # Whether `priority` reads the attention each token received (H2O's `scores`); TOVA reads only the newest
    # query's, so its chunks skip summing the probabilities and run through the attention kernels.
    ranks_by_received_attention: ClassVar[bool] = True

    def __post_init__(self):
        if self.windows is not None and len(self.windows) != self.num_layers:
            raise DuoJaxError(f"windows must give each of the {self.num_layers} layers its sliding window")
        if self.budget_slots is not None:
            object.__setattr__(
                self, "budget_slots", check_slots("budget_slots", self.budget_slots, self.budget, "budget")
            )

    @property
    def recent_tokens(self) -> int:
        """The newest tokens always kept (H2O's `recent`; none for TOVA)."""
        return 0

    def _data_fields(self) -> tuple[str, ...]:
        return ("budget", "recent") if self.budget_slots is not None else ()

    def state(self) -> Budget | None:
        if self.budget_slots is None:
            return None
        return Budget(np.int32(self.budget), np.int32(self.recent_tokens))

    def budget_of(self, state) -> tuple:
        """(budget, recent) inside a step: compiled in, or with `budget_slots` the step's state (traced scalars)."""
        if self.budget_slots is None:
            return self.budget, self.recent_tokens
        budget = runtime_state(state, Budget, f"{self.name} method", "budget_slots", "budget")
        return budget.tokens, budget.recent

    def slots(self, layer: int, budget=None):
        """Tokens layer `layer` keeps per KV head: `budget` (default: its slots, `budget_slots` or the budget), or on
        a layer with window W at most the W - 1 tokens a later query can still see (at least one slot)."""
        budget = (self.budget if self.budget_slots is None else self.budget_slots) if budget is None else budget
        window = None if self.windows is None else self.windows[layer]
        if window is None:
            return budget
        return jnp.clip(budget, 1, window - 1) if isinstance(budget, jax.Array) else max(1, min(budget, window - 1))

    def init_cache(self, batch: int, dtype) -> tuple[EvictionLayerCache, ...]:
        def layer(n):
            slots = (batch, self.num_kv_heads, n)

            def zeros():
                shape = slots + (self.head_dim,)
                return jnp.zeros(shape, dtype) if self.kv_dtype is None else kv_zeros(shape, self.kv_dtype, dtype)

            return EvictionLayerCache(zeros(), zeros(), jnp.full(slots, -1, jnp.int32), jnp.zeros(slots, jnp.float32))

        return tuple(layer(self.slots(l)) for l in range(self.num_layers))

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        vector = kv_bytes_per_vector(self.head_dim, check_kv_dtype(self.kv_dtype), bytes_per_elem)
        per_slot = 2 * vector + 4 + 4  # K, V, position, score
        return batch * self.num_kv_heads * sum(map(self.slots, range(self.num_layers))) * per_slot

    def query_weights(self, step: Step) -> jax.Array:
        """float32 [B, T]: how much each of the step's queries adds to the attention a token received (1 for every
        real query, 0 for padding)."""
        return step.valid.astype(jnp.float32)

    @abc.abstractmethod
    def priority(
        self, positions: jax.Array, scores: jax.Array, newest_probs: Callable[[], jax.Array], step: Step
    ) -> jax.Array:
        """Keep priority [B, K, N + T] of each candidate (higher is kept first). positions [B, K, N + T]
        (-1: empty), scores: H2O's accumulated attention, newest_probs() -> [B, K, G, N + T]: the attention
        of this step's newest real query (computed only when called)."""

    def attend(self, layer, q, k, v, cache: EvictionLayerCache, step: Step, shared):
        check_windows(self, self.windows, layer, step)
        q = apply_rotary(q, step.rope)
        k = apply_rotary(k, step.rope)
        rotation = kv_rotation_for(self.kv_dtype, self.head_dim)
        q, k, v = rotation.into(q, k, v)  # a quantized cache holds k R and v R
        B, T = step.positions.shape
        K = self.num_kv_heads

        def candidates(kept, new):  # the kept tokens, then this step's tokens (quantized once, here): [B, K, N + T, E]
            new = as_stored(jnp.swapaxes(new, 1, 2), kept)
            return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=2), kept, new)

        keys, values = candidates(cache.k, k), candidates(cache.v, v)
        new_positions = jnp.broadcast_to(jnp.where(step.valid, step.positions, -1)[:, None], (B, K, T))
        positions = jnp.concatenate([cache.positions, new_positions], axis=2)
        dense_keys, dense_values = dequantize(keys), dequantize(values)
        own_keys_at = cache.positions.shape[2]  # the kept tokens, then this step's in order
        if not self.ranks_by_received_attention:  # no probabilities summed: the chunk goes through the kernels
            out, received = attend_per_kv_head(q, dense_keys, dense_values, positions, step, own_keys_at), 0.0
        else:  # a kernel that sums them where one serves (the C++ CPU kernel), else the probabilities
            weights = self.query_weights(step)
            served = received_per_kv_head(q, dense_keys, dense_values, positions, step, own_keys_at, weights)
            # Causal, within the layer's window; over query blocks, so a whole-prompt chunk never holds [T, N + T].
            out, received = served or attention_received(
                q,
                dense_keys,
                dense_values,
                step.positions,
                lambda queries: step.sees(positions, queries),
                weights,
                block=max(1, self.query_rows // B),
                own_keys_at=own_keys_at,
            )
        out = rotation.back(out)

        def newest_probs():  # [B, K, G, N + T]
            newest = newest_query(step)[:, None]  # [B, 1]
            query = jnp.take_along_axis(q, newest[:, :, None, None], axis=1)
            at = jnp.take_along_axis(step.positions, newest, axis=1)
            return attention_probs(query, dense_keys, dense_values, step.sees(positions, at))[1][:, :, :, 0]

        scores = jnp.concatenate([cache.scores, jnp.zeros((B, K, T), jnp.float32)], axis=2) + received
        # Empty slots and the tokens out of every future query's window go first (and are dropped below).
        priority = jnp.where(
            step.still_visible(positions), self.priority(positions, scores, newest_probs, step), -jnp.inf
        )
        kept_priority, kept = jax.lax.top_k(priority, self.slots(layer))  # [B, K, N]
        if self.budget_slots is not None:  # the ranks past the runtime budget stay empty
            within = jnp.arange(kept.shape[-1]) < self.slots(layer, self.budget_of(step.state)[0])
            kept_priority = jnp.where(within, kept_priority, -jnp.inf)

        def take(x):  # codes and scales alike for a quantized cache
            return jax.tree.map(
                lambda a: jnp.take_along_axis(a, kept.reshape(kept.shape + (1,) * (a.ndim - 3)), axis=2), x
            )

        return out, EvictionLayerCache(
            take(keys), take(values), jnp.where(kept_priority > -jnp.inf, take(positions), -1), take(scores)
        )


def newest_query(step: Step) -> jax.Array:
    """int32 [B]: each row's last real query in the step (its queries are real first, padding after)."""
    return jnp.maximum(jnp.sum(step.valid, axis=1) - 1, 0)


def attend_per_kv_head(q, keys, values, positions, step: Step, own_keys_at: int) -> jax.Array:
    """q [B, T, H, E] over keys / values [B, K, S, E] at positions [B, K, S] (-1: empty) that differ per KV head:
    each KV head becomes a batch row of `duo_jax.attention.attend` (causal, within the layer's window; the first
    `own_keys_at` slots the kept tokens, filled first, then the step's)."""
    rows, by_head, spec = _kv_heads_as_rows(q, keys, values, positions, step, own_keys_at)
    return _heads_back(attention.attend(rows, *by_head, spec, impl=step.impl), q.shape)


def received_per_kv_head(q, keys, values, positions, step: Step, own_keys_at: int, weights: jax.Array):
    """`attend_per_kv_head` and the attention each key received from the step's queries, each weighted by `weights`
    [B, T], float32 [B, K, S] (`duo_jax.attention.attend_received`), or None where no kernel computes it."""
    B, K, S = positions.shape
    rows, by_head, spec = _kv_heads_as_rows(q, keys, values, positions, step, own_keys_at)
    weights = jnp.repeat(weights, K, axis=0)
    served = attention.attend_received(rows, *by_head, spec, weights, impl=step.impl)
    if served is None:
        return None
    out, received = served
    return _heads_back(out, q.shape), received.reshape(B, K, S)


def _kv_heads_as_rows(q, keys, values, positions, step: Step, own_keys_at: int):
    """q [B, T, H, E] -> [B K, T, G, E], keys / values [B, K, S, E] -> [B K, S, 1, E], and their mask."""
    B, T, H, E = q.shape
    K, S = keys.shape[1], keys.shape[2]
    rows = q.reshape(B, T, K, H // K, E).swapaxes(1, 2).reshape(B * K, T, H // K, E)
    spec = MaskSpec(
        jnp.repeat(step.positions, K, axis=0),
        jnp.full((B * K,), S, jnp.int32),
        positions.reshape(B * K, S),
        window=step.sliding_window,
        own_keys_at=own_keys_at,
    )
    return rows, tuple(x.reshape(B * K, S, 1, E) for x in (keys, values)), spec


def _heads_back(out: jax.Array, shape) -> jax.Array:
    """[B K, T, G, E] -> [B, T, H, E]."""
    B, T, H, E = shape
    K = out.shape[0] // B
    return out.reshape(B, K, T, H // K, E).swapaxes(1, 2).reshape(B, T, H, E)


@dataclasses.dataclass(frozen=True, eq=False)
class H2O(_Eviction):
    """Heavy hitters (highest accumulated attention) + the `recent` newest tokens, per KV head. `scores_from`: "all",
    every query of a chunk adds the attention it gives (H2O's rule); "newest", only its newest real query: with the
    prompt in one chunk, DuoAttention's appendix protocol, whose scores start with the first query after an exact
    prefill (docs/methods.md)."""

    recent: int = 0
    scores_from: str = "all"

    name = "h2o"

    def __post_init__(self):
        super().__post_init__()
        if self.scores_from not in SCORES_FROM:
            raise DuoJaxError(f"h2o's scores_from must be one of {', '.join(SCORES_FROM)}, got {self.scores_from!r}")

    @property
    def recent_tokens(self) -> int:
        return self.recent

    def query_weights(self, step: Step) -> jax.Array:
        weights = super().query_weights(step)
        if self.scores_from == "all":
            return weights
        return weights * (jnp.arange(weights.shape[1])[None] == newest_query(step)[:, None])

    def priority(self, positions, scores, newest_probs, step):
        is_recent = positions >= step.new_lengths[:, None, None] - self.budget_of(step.state)[1]
        return jnp.where(is_recent, jnp.inf, scores)


@dataclasses.dataclass(frozen=True, eq=False)
class TOVA(_Eviction):
    """The tokens the newest query attends to most, averaged over the layer's heads (same for every head)."""

    name = "tova"
    ranks_by_received_attention = False

    def priority(self, positions, scores, newest_probs, step):
        return jnp.broadcast_to(jnp.mean(newest_probs(), axis=(1, 2))[:, None], positions.shape)


@register(
    "h2o",
    budget=kv_budget_only,
    one_chunk_prefill=True,
    summary="H2O: heavy hitters by accumulated attention + the recent newest tokens, kv_budget per head",
)
def make_h2o(
    config: ModelConfig,
    *,
    context: int,
    kv_budget: int | None = None,
    recent: int | None = None,
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
    scores_from: str = "all",
) -> H2O:
    """`recent` defaults to kv_budget // 2 (the paper's equal split). `budget_slots`: slots per KV head (>= kv_budget)
    with the budget and `recent` runtime data, so that H2O at other budgets up to it shares compiled steps.
    `scores_from`: "all" (every query of a chunk adds its attention) or "newest" (a chunk's newest query only)."""
    fields = _fields("h2o", config, kv_budget, kv_dtype, budget_slots)
    recent = fields["budget"] // 2 if recent is None else recent
    if not 0 <= recent <= kv_budget:
        raise DuoJaxError(f"h2o's recent window must lie in [0, kv_budget={kv_budget}], got {recent}")
    return H2O(**fields, recent=recent, scores_from=scores_from)


@register(
    "tova",
    budget=kv_budget_only,
    one_chunk_prefill=True,
    summary="TOVA: the tokens the newest query attends to most (layer-wide), kv_budget per head",
)
def make_tova(
    config: ModelConfig,
    *,
    context: int,
    kv_budget: int | None = None,
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
) -> TOVA:
    """`budget_slots`: slots per KV head (>= kv_budget) with the budget runtime data, so that TOVA at other budgets
    up to it shares compiled steps."""
    return TOVA(**_fields("tova", config, kv_budget, kv_dtype, budget_slots))


def _fields(name: str, config: ModelConfig, kv_budget, kv_dtype, budget_slots) -> dict:
    """What H2O and TOVA are built from, the budget required."""
    if kv_budget is None:
        raise DuoJaxError(f"method {name!r} needs kv_budget (tokens kept per KV head)")
    return dict(
        num_layers=config.num_layers,
        num_kv_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        budget=int(kv_budget),
        kv_dtype=kv_dtype,
        windows=config.layer_windows(),
        budget_slots=budget_slots,
    )
