"""Training DuoAttention gates: optimiser and schedule, the sharded train step, data, checkpoints, outputs.

The objective (gated forward, loss) is `duo_jax.gates`; this module runs it. `train` trains the float32 gates of a
`TrainConfig` run on a ("data", "fsdp", "seq") mesh (`duo_jax.sharding`) with AdamW and `lr_schedule`, clamping
them to [0, 1] after every update; each step's samples are a function of (seed, index) only, and checkpoints
(orbax) hold gates, optimiser state and the next sample index, so a resumed run ends with the gates of an
uninterrupted one (same mesh and backend). `memory_report` compiles the step from shapes and reads its per-device
bytes. Outputs in the run folder: the pattern (`full_attention_heads.tsv` + `config.json`), `loss.json`,
`gates.png`. Design: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import numbers
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from duo_jax import gates as gates_lib
from duo_jax import sharding
from duo_jax.config import ModelConfig
from duo_jax.data import (
    CALIBRATION_HAYSTACK,
    SampleStream,
    check_sample_options,
    context_lengths,
    haystack_tokens,
    min_context_len,
)
from duo_jax.errors import DuoJaxError
from duo_jax.model import Params, stack_layers
from duo_jax.pattern import Pattern
from duo_jax.sharding import MESH_AXES, format_mesh

CHECKPOINT_DIR = "checkpoints"
LOSS_FILE = "loss.json"
HEATMAP_FILE = "gates.png"
# Arguments that may differ between a run and its resumption: they change where or how fast, not what.
_RESUMABLE_CHANGES = ("output_dir", "save_steps", "mesh", "streaming_attn_implementation")
# The largest finite float32: the schedule, the loss and the gates compute in float32, where past it is inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)


class TrainingError(DuoJaxError, ValueError):
    """Training cannot run as asked (mesh, lengths, resumption); the message says why."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every hyper-parameter of a gate-training run (defaults: the original DuoAttention recipe)."""

    objective: gates_lib.Objective = gates_lib.Objective()
    steps: int = 2000
    batch_size: int = 1
    lr: float = 0.02
    warmup_ratio: float = 0.2
    decay_ratio: float = 0.2
    min_lr_ratio: float = 0.1
    initial_value: float = 1.0
    haystack: str = CALIBRATION_HAYSTACK  # the essays' calibration half: evaluations run on the other half
    min_len: int = 1000
    max_len: int = 32000
    num_lengths: int = 50
    num_passkeys: int = 10
    passkey_words: int = 32
    min_depth: float = 0.05
    max_depth: float = 0.95
    supervise: str = "qa"  # as the original: every question / answer token ("answers": the answers only)
    seed: int = 42
    save_every: int = 50

    def __post_init__(self):
        for name in ("steps", "batch_size", "save_every", "num_lengths", "min_len", "max_len", "seed"):
            value, least = getattr(self, name), 0 if name == "seed" else 1
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
                raise TrainingError(f"{name} must be an integer >= {least}, got {value!r}")
        check_sample_options(self.num_passkeys, self.passkey_words, self.min_depth, self.max_depth, self.supervise)
        if self.objective.sink < 0 or self.objective.recent < 1:
            raise TrainingError(
                f"the streaming window needs sink >= 0 and recent >= 1, got sink="
                f"{self.objective.sink}, recent={self.objective.recent}"
            )
        reg_weight = self.objective.reg_weight
        if not (isinstance(reg_weight, (int, float)) and math.isfinite(reg_weight) and reg_weight >= 0):
            raise TrainingError(
                f"reg_weight (the L1 term's weight) must be a finite number >= 0, got {reg_weight!r}: a negative one "
                "rewards large gates, so training would keep every head a retrieval head"
            )
        if not (
            math.isfinite(self.lr)
            and self.lr > 0
            and 0 < self.warmup_ratio <= 1
            and 0 < self.decay_ratio <= 1
            and 0 <= self.min_lr_ratio <= 1
            and 0 <= self.initial_value <= 1
        ):
            raise TrainingError(
                "need a finite lr > 0, warmup and decay ratios in (0, 1], min_lr_ratio and initial_value "
                f"in [0, 1]; got lr={self.lr}, warmup_ratio={self.warmup_ratio}, decay_ratio="
                f"{self.decay_ratio}, min_lr_ratio={self.min_lr_ratio}, initial_value={self.initial_value}"
            )
        check_float32("lr", self.lr)  # the other float options lie within [0, 1]
        if np.float32(self.lr) == 0:
            raise TrainingError(
                f"lr (--lr) {self.lr!r} is 0 in float32, which training computes in (its smallest positive number is "
                f"{float(np.finfo(np.float32).smallest_subnormal):.4g}): no step would move the gates; raise --lr"
            )
        check_float32("reg_weight", reg_weight)

    def meta(self, model_name: str, output_dir: str, mesh: Mesh, dtype: str) -> dict[str, Any]:
        """The run's arguments under the original's `config.json` key names (plus duo-jax's own)."""
        return {
            "model_name": model_name,
            "dataset_name": self.haystack,
            "dataset_format": "multiple_passkey",
            "lr": self.lr,
            "num_steps": self.steps,
            "batch_size": self.batch_size,
            "max_length": self.max_len,
            "context_length_min": self.min_len,
            "context_length_max": self.max_len,
            "context_lengths_num_intervals": self.num_lengths,
            "num_passkeys": self.num_passkeys,
            "passkey_length": self.passkey_words,
            "min_needle_depth_ratio": self.min_depth,
            "max_needle_depth_ratio": self.max_depth,
            "output_dir": output_dir,
            "sink_size": self.objective.sink,
            "recent_size": self.objective.recent,
            "reg_weight": self.objective.reg_weight,
            "initial_value": self.initial_value,
            "save_steps": self.save_every,
            "seed": self.seed,
            "supervision": "distill",
            "streaming_attn_implementation": self.objective.impl,
            "supervise": self.supervise,
            "warmup_ratio": self.warmup_ratio,
            "decay_ratio": self.decay_ratio,
            "min_lr_ratio": self.min_lr_ratio,
            "dtype": dtype,
            "mesh": format_mesh(mesh),
        }


def check_float32(name: str, value) -> None:
    """TrainingError unless `value` is a number that float32, which training computes in, holds finite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not abs(value) <= FLOAT32_MAX:
        flag = "--" + name.replace("_", "-")
        raise TrainingError(
            f"{name} ({flag}) must be a finite number of size at most {FLOAT32_MAX:.4g} (float32's largest: training "
            f"computes in float32, where a larger one is inf), got {value!r}"
        )


# --- optimiser --------------------------------------------------------------------------------------


def lr_schedule(
    lr: float, steps: int, warmup_ratio: float = 0.2, decay_ratio: float = 0.2, min_ratio: float = 0.1
) -> optax.Schedule:
    """The learning rate at optimiser step s = `count` (0-based) of N = `steps`, as the original's `LambdaLR`:
    lr * min(1, max((s + 1) / W, min_ratio), max((N - s) / Dc, min_ratio)), W = N * warmup_ratio,
    Dc = N * decay_ratio."""
    warmup = max(1.0, steps * warmup_ratio)
    decay = max(1.0, steps * decay_ratio)

    def schedule(count):
        count = jnp.asarray(count, jnp.float32)
        up = jnp.maximum((count + 1.0) / warmup, min_ratio)
        down = jnp.maximum((steps - count) / decay, min_ratio)
        return lr * jnp.minimum(1.0, jnp.minimum(up, down))

    return schedule


def make_optimizer(cfg: TrainConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (torch's defaults: betas 0.9 / 0.999, eps 1e-8), weight decay 0, with `lr_schedule`."""
    schedule = lr_schedule(cfg.lr, cfg.steps, cfg.warmup_ratio, cfg.decay_ratio, cfg.min_lr_ratio)
    return optax.adamw(schedule, weight_decay=0.0), schedule


# --- mesh and sequence parallelism ------------------------------------------------------------------


def check_mesh(mesh: Mesh, batch_size: int) -> None:
    """TrainingError unless the batch splits over the "data" x "fsdp" devices."""
    n = sharding.axis_size(mesh, sharding.BATCH_AXES)
    if batch_size % n:
        raise TrainingError(
            f"the batch of {batch_size} does not split over the 'data' x 'fsdp' mesh axes "
            f"({format_mesh(mesh)}: {n} ways); use a batch size that is a multiple of {n}"
        )


def sequence_parallelism(config: ModelConfig, mesh: Mesh) -> str:
    """How attention runs over the "seq" axis: "none" (size 1), "ulysses" (its size divides the KV heads),
    else "all-gather"."""
    seq = mesh.shape["seq"]
    return "none" if seq == 1 else "ulysses" if config.num_kv_heads % seq == 0 else "all-gather"


def ulysses(axis_name: str) -> Callable[[gates_lib.AttentionFn], gates_lib.AttentionFn]:
    """Make an attention function sequence-parallel over mesh axis `axis_name` (inside shard_map).

    With n devices on the axis, q [B, T/n, H, E], k / v [B, T/n, K, E] (a contiguous sequence slice) are
    exchanged so that each device holds the whole sequence for H/n query and K/n KV heads (contiguous head
    blocks, so GQA groups stay whole), attention runs locally, and the output goes back to sequence slices.
    Needs n to divide K. Per device and layer it holds q, k, v and the output for the whole sequence and
    1/n of the heads: as much as its own shard of them.
    """

    def wrap(attend: gates_lib.AttentionFn) -> gates_lib.AttentionFn:
        def attend_sequence_parallel(q, k, v):
            to_heads = lambda x: jax.lax.all_to_all(x, axis_name, split_axis=2, concat_axis=1, tiled=True)
            out = attend(to_heads(q), to_heads(k), to_heads(v))  # [B, T, H/n, E]
            return jax.lax.all_to_all(out, axis_name, split_axis=1, concat_axis=2, tiled=True)  # [B, T/n, H, E]

        return attend_sequence_parallel

    return wrap


def all_gather_kv(axis_name: str) -> Callable[[gates_lib.AttentionFn], gates_lib.AttentionFn]:
    """Make an attention function sequence-parallel over mesh axis `axis_name` (inside shard_map) by
    all-gathering keys and values: each device keeps its queries q [B, T/n, H, E], receives every device's
    k / v slice ([B, T, K, E] in all) and attends with its queries at offset index * T/n, so the causal and
    Λ masks are those of the whole sequence. Works for any n (no head split), at the price of the whole
    sequence's K and V per device and layer (2 * T * K * E elements; recomputed, not kept, for the backward
    pass, whose transpose of the gather is a reduce-scatter of their gradients)."""

    def wrap(attend: gates_lib.AttentionFn) -> gates_lib.AttentionFn:
        def attend_sequence_parallel(q, k, v):
            gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
            offset = jax.lax.axis_index(axis_name) * q.shape[1]
            return attend(q, gather(k), gather(v), q_offset=offset)

        return attend_sequence_parallel

    return wrap


_SEQUENCE_WRAPPERS = {"none": lambda axis: lambda f: f, "ulysses": ulysses, "all-gather": all_gather_kv}


def _shard_map(f, mesh: Mesh, in_specs, out_specs):
    """`jax.shard_map` over `mesh`. Gradients are reduced explicitly inside."""
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


# --- the train step ---------------------------------------------------------------------------------


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Batch:
    """One step's sequences, right-padded: tokens / positions int32 [B, T], supervise bool [B, T]."""

    tokens: Any
    positions: Any
    supervise: Any


def sharded_loss_and_grad(config: ModelConfig, objective: gates_lib.Objective, mesh: Mesh, param_specs: Params):
    """(gates, params, batch) -> (gate gradients [L, K], LossTerms), computed over `mesh`.

    `params` are laid out as `param_specs` says (`duo_jax.sharding.weight_specs`, or all `P()` for
    replicated weights); each layer's weights are gathered inside the scanned layer. Each device computes
    the distillation sum of its (batch, sequence) shard, divided by the global number of supervised
    positions, plus its 1/n share of the L1 term, and differentiates that; the transposes of the sequence
    collectives carry cotangents between devices, and one psum of the gradients gives the gradient of the
    global loss.
    """
    n_devices = mesh.size
    wrap = _SEQUENCE_WRAPPERS[sequence_parallelism(config, mesh)]("seq")
    hooks = dict(
        wrap_attention=wrap,
        layer_weights=lambda layer: sharding.gather_layer(layer, param_specs.layers),
        embed_tokens=lambda params, tokens: sharding.embed_tokens(params.embed, param_specs.embed, tokens),
    )

    def local(gates, params, batch: Batch):
        count = jax.lax.psum(jnp.sum(batch.supervise.astype(jnp.float32)), MESH_AXES)
        count = jnp.maximum(count, 1.0)

        def local_objective(g):
            total, _ = gates_lib.distill_terms(
                g, params, config, batch.tokens, batch.positions, batch.supervise, objective, **hooks
            )
            distill = total / count
            return distill + objective.reg_weight * gates_lib.l1_term(g) / n_devices, distill

        (_, distill), grads = jax.value_and_grad(local_objective, has_aux=True)(gates)
        grads, distill = jax.lax.psum((grads, distill), MESH_AXES)
        l1 = gates_lib.l1_term(gates)
        return grads, gates_lib.LossTerms(loss=distill + objective.reg_weight * l1, distill=distill, l1=l1)

    data_spec = P(sharding.BATCH_AXES, "seq")
    return _shard_map(
        local, mesh, in_specs=(P(), param_specs, Batch(data_spec, data_spec, data_spec)), out_specs=(P(), P())
    )


def make_train_step(
    config: ModelConfig,
    objective: gates_lib.Objective,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    param_specs: Params,
):
    """A jitted step (gates, opt_state, params, batch) -> (gates, opt_state, LossTerms); gates and
    optimiser state are donated. Gates are clamped to [0, 1] after the update. `params` are laid out as
    `param_specs` says (see `sharded_loss_and_grad`)."""
    loss_and_grad = sharded_loss_and_grad(config, objective, mesh, param_specs)

    def step(gates, opt_state, params: Params, batch: Batch):
        grads, terms = loss_and_grad(gates, params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, gates)
        return gates_lib.clamp(optax.apply_updates(gates, updates)), opt_state, terms

    return jax.jit(step, donate_argnums=(0, 1))


def run_train_step(config: ModelConfig, cfg: TrainConfig, mesh: Mesh, param_specs: Params):
    """`make_train_step` with `cfg`'s objective and optimiser, one jitted step per (model, objective,
    optimiser, mesh, layout) in this process: the step `memory_report` compiles is the one `train` runs (a
    batch of the reported shape reuses its executable instead of compiling it again), and a run resumed in
    the same process compiles nothing."""
    leaves, treedef = jax.tree.flatten(param_specs, is_leaf=lambda x: isinstance(x, P))
    optimiser = (cfg.lr, cfg.steps, cfg.warmup_ratio, cfg.decay_ratio, cfg.min_lr_ratio)
    return _train_step(config, cfg.objective, optimiser, mesh, tuple(leaves), treedef)


@functools.lru_cache(maxsize=8)
def _train_step(config, objective, optimiser, mesh, spec_leaves, spec_treedef):
    lr, steps, warmup_ratio, decay_ratio, min_lr_ratio = optimiser
    optimizer, _ = make_optimizer(
        TrainConfig(
            objective=objective,
            lr=lr,
            steps=steps,
            warmup_ratio=warmup_ratio,
            decay_ratio=decay_ratio,
            min_lr_ratio=min_lr_ratio,
        )
    )
    return make_train_step(config, objective, optimizer, mesh, jax.tree.unflatten(spec_treedef, spec_leaves))


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Bytes one device holds for a train step: its arguments, read from their shardings, and the compiled
    step's temporaries (XLA's memory analysis of the executable; gate training keeps no KV cache)."""

    weights: int
    gates: int
    optimizer: int
    batch: int
    temp: int | None  # None where the backend gives no memory analysis
    seq_len: int

    @property
    def total(self) -> int | None:
        held = self.weights + self.gates + self.optimizer + self.batch
        return None if self.temp is None else held + self.temp

    def __str__(self) -> str:
        gib = lambda n: "unknown" if n is None else f"{n / 2**30:.3f} GiB"
        return (
            f"per-device memory of a {self.seq_len}-token step: weights {gib(self.weights)}, gates "
            f"{gib(self.gates)}, optimiser state {gib(self.optimizer)}, batch {gib(self.batch)}, step "
            f"temporaries {gib(self.temp)}; total {gib(self.total)}"
        )


def memory_report(config: ModelConfig, cfg: TrainConfig, mesh: Mesh, params: Params, seq_len: int) -> MemoryReport:
    """Lower and compile the train step for batches of `cfg.batch_size` x `seq_len` tokens (rounded up to
    the "seq" axis) on `mesh`, from shapes only: `params` may be arrays or `jax.ShapeDtypeStruct`s
    (`jax.eval_shape`), in either layout (`duo_jax.model.LAYOUTS`), nothing is allocated."""
    abstract = lambda x, layout: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=layout)
    params = jax.eval_shape(stack_layers, dataclasses.replace(params, lm_head=None))
    specs = sharding.weight_specs(params, mesh)
    params = jax.tree.map(abstract, params, sharding.weight_shardings(params, mesh))
    optimizer, _ = make_optimizer(cfg)
    replicated = NamedSharding(mesh, P())
    gates = abstract(jax.eval_shape(lambda: gates_lib.init_gates(config)), replicated)
    opt_state = jax.tree.map(lambda x: abstract(x, replicated), jax.eval_shape(optimizer.init, gates))
    T = -(-seq_len // mesh.shape["seq"]) * mesh.shape["seq"]
    shape = (cfg.batch_size, T)
    batch = Batch(
        *(
            abstract(jax.ShapeDtypeStruct(shape, dtype), batch_sharding(mesh))
            for dtype in (jnp.int32, jnp.int32, jnp.bool_)
        )
    )
    step = run_train_step(config, cfg, mesh, specs)
    analysis = step.lower(gates, opt_state, params, batch).compile().memory_analysis()
    temp = analysis.temp_size_in_bytes if analysis is not None else None
    return MemoryReport(
        weights=sharding.device_bytes(params),
        gates=sharding.device_bytes(gates),
        optimizer=sharding.device_bytes(opt_state),
        batch=sharding.device_bytes(batch),
        temp=temp,
        seq_len=T,
    )


def replicate(tree, mesh: Mesh):
    """Put every leaf of `tree` on every device of `mesh`."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Batch arrays [B, T]: B split over ("data", "fsdp"), T over "seq"."""
    return NamedSharding(mesh, P(sharding.BATCH_AXES, "seq"))


def shard_batch(batch: Batch, mesh: Mesh) -> Batch:
    """Host arrays [B, T] -> global arrays split as `batch_sharding`; every process passes the same batch."""
    layout = batch_sharding(mesh)
    put = lambda x: jax.make_array_from_callback(x.shape, layout, lambda index: x[index])
    return jax.tree.map(put, batch)


def frozen_weights(params: Params, mesh: Mesh) -> tuple[Params, Params]:
    """The weights gate training reads (the LM head is not: the loss compares hidden states), laid out on
    `mesh` (`duo_jax.sharding.weight_specs`), and their specs. The training step scans stacked layers: weights
    loaded per layer (`duo_jax.load`'s default) are stacked here, a copy (load with layout="stacked" to avoid
    it)."""
    params = stack_layers(dataclasses.replace(params, lm_head=None))
    return sharding.shard_params(params, mesh), sharding.weight_specs(params, mesh)


def fetch(x: jax.Array) -> np.ndarray:
    """The value of a fully replicated array, also in multi-process runs."""
    return np.asarray(x.addressable_data(0))


# --- data -------------------------------------------------------------------------------------------


def sample_stream(tokenizer, cfg: TrainConfig) -> tuple[SampleStream, TrainConfig, str | None]:
    """The run's `SampleStream`, the config with `min_len` raised to what the passkeys need, and a note
    saying so (None when nothing was raised). TrainingError when even `max_len` is too short."""
    bos_id = tokenizer.bos_id if getattr(tokenizer, "add_bos", False) else None
    needed = min_context_len(tokenizer, num_passkeys=cfg.num_passkeys, passkey_words=cfg.passkey_words, bos_id=bos_id)
    note = None
    if needed > cfg.max_len:
        raise TrainingError(
            f"{cfg.num_passkeys} passkeys of {cfg.passkey_words} words need contexts of at least "
            f"{needed} tokens but the longest allowed is {cfg.max_len}; raise --max-len or "
            "lower --num-passkeys / --passkey-words"
        )
    if cfg.min_len < needed:
        note = (
            f"--min-len {cfg.min_len} is too short for {cfg.num_passkeys} passkeys of {cfg.passkey_words} "
            f"words ({needed} tokens at worst with this tokenizer): the lengths start at {needed}"
        )
        cfg = dataclasses.replace(cfg, min_len=needed)
    lengths = context_lengths(cfg.min_len, cfg.max_len, cfg.num_lengths)
    stream = SampleStream(
        tokenizer,
        haystack_tokens(tokenizer, cfg.haystack, cfg.max_len),
        lengths,
        cfg.seed,
        num_passkeys=cfg.num_passkeys,
        passkey_words=cfg.passkey_words,
        min_depth=cfg.min_depth,
        max_depth=cfg.max_depth,
        bos_id=bos_id,
        supervise=cfg.supervise,
    )
    return stream, cfg, note


def padded_length(longest: int, multiple: int) -> int:
    """The length a step whose longest sequence has `longest` tokens is padded to: the next multiple of a
    granularity of about 2^floor(log2 longest) / 4, rounded up to a multiple of `multiple`. That is at most
    four buckets per octave of length (one compiled step each) and at most 25% padding, plus what
    `multiple` itself forces."""
    base = max(1, (1 << (longest.bit_length() - 1)) // 4)
    granularity = -(-base // multiple) * multiple
    return -(-longest // granularity) * granularity


def make_batch(stream: SampleStream, first_sample: int, batch_size: int, multiple: int) -> tuple[Batch, int]:
    """Samples first_sample ... first_sample + batch_size - 1, right-padded to their `padded_length` (a
    multiple of `multiple`); also returns the number of real (unpadded) tokens."""
    samples = [stream[first_sample + b] for b in range(batch_size)]
    T = padded_length(max(len(s.tokens) for s in samples), multiple)
    tokens = np.zeros((batch_size, T), np.int32)
    supervise = np.zeros((batch_size, T), bool)
    for b, sample in enumerate(samples):
        tokens[b, : len(sample.tokens)] = sample.tokens
        supervise[b, : len(sample.tokens)] = sample.supervise
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (batch_size, T)).copy()
    return Batch(tokens, positions, supervise), sum(len(s.tokens) for s in samples)


# --- checkpoints and outputs ------------------------------------------------------------------------


class Checkpoints:
    """Orbax checkpoints of one run in `directory`: the arrays (gates, optimiser state) plus a JSON item
    {"step", "next_sample", "meta"}. The last `keep` are kept; saves are asynchronous."""

    def __init__(self, directory: Path, keep: int = 2):
        self.directory = directory.absolute()
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """The steps of the checkpoints, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def step_folder(self, step: int) -> Path:
        return self.directory / str(step)

    def stored_shapes(self, step: int) -> dict[tuple[str, ...], tuple[int, ...]]:
        """The shape of each array of checkpoint `step` by its path in the state, read from the checkpoint's
        metadata without reading an array."""
        metadata = ocp.StandardCheckpointHandler().metadata(self.step_folder(step) / "state")
        return _shapes(getattr(metadata, "tree", metadata))

    def set_aside(self, step: int, destination: Path) -> Path:
        """Move checkpoint `step` out of the manager's folder to `destination` (or `destination`-2, -3, ...
        when taken); returns where it went. A damaged step left in place would stay the latest and block a
        new save of the same step."""
        target, n = destination, 1
        while target.exists():
            n += 1
            target = destination.with_name(f"{destination.name}-{n}")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(self.step_folder(step), target)
        self.manager.reload()
        return target

    def save(self, step: int, state, progress: dict[str, Any]) -> None:
        self.manager.save(
            step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress))
        )

    def progress(self, step: int) -> dict[str, Any]:
        """The JSON item of checkpoint `step` (step, next sample, the run's arguments), without its arrays."""
        return self.manager.restore(step, args=ocp.args.Composite(progress=ocp.args.JsonRestore()))["progress"]

    def restore(self, step: int, like) -> Any:
        """The arrays of checkpoint `step`, restored with the shapes, dtypes and shardings of `like`."""
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        return self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def write_outputs(
    out: Path, gates: np.ndarray, meta: dict[str, Any], history: list[dict[str, Any]], step: int
) -> Pattern:
    """The pattern (tsv + config.json), loss.json and gates.png in `out` after `step` steps; returns the pattern.
    config.json records the steps done (`steps_done`): a run stopped early leaves its last checkpoint's gates, which
    `Pattern.load` then says are unfinished."""
    pattern = Pattern(gates, dict(meta, steps_done=step))
    pattern.save(out)
    tmp = out / (LOSS_FILE + ".tmp")
    tmp.write_text(json.dumps(history, indent=1) + "\n")
    os.replace(tmp, out / LOSS_FILE)  # atomic: a killed run never leaves half a loss.json
    pattern.heatmap(out / HEATMAP_FILE, title=f"{meta['model_name']}: gates after {step} steps")
    return pattern


def _mismatches(saved: dict[str, Any], meta: dict[str, Any]) -> list[str]:
    keys = sorted((set(saved) | set(meta)) - set(_RESUMABLE_CHANGES))
    return [f"{k}: {saved.get(k)!r} -> {meta.get(k)!r}" for k in keys if saved.get(k) != meta.get(k)]


# --- the loop ---------------------------------------------------------------------------------------


def prepare(params: Params, config: ModelConfig, cfg: TrainConfig, mesh: Mesh):
    """What a run starts from: the frozen weights laid out on `mesh` (`frozen_weights`), the initial state
    {"gates", "opt_state"} (replicated), the jitted step (`run_train_step`) and the learning-rate schedule."""
    optimizer, schedule = make_optimizer(cfg)
    gates = replicate(gates_lib.init_gates(config, cfg.initial_value), mesh)
    state = {"gates": gates, "opt_state": replicate(optimizer.init(gates), mesh)}
    params, specs = frozen_weights(params, mesh)
    return params, state, run_train_step(config, cfg, mesh, specs), schedule


def _shapes(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of a state tree's arrays, with paths spelled alike for live arrays (namedtuple fields) and
    orbax's metadata (dict keys)."""
    name = lambda key: str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(map(name, path)): tuple(leaf.shape) for path, leaf in flat}


# What reading a damaged checkpoint raises: JSON and tensorstore errors (ValueError), missing files
# (FileNotFoundError), JSON of another form (KeyError, TypeError). Other OS errors (permissions, a stale network
# handle) may pass: they stop the run rather than set a healthy checkpoint aside. TrainingError is raised outside
# the guarded reads.
_UNREADABLE = (ValueError, FileNotFoundError, KeyError, TypeError)


def _reason(error: Exception) -> str:
    first_line = (str(error).strip().splitlines() or [""])[0]  # tensorstore's errors go on with a whole spec
    return f"{type(error).__name__}: {first_line[:200]}"


def resume_point(
    checkpoints: Checkpoints,
    out: Path,
    state: dict,
    meta: dict,
    *,
    required: bool,
    log: Callable[[str], None] = print,
) -> tuple[dict, int, int, list[dict[str, Any]]]:
    """Where a run in `out` starts: (state, first step, next sample, loss history). From the newest checkpoint
    that reads when there is one (TrainingError when it was written with other arguments than `meta`, or holds
    arrays of other shapes than `state`), else from `state` at step 0 (TrainingError when `required`: --resume
    with nothing to resume).

    A checkpoint that cannot be read (damaged: truncated or missing files) is skipped for the one before it and
    moved to `out`/checkpoints-damaged/, with a note; TrainingError when none reads (nothing is moved then), or,
    with several processes, at the first damaged one (the user deletes its folder)."""
    folder = out / CHECKPOINT_DIR
    steps = checkpoints.steps()
    if not steps:
        if required:
            raise TrainingError(f"nothing to resume: no checkpoint in {folder}")
        return state, 0, 0, []
    damaged: list[tuple[int, str]] = []  # newer than the one used

    def skip(step: int, error: Exception) -> None:
        if jax.process_count() > 1:  # each process would have to move it, and agree on doing so
            raise TrainingError(
                f"checkpoint {step} in {checkpoints.step_folder(step)} cannot be read ({_reason(error)}): it is "
                f"damaged (truncated or missing files); delete that folder to resume from the checkpoint before it"
            )
        damaged.append((step, _reason(error)))

    for step in steps:
        try:
            progress = checkpoints.progress(step)  # the arguments first: another model's arrays would not restore
            saved, start, next_sample = progress["meta"], progress["step"], progress["next_sample"]
            mismatches = _mismatches(saved, meta)
        except _UNREADABLE as e:
            skip(step, e)
            continue
        if mismatches:
            raise TrainingError(
                f"{out} holds a run with other arguments ({'; '.join(mismatches)}); "
                "pass the same arguments to resume it, or use another --out"
            )
        shape = list(state["gates"].shape)
        if progress.get("gates_shape", shape) != shape:  # other weights under the same name
            raise TrainingError(
                f"the checkpoint in {folder} holds gates of shape {progress['gates_shape']} (layers x KV "
                f"heads), this model has {shape}: it was trained on another model; use another --out"
            )
        try:
            stored = checkpoints.stored_shapes(step)
        except _UNREADABLE as e:
            skip(step, e)
            continue
        # Compared before the restore, so that a restore that fails is a damaged checkpoint, not another model's.
        wanted = _shapes(state)
        if stored != wanted:
            differences = [
                f"{'.'.join(path)}: {stored.get(path)} -> {wanted.get(path)}"
                for path in sorted(set(stored) | set(wanted))
                if stored.get(path) != wanted.get(path)
            ]
            raise TrainingError(
                f"checkpoint {step} in {folder} does not fit this model's gates and optimiser state (stored -> this "
                f"model: {'; '.join(differences[:4])}); it was trained on another model: use another --out"
            )
        try:
            restored = checkpoints.restore(step, state)
        except _UNREADABLE as e:
            skip(step, e)
            continue
        break
    else:
        listed = "; ".join(f"checkpoint {s} ({why})" for s, why in damaged)
        raise TrainingError(
            f"no checkpoint in {folder} can be read: {listed}. They are damaged (truncated or missing files): "
            f"delete {folder} to start the run over, or use another --out"
        )
    for s, why in damaged:
        moved = checkpoints.set_aside(s, out / f"{CHECKPOINT_DIR}-damaged" / str(s))
        log(
            f"note: checkpoint {s} in {checkpoints.step_folder(s)} cannot be read ({why}): it is damaged "
            f"(truncated or missing files); moved it to {moved} and resuming from checkpoint {step}"
        )
    history = []
    if (out / LOSS_FILE).is_file():
        history = [h for h in json.loads((out / LOSS_FILE).read_text()) if h["step"] < start]
    return restored, start, next_sample, history


def run_step(
    step_fn, state: dict, params: Params, host_batch: Batch, mesh: Mesh, step: int
) -> tuple[dict, dict[str, float], float]:
    """One optimizer step on `host_batch`: the new state, the loss terms on the host, and the step's seconds.
    TrainingError when the loss is not finite."""
    tic = time.perf_counter()
    gates, opt_state, terms = step_fn(state["gates"], state["opt_state"], params, shard_batch(host_batch, mesh))
    terms = {f.name: float(fetch(getattr(terms, f.name))) for f in dataclasses.fields(terms)}
    if not all(math.isfinite(v) for v in terms.values()):
        raise TrainingError(f"step {step}: the loss is not finite ({terms})")
    return {"gates": gates, "opt_state": opt_state}, terms, time.perf_counter() - tic


def check_max_len(config: ModelConfig, cfg: TrainConfig) -> None:
    """The longest training context within the model's: past it the frozen model's positions were never trained,
    so its attention is no target to distil (as `generate` refuses prompts past it); and `check_window`."""
    if cfg.max_len > config.max_position_embeddings:
        raise TrainingError(
            f"max_len {cfg.max_len} exceeds the model's context of {config.max_position_embeddings} tokens; "
            "lower --max-len (default: the model's context)"
        )
    check_window(cfg)


def check_window(cfg: TrainConfig) -> None:
    """A streaming window shorter than the longest training context: one that covers it sees every token, the
    distillation term is 0 and only L1 moves the gates."""
    window = cfg.objective.sink + cfg.objective.recent
    if window >= cfg.max_len:  # streaming attention is full attention at every length: nothing to distil
        raise TrainingError(
            f"the streaming window (sink {cfg.objective.sink} + recent {cfg.objective.recent}) covers every training "
            f"context (max_len {cfg.max_len}): streaming heads would see every token, so the gates would only shrink "
            "under the L1 term; lower --sink / --recent or raise --max-len"
        )


def train(
    params: Params,
    config: ModelConfig,
    tokenizer,
    cfg: TrainConfig,
    out: str | os.PathLike,
    mesh: Mesh,
    *,
    model_name: str,
    dtype: str,
    resume: bool = False,
    log: Callable[[str], None] = print,
    progress_bar: bool = True,
) -> Pattern:
    """Train the gates of a frozen model and write the run folder `out`; returns the final pattern.

    Continues from the latest checkpoint in `out/checkpoints` when there is one (TrainingError when its
    arguments differ from `cfg`, or when `resume` is set and there is none). `params` may be anywhere;
    they are laid out over `mesh` by `frozen_weights`.
    """
    from tqdm.auto import tqdm

    out = Path(out)
    check_mesh(mesh, cfg.batch_size)
    check_max_len(config, cfg)
    stream, cfg, note = sample_stream(tokenizer, cfg)
    if note:
        log(f"note: {note}")
    meta = cfg.meta(model_name, str(out), mesh, dtype)
    is_main = jax.process_index() == 0

    params, state, step_fn, schedule = prepare(params, config, cfg, mesh)
    log(
        f"mesh {format_mesh(mesh)}: weights sharded {sharding.axis_size(mesh, sharding.WEIGHT_AXES)} ways, "
        f"sequence parallelism: {sequence_parallelism(config, mesh)}"
    )

    checkpoints = Checkpoints(out / CHECKPOINT_DIR)
    state, start, next_sample, history = resume_point(checkpoints, out, state, meta, required=resume, log=log)
    if start:
        log(f"resuming {out} at step {start} of {cfg.steps}")

    def save(step: int) -> None:
        progress = {"step": step, "next_sample": next_sample, "meta": meta, "gates_shape": list(state["gates"].shape)}
        checkpoints.save(step, state, progress)
        if is_main:
            write_outputs(out, fetch(state["gates"]), meta, history, step)

    bar = tqdm(total=cfg.steps, initial=start, disable=not (progress_bar and is_main), dynamic_ncols=True)
    for step in range(start, cfg.steps):
        host_batch, n_tokens = make_batch(stream, next_sample, cfg.batch_size, mesh.shape["seq"])
        next_sample += cfg.batch_size
        state, terms, seconds = run_step(step_fn, state, params, host_batch, mesh, step)
        history.append(
            {
                "step": step,
                **terms,
                "lr": float(schedule(step)),
                "seq_len": host_batch.tokens.shape[1],
                "tokens": n_tokens,
                "seconds": round(seconds, 4),
                "tokens_per_s": n_tokens / seconds,
            }
        )
        bar.set_postfix(
            loss=f"{terms['loss']:.4f}", l1=f"{terms['l1']:.3f}", tok_s=f"{n_tokens / seconds:.0f}", refresh=False
        )
        bar.update(1)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            save(step + 1)
    bar.close()
    if start == cfg.steps and is_main:  # nothing left to train: rewrite the outputs from the checkpoint
        write_outputs(out, fetch(state["gates"]), meta, history, start)
    checkpoints.close()
    return Pattern(fetch(state["gates"]), dict(meta, steps_done=cfg.steps))
