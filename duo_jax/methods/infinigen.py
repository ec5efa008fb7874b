"""InfiniGen: the full KV cache in host memory, and per decode step only the tokens a cheap speculation
predicts to matter are fetched and attended to exactly.

`skew` calibrates, per layer and head, an orthogonal skew A (the SVD of the head's queries on a sample) and
the partial channels to speculate on; `InfiniGen` caches every token's skewed keys and values (in host memory
where the backend has it) and, on a speculating layer, the partial keys on the device. Prefill and the dense
layers attend exactly to every token; a speculating layer's decode step scores the cached tokens with the
partial query (from the previous layer's input, `prepare`), fetches each KV head's top tokens (alpha rule,
capped by `kv_budget`) and attends to them exactly. With `budget_slots` a step fetches that many rows and the
budget is runtime data (the method's state), so that InfiniGen at other budgets runs the same executables. Defaults
are the authors' Llama rules. Their sources, the deviations, sliding windows, memory placement and quantized
caches: docs/methods.md, "InfiniGen".
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import attention
from duo_jax.attention import attention_probs
from duo_jax.cache import StaticSpec, check_slots, round_capacity, runtime_state
from duo_jax.config import ModelConfig
from duo_jax.data.haystack import CALIBRATION_HAYSTACK
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, kv_rotation_for, write_slots
from duo_jax.methods.registry import kv_budget_only, register
from duo_jax.model import (
    Params,
    apply_rotary,
    building,
    decoder_layer,
    embed,
    layer_at,
    project_qkv,
    rope_inv_freq,
    rotary,
)
from duo_jax.quant import as_stored, check_kv_dtype, dequantize, kv_bytes_per_vector, kv_zeros
from duo_jax.sampling import check_number


@functools.cache
def host_offload_supported() -> bool:
    """Whether the default device has a `pinned_host` memory and runs host computations (compute_on)."""
    try:
        import jax.experimental.compute_on  # noqa: F401  (the import is the check)

        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return False
    return "pinned_host" in kinds and hasattr(jax, "memory")


def on_host(fn, *args):
    """fn(*args) computed by the host, its outputs in host memory, through JAX's function form of `compute_on`
    (so named since JAX 0.11; `compute_on2` in JAX 0.10, whose `compute_on` is a context manager)."""
    from jax.experimental import compute_on as host

    compute_on = getattr(host, "compute_on2", host.compute_on)
    return compute_on(fn, compute_type="device_host", out_memory_spaces=jax.memory.Space.Host)(*args)


LLAMA_ALPHA = 5.0  # the authors' alpha for Llama models (their OPT runs use 4)
DENSE_LAYERS = 2  # layers that never speculate in the authors' Llama code (0 and 1)
CHANNEL_RULES = ("qk", "q")  # union of the top |QA| and top |KA| columns (the authors' Llama setup) | |QA| only


def num_partial_channels(head_dim: int, partial_ratio: float) -> int:
    """Columns each ranking keeps: int(partial_ratio * head_dim) as the authors (at least 1)."""
    if not 0 < partial_ratio <= 1:
        raise DuoJaxError(f"partial_ratio must lie in (0, 1], got {partial_ratio}")
    return max(1, int(partial_ratio * head_dim + 1e-9))


def _layer_qk(params: Params, config: ModelConfig, tokens) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rotated queries [T, H, E] and keys [T, K, E] of each layer of the dense model on `tokens` [T]."""
    tokens = jnp.asarray(np.asarray(tokens, np.int32))[None]
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    rope = rotary(positions, rope_inv_freq(config))

    def attend(q, k, v, h, window):
        q, k = apply_rotary(q, rope), apply_rotary(k, rope)
        return attention.attend(q, k, v, attention.prefix_spec(1, T, num_keys=T, window=window)), (q[0], k[0])

    x = embed(params, tokens)
    out = []
    for l in range(config.num_layers):
        x, (q, k) = decoder_layer(
            x, layer_at(params, l), config, functools.partial(attend, window=config.layer_window(l))
        )
        out.append((np.asarray(q, np.float32), np.asarray(k, np.float32)))
    return out


def skew(params: Params, config: ModelConfig, sample_tokens, *, partial_ratio: float = 0.2, channel_rule: str = "qk"):
    """(A float32 [L, K, E, E], channel mask bool [L, K, E]) from the dense model on `sample_tokens`.

    A[l, k] = V of the SVD of the group's stacked rotated queries Q [T*G, E] (float64). With c =
    `num_partial_channels(E, partial_ratio)`, the mask marks the c columns with the largest
    sum_{tokens, group heads} |Q A|, and (channel_rule "qk") also the c columns with the largest
    sum_tokens |K A| of the head's rotated keys K.
    """
    if channel_rule not in CHANNEL_RULES:
        raise DuoJaxError(f"channel_rule must be one of {CHANNEL_RULES}, got {channel_rule!r}")
    L, K, G, E = config.num_layers, config.num_kv_heads, config.group_size, config.head_dim
    c = num_partial_channels(E, partial_ratio)
    top = lambda x: np.argsort(-np.abs(x).sum(axis=0), kind="stable")[:c]  # noqa: E731
    A = np.zeros((L, K, E, E), np.float32)
    mask = np.zeros((L, K, E), bool)
    for l, (q, k) in enumerate(_layer_qk(params, config, sample_tokens)):
        for h in range(K):
            Q = q[:, h * G : (h + 1) * G].reshape(-1, E).astype(np.float64)
            _, _, vt = np.linalg.svd(Q, full_matrices=Q.shape[0] < E)
            A[l, h] = vt.T
            mask[l, h, top(Q @ vt.T)] = True
            if channel_rule == "qk":
                mask[l, h, top(k[:, h].astype(np.float64) @ vt.T)] = True
    return A, mask


def skew_on_text(
    params: Params,
    config: ModelConfig,
    tokenizer,
    *,
    sample_length: int = 512,
    partial_ratio: float = 0.2,
    channel_rule: str = "qk",
):
    """`skew` on the first `sample_length` tokens of the calibration half of the Paul Graham essays
    (`duo_jax.data.haystack.CALIBRATION_HAYSTACK`, disjoint from the text evaluations run on)."""
    from duo_jax.data.haystack import CALIBRATION_HAYSTACK, haystack_tokens

    if tokenizer is None:
        raise DuoJaxError(
            "InfiniGen calibrates on text and needs the model's tokenizer; without one, build it "
            "with InfiniGen.calibrate(params, config, sample_tokens, ...)"
        )
    tokens = np.asarray(haystack_tokens(tokenizer, CALIBRATION_HAYSTACK, sample_length), np.int32)
    return skew(params, config, tokens, partial_ratio=partial_ratio, channel_rule=channel_rule)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InfiniGenLayerCache:
    k: jax.Array  # [B, C, K, E] skewed rotated keys, slot = absolute position (pinned_host when offloaded)
    v: jax.Array  # [B, C, K, E] values (pinned_host when offloaded); both `QuantizedKV` with a kv_dtype
    partial_k: jax.Array  # [B, C, K, W] the partial channels of the skewed keys (device; W = 0 on a dense layer)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InfiniGenState:
    """What calibration fits: the arrays the compiled steps take as an argument (`Step.state`)."""

    skew: jax.Array  # float32 [L, K, E, E]: A per layer and KV head
    channel_mask: jax.Array  # bool [L, K, E]: each head's partial channels (columns of A-space)
    budget: jax.Array | None = None  # int32 []: kv_budget where it is runtime data (`InfiniGen.budget_slots`)


@dataclasses.dataclass(frozen=True, eq=False)
class InfiniGen(StaticSpec, Method):
    """The spec (shapes and rules: hashable, static) plus its calibration (`state()`, excluded from equality and
    hashing), so a recalibrated InfiniGen of the same shapes runs the same executables; with `budget_slots` the
    budget too."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int  # C: slots per head (context rounded up)
    kv_budget: int  # the most tokens a decode step fetches per KV head
    calibration: InfiniGenState = dataclasses.field(repr=False)  # runtime data (`_data_fields`)
    alpha: float = LLAMA_ALPHA
    offload: str = "auto"  # "auto" | "host" | "device"
    lookahead: bool = True  # decode steps speculate from the previous layer's attention input (False: own layer)
    dense_layers: int = DENSE_LAYERS  # layers 0 .. dense_layers-1 attend densely and never speculate
    kv_dtype: str | None = None  # "int8" / "int4": the full K and V quantized (`duo_jax.quant`; not the partial keys)
    # Rows a decode step fetches per KV head (>= kv_budget), the budget runtime data (the state's `budget`); None:
    # kv_budget rows, the budget compiled in.
    budget_slots: int | None = None
    # W_l: partial channels of layer l's widest head (0: a dense layer), from the calibration: part of the spec
    # (the partial cache's shapes), so a recalibration that changes them compiles anew.
    widths: tuple[int, ...] = dataclasses.field(init=False)

    name = "infinigen"

    def __post_init__(self):
        L, K, E = self.num_layers, self.num_kv_heads, self.head_dim
        if self.calibration.skew.shape != (L, K, E, E) or self.calibration.channel_mask.shape != (L, K, E):
            raise DuoJaxError("InfiniGen skew data does not match its shapes")
        if not 0 <= self.dense_layers <= L:
            raise DuoJaxError(f"dense_layers must lie in [0, {L}] (the model's layers), got {self.dense_layers}")
        if not self.channel_mask[self.dense_layers :].any(axis=-1).all():
            raise DuoJaxError("every head of a speculating layer needs at least one partial channel")
        object.__setattr__(self, "widths", _widths(self.channel_mask, self.dense_layers))
        hint = " (a token counts when its speculated score is within alpha of its head's top one)"
        object.__setattr__(self, "alpha", check_number("alpha", self.alpha, minimum=0, hint=hint))
        if not isinstance(self.lookahead, (bool, np.bool_)):
            raise DuoJaxError(f"lookahead must be True or False, got {self.lookahead!r}")
        if self.offload not in ("auto", "host", "device"):
            raise DuoJaxError(f"offload must be 'auto', 'host' or 'device', got {self.offload!r}")
        if self.offload == "host" and not host_offload_supported():
            raise DuoJaxError("this backend has no pinned_host memory: use offload='device' or 'auto'")
        if self.kv_budget <= 0:
            raise DuoJaxError(f"kv_budget (tokens kept per KV head) must be positive, got {self.kv_budget}")
        if self.budget_slots is not None:
            object.__setattr__(
                self, "budget_slots", check_slots("budget_slots", self.budget_slots, self.kv_budget, "kv_budget")
            )
        check_kv_dtype(self.kv_dtype)

    def _data_fields(self) -> tuple[str, ...]:
        return ("calibration", "kv_budget") if self.budget_slots is not None else ("calibration",)

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_skew(
        cls, A: np.ndarray, channel_mask: np.ndarray, *, context: int, kv_budget: int, **options
    ) -> InfiniGen:
        """From `skew`'s output; `options`: alpha, offload, lookahead, dense_layers, kv_dtype, budget_slots."""
        A, channel_mask = np.asarray(A, np.float32), np.asarray(channel_mask, bool)
        if channel_mask.shape != A.shape[:-1]:
            raise DuoJaxError(f"channel mask {channel_mask.shape} does not match skew matrices {A.shape}")
        L, K, E, _ = A.shape
        return cls(
            L,
            K,
            E,
            round_capacity(context),
            int(kv_budget),
            InfiniGenState(jnp.asarray(A), jnp.asarray(channel_mask)),
            **options,
        )

    @classmethod
    def calibrate(
        cls,
        params: Params,
        config: ModelConfig,
        sample_tokens,
        *,
        context: int,
        kv_budget: int,
        partial_ratio: float = 0.2,
        channel_rule: str = "qk",
        **options,
    ) -> InfiniGen:
        """Skew on `sample_tokens` (`params` in either layout) and build the method."""
        A, mask = skew(params, config, sample_tokens, partial_ratio=partial_ratio, channel_rule=channel_rule)
        return cls.from_skew(A, mask, context=context, kv_budget=kv_budget, **options)

    def state(self) -> InfiniGenState:
        """The calibration, and with `budget_slots` the budget."""
        if self.budget_slots is None:
            return self.calibration
        return dataclasses.replace(self.calibration, budget=np.int32(self.kv_budget))

    def budget_of(self, state) -> tuple:
        """(the most rows a decode step fetches per KV head: static, the most tokens it attends to per KV head: the
        budget compiled in, or with `budget_slots` the state's, traced)."""
        if self.budget_slots is None:
            return min(self.kv_budget, self.capacity), self.kv_budget
        if getattr(state, "budget", None) is None:  # no state, or the calibration alone (`self.calibration`)
            state = None
        state = runtime_state(state, InfiniGenState, "InfiniGen", "budget_slots", "kv_budget")
        return min(self.budget_slots, self.capacity), state.budget

    @property
    def skew_matrices(self) -> np.ndarray:
        return np.asarray(self.calibration.skew)

    @property
    def channel_mask(self) -> np.ndarray:
        """bool [L, K, E]: each head's partial channels (columns of A-space)."""
        return np.asarray(self.calibration.channel_mask)

    @property
    def host_offload(self) -> bool:
        return self.offload == "host" or (self.offload == "auto" and host_offload_supported())

    # --- cache ------------------------------------------------------------------------------------------

    def init_cache(self, batch: int, dtype) -> tuple[InfiniGenLayerCache, ...]:
        full = (batch, self.capacity, self.num_kv_heads, self.head_dim)
        place = (lambda x: jax.device_put(x, jax.memory.Space.Host)) if self.host_offload else (lambda x: x)

        def zeros():  # the full K or V: in the model's dtype, or quantized
            return jnp.zeros(full, dtype) if self.kv_dtype is None else kv_zeros(full, self.kv_dtype, dtype)

        return tuple(
            InfiniGenLayerCache(place(zeros()), place(zeros()), jnp.zeros(full[:3] + (self.widths[l],), dtype))
            for l in range(self.num_layers)
        )

    def cache_spec(self, batch: int, dtype) -> tuple[InfiniGenLayerCache, ...]:
        if not self.host_offload:
            return super().cache_spec(batch, dtype)
        # A ShapeDtypeStruct with a pinned_host sharding still traces as device memory (JAX 0.10), so the
        # step is lowered with real host arrays: a transient host allocation, per compilation.
        return self.init_cache(batch, dtype)

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        """B * C * K * sum_l (2 V + W_l * bytes): full K and V (V the bytes of one key,
        `duo_jax.quant.kv_bytes_per_vector`: E * bytes, or codes + scale) plus the partial keys (W_l channels in the
        model's dtype, 0 on a dense layer)."""
        vector = kv_bytes_per_vector(self.head_dim, self.kv_dtype, bytes_per_elem)
        return (
            batch
            * self.capacity
            * self.num_kv_heads
            * (2 * vector * self.num_layers + sum(self.widths) * bytes_per_elem)
        )

    # --- host / device helpers ----------------------------------------------------------------------

    def _host_write(self, full, rows: jax.Array, new):
        """full [B, C, K, E] with rows (flat row indices [N], out of range: dropped) set to new [..., E] (N rows,
        already in the cache's form: `as_stored`). A quantized cache writes codes and scales alike."""

        def write(full, new):  # one array: [B, C, K, W] rows <- [..., W]
            flat = full.reshape(-1, full.shape[-1])
            return flat.at[rows].set(new.reshape(-1, full.shape[-1]), mode="drop").reshape(full.shape)

        if not self.host_offload:
            return jax.tree.map(write, full, new)
        rows, new = jax.device_put((rows, new), jax.memory.Space.Host)
        return on_host(lambda full, new: jax.tree.map(write, full, new), full, new)

    def _host_gather(self, full, rows: jax.Array) -> jax.Array:
        """Rows [N] (in range) of full [B, C, K, E] as a device array [N, E] in the model's dtype: only these rows
        move (a quantized cache's codes and scales, dequantized on the device)."""

        def gather(full):
            return full.reshape(-1, full.shape[-1]).at[rows].get(mode="promise_in_bounds")

        if not self.host_offload:
            return dequantize(jax.tree.map(gather, full))
        rows = jax.device_put(rows, jax.memory.Space.Host)
        picked = on_host(lambda full: jax.tree.map(gather, full), full)
        return dequantize(jax.device_put(picked, jax.memory.Space.Device))

    def _to_device(self, full: jax.Array) -> jax.Array:
        return jax.device_put(full, jax.memory.Space.Device) if self.host_offload else full

    # --- attention --------------------------------------------------------------------------------------

    def prepare(self, layer, q, previous_input, weights, config, step):
        """Decode steps speculate one layer ahead (`lookahead`): `lookahead_q` is layer l's query projection of
        layer l-1's attention input (layer 0: its own query)."""
        if not (self.lookahead and step.is_decode):
            return {}
        return {"lookahead_q": q if previous_input is None else project_qkv(previous_input, weights, config)[0]}

    def attend(self, layer, q, k, v, cache: InfiniGenLayerCache, step: Step, shared, lookahead_q=None):
        B, T, H, E = q.shape
        K, C = self.num_kv_heads, self.capacity
        G = H // K
        A = step.state.skew[layer]  # [K, E, E]
        index, weight = partial_channels(step.state.channel_mask[layer], self.widths[layer])  # [K, W]
        q = apply_rotary(q, step.rope)
        k = apply_rotary(k, step.rope)
        # A stays in float32 and the products accumulate there, each rounded once to the model's dtype (A rounded to
        # bf16 first put a second rounding into every attention score)
        skew_q = lambda x: jnp.einsum(  # noqa: E731
            "btkge,kef->btkgf", x.reshape(B, -1, K, G, E), A, preferred_element_type=jnp.float32
        ).reshape(B, -1, H, E)
        qs = skew_q(q).astype(q.dtype)
        ks = jnp.einsum("btke,kef->btkf", k, A, preferred_element_type=jnp.float32).astype(k.dtype)
        kp = jnp.take_along_axis(ks, index[None, None], axis=-1)  # [B, T, K, W]: the speculation's, unquantized
        rotation = kv_rotation_for(self.kv_dtype, E)
        # The quantized full cache holds k A R and v R; exact attention reads q A R.
        exact_q, stored_k, stored_v = rotation.into(qs, ks, v)
        stored_k, stored_v = as_stored(stored_k, cache.k), as_stored(stored_v, cache.v)  # quantized once, here

        # Write this step's tokens (slot = absolute position; padding and overflow dropped).
        slots = jnp.where(step.valid & (step.positions < C), step.positions, C)  # [B, T]
        rows = ((jnp.arange(B)[:, None, None] * C + slots[:, :, None]) * K + jnp.arange(K)).reshape(-1)
        rows = jnp.where(jnp.repeat(slots.reshape(-1) < C, K), rows, B * C * K)
        new_k = self._host_write(cache.k, rows, stored_k)
        new_v = self._host_write(cache.v, rows, stored_v)
        new_partial = write_slots(cache.partial_k, slots, kp)
        new_cache = InfiniGenLayerCache(new_k, new_v, new_partial)

        if not step.is_decode or layer < self.dense_layers:  # exact attention to every cached token and the new
            keys, values = self._to_device(new_k), self._to_device(new_v)
            out = attention.attend(exact_q, keys, values, step.prefix_spec(), impl=step.impl)
            return rotation.back(out), new_cache

        # Decode: speculate with the partial query against the partial keys of the cached tokens. The query is
        # this layer's projection of the previous layer's attention input (`prepare`'s lookahead_q), so the
        # selection, and the fetch of its rows, depend only on what the previous layer had.
        spec = qs if lookahead_q is None else skew_q(apply_rotary(lookahead_q, step.rope)).astype(qs.dtype)
        qp = jnp.take_along_axis(spec[:, 0].reshape(B, K, G, E), index[None, :, None], axis=-1)
        qp = qp * weight.astype(qp.dtype)[None, :, None]  # [B, K, G, W], padding channels zeroed
        approx = jnp.einsum(
            "bkgc,bskc->bkgs", qp, cache.partial_k.astype(qp.dtype), preferred_element_type=jnp.float32
        ) / math.sqrt(E)
        # The cached tokens the query sees: every one, or those within the layer's sliding window. Tokens out
        # of the window are never speculated on, counted or fetched.
        slot_positions = jnp.where(jnp.arange(C)[None, :] < step.lengths[:, None], jnp.arange(C)[None, :], -1)
        cached = step.sees(slot_positions)[:, 0]  # [B, C]
        head_score = jnp.where(cached[:, None], jnp.max(approx, axis=2), -jnp.inf)  # [B, K, C]
        top = jnp.max(head_score, axis=-1, keepdims=True)
        per_head = jnp.sum(cached[:, None] & (head_score >= top - self.alpha), axis=-1)  # [B, K]
        budget, kv_budget = self.budget_of(step.state)  # rows fetched (static), tokens attended to at most
        count = jnp.minimum(jnp.floor(jnp.mean(per_head.astype(jnp.float32), axis=1)), kv_budget)  # [B]
        ranked, chosen = jax.lax.top_k(head_score, budget)  # [B, K, N]
        keep = (jnp.arange(budget)[None, None] < count[:, None, None]) & (ranked > -jnp.inf)

        rows = ((jnp.arange(B)[:, None, None] * C + chosen) * K + jnp.arange(K)[None, :, None]).reshape(-1)
        sel_k = self._host_gather(cache.k, rows).reshape(B, K, budget, E)
        sel_v = self._host_gather(cache.v, rows).reshape(B, K, budget, E)
        # [B, K, N + 1, E]: the fetched rows, then the current token (as the cache stores it)
        keys = jnp.concatenate([sel_k.astype(q.dtype), jnp.swapaxes(dequantize(stored_k), 1, 2).astype(q.dtype)], 2)
        values = jnp.concatenate([sel_v.astype(v.dtype), jnp.swapaxes(dequantize(stored_v), 1, 2).astype(v.dtype)], 2)
        mask = jnp.concatenate([keep, jnp.ones((B, K, 1), bool)], axis=2)[:, :, None]  # [B, K, 1, N + 1]
        out, _ = attention_probs(exact_q, keys, values, mask)
        return rotation.back(out), new_cache


def _widths(channel_mask: np.ndarray, dense_layers: int) -> tuple[int, ...]:
    """W_l: the most partial channels a head of layer l has (0 for the dense layers): the partial cache's width."""
    return tuple(0 if l < dense_layers else int(m.sum(axis=-1).max()) for l, m in enumerate(channel_mask))


def partial_channels(mask: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
    """(index int32 [K, W], weight [K, W]) of one layer's partial channels (mask bool [K, E]): each head's
    channels in ascending order, padded to W with a channel at weight 0 (W = 0: dense layer). Traced, so a
    recalibrated mask of the same widths reuses the compiled step."""
    index = jnp.argsort(~mask, axis=-1, stable=True)[:, :width].astype(jnp.int32)  # chosen channels first
    return index, jnp.take_along_axis(mask, index, axis=-1).astype(jnp.float32)


@register(
    "infinigen",
    budget=kv_budget_only,
    calibrated_on=CALIBRATION_HAYSTACK,
    summary="InfiniGen: skewed partial keys pick the tokens each decode step fetches (calibrated on the model)",
)
def make_infinigen(
    config: ModelConfig,
    *,
    context: int,
    model,
    kv_budget: int | None = None,
    alpha: float = LLAMA_ALPHA,
    partial_ratio: float = 0.2,
    channel_rule: str = "qk",
    dense_layers: int = DENSE_LAYERS,
    offload: str = "auto",
    lookahead: bool = True,
    kv_dtype: str | None = None,
    budget_slots: int | None = None,
) -> InfiniGen:
    """InfiniGen for `model` with the authors' Llama rules by default, skewed on a sample of the calibration
    essays (`skew_on_text`, once per set of weights and rules: later builds reuse it); `kv_budget`: tokens
    fetched per KV head and step; `kv_dtype` "int8" / "int4" quantizes the full K / V (not the partial keys);
    `budget_slots`: rows fetched per KV head and step (>= kv_budget), the budget runtime data, so that InfiniGen at
    other budgets up to it runs the same executables."""
    if kv_budget is None:
        raise DuoJaxError("method 'infinigen' needs a positive kv_budget (tokens fetched per KV head)")
    A, mask = _skew_of(model, partial_ratio, channel_rule)
    return InfiniGen.from_skew(
        A,
        mask,
        context=context,
        kv_budget=int(kv_budget),
        alpha=alpha,
        dense_layers=dense_layers,
        offload=offload,
        lookahead=lookahead,
        kv_dtype=kv_dtype,
        budget_slots=budget_slots,
    )


def _skew_of(model, partial_ratio: float, channel_rule: str):
    """`skew_on_text` of `model`, once per set of weights and rules (`duo_jax.model.weights_memo`)."""
    key = ("infinigen skew", id(model.tokenizer), float(partial_ratio), channel_rule)
    with building(model.params, key) as memo:  # calibrated once, however many threads ask first
        if key not in memo:
            memo[key] = skew_on_text(
                model.params, model.config, model.tokenizer, partial_ratio=partial_ratio, channel_rule=channel_rule
            )
        return memo[key]
