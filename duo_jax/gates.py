"""DuoAttention's gate-training objective: the gated (mixed-attention) model and its distillation loss.

One trainable float32 gate alpha[l, k] per layer l and KV head k (covering its group of query heads); every model
weight is frozen. Each layer's per-head attention output before the output projection is

    attn = alpha * full_attn + (1 - alpha) * streaming_attn

with `streaming_attn` under the Λ mask (and the layer's sliding window, if any), and `full_attn` the teacher's
full-attention output of the same layer. The loss is

    L = sum_{supervised t} mean_D (teacher_t - student_t)^2 / #supervised  +  reg_weight * mean |alpha|

over the final hidden states (after the final RMSNorm) of the full-attention model and the gated one. At alpha = 1
everywhere the student is the teacher (loss exactly 0). `loss` and `distill_terms` compute it (with hooks for the
sharded trainer); `gated_hidden_states` runs both models in one scan. Design: docs/training.md, "The objective".

Dimension letters as in `duo_jax.model`: B batch, T positions, D model width, H query heads, K KV heads,
G query heads per KV head, E head_dim, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from duo_jax import attention
from duo_jax.config import ModelConfig
from duo_jax.model import (
    LayerParams,
    Params,
    apply_rotary,
    check_tokens,
    decoder_layer,
    embed,
    rms_norm,
    rope_inv_freq,
    rotary,
    scan_layers,
)

# q [B, T, H, E], k / v [B, T, K, E] -> [B, T, H, E]
AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]
# The name of the only activation the rematerialised layer body keeps for the backward pass.
REMAT_SAVED = "teacher_attention"


@dataclasses.dataclass(frozen=True)
class Objective:
    """The training objective's hyper-parameters (defaults: the original's training run).

    sink / recent: the streaming branch's Λ window. reg_weight: lambda of the L1 term.
    impl: attention implementation, see `duo_jax.attention` ("auto": Pallas on GPU, Mosaic on TPU, the blocked
    XLA path elsewhere).
    """

    sink: int = 128
    recent: int = 256
    reg_weight: float = 0.05
    impl: attention.Impl = "auto"

    def full_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset=0, window: int | None = None
    ) -> jax.Array:
        """Causal attention (within the layer's sliding `window`, the model's); query i sits at position
        q_offset + i of the keys (a sequence shard's offset)."""
        return attention.flash_attention(q, k, v, causal=True, q_offset=q_offset, window=window, impl=self.impl)

    def streaming_attention(
        self, q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset=0, window: int | None = None
    ) -> jax.Array:
        """Λ attention (and the layer's sliding `window`: a sink further back than it is not seen, as in the
        engine's streaming heads); query i sits at position q_offset + i of the keys."""
        return attention.lambda_attention(
            q, k, v, sink=self.sink, recent=self.recent, q_offset=q_offset, window=window, impl=self.impl
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LossTerms:
    """What one evaluation of the objective reports (float32 scalars)."""

    loss: jax.Array  # distill + reg_weight * l1
    distill: jax.Array  # the distillation term
    l1: jax.Array  # mean |alpha| (before the reg_weight factor)


def init_gates(config: ModelConfig, value: float = 1.0) -> jax.Array:
    """Every gate `value` (the original starts at 1.0: all heads full): float32 [L, K]."""
    return jnp.full((config.num_layers, config.num_kv_heads), value, jnp.float32)


def clamp(gates: jax.Array) -> jax.Array:
    """Project the gates back onto [0, 1] (done after every optimiser step; no sigmoid)."""
    return jnp.clip(gates, 0.0, 1.0)


def gated_hidden_states(
    params: Params,
    config: ModelConfig,
    gates: jax.Array,
    tokens: jax.Array,
    positions: jax.Array,
    objective: Objective,
    *,
    wrap_attention: Callable[[AttentionFn], AttentionFn] = lambda f: f,
    layer_weights: Callable[[LayerParams], LayerParams] = lambda layer: layer,
    embed_tokens: Callable[[Params, jax.Array], jax.Array] = embed,
) -> tuple[jax.Array, jax.Array]:
    """Final normed hidden states of the teacher (full attention) and the gated student.

    tokens int32 [B, T] at absolute `positions` int32 [B, T]; gates float32 [L, K].
    Returns (teacher, student), each [B, T, D] in the params' dtype. The hooks are identities here; the
    sharded trainer (`duo_jax.training`) passes its own: `wrap_attention` transforms both attention
    functions (sequence parallelism), `layer_weights` turns one layer's stored weights into the whole
    layer inside the scanned body (an all-gather of FSDP shards), `embed_tokens(params, tokens)` embeds.
    """
    if gates.shape != (config.num_layers, config.num_kv_heads):
        raise ValueError(
            f"gates must have shape [layers, kv_heads] = {(config.num_layers, config.num_kv_heads)}, got {gates.shape}"
        )
    rope = rotary(positions, rope_inv_freq(config))
    eps = config.rms_norm_eps

    def rotate(q, k):
        return apply_rotary(q, rope), apply_rotary(k, rope)

    def layer_step(carry, layer, gate, window):  # LayerParams of one layer, gate [K]
        full_attention = wrap_attention(functools.partial(objective.full_attention, window=window))
        streaming_attention = wrap_attention(functools.partial(objective.streaming_attention, window=window))

        def teacher_attend(q, k, v, h):  # the frozen model with full attention everywhere
            full = checkpoint_name(full_attention(*rotate(q, k), v), REMAT_SAVED)  # [B, T, H, E]
            return full, full

        x_teacher, x_student = carry  # [B, T, D] each
        layer = layer_weights(layer)  # inside the rematerialised body: gathered again, never saved
        x_teacher, full = decoder_layer(x_teacher, layer, config, teacher_attend)

        def student_attend(q, k, v, h):  # per head, the teacher's full output mixed with its own streaming one
            streaming = streaming_attention(*rotate(q, k), v)  # [B, T, H, E]
            alpha = jnp.repeat(gate, config.group_size)[None, None, :, None]  # [1, 1, H, 1], float32
            mixed = alpha * jax.lax.stop_gradient(full).astype(jnp.float32) + (1.0 - alpha) * streaming.astype(
                jnp.float32
            )
            return mixed.astype(x_student.dtype), None

        x_student, _ = decoder_layer(x_student, layer, config, student_attend)
        return (x_teacher, x_student), None

    def make_body(window):  # the layers of one window run (`scan_layers`), their body rematerialised
        return jax.checkpoint(
            functools.partial(layer_step, window=window),
            policy=jax.checkpoint_policies.save_only_these_names(REMAT_SAVED),
        )

    x = embed_tokens(params, tokens)  # [B, T, D]
    (x_teacher, x_student), _ = scan_layers(make_body, (x, x), config, params.layers, gates)
    return rms_norm(x_teacher, params.final_norm, eps), rms_norm(x_student, params.final_norm, eps)


def distill_terms(
    gates: jax.Array,
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    supervise: jax.Array,
    objective: Objective,
    **hooks,
) -> tuple[jax.Array, jax.Array]:
    """The distillation term's sum and count over the positions in hand (a shard, or everything).

    supervise bool [B, T]: the positions the loss compares (padding is False). Returns float32 scalars
    (sum over supervised positions of mean_D (teacher - student)^2, number of supervised positions).
    `hooks`: `gated_hidden_states`' keyword arguments (wrap_attention, layer_weights, embed_tokens).
    """
    teacher, student = gated_hidden_states(params, config, gates, tokens, positions, objective, **hooks)
    diff = teacher.astype(jnp.float32) - student.astype(jnp.float32)  # [B, T, D]
    per_position = jnp.mean(diff * diff, axis=-1)  # [B, T]
    weight = supervise.astype(jnp.float32)
    return jnp.sum(per_position * weight), jnp.sum(weight)


def l1_term(gates: jax.Array) -> jax.Array:
    """mean |alpha| over every gate, with the original's gradient: PyTorch's `abs` has derivative 0 at 0, JAX's 1,
    so a gate clamped to exactly 0 would keep the L1 push here and not there. sign(x) * x has sign(x) as its
    derivative (sign's own is 0)."""
    return jnp.mean(jnp.sign(gates) * gates)


def loss(
    gates: jax.Array,
    params: Params,
    config: ModelConfig,
    tokens: jax.Array,
    positions: jax.Array,
    supervise: jax.Array,
    objective: Objective,
) -> tuple[jax.Array, LossTerms]:
    """The objective on one device: (loss, LossTerms); differentiate with respect to `gates` (argument 0).

    Sequences with no supervised position contribute nothing (the count is floored at 1). Concrete `tokens` are
    checked as `forward` checks them (an id past the vocabulary was clamped: every token the same row, distillation
    0, a loss that looked healthy).
    """
    check_tokens(tokens, config.vocab_size)
    total, count = distill_terms(gates, params, config, tokens, positions, supervise, objective)
    distill = total / jnp.maximum(count, 1.0)
    l1 = l1_term(gates)
    value = distill + objective.reg_weight * l1
    return value, LossTerms(loss=value, distill=distill, l1=l1)
