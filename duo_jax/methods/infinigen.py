"""InfiniGen: the full KV cache in host memory, and per decode step only the tokens a cheap speculation
predicts to matter are fetched and attended to exactly.

Offline skewing (`skew`): the dense model runs on a sample prompt; per layer and KV head the rotated (post-RoPE)
queries of the head's query group are stacked into Q [T*G, E] and A = V from the SVD Q = U S V^T (the right
singular vectors, as InfiniGen). A is orthogonal, so (QA)(KA)^T = QK^T: attention is unchanged, but QA = US
concentrates the query's energy in few columns. The partial channels are the c = ceil(partial_ratio * E)
columns of A-space with the largest sum over the sample's tokens (and the group's query heads) of |QA|:
the paper's partial weight index generation ranks columns by their absolute sum over the skewed query
("计算所有列的绝对和 ... 选择最重要的列索引", seed 004), which is what a partial dot product over those
columns loses least by. The sample's keys are not needed for this rule.

Because RoPE rotates q and k before skewing could be folded into the weights, A is applied at runtime to the
rotated q and k. Per layer the cache holds every token's skewed K and V ([B, C, K, E], C = the context rounded
to `duo_jax.cache.CAPACITY_BLOCK`, slot = absolute position) and a partial key cache [B, C, K, c] (the c
selected skewed channels, on the device, as the paper keeps it on the GPU).

Steps:
  prefill chunks (T > 1) attend exactly to every cached token plus the chunk causally (full attention);
  decode (T == 1): the partial speculative query (the c channels of the skewed query that layer i's weights
      make of layer i-1's attention input, see below) times the partial keys gives
      approximate scores (scaled by 1/sqrt(E), i.e. softmax logits); per KV head the max over its query
      group; a head keeps the tokens scoring >= its max - alpha; the count is averaged over the layer's KV
      heads (ceil), capped by the static `kv_budget`; each head takes its top_k(kv_budget) tokens and masks
      ranks >= count; exact attention over those rows (gathered from the full cache) plus the current token.

As the paper, layer i speculates from layer i-1's attention input: the engine (`Method.lookahead`) hands each
decode step's `attend` that input projected by layer i's query weights (`lookahead_q`; layer 0 uses its own
input), which is rotated, skewed and cut to the partial channels here. The selection and the gather of the
selected rows thus depend only on layer i-1's input, so XLA may overlap them with layer i-1's compute (the
schedule is XLA's; the overlap is not measured). `lookahead=False` speculates from the layer's own query.
Deviations: the full query projection is computed (one token per step) rather than only the partial columns
of a skewed weight (RoPE sits between the projection and the skew, so the skew cannot be folded into the
weights). The partial channels are fixed offline on the sample prompt rather than regenerated per prompt at
prefill, and there is no counter-based eviction of the host pool (the host cache has a fixed capacity).

Memory placement: where the backend exposes the `pinned_host` memory kind (`host_offload_supported()`), the
full K / V live there between steps (offload="auto" or "host"); writes and the gather of selected rows run on
the host (`compute_on("device_host")`) and only the gathered rows move to the device (the whole cache moves
only for prefill chunks, which attend to all of it). Elsewhere (offload="device", or "auto" without support)
the same code runs with the full cache in device memory.
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
from duo_jax.cache import round_capacity
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.methods.base import Method, Step, write_slots
from duo_jax.model import Params, apply_rope, decoder_layer, embed, rope_inv_freq


@functools.lru_cache(maxsize=None)
def host_offload_supported() -> bool:
    """Whether the default device has a `pinned_host` memory and runs host computations (compute_on)."""
    try:
        import jax.experimental.compute_on  # noqa: F401  (the import is the check)
        kinds = {m.kind for m in jax.devices()[0].addressable_memories()}
    except Exception:  # noqa: BLE001 - a backend without memory kinds
        return False
    return "pinned_host" in kinds and hasattr(jax, "memory")


def num_partial_channels(head_dim: int, partial_ratio: float) -> int:
    if not 0 < partial_ratio <= 1:
        raise DuoJaxError(f"partial_ratio must lie in (0, 1], got {partial_ratio}")
    return max(1, math.ceil(partial_ratio * head_dim - 1e-9))


def _layer_qk(params: Params, config: ModelConfig, tokens) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rotated queries [T, H, E] and keys [T, K, E] of each layer of the dense model on `tokens` [T]."""
    tokens = jnp.asarray(np.asarray(tokens, np.int32))[None]
    T = tokens.shape[1]
    positions = jnp.arange(T, dtype=jnp.int32)[None]
    inv_freq = rope_inv_freq(config)
    spec = attention.prefix_spec(1, T, num_keys=T, window=config.sliding_window)

    def attend(q, k, v, h):
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return attention.attend(q, k, v, spec), (q[0], k[0])

    x = embed(params, tokens)
    out = []
    for l in range(config.num_layers):
        x, (q, k) = decoder_layer(x, jax.tree.map(lambda w, l=l: w[l], params.layers), config, attend)
        out.append((np.asarray(q, np.float32), np.asarray(k, np.float32)))
    return out


def skew(params: Params, config: ModelConfig, sample_tokens, *, partial_ratio: float = 0.2):
    """(A float32 [L, K, E, E], channels int32 [L, K, c]) from the dense model on `sample_tokens`.

    A[l, k] = V of the SVD of the group's stacked rotated queries Q [T*G, E] (float64); channels[l, k] are
    the c = ceil(partial_ratio * E) columns with the largest sum_{tokens, group heads} |Q A| (ascending order).
    """
    L, K, G, E = config.num_layers, config.num_kv_heads, config.group_size, config.head_dim
    c = num_partial_channels(E, partial_ratio)
    A = np.zeros((L, K, E, E), np.float32)
    channels = np.zeros((L, K, c), np.int32)
    for l, (q, _) in enumerate(_layer_qk(params, config, sample_tokens)):
        for h in range(K):
            Q = q[:, h * G:(h + 1) * G].reshape(-1, E).astype(np.float64)
            _, _, vt = np.linalg.svd(Q, full_matrices=Q.shape[0] < E)
            A[l, h] = vt.T
            magnitude = np.abs(Q @ vt.T).sum(axis=0)
            channels[l, h] = np.sort(np.argsort(-magnitude, kind="stable")[:c])
    return A, channels


def skew_on_text(params: Params, config: ModelConfig, tokenizer, *, sample_length: int = 512,
                 partial_ratio: float = 0.2):
    """`skew` on the first `sample_length` tokens of the Paul Graham essays (the NIAH haystack, without a needle:
    the skew captures the query projections' dominant channels, not the content)."""
    from duo_jax.data.haystack import haystack_tokens

    if tokenizer is None:
        raise DuoJaxError("InfiniGen calibrates on text and needs the model's tokenizer; without one, build it "
                          "with InfiniGen.calibrate(params, config, sample_tokens, ...)")
    tokens = np.asarray(haystack_tokens(tokenizer, "paul_graham", sample_length), np.int32)
    return skew(params, config, tokens, partial_ratio=partial_ratio)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class InfiniGenLayerCache:
    k: jax.Array  # [B, C, K, E] skewed rotated keys, slot = absolute position (pinned_host when offloaded)
    v: jax.Array  # [B, C, K, E] values (pinned_host when offloaded)
    partial_k: jax.Array  # [B, C, K, c] the selected channels of the skewed keys (device)


@dataclasses.dataclass(frozen=True)
class InfiniGen(Method):
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_channels: int  # c
    capacity: int  # C: slots per head (context rounded up)
    kv_budget: int  # the most tokens a decode step fetches per KV head
    skew_bytes: bytes = dataclasses.field(repr=False)  # A float32 [L, K, E, E] then channels int32 [L, K, c]
    alpha: float = 4.0
    offload: str = "auto"  # "auto" | "host" | "device"
    lookahead: bool = True  # decode steps speculate from the previous layer's attention input (False: own layer)

    name = "infinigen"

    def __post_init__(self):
        L, K, E, c = self.num_layers, self.num_kv_heads, self.head_dim, self.num_channels
        if len(self.skew_bytes) != 4 * L * K * (E * E + c):
            raise DuoJaxError("InfiniGen skew data does not match its shapes")
        if self.offload not in ("auto", "host", "device"):
            raise DuoJaxError(f"offload must be 'auto', 'host' or 'device', got {self.offload!r}")
        if self.offload == "host" and not host_offload_supported():
            raise DuoJaxError("this backend has no pinned_host memory: use offload='device' or 'auto'")
        if self.kv_budget <= 0:
            raise DuoJaxError(f"kv_budget (tokens kept per KV head) must be positive, got {self.kv_budget}")

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_skew(cls, A: np.ndarray, channels: np.ndarray, *, context: int, kv_budget: int, alpha: float = 4.0,
                  offload: str = "auto") -> "InfiniGen":
        A = np.ascontiguousarray(A, np.float32)
        channels = np.ascontiguousarray(channels, np.int32)
        L, K, E, _ = A.shape
        return cls(L, K, E, channels.shape[-1], round_capacity(context), int(kv_budget),
                   A.tobytes() + channels.tobytes(), float(alpha), offload)

    @classmethod
    def calibrate(cls, params: Params, config: ModelConfig, sample_tokens, *, context: int, kv_budget: int,
                  alpha: float = 4.0, partial_ratio: float = 0.2, offload: str = "auto") -> "InfiniGen":
        """Skew on `sample_tokens` (stacked `params`, as `init_params` / loading give) and build the method."""
        A, channels = skew(params, config, sample_tokens, partial_ratio=partial_ratio)
        return cls.from_skew(A, channels, context=context, kv_budget=kv_budget, alpha=alpha, offload=offload)

    @property
    def skew_matrices(self) -> np.ndarray:
        L, K, E = self.num_layers, self.num_kv_heads, self.head_dim
        return np.frombuffer(self.skew_bytes, np.float32, L * K * E * E).reshape(L, K, E, E)

    @property
    def channels(self) -> np.ndarray:
        L, K, E, c = self.num_layers, self.num_kv_heads, self.head_dim, self.num_channels
        return np.frombuffer(self.skew_bytes, np.int32, L * K * c, offset=4 * L * K * E * E).reshape(L, K, c)

    @property
    def host_offload(self) -> bool:
        return self.offload == "host" or (self.offload == "auto" and host_offload_supported())

    # --- cache ------------------------------------------------------------------------------------------

    def init_cache(self, batch: int, dtype) -> tuple[InfiniGenLayerCache, ...]:
        full = (batch, self.capacity, self.num_kv_heads, self.head_dim)
        partial = (batch, self.capacity, self.num_kv_heads, self.num_channels)
        place = ((lambda x: jax.device_put(x, jax.memory.Space.Host)) if self.host_offload else (lambda x: x))
        return tuple(InfiniGenLayerCache(place(jnp.zeros(full, dtype)), place(jnp.zeros(full, dtype)),
                                         jnp.zeros(partial, dtype))
                     for _ in range(self.num_layers))

    def cache_spec(self, batch: int, dtype) -> tuple[InfiniGenLayerCache, ...]:
        if not self.host_offload:
            return super().cache_spec(batch, dtype)
        # A ShapeDtypeStruct with a pinned_host sharding still traces as device memory (JAX 0.10), so the
        # step is lowered with real host arrays: a transient host allocation, per compilation.
        return self.init_cache(batch, dtype)

    def expected_cache_bytes(self, batch: int, bytes_per_elem: int) -> int:
        """B * L * C * K * (2E + c) * bytes: full K and V plus the partial keys."""
        return (batch * self.num_layers * self.capacity * self.num_kv_heads
                * (2 * self.head_dim + self.num_channels) * bytes_per_elem)

    # --- host / device helpers ----------------------------------------------------------------------

    def _host_write(self, full: jax.Array, rows: jax.Array, new: jax.Array) -> jax.Array:
        """full [B, C, K, E] with rows (flat row indices [N], out of range: dropped) set to new [N, E]."""
        B, C, K, E = full.shape
        if not self.host_offload:
            return full.reshape(B * C * K, E).at[rows].set(new.astype(full.dtype), mode="drop").reshape(full.shape)
        from jax.experimental.compute_on import compute_on
        rows, new = jax.device_put(rows, jax.memory.Space.Host), jax.device_put(new.astype(full.dtype),
                                                                              jax.memory.Space.Host)
        with compute_on("device_host"):
            out = full.reshape(B * C * K, E).at[rows].set(new, mode="drop").reshape(full.shape)
        return out

    def _host_gather(self, full: jax.Array, rows: jax.Array) -> jax.Array:
        """Rows [N] (in range) of full [B, C, K, E] as a device array [N, E]: only these rows move."""
        B, C, K, E = full.shape
        if not self.host_offload:
            return full.reshape(B * C * K, E).at[rows].get(mode="promise_in_bounds")
        from jax.experimental.compute_on import compute_on
        rows = jax.device_put(rows, jax.memory.Space.Host)
        with compute_on("device_host"):
            picked = full.reshape(B * C * K, E).at[rows].get(mode="promise_in_bounds")
        return jax.device_put(picked, jax.memory.Space.Device)

    def _to_device(self, full: jax.Array) -> jax.Array:
        return jax.device_put(full, jax.memory.Space.Device) if self.host_offload else full

    # --- attention --------------------------------------------------------------------------------------

    def attend(self, layer, q, k, v, cache: InfiniGenLayerCache, step: Step, shared, lookahead_q=None):
        B, T, H, E = q.shape
        K, C = self.num_kv_heads, self.capacity
        G = H // K
        A = jnp.asarray(self.skew_matrices[layer])  # [K, E, E]
        channels = self.channels[layer]  # [K, c] (static)
        q = apply_rope(q, step.positions, step.inv_freq)
        k = apply_rope(k, step.positions, step.inv_freq)
        skew_q = lambda x: jnp.einsum("btkge,kef->btkgf", x.reshape(B, -1, K, G, E),  # noqa: E731
                                      A.astype(x.dtype)).reshape(B, -1, H, E)
        qs = skew_q(q)
        ks = jnp.einsum("btke,kef->btkf", k, A.astype(k.dtype))
        kp = jnp.stack([ks[:, :, h, channels[h]] for h in range(K)], axis=2)  # [B, T, K, c]

        # Write this step's tokens (slot = absolute position; padding and overflow dropped).
        slots = jnp.where(step.valid & (step.positions < C), step.positions, C)  # [B, T]
        rows = ((jnp.arange(B)[:, None, None] * C + slots[:, :, None]) * K + jnp.arange(K)).reshape(-1)
        rows = jnp.where(jnp.repeat(slots.reshape(-1) < C, K), rows, B * C * K)
        new_k = self._host_write(cache.k, rows, ks.reshape(-1, E))
        new_v = self._host_write(cache.v, rows, v.reshape(-1, E))
        new_partial = write_slots(cache.partial_k, slots, kp)
        new_cache = InfiniGenLayerCache(new_k, new_v, new_partial)

        if not step.is_decode:  # prefill chunk: exact attention to every cached token and the chunk
            keys, values = self._to_device(new_k), self._to_device(new_v)
            out = attention.attend(qs, keys.astype(q.dtype), values.astype(v.dtype), step.prefix_spec(), impl=step.impl)
            return out, new_cache

        # Decode: speculate with the partial query against the partial keys of the cached tokens. The query is
        # this layer's projection of the previous layer's attention input (the engine's lookahead_q), so the
        # selection, and the fetch of its rows, depend only on what the previous layer had.
        spec = qs if lookahead_q is None else skew_q(apply_rope(lookahead_q, step.positions, step.inv_freq))
        qp = jnp.stack([spec[:, 0, h * G:(h + 1) * G][..., channels[h]] for h in range(K)], axis=1)  # [B, K, G, c]
        approx = jnp.einsum("bkgc,bskc->bkgs", qp, cache.partial_k.astype(qp.dtype),
                            preferred_element_type=jnp.float32) / math.sqrt(E)
        cached = jnp.arange(C)[None, :] < step.lengths[:, None]  # [B, C]
        head_score = jnp.where(cached[:, None], jnp.max(approx, axis=2), -jnp.inf)  # [B, K, C]
        top = jnp.max(head_score, axis=-1, keepdims=True)
        per_head = jnp.sum(cached[:, None] & (head_score >= top - self.alpha), axis=-1)  # [B, K]
        count = jnp.minimum(jnp.ceil(jnp.mean(per_head.astype(jnp.float32), axis=1)), self.kv_budget)  # [B]
        budget = min(self.kv_budget, C)
        ranked, chosen = jax.lax.top_k(head_score, budget)  # [B, K, N]
        keep = (jnp.arange(budget)[None, None] < count[:, None, None]) & (ranked > -jnp.inf)

        rows = ((jnp.arange(B)[:, None, None] * C + chosen) * K + jnp.arange(K)[None, :, None]).reshape(-1)
        sel_k = self._host_gather(cache.k, rows).reshape(B, K, budget, E)
        sel_v = self._host_gather(cache.v, rows).reshape(B, K, budget, E)
        keys = jnp.concatenate([sel_k.astype(q.dtype), jnp.swapaxes(ks, 1, 2)], axis=2)  # [B, K, N + 1, E]
        values = jnp.concatenate([sel_v.astype(v.dtype), jnp.swapaxes(v, 1, 2)], axis=2)
        mask = jnp.concatenate([keep, jnp.ones((B, K, 1), bool)], axis=2)[:, :, None]  # [B, K, 1, N + 1]
        out, _ = attention_probs(qs, keys, values, mask)
        return out, new_cache
