"""Device meshes and weight sharding: JAX's own SPMD runtime (`Mesh`, `NamedSharding`, `shard_map`).

Gate training runs on a ("data", "fsdp", "seq") mesh (`make_mesh`): the batch split over data x fsdp, each
sequence over seq, frozen weights stored 1/n over fsdp x seq (`weight_specs`) and gathered one layer at a time
inside the scanned layer (`gather_layer`, `embed_tokens`). Generation runs on a ("data", "model") mesh
(`make_generation_mesh`): the batch over data, tensor-parallel weights over model (`tensor_parallel_specs`), the
retrieval cache split along its capacity over model with partial results merged by `merge_partials`.
Design: docs/training.md.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from duo_jax.errors import DuoJaxError
from duo_jax.model import LayerParams, Params
from duo_jax.quant import QuantizedWeight

MESH_AXES = ("data", "fsdp", "seq")
GENERATION_AXES = DATA, MODEL = ("data", "model")
BATCH_AXES = ("data", "fsdp")  # the batch dimension is split over both
WEIGHT_AXES = ("fsdp", "seq")  # frozen weights are split over both


class MeshError(DuoJaxError, ValueError):
    """A mesh that cannot be built or used as asked; the message says why and what to choose."""


def parse_mesh(spec: str, axes: tuple[str, ...] = MESH_AXES) -> dict[str, int]:
    """ "data=2,fsdp=2,seq=2" -> {"data": 2, "fsdp": 2, "seq": 2}; axes left out have size 1. `axes`: the
    training mesh's (default) or the generation mesh's (`GENERATION_AXES`)."""
    sizes: dict[str, int] = {}
    for part in spec.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in axes or name in sizes or not value.strip().isdigit() or int(value) < 1:
            example = ",".join(f"{a}=2" for a in axes)
            raise MeshError(
                f"bad mesh {spec!r}: expected comma-separated 'axis=N' with axes {axes} "
                "(each at most once, sizes of 1 may be left out) and positive integers, "
                f"e.g. {example!r}"
            )
        sizes[name] = int(value)
    return {name: sizes.get(name, 1) for name in axes}


def make_mesh(*, data: int = 1, fsdp: int = 1, seq: int = 1, devices=None) -> Mesh:
    """A ("data", "fsdp", "seq") mesh over `devices` (default: every device of every process)."""
    devices = jax.devices() if devices is None else list(devices)
    if data * fsdp * seq != len(devices):
        raise MeshError(
            f"mesh data={data},fsdp={fsdp},seq={seq} needs {data * fsdp * seq} devices but there are "
            f"{len(devices)}; choose sizes whose product is {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(data, fsdp, seq), MESH_AXES)


def format_mesh(mesh: Mesh) -> str:
    return ",".join(f"{name}={mesh.shape[name]}" for name in mesh.axis_names)


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
    if isinstance(params.layers, tuple):
        raise MeshError(
            "weight_specs lays out stacked layers (gate training scans them): pass "
            "duo_jax.model.stack_layers(params), or load with layout='stacked'"
        )
    n = axis_size(mesh, WEIGHT_AXES)
    layers = jax.tree.map(lambda x: _spec(x.ndim, _split_axis(x.shape, n, 1)), params.layers)
    embed_axis = 1 if params.embed.shape[1] % n == 0 and n > 1 else None
    lm_head = None if params.lm_head is None else _spec(2, _split_axis(params.lm_head.shape, n, 0))
    return Params(embed=_spec(2, embed_axis), layers=layers, final_norm=P(), lm_head=lm_head)


def weight_shardings(params: Params, mesh: Mesh) -> Params:
    return jax.tree.map(
        lambda spec: NamedSharding(mesh, spec), weight_specs(params, mesh), is_leaf=lambda x: isinstance(x, P)
    )


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
    return jax.tree.map(lambda x, spec: _gather(x, spec, skip=1), layer, specs, is_leaf=lambda x: isinstance(x, P))


def embed_tokens(embed: jax.Array, spec: P, tokens: jax.Array) -> jax.Array:
    """Inside shard_map: the embeddings [B, T, D] of this device's `tokens` [B, T] from the local D-slice of
    the table: every device of the weight axes looks its peers' tokens up in its slice, and one all-to-all
    hands each device the n slices of its own rows."""
    if spec == P():
        return embed[tokens]
    everyone = jax.lax.all_gather(tokens, WEIGHT_AXES)  # [n, B, T]: the peers' tokens (ints: cheap)
    rows = embed[everyone]  # [n, B, T, D / n]
    return jax.lax.all_to_all(rows, WEIGHT_AXES, split_axis=0, concat_axis=3, tiled=True)[0]  # [B, T, D]


# --- generation: ("data", "model") -----------------------------------------------------------------------


def make_generation_mesh(*, data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ("data", "model") mesh for generation over `devices` (default: every device)."""
    devices = jax.devices() if devices is None else list(devices)
    if data * model != len(devices):
        raise MeshError(
            f"mesh data={data},model={model} needs {data * model} devices but there are "
            f"{len(devices)}; choose sizes whose product is {len(devices)}"
        )
    return Mesh(np.asarray(devices).reshape(data, model), GENERATION_AXES)


def auto_axes(mesh: Mesh) -> Mesh:
    """`mesh` with every axis Auto (the same mesh when it already is). `jax.make_mesh` makes Explicit axes by
    default, under which every op's output sharding is part of its type and must be resolvable without
    collectives; generation places its arrays with `NamedSharding`s and sharding constraints and lets GSPMD
    partition the rest (docs/training.md), which is what Auto axes mean. Manual axes (inside shard_map) are
    refused."""
    if not isinstance(mesh, Mesh):  # e.g. the CLIs' spelling "data=2,model=4"
        raise MeshError(
            f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__} {mesh!r:.60}: build one with "
            "duo_jax.sharding.make_generation_mesh(data=2, model=4), or from a --mesh string with "
            "make_generation_mesh(**sharding.parse_mesh(text, sharding.GENERATION_AXES))"
        )
    types = tuple(getattr(mesh, "axis_types", None) or ())
    if all(t == AxisType.Auto for t in types):
        return mesh
    if any(t == AxisType.Manual for t in types):
        raise MeshError(
            f"generation cannot run on a mesh with Manual axes ({mesh.axis_names}, {types}); build "
            "it with jax.make_mesh(..., axis_types=(AxisType.Auto,) * n) or make_generation_mesh"
        )
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def check_generation_mesh(mesh: Mesh, num_heads: int, intermediate_size: int) -> None:
    """The tensor-parallel split needs `model` to divide the query heads and the MLP width."""
    if tuple(mesh.axis_names) != GENERATION_AXES:
        raise MeshError(
            f"generation needs a mesh with axes {GENERATION_AXES} (`make_generation_mesh`), "
            f"got {tuple(mesh.axis_names)}"
        )
    m = mesh.shape[MODEL]
    if num_heads % m or intermediate_size % m:
        raise MeshError(
            f"model={m} must divide the query heads ({num_heads}) and the MLP width "
            f"({intermediate_size}); choose a model axis that divides both"
        )


def check_batch(mesh: Mesh, batch: int) -> None:
    """The batch is split over `data`: it must be a multiple of it."""
    if batch % mesh.shape[DATA]:
        raise MeshError(
            f"a batch of {batch} sequences does not split over data={mesh.shape[DATA]}; pass a "
            f"multiple of {mesh.shape[DATA]} prompts or a data axis that divides {batch}"
        )


# The axis of each per-layer weight (layers unstacked, as the engine holds them) that `model` splits.
_TP_AXIS = dict(wq=1, wk=1, wv=1, wo=0, w_gate=1, w_up=1, w_down=0, bq=0, bk=0, bv=0)


def _tp_spec(x, axis: int | None, m: int) -> P | QuantizedWeight:
    """x's spec split along `axis` over `model` (size m), replicated where m does not divide it. An int8 weight's
    codes split so, and its per-output-channel scales with them: along an output axis they split alike, along the
    contracted axis (size 1 there: one scale serves every slice of the sum) they stay whole."""
    if isinstance(x, QuantizedWeight):
        return QuantizedWeight(_tp_spec(x.codes, axis, m), _tp_spec(x.scale, axis, m))
    if axis is None or x.shape[axis] % m or m == 1:
        return P()
    return P(*(MODEL if a == axis else None for a in range(x.ndim)))


def tensor_parallel_specs(params: Params, mesh: Mesh) -> Params:
    """The `PartitionSpec` of every weight of `params` (layers unstacked: a tuple of `LayerParams`, arrays or
    `ShapeDtypeStruct`s) on a generation mesh (docs/training.md)."""
    if not isinstance(params.layers, tuple):
        raise MeshError(
            "tensor_parallel_specs lays out per-layer weights (generation's engine holds them so): pass "
            "duo_jax.model.unstack_layers(params), or load with layout='per_layer' (the default)"
        )
    m = mesh.shape[MODEL]
    layers = tuple(
        LayerParams(
            **{
                f.name: None
                if getattr(layer, f.name) is None
                else _tp_spec(getattr(layer, f.name), _TP_AXIS.get(f.name), m)
                for f in dataclasses.fields(layer)
            }
        )
        for layer in params.layers
    )
    return Params(
        embed=_tp_spec(params.embed, 0, m),
        layers=layers,
        final_norm=P(),
        lm_head=None if params.lm_head is None else _tp_spec(params.lm_head, 0, m),
    )


def tensor_parallel_shardings(params: Params, mesh: Mesh) -> Params:
    """`tensor_parallel_specs` as shardings: `duo_jax.load(..., shardings=partial(tensor_parallel_shardings,
    mesh=mesh))` loads each device's slices straight into them, and an `Engine` on `mesh` runs those arrays as
    they are (one copy of the weights)."""
    return named(tensor_parallel_specs(params, mesh), auto_axes(mesh))


def named(specs: Any, mesh: Mesh) -> Any:
    """`PartitionSpec`s -> `NamedSharding`s on `mesh` (same tree)."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, P))


def abstract(tree: Any, specs: Any, mesh: Mesh) -> Any:
    """`ShapeDtypeStruct`s of `tree`'s arrays placed as `specs` say on `mesh` (to compile for, or to count
    bytes per device without allocating)."""
    return jax.tree.map(
        lambda x, spec: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
        tree,
        specs,
        is_leaf=lambda x: isinstance(x, P),
    )


def check_runs_on_a_mesh(method) -> Any:
    """`method.cache_partition()`, or a MeshError for a method that has none (it does not run on a mesh)."""
    specs = method.cache_partition()
    if specs is None:
        raise MeshError(
            f"method {method.name!r} does not run on a device mesh yet; use 'full' or 'duo' (or generate without mesh=)"
        )
    return specs


def cache_specs(method, cache: Any, mesh: Mesh) -> Any:
    """The `PartitionSpec` of every array of `method`'s cache on a generation mesh (`method.cache_partition()`,
    one spec per cache array or per quantized array's codes and scales alike), checked against the cache's shapes
    (arrays or `ShapeDtypeStruct`s); empty arrays (a layer without retrieval or streaming heads) are replicated:
    there is nothing to split, and XLA returns them so."""
    specs = check_runs_on_a_mesh(method)

    def check(x, spec: P) -> P:
        for dim, names in zip(x.shape, spec):
            n = axis_size(mesh, names if isinstance(names, tuple) else (names,)) if names is not None else 1
            if dim % n:
                what = "batch" if names == DATA else "cache capacity"
                raise MeshError(
                    f"the {what} ({dim}) is not a multiple of the mesh's {names} axis ({n}); "
                    f"choose a {what} that it divides (or a smaller {names} axis)"
                )
        return spec if math.prod(x.shape) else P()

    each = lambda spec, arrays: jax.tree.map(lambda x: check(x, spec), arrays)
    return jax.tree.map(each, specs, cache, is_leaf=lambda x: isinstance(x, P))


def split_heads_over_model(x: jax.Array, mesh: Mesh) -> jax.Array:
    """Attention activations [B, T, heads, E] constrained to their tensor-parallel layout: batch over `data`,
    heads over `model` (when it divides them). Pinned on the projections' outputs and on the attention's
    output, so that GSPMD moves these activations (an all-gather of q / k / v for the retrieval heads, the
    all-reduce after wo) rather than all-gathering wq / wk / wv / wo, which its cost model otherwise may."""
    heads = MODEL if x.shape[2] % mesh.shape[MODEL] == 0 else None
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA, None, heads, None)))


def whole_over_model(x: jax.Array, mesh: Mesh) -> jax.Array:
    """x [B, ...] split by batch over `data` and whole on every `model` device (DuoAttention's activations
    before `split_heads` picks each layer's heads: one all-gather over `model`, then local slicing)."""
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(DATA)))


def merge_partials(out: jax.Array, lse: jax.Array, axis: str) -> jax.Array:
    """Inside shard_map: attention over keys split across mesh axis `axis`, from each device's partial
    (out [B, T, H, E], log-sum-exp [B, T, H]; `duo_jax.attention.attend_partial`): the softmax-weighted mean
    of the partials, weights exp(lse - max lse) (a device whose keys a query cannot see weighs 0)."""
    weight = jnp.exp(lse - jax.lax.pmax(lse, axis))
    total = jax.lax.psum(weight, axis)
    merged = jax.lax.psum(out.astype(jnp.float32) * weight[..., None], axis) / total[..., None]
    return merged.astype(out.dtype)


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
