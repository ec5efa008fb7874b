"""Device meshes and weight sharding: JAX's own SPMD runtime (`Mesh`, `NamedSharding`, `shard_map`).

One mesh with three axes, used by gate training (`duo_jax.training`) and meant for generation too:

* ``data``: plain data parallelism. The batch is split over it; the weights are replicated (the axis to
  put across slow links, e.g. between TPU slices).
* ``fsdp``: fully sharded data parallelism (ZeRO-3). The batch is split over it as well, and every frozen
  weight is stored 1/n per device.
* ``seq``: sequence parallelism. Each device holds a contiguous slice of every sequence.

Frozen weights are sharded over ``fsdp`` *and* ``seq`` (`WEIGHT_AXES`): devices of the sequence axis need
the same layer at the same time, exactly as those of the fsdp axis do, so they can share its storage too
(MaxText's rules shard the weights' embed dimension over its fsdp and sequence axes alike). Each stacked
weight [L, ...] is split along its largest non-layer axis that the fsdp x seq devices divide (replicated
when none does, e.g. a norm of odd width); the embedding [V, D] along D.

Where the gathering happens, and why by hand: inside `shard_map`, `gather_layer` all-gathers one layer's
weights in the body of the scanned (and rematerialised) layer, so at any time a device holds its 1/n of
every layer plus one (two, with the backward pass's recomputation) gathered layer: weight memory falls as
1/n. The alternative, letting GSPMD place the gathers from sharding constraints, leaves the choice of where
to all-gather to the partitioner, which may hoist the gather of the whole stacked weight out of the loop;
an explicit collective has the memory it says, and the compiled step's memory analysis
(`benchmarks/train_memory.py`) confirms it. The embedding is looked up in the local D-slice of the table
for every peer's tokens and the rows exchanged with one all-to-all (`embed_tokens`), never gathering the
[V, D] table.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from duo_jax.errors import DuoJaxError
from duo_jax.model import LayerParams, Params

MESH_AXES = ("data", "fsdp", "seq")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both
WEIGHT_AXES = ("fsdp", "seq")  # frozen weights are split over both


class MeshError(DuoJaxError, ValueError):
    """A mesh that cannot be built or used as asked; the message says why and what to choose."""


def parse_mesh(spec: str) -> dict[str, int]:
    """"data=2,fsdp=2,seq=2" -> {"data": 2, "fsdp": 2, "seq": 2}; axes left out have size 1."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in MESH_AXES or name in sizes or not value.strip().isdigit() or int(value) < 1:
            raise MeshError(f"bad mesh {spec!r}: expected comma-separated 'axis=N' with axes {MESH_AXES} "
                            "(each at most once, sizes of 1 may be left out) and positive integers, "
                            "e.g. 'data=2,fsdp=2,seq=2'")
        sizes[name] = int(value)
    return {name: sizes.get(name, 1) for name in MESH_AXES}


def make_mesh(*, data: int = 1, fsdp: int = 1, seq: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "seq") mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    if data * fsdp * seq != len(devices):
        raise MeshError(f"mesh data={data},fsdp={fsdp},seq={seq} needs {data * fsdp * seq} devices but there are "
                        f"{len(devices)}; choose sizes whose product is {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, fsdp, seq), MESH_AXES)


def format_mesh(mesh: Mesh) -> str:
    return ",".join(f"{name}={mesh.shape[name]}" for name in MESH_AXES)


def axis_size(mesh: Mesh, axes: tuple[str, ...]) -> int:
    return math.prod(mesh.shape[a] for a in axes)


# --- weights ------------------------------------------------------------------------------------------


def _split_axis(shape: tuple[int, ...], n: int, first: int) -> int | None:
    """The largest axis >= `first` of `shape` that n divides (the first of equals), or None."""
    candidates = [a for a in range(first, len(shape)) if shape[a] % n == 0]
    return max(candidates, key=lambda a: shape[a]) if candidates and n > 1 else None


def _spec(ndim: int, axis: int | None) -> P:
    return P() if axis is None else P(*(WEIGHT_AXES if a == axis else None for a in range(ndim)))


def weight_specs(params: Params, mesh: Mesh) -> Params:
    """The `PartitionSpec` of every weight (arrays or `jax.ShapeDtypeStruct`s) on `mesh`; see the module
    docstring. The final norm is replicated (a vector, used once)."""
    n = axis_size(mesh, WEIGHT_AXES)
    layers = jax.tree.map(lambda x: _spec(x.ndim, _split_axis(x.shape, n, 1)), params.layers)
    embed_axis = 1 if params.embed.shape[1] % n == 0 and n > 1 else None
    lm_head = None if params.lm_head is None else _spec(2, _split_axis(params.lm_head.shape, n, 0))
    return Params(embed=_spec(2, embed_axis), layers=layers, final_norm=P(), lm_head=lm_head)


def weight_shardings(params: Params, mesh: Mesh) -> Params:
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), weight_specs(params, mesh),
                        is_leaf=lambda x: isinstance(x, P))


def shard_params(params: Params, mesh: Mesh) -> Params:
    """Place the weights on `mesh` as `weight_specs` says (each device receives only its slices)."""
    return jax.device_put(params, weight_shardings(params, mesh))


def _gather(x: jax.Array, spec: P, skip: int = 0) -> jax.Array:
    """Inside shard_map: the whole of x, whose dimension `skip + i` is split as spec[i] says."""
    for axis, names in enumerate(spec):
        if names is not None:
            return jax.lax.all_gather(x, names, axis=axis - skip, tiled=True)
    return x


def gather_layer(layer: LayerParams, specs: LayerParams) -> LayerParams:
    """Inside shard_map: one layer's whole weights from the local slices of the stacked ones (`specs`:
    their `weight_specs`, whose leading layer axis the scan has removed)."""
    return jax.tree.map(lambda x, spec: _gather(x, spec, skip=1), layer, specs,
                        is_leaf=lambda x: isinstance(x, P))


def embed_tokens(embed: jax.Array, spec: P, tokens: jax.Array) -> jax.Array:
    """Inside shard_map: the embeddings [B, T, D] of this device's `tokens` [B, T] from the local D-slice of
    the table: every device of the weight axes looks its peers' tokens up in its slice, and one all-to-all
    hands each device the n slices of its own rows."""
    if spec == P():
        return embed[tokens]
    everyone = jax.lax.all_gather(tokens, WEIGHT_AXES)  # [n, B, T]: the peers' tokens (ints: cheap)
    rows = embed[everyone]  # [n, B, T, D / n]
    return jax.lax.all_to_all(rows, WEIGHT_AXES, split_axis=0, concat_axis=3, tiled=True)[0]  # [B, T, D]


# --- bytes --------------------------------------------------------------------------------------------


def device_bytes(tree: Any) -> int:
    """Bytes of `tree` (arrays or `ShapeDtypeStruct`s with shardings) held by one device: each leaf's
    shard shape as its sharding says (the largest shard, where shards differ)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += math.prod(shape) * np.dtype(x.dtype).itemsize
    return total


def total_bytes(tree: Any) -> int:
    """Bytes of `tree`'s leaves in full (every shard once)."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))
