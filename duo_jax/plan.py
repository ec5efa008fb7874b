"""Memory planner: the largest context of one sequence that fits in a device's memory, full attention vs duo.

    python -m duo_jax.plan --model llama3-8b --hbm-gib 80 --sparsity 0.75 --kv-dtype int4 --weights int8 [--json]
    python -m duo_jax.plan --model llama3-8b --hbm-gib 16 --mesh model=8 --kv-dtype int4 --no-temp   # 8 chips

On a generation mesh (`--mesh data=A,model=B`) every figure is one device's: the engine's tensor-parallel weights,
its slice of the cache (one sequence per `data` slot), and the compiled steps' temp memory per device (compiling
needs the mesh's devices here: `--no-temp` plans for any mesh shape, or on a CPU host
XLA_FLAGS=--xla_force_host_platform_device_count=N gives XLA:CPU's figures).

Every figure comes from the real layouts, nothing is allocated: weights are `jax.eval_shape` of the loaded
`Params`, the cache is the method's own `cache_spec`, temp memory is XLA's memory analysis of the compiled steps
`generate` runs, for this machine's backend. Each is measured at two capacities and the largest capacity C (a
multiple of `duo_jax.cache.CAPACITY_BLOCK`) with weights + cache(C) + temp(C) <= HBM is solved for, then checked
at C. Design: docs/quantization.md, "The memory planner".
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from fractions import Fraction

import jax
import jax.numpy as jnp
from jax.sharding import AbstractMesh, Mesh
from tqdm.auto import tqdm

from duo_jax import sharding
from duo_jax.cache import CAPACITY_BLOCK
from duo_jax.config import ModelConfig, get_config
from duo_jax.engine import abstract_params, compiled_decode, compiled_extend, fuses_qkv_by_default, prepared
from duo_jax.errors import DuoJaxError
from duo_jax.methods import Method, make_method
from duo_jax.model import check_weight_dtype, param_shapes, quantize_weights
from duo_jax.pattern import Pattern
from duo_jax.sampling import check_number

GIB = 2**30


def tree_bytes(tree) -> int:
    """Bytes of every array (or `jax.ShapeDtypeStruct`) in a pytree."""
    return int(sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def weight_bytes(config: ModelConfig, dtype: str, weights: str | None, fused_qkv: bool = False) -> int:
    """Bytes of the model's weights as loaded (`duo_jax.load(..., dtype, weights=...)`), plus the engine's fused
    q/k/v copy when `fused_qkv` (docs/engine.md, "Fused q/k/v": the model's own arrays stay alive beside it)."""
    stacked = jax.tree.map(
        lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(config), is_leaf=lambda s: isinstance(s, tuple)
    )
    loaded = jax.eval_shape(lambda p: quantize_weights(p, weights), stacked)
    copy = jax.eval_shape(lambda p: [layer.wqkv for layer in prepared(p, True).layers], loaded) if fused_qkv else []
    return tree_bytes(loaded) + tree_bytes(copy)


def _method(name: str, config: ModelConfig, capacity: int, options: dict) -> Method:
    return make_method(name, config, context=capacity, **options)


def _step_temp(
    config: ModelConfig,
    method: Method,
    dtype: str,
    weights: str | None,
    chunk: int,
    fused_qkv: bool,
    mesh: Mesh | None = None,
) -> int:
    """Temp bytes (per device, on `mesh`) of the largest of what `generate` compiles: the prefill chunk and the
    decode loop (greedy; its token buffer's bucket is a few KiB) (XLA memory analysis), one sequence per `data`
    slot."""
    layout = dict(weight_format=weights, fused_qkv=fused_qkv)
    batch = 1 if mesh is None else mesh.shape[sharding.DATA]
    steps = [compiled_extend(config, method, batch, chunk, dtype, "auto", False, mesh, **layout)]
    steps.append(compiled_decode(config, method, batch, dtype, "auto", True, 16, (), mesh, **layout))
    return max(step.memory_analysis().temp_size_in_bytes for step in steps)


def _largest(budget: int, fixed: Fraction, per_token: Fraction, block: int) -> int | None:
    """The largest multiple of `block` with fixed + per_token * C <= budget (0 if none; None if any fits: nothing
    grows with C, as a cache of streaming heads only)."""
    if budget < fixed + per_token * block:
        return 0
    if per_token <= 0:
        return None
    return math.floor((budget - fixed) / per_token) // block * block


def _fitting(budget, fixed, per_token, low, block, cache_at, extra_fixed, extra_per_token) -> int | None:
    """`_largest` of the cache's line (measured at capacities >= `low`) plus an extra line (temp); below `low`,
    where a cache narrows its streaming window to the capacity, the exact layouts, bisected over blocks (a cache
    never shrinks as its capacity grows; a wide window made a scan block by block take one build per block)."""

    def fits(blocks: int) -> bool:
        capacity = blocks * block
        return cache_at(capacity) + extra_fixed + extra_per_token * capacity <= budget

    best = _largest(budget, fixed + extra_fixed, per_token + extra_per_token, block)
    if best is not None and best < low:
        lo, hi = 0, low // block  # lo blocks fit (or lo is 0), more than hi do not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
        best = lo * block
    return best


def plan(
    config: ModelConfig,
    *,
    hbm_bytes: int,
    sparsity: float = 0.5,
    kv_dtype: str | None = None,
    weights: str | None = None,
    dtype: str = "bfloat16",
    pattern: Pattern | None = None,
    sink: int = 64,
    recent: int = 256,
    chunk: int = 512,
    temp: bool = True,
    fused_qkv: bool | None = None,
    mesh: str | None = None,
    progress: bool = False,
) -> dict:
    """Weights, cache per token, temp memory and the largest context for "full" and "duo" (batch 1).

    pattern: duo's head pattern (default: the model's shipped one, if any: else only full attention is planned; only
    how many heads it makes retrieval heads matters here). temp=False skips compiling (temp counted as 0).
    fused_qkv: whether the engine holds q/k/v as one weight, a copy counted with the weights (None: the engine's
    default on this backend). mesh: a generation mesh "data=A,model=B": every figure per device (one sequence per
    `data` slot), the capacity a multiple of lcm(128, B); compiling needs A x B devices here (temp=False does
    not). progress: a progress bar over the compiles (minutes at an 8B model's shapes on a CPU).
    Returns a dict with weight_bytes, and per method (prefix "full_" / "duo_"): cache_bytes_per_token,
    cache_fixed_bytes, temp_bytes, temp_bytes_per_token, max_context (weights + cache + temp <= HBM) and
    max_context_no_temp (None: any length fits, nothing grows with it); plus max_context_full and max_context_duo.
    """
    check_number("chunk", chunk, integer=True, minimum=1, hint=" (prefill tokens per step)")
    dtype = check_weight_dtype(dtype).name
    if pattern is None:
        pattern = Pattern.for_model(config.name)  # None: full attention only (no shipped pattern)
    if pattern is not None:
        pattern.validate(config)
    sizes = None if mesh is None else sharding.parse_mesh(mesh, sharding.GENERATION_AXES)
    if sizes is None:
        fused_qkv = fuses_qkv_by_default() if fused_qkv is None else fused_qkv
        w_bytes, block, batch = weight_bytes(config, dtype, weights, fused_qkv), CAPACITY_BLOCK, 1
        shapes = None  # bytes of whole arrays
    else:
        if fused_qkv:
            raise DuoJaxError("fused_qkv is for one device: a tensor-parallel mesh splits q, k and v by head")
        fused_qkv, shapes = False, AbstractMesh(tuple(sizes.values()), sharding.GENERATION_AXES)
        sharding.check_generation_mesh(shapes, config.num_heads, config.intermediate_size)
        w_bytes = sharding.device_bytes(abstract_params(config, dtype, shapes, weights))
        block, batch = math.lcm(CAPACITY_BLOCK, sizes[sharding.MODEL]), sizes[sharding.DATA]
    compile_mesh = None if sizes is None or not temp else _devices_for(sizes)

    def cache_bytes(method: Method) -> int:
        """One device's bytes of `method`'s cache (of one sequence per `data` slot)."""
        cache = method.cache_spec(batch, dtype)
        if shapes is None:
            return tree_bytes(cache)
        return sharding.device_bytes(sharding.abstract(cache, sharding.cache_specs(method, cache, shapes), shapes))

    out = dict(
        model=config.name,
        hbm_bytes=int(hbm_bytes),
        dtype=dtype,
        weights=weights or dtype,
        kv_dtype=kv_dtype or dtype,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        chunk=chunk,
        backend=jax.default_backend(),
        weight_bytes=w_bytes,
        fused_qkv=fused_qkv,
        mesh=mesh and ",".join(f"{k}={v}" for k, v in sizes.items()),
        max_position_embeddings=config.max_position_embeddings,
    )
    options = {"full": dict(kv_dtype=kv_dtype)}
    if pattern is not None:
        options["duo"] = dict(kv_dtype=kv_dtype, pattern=pattern, sparsity=sparsity, sink=sink, recent=recent)
    # Two capacities past the streaming window (below it a cache narrows the window to the capacity: not linear)
    # and at least the XLA path's key tile (512), so only the context changes between them.
    low = -(-max(2 * chunk, 1024, 2 * (sink + recent)) // block) * block
    high = 2 * low
    compiles = tqdm(total=2 * len(options), desc="compiling the steps (temp memory)", disable=not (temp and progress))
    for name, opts in options.items():
        methods = [_method(name, config, c, opts) for c in (low, high)]
        cache = [cache_bytes(m) for m in methods]
        per_token = Fraction(cache[1] - cache[0], high - low)
        fixed = cache[0] - per_token * low
        temps = [0, 0]
        for i, (capacity, m) in enumerate(zip((low, high), methods) if temp else ()):
            compiles.set_postfix_str(f"{name}, {capacity} tokens")
            temps[i] = _step_temp(config, m, dtype, weights, chunk, fused_qkv, compile_mesh)
            compiles.update()
        temp_per_token = Fraction(max(temps[1] - temps[0], 0), high - low)
        temp_fixed = temps[0] - temp_per_token * low
        budget = hbm_bytes - w_bytes

        cache_at = lambda capacity, name=name, opts=opts: cache_bytes(_method(name, config, capacity, opts))  # noqa: E731
        fit = functools.partial(_fitting, budget, fixed, per_token, low, block, cache_at)
        best = fit(temp_fixed, temp_per_token)
        if best and cache_at(best) + temp_fixed + temp_per_token * best > budget:  # the layout at the answer, built
            raise DuoJaxError(f"internal: the {name} cache at {best} tokens does not fit the plan's budget")
        out.update(
            {
                f"{name}_cache_bytes_per_token": float(per_token),
                f"{name}_cache_fixed_bytes": int(fixed),
                f"{name}_temp_bytes": int(temps[0]),
                f"{name}_temp_bytes_per_token": float(temp_per_token),
                f"{name}_max_context": best,
                f"{name}_max_context_no_temp": fit(Fraction(0), Fraction(0)),
            }
        )
        out[f"max_context_{name}"] = best
    compiles.close()
    return out


def _devices_for(sizes: dict[str, int]) -> Mesh:
    """A generation mesh of `sizes` over this machine's devices, to compile for; an error saying how to plan
    without them where there are too few."""
    n = math.prod(sizes.values())
    if jax.device_count() < n:
        raise DuoJaxError(
            f"compiling for mesh {','.join(f'{k}={v}' for k, v in sizes.items())} needs {n} devices, this machine has "
            f"{jax.device_count()}: pass --no-temp (temp=False) to plan the weights and cache alone, or on a CPU host "
            f"set XLA_FLAGS=--xla_force_host_platform_device_count={n} (XLA:CPU's temp memory)"
        )
    return sharding.make_generation_mesh(**sizes, devices=jax.devices()[:n])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m duo_jax.plan", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3-8b", help="a name from configs/ (default llama3-8b)")
    p.add_argument("--hbm-gib", type=float, default=80.0, help="device memory in GiB (default 80)")
    p.add_argument("--sparsity", type=float, default=0.5, help="duo's share of streaming heads (default 0.5)")
    p.add_argument("--kv-dtype", choices=["int8", "int4"], default=None, help="quantized KV cache")
    p.add_argument("--weights", choices=["int8"], default=None, help="int8 weights")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the model's dtype (default bfloat16; int8 weights: --weights int8)",
    )
    p.add_argument("--pattern", default=None, help="duo head pattern directory (default: the model's own)")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (default 512)")
    p.add_argument("--no-temp", action="store_true", help="skip compiling the steps (temp memory counted as 0)")
    p.add_argument(
        "--fuse-qkv",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count the engine's fused q/k/v copy with the weights (default: where the engine makes it, on a GPU; "
        "pass it when planning for a GPU on another machine)",
    )
    p.add_argument(
        "--mesh", default=None, help="a generation mesh 'data=A,model=B': per-device figures (default: one device)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    try:
        config = get_config(args.model)
        hbm_gib = check_number("--hbm-gib", args.hbm_gib, minimum=0, above=True, hint=" (the device's memory in GiB)")
        result = plan(
            config,
            hbm_bytes=int(hbm_gib * GIB),
            sparsity=args.sparsity,
            kv_dtype=args.kv_dtype,
            weights=args.weights,
            dtype=args.dtype,
            pattern=None if args.pattern is None else Pattern.load(args.pattern),
            sink=args.sink,
            recent=args.recent,
            chunk=args.chunk,
            temp=not args.no_temp,
            fused_qkv=args.fuse_qkv,
            mesh=args.mesh,
            progress=True,
        )
    except DuoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
        return 0
    r = result
    where = f" per device of mesh {r['mesh']} (one sequence per data slot)" if r["mesh"] else ""
    print(
        f"{r['model']} on {args.hbm_gib:g} GiB{where}: weights {r['weights']}, KV {r['kv_dtype']}, duo sparsity "
        f"{r['sparsity']} (sink {r['sink']}, recent {r['recent']}); "
        + ("temp not measured (--no-temp)" if args.no_temp else f"temp compiled for {r['backend']}")
    )
    fused = " (with the engine's fused q/k/v copy)" if r["fused_qkv"] else ""
    print(f"  weights: {r['weight_bytes'] / GIB:.2f} GiB{fused}")
    tokens = lambda n: "any length" if n is None else f"{n:,} tokens"  # noqa: E731
    for name in ("full", "duo"):
        if f"{name}_max_context" not in r:
            print(f"  {name:4s}: not planned ({r['model']} ships no head pattern: pass --pattern)")
            continue
        print(
            f"  {name:4s}: cache {r[f'{name}_cache_bytes_per_token'] / 1024:.2f} KiB/token + "
            f"{r[f'{name}_cache_fixed_bytes'] / 2**20:.1f} MiB fixed; temp {r[f'{name}_temp_bytes'] / GIB:.2f} GiB "
            f"(+{r[f'{name}_temp_bytes_per_token']:.0f} B/token); largest context {tokens(r[f'{name}_max_context'])} "
            f"({tokens(r[f'{name}_max_context_no_temp'])} without temp)"
        )
    print(f"  (the model was trained for {r['max_position_embeddings']:,} positions)")
    print(
        "  generate reserves exactly a planned context with context=N; without it, it rounds the capacity up to a "
        "shared bucket (duo_jax.cache.capacity_bucket), which may not fit"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
