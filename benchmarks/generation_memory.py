"""Per-device memory of sharded generation (`generate(mesh=...)`) for a model's shapes (default Llama-3-8B).

For each ("data", "model") mesh: the bytes one device holds of the engine's tensor-parallel weights and of the
KV cache of full attention and of DuoAttention (the model's shipped pattern at `--sparsity`), read from the
arrays' shardings (`duo_jax.sharding.device_bytes` over `ShapeDtypeStruct`s: nothing is allocated), on N host
CPU devices (one subprocess per device count). With `--compile`, also the compiled decode step's memory
analysis (arguments and temporaries per device), as a check that the shardings are what the step takes.
`--weights int8` / `--kv-dtype int8|int4`: int8 weights, a quantized cache, split as the plain ones are.

    python benchmarks/generation_memory.py                                      # Llama-3-8B, 32k context
    python benchmarks/generation_memory.py --context 1048576 --weights int8 --kv-dtype int4 --meshes model=8
    python benchmarks/generation_memory.py --model smollm2-135m --meshes model=3 data=2,model=3 --compile
"""

from __future__ import annotations

import argparse
import json
import sys

import common

DEFAULT_MESHES = ("model=1", "model=2", "model=4", "model=8", "data=2,model=4")
CONTEXT = 32768


def _worker(
    model: str,
    context: int,
    sparsity: float,
    meshes: list[str],
    compile_step: bool,
    weights: str | None,
    kv_dtype: str | None,
) -> None:
    """In a process with the right number of host devices: one JSON line per mesh."""
    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax import config as config_lib
    from duo_jax import sharding
    from duo_jax.engine import compiled_decode
    from duo_jax.methods import make_method
    from duo_jax.model import quantize_weights, unstack_layers
    from duo_jax.pattern import Pattern

    config = config_lib.get_config(model)
    stacked = jax.eval_shape(lambda: duo_jax.init_params(config, jax.random.key(0), dtype=jnp.bfloat16))
    params = jax.eval_shape(lambda p: unstack_layers(quantize_weights(p, weights)), stacked)
    methods = {
        "full": make_method("full", config, context=context, kv_dtype=kv_dtype),
        "duo": make_method(
            "duo",
            config,
            context=context,
            pattern=Pattern.for_model(config.name),
            sparsity=sparsity,
            sink=64,
            recent=256,
            kv_dtype=kv_dtype,
        ),
    }
    for spec in meshes:
        sizes = sharding.parse_mesh(spec, sharding.GENERATION_AXES)
        mesh = sharding.make_generation_mesh(**sizes)
        sharded = sharding.abstract(params, sharding.tensor_parallel_specs(params, mesh), mesh)
        row = dict(
            mesh=sharding.format_mesh(mesh),
            devices=mesh.size,
            batch=sizes["data"],
            weights=sharding.device_bytes(sharded),
            full_weights=sharding.total_bytes(params),
        )
        for name, method in methods.items():
            cache = method.cache_spec(sizes["data"], "bfloat16")
            placed = sharding.abstract(cache, sharding.cache_specs(method, cache, mesh), mesh)
            row[f"{name}_cache"], row[f"{name}_full_cache"] = sharding.device_bytes(placed), sharding.total_bytes(cache)
            if compile_step:
                step = compiled_decode(
                    config, method, sizes["data"], "bfloat16", "xla", True, 16, (), mesh, weight_format=weights
                )
                stats = step.memory_analysis()
                row[f"{name}_step_arguments"], row[f"{name}_step_temp"] = (
                    stats.argument_size_in_bytes,
                    stats.temp_size_in_bytes,
                )
        print(json.dumps(row), flush=True)


def main(argv=None) -> int:
    p = common.parser(__doc__, "generation_memory")
    p.set_defaults(out=common.REPO / "benchmarks" / "results")
    p.add_argument("--model", default="llama3-8b", help="a config name with a shipped pattern (only shapes are used)")
    p.add_argument("--context", type=int, default=CONTEXT, help="cache capacity in tokens")
    p.add_argument("--sparsity", type=float, default=0.5, help="DuoAttention's fraction of streaming heads")
    p.add_argument(
        "--meshes", nargs="+", default=DEFAULT_MESHES, help="meshes 'data=A,model=B'; one sequence per data slot"
    )
    p.add_argument("--compile", action="store_true", help="also compile each decode step (slow for 8B shapes)")
    p.add_argument("--weights", choices=["int8"], default=None, help="int8 weights (default: bf16)")
    p.add_argument("--kv-dtype", choices=["int8", "int4"], default=None, help="a quantized cache (default: bf16)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args.model, args.context, args.sparsity, args.meshes, args.compile, args.weights, args.kv_dtype)
        return 0

    from duo_jax import sharding

    worker_args = [
        "--model",
        args.model,
        "--context",
        str(args.context),
        "--sparsity",
        str(args.sparsity),
        *(["--compile"] if args.compile else []),
        *(["--weights", args.weights] if args.weights else []),
        *(["--kv-dtype", args.kv_dtype] if args.kv_dtype else []),
    ]
    results = common.run_workers(__file__, args.meshes, sharding.GENERATION_AXES, worker_args)
    if results is None:
        return 1

    gib = lambda b: round(b / 2**30, 3)
    formats = f"{args.weights or 'bf16'} weights, {args.kv_dtype or 'bf16'} cache"
    headers = ["devices", "mesh", "batch", "weights GiB", "full cache GiB", "duo cache GiB", "weights + duo GiB"]
    if args.compile:
        headers += ["duo decode step: arguments GiB", "temp GiB"]
    rows = []
    for r in results:
        rows.append(
            [
                r["devices"],
                r["mesh"],
                r["batch"],
                gib(r["weights"]),
                gib(r["full_cache"]),
                gib(r["duo_cache"]),
                gib(r["weights"] + r["duo_cache"]),
            ]
        )
        if args.compile:
            rows[-1] += [gib(r["duo_step_arguments"]), gib(r["duo_step_temp"])]
    first = results[0]
    notes = [
        f"{args.model} shapes ({formats}), per device, from the arrays' shardings; one {args.context}-token sequence "
        f"per data slot. In full: weights {gib(first['full_weights'])} GiB (engine copy, LM head included), "
        f"full cache {gib(first['full_full_cache'] / first['batch'])} GiB and duo cache "
        f"{gib(first['duo_full_cache'] / first['batch'])} GiB per sequence (shipped pattern, sparsity "
        f"{args.sparsity}, sink 64 + recent 256). Retrieval slots split over model, streaming partition "
        "replicated over it, batch over data (duo_jax/sharding.py)."
    ]
    common.write_result(
        args.out,
        "_".join(
            [
                "generation_memory",
                args.model,
                *([f"{args.context // 1024}k"] if args.context != CONTEXT else []),
                *([f"{args.weights}_weights"] if args.weights else []),
                *([f"{args.kv_dtype}_kv"] if args.kv_dtype else []),
                *(["compiled"] if args.compile else []),
            ]
        ),
        title=f"Sharded generation memory per device: {args.model}, {args.context}-token cache, {formats}",
        headers=headers,
        rows=rows,
        data=dict(results=results),
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
