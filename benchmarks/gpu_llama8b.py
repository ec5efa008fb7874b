"""Llama-3-8B on one GPU: decode latency and prefill time, DuoAttention vs full attention, from 8k tokens to the
largest context that fits, against the paper (A100: 1.50x faster decode, 1.63x faster prefill for GQA models at
50% retrieval heads) and the HBM roofline.

The model has Llama-3-8B's shape with random bf16 weights (timings do not depend on the values; one set of
unstacked weights serves both modes, since reordering random heads changes nothing). duo uses the published
pattern (configs/patterns/llama3-8b) at --sparsity, sink 64 / recent 256. Batch 1, prefill chunked by
--chunk-size, both through the engine (`duo_jax.engine.Engine.prefill` and `.step`: the executables `generate` runs).

Per context C and mode:
- prefill: C - 11 - 4 x --decode-steps random tokens in chunks, timed end to end: the median of
  --prefill-repeats runs, and the time the driver took to return (host work the GPU did not hide) (contexts up
  to --max-prefill only: beyond, a prefill takes longer than a device session allows);
- decode, two ways, at lengths just under C: "decode ms" is --decode-steps tokens generated on the device in
  one `Engine.decode_loop` (a `lax.while_loop` with sampling inside: what `generate` runs), time / steps (the JSON
  keeps the first sequence's tokens, so runs under different XLA flags can be checked for the same output);
  "host step ms" is the median of single `Engine.step` calls, each one dispatched from Python and waited for
  (what a caller that needs every step on the host pays; the token stays on the device). The cache is filled by the
  prefill when
  there was one; beyond --max-prefill it holds zeros, which costs the same: a step reads the same bytes
  whatever they hold;
- with --profile, one more device loop per context and mode under `jax.profiler`, its GPU time per step split
  by XLA op (the 15 costliest) into the JSON: what stands between a step and the roofline;
- "largest context that fits": the first context whose cache or step runs out of device memory ends the
  mode's sweep; the one before it is reported.

Roofline: a decode step must read every weight and the KV cache it attends to,
bytes / HBM bandwidth (measured here with a jnp.sum over a large bf16 buffer, or --bandwidth-tbs). Prefill is
FLOP-bound: 2 * params * T for the linear layers plus causal attention 2 * T^2 * H * E * L over the retrieval
heads' share and 4 * T * (sink + recent + chunk) * H * E * L over the streaming heads' (an upper bound).

--kv-dtype int8 / int4 quantizes the KV cache of both modes and --weights int8 the matmul weights (the
formats `duo_jax.plan` counts): the roofline then reads the quantized bytes (codes + scales), so "% roofline"
stays comparable across formats.

--fill-memory decodes each mode at the largest batch its caches fit into the GPU's free memory instead (the
serving case: the memory duo saves holds more sequences), and reports tokens/s side by side. --impl cudnn runs the
dense prefill chunks through cuDNN, --impl pallas every one through the Triton kernels (auto: cuDNN for chunks over
caches of 16k keys or more; docs/attention.md).

--dry-run builds everything abstractly on any backend (CPU included): the weights, the caches and one prefill
chunk and one decode step of both modes with `jax.eval_shape`, and prints the plan (sizes, what fits in
--hbm-gib, roofline times) without allocating.

    python benchmarks/gpu_llama8b.py --dry-run
    python benchmarks/gpu_llama8b.py --contexts 8192 32768 131072 524288 --out results/benchmarks/gpu_llama8b
    python benchmarks/gpu_llama8b.py --kv-dtype int4 --weights int8 --sparsity 0.75 --contexts 131072 1048576 4194304
    python benchmarks/gpu_llama8b.py --fill-memory --contexts 32768 --decode-steps 16
    python benchmarks/gpu_llama8b.py --num-layers 1 --contexts 16384 131072 --impl cudnn   # one layer: seconds
    DUO_JAX_DISABLE_TRITON=1 python benchmarks/gpu_llama8b.py --contexts 8192 32768   # as a GPU without Triton
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
import pathlib
import re
import statistics
import sys
import tempfile
import time

import common
import numpy as np

MODEL = "llama3-8b"
PAPER = dict(decode=1.50, prefill=1.63)  # DuoAttention, A100, GQA at 50% retrieval heads
QUARTILES = (0.0, 0.25, 0.5, 0.75, 1.0)  # of one launch's time, for the profile's costliest ops
# H100 80GB HBM3 read bandwidth reached by jnp.sum over 8 GiB of bf16 (measured 2026-11-22, JAX 0.11.2 CUDA).
DRY_RUN_BANDWIDTH_TBS = 3.03


def random_params(config, seed: int = 0):
    """Random bf16 weights of `config`'s shape, layers unstacked as `extend` takes them (N(0, 0.02), norms 1)."""
    import jax
    import jax.numpy as jnp

    from duo_jax.model import LayerParams, Params, param_shapes

    shapes = param_shapes(config)
    key = iter(jax.random.split(jax.random.key(seed), 16 * (config.num_layers + 2)))

    @functools.cache  # one executable per shape: a jit per weight compiled 290 times at Llama-3-8B (90 s)
    def sampler(shape):
        return jax.jit(lambda k: 0.02 * jax.random.normal(k, shape, jnp.bfloat16))

    def normal(shape):
        return sampler(tuple(shape))(next(key))

    def layer(_):
        stacked = {f.name: getattr(shapes.layers, f.name) for f in dataclasses.fields(shapes.layers)}
        fields = {
            name: (jnp.ones(shape[1:], jnp.bfloat16) if "norm" in name else normal(shape[1:]))
            for name, shape in stacked.items()
            if shape is not None
        }  # fields this family has
        return LayerParams(**fields)

    return Params(
        embed=normal(shapes.embed),
        layers=tuple(layer(l) for l in range(config.num_layers)),
        final_norm=jnp.ones(shapes.final_norm, jnp.bfloat16),
        lm_head=None if shapes.lm_head is None else normal(shapes.lm_head),
    )


def model_params(config, weights: str | None = None, seed: int = 0):
    """`random_params`, int8 per output channel when weights="int8" (`duo_jax.model.quantize_weights`)."""
    from duo_jax.model import quantize_weights

    return quantize_weights(random_params(config, seed), weights)


def tree_bytes(tree) -> int:
    import jax
    import numpy as np

    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))


def roofline(
    config,
    *,
    weight_bytes: int,
    share: float,
    window: int,
    context: int,
    chunk: int,
    bandwidth: float,
    kv_dtype: str | None = None,
    batch: int = 1,
) -> dict:
    """Best-case decode ms per step (bytes / bandwidth) and prefill FLOPs, full and duo, at `context` tokens
    for each of `batch` sequences. kv_dtype "int8" / "int4": a cached vector is its codes + its scale
    (`duo_jax.quant.kv_bytes_per_vector`)."""
    from duo_jax.quant import kv_bytes_per_vector

    kv_token = 2 * batch * config.num_layers * config.num_kv_heads * kv_bytes_per_vector(config.head_dim, kv_dtype, 2)
    kv = dict(full=context * kv_token, duo=share * context * kv_token + (1 - share) * window * kv_token)
    params = weight_bytes / 2
    attention = 2 * context**2 * config.num_heads * config.head_dim * config.num_layers  # causal
    streaming = 4 * context * (window + chunk) * config.num_heads * config.head_dim * config.num_layers
    flops = dict(
        full=2 * params * context + attention, duo=2 * params * context + share * attention + (1 - share) * streaming
    )
    return dict(decode_ms={m: 1e3 * (weight_bytes + kv[m]) / bandwidth for m in kv}, prefill_flops=flops)


def measure_bandwidth(gib: float = 8.0) -> float:
    """HBM read bandwidth in bytes/s: the best of 10 jnp.sum over `gib` GiB of bf16."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((int(gib * 2**30) // 2,), jnp.bfloat16)
    total = jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32))
    total(x).block_until_ready()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        total(x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    del x
    return gib * 2**30 / best


def largest_batch(method, free_bytes: int, margin_bytes: int) -> int:
    """The most sequences whose caches (bf16) fit `free_bytes` less `margin_bytes` (the decode step's temporaries,
    the allocator's slack): the serving case, where the memory a method saves holds more sequences."""
    import jax
    import jax.numpy as jnp

    per_sequence = tree_bytes(jax.eval_shape(lambda: method.init_cache(1, jnp.bfloat16)))
    return max(0, (free_bytes - margin_bytes) // per_sequence)


def fill_memory(engine, methods: dict, context: int, *, steps: int, margin_gib: float, impl: str) -> dict:
    """Decode at `context` with each mode's largest batch (`largest_batch` over the device's free memory once the
    weights are loaded), backing off by a tenth on an out-of-memory error: {mode: run_mode's result + batch}."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
    out = {}
    for mode, method in methods.items():
        batch = largest_batch(method, free, int(margin_gib * 2**30))
        while batch > 0:
            try:
                out[mode] = dict(
                    run_mode(engine, method, context, chunk=1, steps=steps, prefill=False, batch=batch, impl=impl),
                    batch=batch,
                )
                break
            except Exception as e:  # XLA reports device OOM as a runtime error
                if not is_oom(e):
                    raise
                gc.collect()
                batch -= max(1, batch // 10)
    return out


def is_oom(error: Exception) -> bool:
    return "RESOURCE_EXHAUSTED" in str(error) or "out of memory" in str(error).lower()


def gpu_op_times(trace_dir: str, steps: int, top: int = 15) -> dict:
    """GPU time per decode step from a `jax.profiler` trace: the total, the span from the first kernel's start to
    the last one's end (the difference is the GPU idle between kernels, waiting for the host), the `top` costliest
    XLA ops (ms per step, launches per step, and the quartiles of one launch's microseconds: one kernel launched
    for two kinds of call, such as cuDNN's over the retrieval cache and over the ring, shows two sizes) and every
    op kind's ms and launches per step. Reads the device plane's "XLA Ops" line (or, without one, its busiest
    line)."""
    import glob

    from jax.profiler import ProfileData

    files = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
    if not files:
        return {"error": f"no trace written under {trace_dir}"}
    planes = [
        p
        for p in ProfileData.from_file(max(files, key=lambda f: pathlib.Path(f).stat().st_mtime)).planes
        if p.name.startswith("/device:GPU")
    ]
    if not planes:
        return {"error": "the trace has no GPU plane"}
    lines = {line.name: list(line.events) for line in planes[0].lines}
    name = "XLA Ops" if "XLA Ops" in lines else max(lines, key=lambda n: len(lines[n]))
    totals, counts, durations = {}, {}, {}
    for event in lines[name]:
        totals[event.name] = totals.get(event.name, 0.0) + event.duration_ns
        counts[event.name] = counts.get(event.name, 0) + 1
        durations.setdefault(event.name, []).append(event.duration_ns / 1e3)
    ranked = sorted(totals, key=totals.get, reverse=True)[:top]
    events = lines[name]
    span = (max(e.end_ns for e in events) - min(e.start_ns for e in events)) if events else 0.0
    return {
        "line": name,
        "lines": {n: len(e) for n, e in lines.items()},
        "gpu_ms_per_step": sum(totals.values()) / 1e6 / steps,
        # first kernel's start to last kernel's end: what the GPU spent idle between kernels is span - gpu ms
        "span_ms_per_step": span / 1e6 / steps,
        "launches_per_step": sum(counts.values()) / steps,
        "top_ops": [
            {
                "op": op,
                "ms_per_step": totals[op] / 1e6 / steps,
                "per_step": counts[op] / steps,
                "us_per_launch": {
                    name: float(x)
                    for name, x in zip(("min", "q1", "median", "q3", "max"), np.quantile(durations[op], QUARTILES))
                },
            }
            for op in ranked
        ],
        "by_kind": op_kinds(totals, counts, steps),
    }


def op_kinds(totals: dict, counts: dict, steps: int) -> dict:
    """Every op's GPU ns (`totals`) and launches (`counts`) summed by kind, its name without the numeric suffixes
    XLA gives each fusion ("loop_add_fusion_62" -> "loop_add_fusion"), per step, most launches first: where a
    step's launches go."""
    kinds = {}
    for op in totals:
        kind = re.sub(r"(_\d+)+$", "", op)
        ms, launches = kinds.get(kind, (0.0, 0.0))
        kinds[kind] = (ms + totals[op] / 1e6 / steps, launches + counts[op] / steps)
    ranked = sorted(kinds.items(), key=lambda item: -item[1][1])
    return {kind: {"ms_per_step": ms, "per_step": n} for kind, (ms, n) in ranked}


def run_mode(
    engine,
    method,
    context: int,
    *,
    chunk: int,
    steps: int,
    prefill: bool,
    batch: int = 1,
    profile_dir: str | None = None,
    prefill_repeats: int = 3,
    impl: str = "auto",
) -> dict:
    """Prefill (when asked) and decode timings of one mode at one context on the device, through the engine's
    prefill driver, its device decode loop and its single-token step (the executables `generate` runs), for
    `batch` sequences of the same length. Prefill is timed `prefill_repeats` times (the median, each run, and
    how long the driver took to return before the GPU finished). `impl`: the attention implementation."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(context)
    warmup = 3
    # Room for the host steps and three device loops (compile, timed, profiled) of `steps` tokens each.
    start_length = context - warmup - 4 * steps - 8
    if prefill:
        tokens = rng.integers(0, engine.config.vocab_size, (batch, start_length)).astype(np.int32)
        engine.prefill(method, tokens[:, :chunk], np.full(batch, chunk), chunk=chunk, impl=impl)  # compile first

        def prefill_all(times: list | None = None):
            start = time.perf_counter()
            logits, cache, lengths = engine.prefill(
                method, tokens, np.full(batch, start_length), chunk=chunk, impl=impl
            )
            dispatched = time.perf_counter()
            logits.block_until_ready()
            if times is not None:  # (wall s, s until the driver returned: host work not hidden behind the GPU)
                times.append((time.perf_counter() - start, dispatched - start))
            return cache, lengths

        prefill_runs = []
        for _ in range(prefill_repeats):
            cache, lengths = prefill_all(prefill_runs)
            if len(prefill_runs) < prefill_repeats:
                del cache
                gc.collect()
        if profile_dir is not None:  # one more prefill, traced: GPU ms by op kind over the whole prefill
            del cache
            gc.collect()
            try:
                with jax.profiler.trace(f"{profile_dir}/prefill"):
                    cache, lengths = prefill_all()
                prefill_profile = gpu_op_times(f"{profile_dir}/prefill", 1)
            except Exception as e:  # noqa: BLE001 - a profile is a diagnostic: record why it failed
                prefill_profile = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
                cache, lengths = prefill_all()
    else:
        cache = method.init_cache(batch, jnp.bfloat16)
        lengths = jnp.full((batch,), start_length, jnp.int32)  # a zero-filled cache: the same bytes move
    out = dict(cache_bytes=tree_bytes(cache))
    if prefill:
        out["prefill_s"] = statistics.median(wall for wall, _ in prefill_runs)
        out["prefill_runs_s"] = [wall for wall, _ in prefill_runs]
        out["prefill_dispatch_s"] = statistics.median(dispatch for _, dispatch in prefill_runs)
        if profile_dir is not None:
            out["prefill_profile"] = prefill_profile
    token, times = jnp.zeros((batch,), jnp.int32), []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        logits, cache, lengths = engine.step(method, cache, lengths, token, impl=impl)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        token.block_until_ready()
        times.append(time.perf_counter() - start)
    out["host_step_ms"] = 1e3 * statistics.median(times[warmup:])

    def device_loop():  # `steps` new tokens after `token`, in one executable
        nonlocal cache, lengths
        tokens, done, cache, lengths = engine.decode_loop(
            method, cache, lengths, token, max_new_tokens=steps + 1, impl=impl
        )
        tokens.block_until_ready()
        return int(done), tokens

    device_loop()  # compile
    start = time.perf_counter()
    done, tokens = device_loop()
    out["decode_ms"] = 1e3 * (time.perf_counter() - start) / done
    # the first sequence's tokens of the timed loop: two runs of one mode under different XLA flags must agree
    out["tokens"] = np.asarray(tokens[0, :done]).tolist()
    if profile_dir is not None:
        try:
            with jax.profiler.trace(profile_dir):
                done, _ = device_loop()
            out["profile"] = gpu_op_times(profile_dir, done)
        except Exception as e:  # noqa: BLE001 - a profile is a diagnostic: record why it failed, keep the timings
            out["profile"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    del cache
    gc.collect()
    return out


def dry_run_checks(config, methods: dict, chunk: int, weights: str | None) -> None:
    """One prefill chunk and one decode step of every mode traced with abstract shapes (nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from duo_jax.engine import extend

    params = jax.eval_shape(lambda: model_params(config, weights))
    for name, method in methods.items():
        cache = jax.eval_shape(lambda m=method: m.init_cache(1, jnp.bfloat16))
        ints = jax.ShapeDtypeStruct((1,), jnp.int32)
        for T in (chunk, 1):
            tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)
            logits, new_cache, _ = jax.eval_shape(
                functools.partial(extend, config=config, method=method), params, cache, ints, tokens, ints
            )
            assert logits.shape == (1, config.vocab_size), logits.shape
            assert jax.tree.structure(new_cache) == jax.tree.structure(cache)
        print(f"  traced {name}: prefill chunk of {chunk} and a decode step, cache {tree_bytes(cache) / 2**30:.2f} GiB")


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "gpu_llama8b")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576],
        help="contexts (tokens)",
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["full", "duo"],
        default=["full", "duo"],
        help="the modes to run (duo's streaming heads attend to their whole chunk: with a prompt in one chunk, duo's "
        "prefill is dense unless --streaming-chunk is given); --dry-run plans both",
    )
    p.add_argument(
        "--streaming-chunk",
        type=int,
        default=None,
        help="duo: the streaming heads see a longer prefill chunk as chunks of this many tokens, the retrieval heads "
        "see it whole (DuoAttention.streaming_chunk: the output of a prefill in such chunks); --chunk-size a multiple",
    )
    p.add_argument("--sparsity", type=float, default=0.5, help="duo: fraction of streaming heads")
    p.add_argument("--sink", type=int, default=64)
    p.add_argument("--recent", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=2048, help="prefill chunk (tokens)")
    p.add_argument(
        "--decode-steps",
        type=int,
        default=32,
        help="decode tokens timed per context and mode (device loop), and host steps (median)",
    )
    p.add_argument("--max-prefill", type=int, default=131072, help="largest context whose prefill is timed")
    p.add_argument("--prefill-repeats", type=int, default=3, help="timed prefills per context and mode (median)")
    p.add_argument(
        "--impl",
        default="auto",
        choices=["auto", "pallas", "cudnn", "mosaic", "xla"],
        help="attention implementation (cudnn: dense prefill chunks through cuDNN; pallas: through the Triton "
        "kernels; auto: cuDNN over caches of 16k keys or more; mosaic: cudnn, with duo's decode steps in the Pallas "
        "Mosaic GPU kernel; docs/attention.md)",
    )
    p.add_argument(
        "--batch",
        type=int,
        default=1,
        help="sequences decoded together, each at the context (above 1: zero-filled caches, no prefill)",
    )
    p.add_argument(
        "--fill-memory",
        action="store_true",
        help="decode each mode at the largest batch its caches fit into the GPU's free memory (the serving "
        "case), at each context: tokens/s side by side",
    )
    p.add_argument("--margin-gib", type=float, default=4.0, help="--fill-memory: memory left for temporaries")
    p.add_argument(
        "--bandwidth-tbs",
        type=float,
        default=None,
        help=f"HBM bandwidth for the roofline, TB/s (default: measured; dry run: {DRY_RUN_BANDWIDTH_TBS})",
    )
    p.add_argument("--hbm-gib", type=float, default=80.0, help="dry run: device memory assumed for 'fits'")
    p.add_argument("--kv-dtype", choices=["int8", "int4"], default=None, help="quantized KV cache (default bf16)")
    p.add_argument("--weights", choices=["int8"], default=None, help="int8 weights (default bf16)")
    p.add_argument("--dry-run", action="store_true", help="shapes only, on any backend: print the plan")
    p.add_argument(
        "--separate-qkv",
        action="store_true",
        help="hold q, k and v as three weights (the engine's default on a GPU is one fused weight: "
        "docs/engine.md, 'Fused q/k/v')",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="also trace one device loop per context and mode (into a temporary folder): GPU ms per "
        "step by XLA op, in the JSON; and one prefill where prefill is timed (GPU ms by op over the prefill)",
    )
    p.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="only the model's first N layers, duo on the published pattern's first N (one layer: its prefill "
        "attention by chunk size and implementation, in seconds rather than minutes)",
    )
    args = p.parse_args(argv)

    import jax

    import duo_jax
    from duo_jax.eval import report
    from duo_jax.eval.modes import mode_settings, num_retrieval_heads
    from duo_jax.pattern import Pattern

    config = duo_jax.get_config(MODEL)
    pattern = Pattern.for_model(MODEL)
    layers = config.num_layers
    if args.num_layers is not None:
        if not 1 <= args.num_layers <= layers:
            p.error(f"--num-layers must be between 1 and {layers}, got {args.num_layers}")
        config = dataclasses.replace(config, num_layers=args.num_layers)
        pattern = Pattern(pattern.gates[: args.num_layers], pattern.meta)
    share = num_retrieval_heads(config, args.sparsity) / (config.num_layers * config.num_kv_heads)
    window = args.sink + args.recent
    contexts = sorted(set(args.contexts))

    def methods_at(context, modes=tuple(args.modes)):
        built = {
            m: mode_settings(
                m,
                config,
                pattern,
                sparsity=args.sparsity,
                sink=args.sink,
                recent=args.recent,
                context=context,
                kv_dtype=args.kv_dtype,
            ).build(config, context)
            for m in modes
        }
        if "duo" in built and args.streaming_chunk is not None:
            built["duo"] = dataclasses.replace(built["duo"], streaming_chunk=args.streaming_chunk)
        return built

    weight_bytes = tree_bytes(jax.eval_shape(lambda: model_params(config, args.weights)))
    formats = f"weights {args.weights or 'bf16'}, KV {args.kv_dtype or 'bf16'}"
    if args.num_layers is not None:
        formats += f", first {args.num_layers} of {layers} layers"
    rooflines = functools.partial(
        roofline,
        config,
        weight_bytes=weight_bytes,
        share=share,
        window=window,
        chunk=args.chunk_size,
        kv_dtype=args.kv_dtype,
        batch=args.batch,
    )
    if args.dry_run:
        bandwidth = (args.bandwidth_tbs or DRY_RUN_BANDWIDTH_TBS) * 1e12
        print(
            f"dry run on {jax.default_backend()}: {MODEL} shape, {formats}, weights {weight_bytes / 2**30:.2f} "
            f"GiB, duo sparsity {args.sparsity} (r = {share:.3f}), chunk {args.chunk_size}"
        )
        dry_run_checks(config, methods_at(contexts[0], ("full", "duo")), args.chunk_size, args.weights)
        rows, plan = [], {}
        for context in contexts:
            sizes = {
                m: tree_bytes(jax.eval_shape(lambda m=method: m.init_cache(args.batch, jax.numpy.bfloat16)))
                for m, method in methods_at(context, ("full", "duo")).items()
            }
            roof = rooflines(context=context, bandwidth=bandwidth)
            fits = {m: weight_bytes + sizes[m] <= args.hbm_gib * 2**30 for m in sizes}
            plan[context] = dict(cache_bytes=sizes, fits=fits, **roof)
            rows.append(
                [
                    context,
                    sizes["full"] / 2**30,
                    sizes["duo"] / 2**30,
                    fits["full"],
                    fits["duo"],
                    roof["decode_ms"]["full"],
                    roof["decode_ms"]["duo"],
                    roof["decode_ms"]["full"] / roof["decode_ms"]["duo"],
                    roof["prefill_flops"]["full"] / roof["prefill_flops"]["duo"],
                ]
            )
        headers = [
            "context",
            "full KV GiB",
            "duo KV GiB",
            f"full fits {args.hbm_gib:g} GiB",
            f"duo fits {args.hbm_gib:g} GiB",
            "roofline full ms",
            "roofline duo ms",
            "best decode speed-up",
            "best prefill speed-up",
        ]
        common.write_result(
            args.out,
            "gpu_llama8b_plan",
            title=f"Llama-3-8B plan, {formats} (dry run, nothing allocated)",
            headers=headers,
            rows=rows,
            data=dict(
                args={k: str(v) for k, v in vars(args).items()},
                plan=plan,
                weight_bytes=weight_bytes,
                bandwidth=bandwidth,
            ),
            notes=[
                f"roofline bandwidth {bandwidth / 1e12:.2f} TB/s (not measured: dry run); "
                f"paper (A100): decode {PAPER['decode']}x, prefill {PAPER['prefill']}x"
            ],
        )
        return 0

    if jax.default_backend() == "cpu":
        p.error("this benchmark needs a GPU (Llama-3-8B in bf16); on CPU run it with --dry-run")
    bandwidth = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else measure_bandwidth()
    from duo_jax.engine import Engine

    engine = Engine(model_params(config, args.weights), config, fuse_qkv=False if args.separate_qkv else None)
    formats += ", q/k/v " + ("fused" if engine.fused_qkv else "separate")
    if args.impl != "auto" or common.triton_disabled():
        formats += f", attention impl={common.attention_label(args.impl)}"
    if args.fill_memory:
        rows, data = [], {}
        for context in contexts:
            data[context] = fill_memory(
                engine,
                methods_at(context),
                context,
                steps=args.decode_steps,
                margin_gib=args.margin_gib,
                impl=args.impl,
            )
            full, duo = data[context].get("full", {}), data[context].get("duo", {})
            tokens = {
                m: common.ratio(1e3 * r["batch"], r.get("decode_ms")) if r else None
                for m, r in (("full", full), ("duo", duo))
            }
            rows.append(
                [
                    context,
                    full.get("batch"),
                    duo.get("batch"),
                    full.get("decode_ms"),
                    duo.get("decode_ms"),
                    tokens["full"],
                    tokens["duo"],
                    common.ratio(tokens["duo"], tokens["full"]),
                ]
            )
        common.write_result(
            args.out,
            "gpu_llama8b_fill",
            title=f"Llama-3-8B shape on one GPU, {formats}: each mode at the largest batch that fits",
            headers=[
                "context",
                "full batch",
                "duo batch",
                "full ms / step",
                "duo ms / step",
                "full tokens/s",
                "duo tokens/s",
                "duo / full tokens/s",
            ],
            rows=rows,
            data=dict(args={k: str(v) for k, v in vars(args).items()}, results=data, weight_bytes=weight_bytes),
            notes=[
                f"device {jax.devices()[0].device_kind}; batch: the caches that fit the free memory after the "
                f"weights, less {args.margin_gib:g} GiB, backed off by a tenth on an out-of-memory error; "
                "zero-filled caches (a step reads the same bytes)"
            ],
        )
        return 0
    results = {m: {} for m in ("full", "duo")}
    largest = {}
    from tqdm.auto import tqdm

    for context in tqdm(contexts, desc="contexts", unit="context"):
        for mode, method in methods_at(context).items():
            if mode in largest:  # already out of memory at a smaller context
                continue
            try:
                results[mode][context] = run_mode(
                    engine,
                    method,
                    context,
                    chunk=args.chunk_size,
                    steps=args.decode_steps,
                    prefill=context <= args.max_prefill and args.batch == 1,
                    batch=args.batch,
                    profile_dir=tempfile.mkdtemp(prefix=f"trace_{mode}_{context}_") if args.profile else None,
                    prefill_repeats=args.prefill_repeats,
                    impl=args.impl,
                )
                tqdm.write(f"{mode} at {context}: {json.dumps(results[mode][context])}")  # kept if a later one dies
            except Exception as e:  # XLA reports device OOM as a runtime error
                if not is_oom(e):
                    raise
                largest[mode] = max(results[mode], default=None)
                gc.collect()
    for mode in results:
        largest.setdefault(mode, max(results[mode], default=None))

    rows, data = [], {}
    for context in contexts:
        full, duo = results["full"].get(context, {}), results["duo"].get(context, {})
        roof = rooflines(context=context, bandwidth=bandwidth)
        data[context] = dict(full=full, duo=duo, **roof)
        rows.append(
            [
                context,
                full.get("decode_ms"),
                duo.get("decode_ms"),
                common.ratio(full.get("decode_ms"), duo.get("decode_ms")),
                common.ratio(roof["decode_ms"]["full"], full.get("decode_ms")),
                common.ratio(roof["decode_ms"]["duo"], duo.get("decode_ms")),
                *(common.ratio(1e3 * args.batch, r.get("decode_ms")) for r in (full, duo)),
                full.get("host_step_ms"),
                duo.get("host_step_ms"),
                full.get("prefill_s"),
                duo.get("prefill_s"),
                common.ratio(full.get("prefill_s"), duo.get("prefill_s")),
            ]
        )
    headers = [
        "context",
        "full decode ms",
        "duo decode ms",
        "decode speed-up",
        "full % roofline",
        "duo % roofline",
        "full tokens/s",
        "duo tokens/s",
        "full host step ms",
        "duo host step ms",
        "full prefill s",
        "duo prefill s",
        "prefill speed-up",
    ]
    notes = [
        f"device {jax.devices()[0].device_kind}, HBM bandwidth {bandwidth / 1e12:.2f} TB/s "
        f"({'given' if args.bandwidth_tbs else 'measured'}); paper (A100): decode {PAPER['decode']}x, "
        f"prefill {PAPER['prefill']}x",
        f"largest context that fits: full {largest['full']}, duo {largest['duo']} (of the contexts tried)",
        "% roofline = roofline ms / measured ms; decode ms: device loop (what generate runs), "
        "host step ms: one synchronised Engine.step per token",
    ]

    def plot(path):
        series = {f"{m} decode": [results[m].get(c, {}).get("decode_ms") for c in contexts] for m in results}
        series.update(
            {
                f"{m} roofline": [rooflines(context=c, bandwidth=bandwidth)["decode_ms"][m] for c in contexts]
                for m in results
            }
        )
        return report.line_plot(
            path,
            contexts,
            series,
            xlabel="context (tokens)",
            ylabel="ms per decode step",
            logx=True,
            title=f"Llama-3-8B shape, {formats}, {jax.devices()[0].device_kind}",
        )

    common.write_result(
        args.out,
        "gpu_llama8b",
        title=f"Llama-3-8B shape on one GPU, {formats}: duo vs full (batch {args.batch})",
        headers=headers,
        rows=rows,
        data=dict(
            args={k: str(v) for k, v in vars(args).items()},
            results=data,
            largest=largest,
            bandwidth=bandwidth,
            weight_bytes=weight_bytes,
        ),
        plot=plot,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
