"""Flax NNX front: `CausalLM`, an `nnx.Module` over the same arrays as `duo_jax.model.Params`, and `Gate`.

A thin front with no math of its own: `CausalLM` holds every weight of a `Params` as an `nnx.Param` (the very same
arrays: `to_params` copies nothing), its `__call__` is `duo_jax.forward`, its gate objective `duo_jax.gates.loss`
and its `generate` `duo_jax.generate`. Layers are stacked ([L, ...]); the gates are one `Gate` variable [L, K].
Filters: `nnx.Param` selects weights and gates, `Gate` the gates, `WEIGHTS` the weights only;
`nnx.Optimizer(model, tx, wrt=Gate)` with `train_step` trains the gates as `duo_jax.training` does.
Design: docs/engine.md, "The Flax front".
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from duo_jax import gates as gates_lib
from duo_jax import generation, methods
from duo_jax.config import ModelConfig
from duo_jax.errors import DuoJaxError
from duo_jax.loading import Model, load
from duo_jax.model import LayerParams, Params, check_tokens, forward_jit, stack_layers, weight_format
from duo_jax.pattern import Pattern, PatternError, exact_sparsity

ATTENTION_FIELDS = ("wq", "wk", "wv", "wo", "bq", "bk", "bv", "q_norm", "k_norm")
MLP_FIELDS = ("w_gate", "w_up", "w_down")
NORM_FIELDS = ("attn_norm", "mlp_norm")
BATCH_NAMES = ("tokens", "positions", "supervise")


class Gate(nnx.Param):
    """DuoAttention gates alpha, float32 [L, K]: 1 keeps a KV head's full attention, 0 makes it streaming."""


WEIGHTS = nnx.All(nnx.Param, nnx.Not(Gate))  # the frozen model weights: every Param that is not a Gate


def _param(x: jax.Array | None) -> nnx.Param | None:
    return None if x is None else nnx.Param(x)


def _array(variable: nnx.Variable | None) -> jax.Array | None:
    return None if variable is None else variable[...]  # the stored array itself, not a copy


class Attention(nnx.Module):
    """The attention weights of every layer, stacked on L, and the layers' gates (`gate`, Gate [L, K])."""

    def __init__(self, layers: LayerParams, gates: jax.Array):
        for name in ATTENTION_FIELDS:
            setattr(self, name, _param(getattr(layers, name)))
        self.gate = Gate(gates)


class MLP(nnx.Module):
    """The SwiGLU weights of every layer, stacked on L."""

    def __init__(self, layers: LayerParams):
        for name in MLP_FIELDS:
            setattr(self, name, nnx.Param(getattr(layers, name)))


class DecoderLayers(nnx.Module):
    """Every decoder layer, stacked on a leading axis L: norms, `attention` (with the gates), `mlp`."""

    def __init__(self, layers: LayerParams, gates: jax.Array):
        for name in NORM_FIELDS:
            setattr(self, name, nnx.Param(getattr(layers, name)))
        self.attention = Attention(layers, gates)
        self.mlp = MLP(layers)

    def to_params(self) -> LayerParams:
        arrays = {name: _array(getattr(self, name)) for name in NORM_FIELDS}
        arrays.update({name: _array(getattr(self.attention, name)) for name in ATTENTION_FIELDS})
        arrays.update({name: _array(getattr(self.mlp, name)) for name in MLP_FIELDS})
        return LayerParams(**arrays)


def _initial_gates(config: ModelConfig, gates: Pattern | float | Any | None) -> jax.Array:
    """Gates float32 [L, K] from None (all 1, the original's start), a number, a `Pattern` or an array."""
    if gates is None:
        return gates_lib.init_gates(config)
    if isinstance(gates, Pattern):
        gates.validate(config)
        return jnp.asarray(gates.gates)
    try:
        values = np.asarray(gates)
    except (TypeError, ValueError):
        values = None
    numeric = values is not None and any(jnp.issubdtype(values.dtype, kind) for kind in (jnp.integer, jnp.floating))
    if not numeric:  # a string or a bool would otherwise convert ("0.5" to 0.5, True to 1)
        raise DuoJaxError(
            f"gates must be None, a number, a Pattern or an array [layers, kv_heads] of numbers (not strings or "
            f"bools), got {gates!r:.80}"
        )
    values = values.astype(np.float32)
    if values.ndim == 0:
        values = np.full((config.num_layers, config.num_kv_heads), values)
    if values.shape != (config.num_layers, config.num_kv_heads):
        raise PatternError(
            f"gates must have shape [layers, kv_heads] = {(config.num_layers, config.num_kv_heads)}"
            f" for model {config.name!r}, got {values.shape}"
        )
    if not ((values >= 0) & (values <= 1)).all():
        raise DuoJaxError(
            f"gates must lie in [0, 1] (training clamps them there), got values in [{values.min()}, {values.max()}]"
        )
    return jnp.asarray(values)


def _as_array(x: Any, what: str) -> jax.Array | np.ndarray:
    """A JAX array as it is; anything else (a nested list too) as a numpy array, as `duo_jax.forward` takes tokens."""
    if isinstance(x, jax.Array):
        return x
    try:
        return np.asarray(x)
    except ValueError:  # rows of different lengths
        raise DuoJaxError(f"{what} must be rows of one length (an array [batch, length]); pad them") from None


def _check_batch(config: ModelConfig, tokens: Any, positions: Any, supervise: Any) -> tuple[Any, Any, Any]:
    """A gate-training batch as arrays, checked: tokens as `__call__` checks them, positions and supervise of the
    tokens' shape, and (where concrete) some position supervised, else only the L1 term would move the gates."""
    tokens, positions, supervise = (_as_array(x, n) for x, n in zip((tokens, positions, supervise), BATCH_NAMES))
    check_tokens(tokens, config.vocab_size)
    if positions.shape != tokens.shape or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise DuoJaxError(
            f"positions must be an integer array shaped like tokens, [batch, length] = {tuple(tokens.shape)}; "
            f"got {positions.dtype} of shape {tuple(positions.shape)}"
        )
    if supervise.shape != tokens.shape:
        raise DuoJaxError(
            f"supervise must be a bool array shaped like tokens, [batch, length] = {tuple(tokens.shape)}; "
            f"got shape {tuple(supervise.shape)}"
        )
    if not isinstance(supervise, jax.core.Tracer) and not np.asarray(supervise).any():
        raise DuoJaxError(
            "supervise selects no position (all False), so the distillation term is 0 and only the L1 term would "
            "move the gates; mark the positions the loss compares (True where a token is not padding)"
        )
    return tokens, positions, supervise


def _check_float_weights(params: Params) -> None:
    """The module's weights are `nnx.Param` arrays it indexes and trains around: int8 weights (`duo_jax.load(...,
    weights="int8")`) are refused here, not at the first call."""
    if weight_format(params) is not None:
        raise DuoJaxError(
            "CausalLM does not take int8 weights (loaded with weights='int8'); load the model without weights= "
            "for the Flax module, or run the int8 model with duo_jax.generate"
        )


class CausalLM(nnx.Module):
    """A Llama / Mistral / Qwen causal LM as an NNX module over the arrays of a `Params`, with gates.

    `model(tokens)` is `duo_jax.forward` (dense full attention; the gates take no part). Build it with
    `from_model` or `from_pretrained`; `to_params()` gives the `Params` back (the same arrays).
    """

    def __init__(
        self,
        config: ModelConfig,
        params: Params,
        gates: Pattern | float | Any | None = None,
        *,
        tokenizer=None,
        source: str = "",
        names: tuple[str, ...] = (),
    ):
        """`params` with stacked layers (`duo_jax.model.stack_layers`)."""
        _check_float_weights(params)
        if isinstance(params.layers, tuple):
            raise DuoJaxError(
                "CausalLM holds its layers stacked: pass duo_jax.model.stack_layers(params), or use "
                "CausalLM.from_model, which stacks them"
            )
        self.config = config
        self.embed = nnx.Param(params.embed)
        self.layers = DecoderLayers(params.layers, _initial_gates(config, gates))
        self.final_norm = nnx.Param(params.final_norm)
        self.lm_head = _param(params.lm_head)
        self.tokenizer, self.source, self.names = tokenizer, source, tuple(names)

    @classmethod
    def from_model(cls, model: Model, gates: Pattern | float | Any | None = None) -> CausalLM:
        """Wrap a loaded `Model`: its arrays, not copies, when its layers are stacked (`duo_jax.load(...,
        layout="stacked")`); weights loaded per layer (the default) are stacked, a copy of the layers' weights.
        gates: None (all 1), a number, a Pattern, [L, K]."""
        _check_float_weights(model.params)  # before stacking copies the layers
        return cls(
            model.config,
            stack_layers(model.params),
            gates,
            tokenizer=model.tokenizer,
            source=model.source,
            names=model.names,
        )

    @classmethod
    def from_pretrained(
        cls, name_or_path: str | os.PathLike, dtype=jnp.bfloat16, *, path: str | os.PathLike | None = None, gates=None
    ) -> CausalLM:
        """`duo_jax.load(name_or_path, dtype, path=path, layout="stacked")` wrapped by `from_model`."""
        return cls.from_model(load(name_or_path, dtype, path=path, layout="stacked"), gates)

    def to_params(self) -> Params:
        """The weights as the functional core's `Params`: the very arrays this module holds."""
        return Params(
            embed=_array(self.embed),
            layers=self.layers.to_params(),
            final_norm=_array(self.final_norm),
            lm_head=_array(self.lm_head),
        )

    def to_model(self) -> Model:
        """A `duo_jax.loading.Model` over the same arrays and tokenizer (what `duo_jax.generate` takes)."""
        return Model(self.config, self.to_params(), self.tokenizer, self.source, self.names)

    @property
    def gates(self) -> jax.Array:
        """The current gates, float32 [L, K]."""
        return self.layers.attention.gate[...]

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Dense causal forward pass: tokens int32 [B, T] -> logits float32 [B, T, V] (`duo_jax.forward`), T at
        most the model's context (`generate` refuses prompts past it too)."""
        tokens = _as_array(tokens, "tokens")
        check_tokens(tokens, self.config.vocab_size)
        length, context = tokens.shape[1], self.config.max_position_embeddings
        if length > context:
            raise DuoJaxError(
                f"tokens ({length} positions) exceed the model's context of {context} tokens; shorten or split "
                "the sequences"
            )
        return forward_jit(self.to_params(), self.config, tokens)

    def gate_loss(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        supervise: jax.Array,
        objective: gates_lib.Objective = gates_lib.Objective(),
    ) -> tuple[jax.Array, gates_lib.LossTerms]:
        """`duo_jax.gates.loss` of this module's gates and weights: (loss, LossTerms)."""
        tokens, positions, supervise = _check_batch(self.config, tokens, positions, supervise)
        return gates_lib.loss(self.gates, self.to_params(), self.config, tokens, positions, supervise, objective)

    def clamp_gates(self) -> None:
        """Project the gates onto [0, 1], as the functional trainer does after every optimiser update."""
        self.layers.attention.gate[...] = gates_lib.clamp(self.gates)

    def pattern(self, meta: dict[str, Any] | None = None) -> Pattern:
        """The gates as a `Pattern` (`.save(folder)` writes the original DuoAttention format)."""
        return Pattern(np.asarray(self.gates), meta)

    def _check_gates_split(self, sparsity) -> None:
        """Refuse gates that are all equal (fresh ones are all 1): no head split can be read from them, and the
        tie-break order alone would choose the streaming heads. Sparsity 0 or 1 needs no split."""
        gates = np.asarray(self.gates)
        if gates.min() != gates.max() or (sparsity is not None and exact_sparsity(sparsity) in (0, 1)):
            return
        raise DuoJaxError(
            f"the module's gates are untrained or all equal (every gate {gates.flat[0]:g}), so no split into "
            "retrieval and streaming heads can be read from them: train them (train_step) or restore trained ones "
            "(restore_gates), or pass pattern='default' (the model's shipped pattern), a Pattern or a path, or "
            "pattern=None for full attention"
        )

    def generate(self, prompts, *, pattern: Pattern | str | None = "gates", method=None, **options):
        """`duo_jax.generate` on this module's weights; returns a `duo_jax.Generation`.

        pattern: "gates" (the default) is `self.pattern()` for the methods that take a pattern (`duo`,
        `duo_headkv`, and method=None, which then means `duo`) and nothing for the others; anything else
        is passed on ("default": the model's shipped pattern, None: full attention, a Pattern or a path).
        Gates that are all equal (untrained: all 1) are refused for "gates" unless sparsity is 0 or 1: they
        hold no split of the heads.
        The other options are `duo_jax.generate`'s (sparsity, sink, recent, max_new_tokens, ...).
        """
        if isinstance(pattern, str) and pattern == "gates":
            takes_pattern = method is None or (isinstance(method, str) and methods.entry(method).takes_pattern)
            if takes_pattern:
                self._check_gates_split(options.get("sparsity"))
            pattern = self.pattern() if takes_pattern else None
        return generation.generate(self.to_model(), prompts, pattern=pattern, method=method, **options)


def train_step(
    model: CausalLM,
    optimizer: nnx.Optimizer,
    tokens: jax.Array,
    positions: jax.Array,
    supervise: jax.Array,
    objective: gates_lib.Objective = gates_lib.Objective(),
) -> gates_lib.LossTerms:
    """One gate-training step in place: the gradient of `CausalLM.gate_loss` with respect to the gates,
    `optimizer.update` (an `nnx.Optimizer(model, tx, wrt=Gate)`), then the gates clamped to [0, 1].

    tokens / positions int32 [B, T], supervise bool [B, T] (as `duo_jax.training.Batch`; nested lists too, as
    `CausalLM.__call__` takes tokens). Returns LossTerms. Token ids past the vocabulary, shapes that differ and a
    `supervise` that selects no position are refused before the compiled step (inside it they cannot be read).
    The weights enter the compiled step as inputs only, so the module keeps its arrays (`nnx.jit` would
    hand back a copy of every weight each step).
    """
    if optimizer.wrt is not Gate:
        raise DuoJaxError(
            f"train_step trains the gates only; build the optimizer with nnx.Optimizer(model, tx, "
            f"wrt=Gate), not wrt={optimizer.wrt!r}"
        )
    tokens, positions, supervise = _check_batch(model.config, tokens, positions, supervise)
    graphdef, weights, trained = nnx.split((model, optimizer), WEIGHTS, ...)
    trained, terms = _gate_step(graphdef, weights, trained, tokens, positions, supervise, objective)
    nnx.update((model, optimizer), trained)
    return terms


@functools.partial(jax.jit, static_argnames=("graphdef", "objective"))
def _gate_step(graphdef, weights, trained, tokens, positions, supervise, objective):
    model, optimizer = nnx.merge(graphdef, weights, trained)
    grad_fn = nnx.value_and_grad(
        lambda m: m.gate_loss(tokens, positions, supervise, objective), argnums=nnx.DiffState(0, Gate), has_aux=True
    )
    (_, terms), grads = grad_fn(model)
    optimizer.update(model, grads)
    model.clamp_gates()
    return nnx.state((model, optimizer), nnx.Not(WEIGHTS)), terms


def save_gates(model: CausalLM, directory: str | os.PathLike) -> Path:
    """Save `nnx.state(model, Gate)` with orbax into `directory` (which must not exist yet); returns it."""
    directory = Path(directory).absolute()
    if directory.exists():
        raise DuoJaxError(f"{directory} already exists; save the gates into a new directory or remove it first")
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(directory, nnx.state(model, Gate))
    checkpointer.wait_until_finished()
    checkpointer.close()
    return directory


def restore_gates(model: CausalLM, directory: str | os.PathLike) -> None:
    """Restore gates saved by `save_gates` into `model` in place (shapes, dtypes and shardings of its own)."""
    directory = Path(directory).absolute()
    if not directory.is_dir():
        raise DuoJaxError(f"no gate checkpoint at {directory}; pass a directory written by save_gates")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, nnx.state(model, Gate))
    checkpointer = ocp.StandardCheckpointer()
    try:
        saved = checkpointer.metadata(directory)
        saved = getattr(saved, "item_metadata", saved)  # orbax's metadata object, or the tree itself
        shapes = {tuple(getattr(x, "shape", ())) for x in jax.tree.leaves(saved)}
        expected = tuple(model.gates.shape)
        if shapes and shapes != {expected}:
            raise DuoJaxError(
                f"the gate checkpoint at {directory} holds gates of shape(s) {sorted(shapes)}, but "
                f"this model's are {expected} (layers x KV heads): restore into the model it was saved "
                "from"
            )
        restored = checkpointer.restore(directory, abstract)
    finally:
        checkpointer.close()
    nnx.update(model, restored)
