"""Benchmark the attention kernels: Λ (streaming heads) vs flash (causal) vs XLA.

On GPU: forward and forward+backward times of
  * lambda   - `pallas_kernels.lambda_attention` (block-sparse, sink + recent),
  * flash    - `pallas_kernels.flash_attention` (dense causal),
  * xla      - the dense masked jnp reference (skipped when its scores would not fit),
  * cudnn    - `jax.nn.dot_product_attention(is_causal=True, implementation="cudnn")` (GPU only; without
               `implementation` JAX picks its XLA path, which runs out of memory past 8k),
  * cudnn_lambda - Λ through cuDNN (`duo_jax.attention.cudnn.attention`: its sliding window and a call over the
               sinks, merged; the backward is cuDNN's from the merged statistics): gate training on a GPU
               without Triton (GPU only),
  * tokamax  - `tokamax.dot_product_attention(is_causal=True, implementation="mosaic")`, the maintained Mosaic GPU
               (Hopper) flash attention of openxla/tokamax, when that package is importable (GPU only): a
               candidate for the prefill's dense heads where our Triton kernel trails cuDNN,
at Llama-3-8B head shapes (32 query / 8 KV heads, head_dim 128, bf16), with the
Λ/causal visited-block ratio and the time ratios side by side: flash/Λ, cuDNN/Λ (how much faster Λ is than
cuDNN's causal attention), cuDNN/flash (our flash kernel's speed as a fraction of cuDNN's), cuDNN/cuDNN Λ and
cuDNN Λ/Λ (Λ through cuDNN against cuDNN's causal attention and against the Λ kernel).

On TPU the same table times the TPU kernels (`pallas_kernels.tpu`: splash
attention for these static masks) instead of the Triton ones; use
--block-q 512 --block-k 512 there (TPU blocks are multiples of 128).

On CPU there is no kernel compiler: the script records the visited-block ratio
per T (pure arithmetic), with --cpu-smoke times one tiny shape in interpret
mode, only to show that everything runs, and with --tpu-export exports every TPU
kernel for TPU from this host (``jax.export(..., platforms=["tpu"])``) and
records each launch's grid and block sizes: splash Λ / causal (fwd + bwd), the
own kernel with a traced offset (Λ fwd + bwd, a causal prefill chunk against a
cache), decode, and a streaming head's chunk and decode step over its ring of
sink + recent cached tokens (keys at explicit positions, the own kernel).

  python benchmarks/kernels.py --out results/kernels.json
  python benchmarks/kernels.py --sweep --seq-lens 32768 --out results/kernels_sweep.json   # GPU: launch tuning
  python benchmarks/kernels.py --cudnn-masks --chunk 2048 --seq-lens 32768 131072   # GPU: cuDNN's calls per mask
  python benchmarks/kernels.py --cpu-smoke
  python benchmarks/kernels.py --tpu-export --seq-lens 4096 16384 --out results/tpu_export.json
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import pallas_kernels  # noqa: E402
from duo_jax.attention import cudnn  # noqa: E402
from duo_jax.attention.masks import prefix_spec  # noqa: E402
from pallas_kernels import _backend, causal_visited_blocks, lambda_visited_blocks, reference  # noqa: E402
from pallas_kernels.tpu.launches import pallas_launches  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument(
        "--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536, 131072], help="sequence lengths T"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--num-heads", type=int, default=32, help="query heads")
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--sink", type=int, default=128)
    parser.add_argument("--recent", type=int, default=256)
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=128)
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions (median reported)")
    parser.add_argument(
        "--xla-max-gib", type=float, default=16.0, help="skip the dense XLA reference when its fp32 scores exceed this"
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="on CPU: also time a tiny shape in interpret mode")
    parser.add_argument(
        "--tpu-export", action="store_true", help="on CPU: export the TPU kernels for TPU, record grids and blocks"
    )
    parser.add_argument("--chunk", type=int, default=512, help="--tpu-export: queries per chunked-prefill step")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="on GPU: forward times of Λ (its tiles in runs and in one loop) and flash over tiles x num_warps x "
        "num_stages at each T, against cuDNN, instead of the table above (--out written after each point)",
    )
    parser.add_argument(
        "--cudnn-masks",
        action="store_true",
        help="on GPU: cuDNN's forward at each T as the engine calls it, in TFLOP/s: causal self-attention (a prompt "
        "in one chunk), the last --chunk queries over the keys before them with a padding mask over a T-slot cache "
        "(a chunk at a traced offset) and over exactly those keys (no mask), and their own causal call",
    )
    parser.add_argument("--out", type=pathlib.Path, default=None, help="write results as JSON here")
    return parser.parse_args(argv)


def median_ms(fn, *args, reps: int) -> float:
    """Median wall time of a jitted call, after one compile-and-warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def forward_and_grad(attn):
    """Jitted forward, and jitted forward+backward of sum(attn(q, k, v) * do)."""
    fwd = jax.jit(attn)

    @jax.jit
    def fwd_bwd(q, k, v, do):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(do)

    return fwd, fwd_bwd


def implementations(args, interpret: bool | None):
    window = dict(sink=args.sink, recent=args.recent)
    blocks = dict(block_q=args.block_q, block_k=args.block_k, interpret=interpret)
    kernels = pallas_kernels.tpu if _backend.backend() == "tpu" else pallas_kernels
    impls = {
        "lambda": lambda q, k, v: kernels.lambda_attention(q, k, v, **window, **blocks),
        "flash": lambda q, k, v: kernels.flash_attention(q, k, v, **blocks),
        "xla": lambda q, k, v: reference.flash_attention_reference(q, k, v),
    }
    if _backend.backend() == "gpu" and not interpret:
        impls["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        # Λ without Triton: cuDNN's sliding window and a call over the sinks, merged (gate training's path there)
        impls["cudnn_lambda"] = lambda q, k, v: cudnn.attention(
            q, k, v, prefix_spec(q.shape[0], q.shape[1], num_keys=k.shape[1], **window)
        )
        if importlib.util.find_spec("tokamax") is not None:
            import tokamax

            impls["tokamax"] = lambda q, k, v: tokamax.dot_product_attention(
                q, k, v, is_causal=True, implementation="mosaic"
            )
    return impls


def time_all(args, seq_len: int, interpret: bool | None) -> dict:
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 4)
    q_shape = (args.batch, seq_len, args.num_heads, args.head_dim)
    kv_shape = (args.batch, seq_len, args.num_kv_heads, args.head_dim)
    q, do = (jax.random.normal(key, q_shape, dtype) for key in keys[:2])
    k, v = (jax.random.normal(key, kv_shape, dtype) for key in keys[2:])
    xla_gib = 4 * args.batch * args.num_heads * seq_len**2 / 2**30

    row = {}
    for name, attn in implementations(args, interpret).items():
        if name == "xla" and xla_gib > args.xla_max_gib:
            row[name] = {"skipped": f"scores need {xla_gib:.0f} GiB > --xla-max-gib"}
            continue
        fwd, fwd_bwd = forward_and_grad(attn)
        try:
            row[name] = {
                "fwd_ms": median_ms(fwd, q, k, v, reps=args.reps),
                "fwd_bwd_ms": median_ms(fwd_bwd, q, k, v, do, reps=args.reps),
            }
        except Exception as e:  # e.g. out of memory at long T: record it, keep going.
            row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return row


def block_ratio(args, seq_len: int) -> dict:
    lam = lambda_visited_blocks(seq_len, args.sink, args.recent, args.block_q, args.block_k)
    causal = causal_visited_blocks(seq_len, args.block_q, args.block_k)
    return {"lambda_blocks": lam, "causal_blocks": causal, "block_ratio": lam / causal}


def _fmt(entry: dict, key: str) -> str:
    return f"{entry[key]:.2f}" if key in entry else "-"


def print_table(rows: list[dict]) -> None:
    names = [n for n in ("lambda", "flash", "xla", "cudnn", "cudnn_lambda", "tokamax") if any(n in r for r in rows)]
    phases = ("fwd_ms", "fwd_bwd_ms") if names else ()
    ratios = [
        (a, b)
        for a, b in (
            ("flash", "lambda"),
            ("cudnn", "lambda"),
            ("cudnn", "flash"),
            ("cudnn", "tokamax"),
            ("cudnn", "cudnn_lambda"),
            ("cudnn_lambda", "lambda"),
        )
        if a in names and b in names
    ]
    header = ["T", "Λ blocks", "causal blocks", "Λ/causal"]
    for phase in phases:
        header += [f"{n} {phase}" for n in names] + [f"{a}/{b} {phase[:-3]}".replace("lambda", "Λ") for a, b in ratios]
    print(" | ".join(header))
    for r in rows:
        cells = [str(r["seq_len"]), str(r["lambda_blocks"]), str(r["causal_blocks"]), f"{r['block_ratio']:.4f}"]
        for phase in phases:
            cells += [_fmt(r.get(n, {}), phase) for n in names]
            for a, b in ratios:  # time of a / time of b: how many times faster b runs
                ta, tb = r.get(a, {}).get(phase), r.get(b, {}).get(phase)
                cells.append(f"{ta / tb:.2f}x" if ta and tb else "-")
        print(" | ".join(cells))
    for r in rows:
        for n in names:
            note = r.get(n, {}).get("error") or r.get(n, {}).get("skipped")
            if note:
                print(f"T={r['seq_len']} {n}: {note}")


def _with_vjp(attn):
    def fwd_bwd(q, k, v):
        out, vjp = jax.vjp(attn, q, k, v)
        return out, vjp(out)

    return fwd_bwd


def tpu_export_rows(args, seq_len: int) -> list[dict]:
    """Exports each TPU kernel for TPU at this T (no TPU needed) and records its launches."""
    dtype = jnp.dtype(args.dtype)
    tpu = pallas_kernels.tpu
    q = jax.ShapeDtypeStruct((args.batch, seq_len, args.num_heads, args.head_dim), dtype)
    kv = jax.ShapeDtypeStruct((args.batch, seq_len, args.num_kv_heads, args.head_dim), dtype)
    chunk = jax.ShapeDtypeStruct((args.batch, min(args.chunk, seq_len), args.num_heads, args.head_dim), dtype)
    one = jax.ShapeDtypeStruct((args.batch, args.num_heads, args.head_dim), dtype)
    per_seq = jax.ShapeDtypeStruct((args.batch,), jnp.int32)
    ring = args.sink + args.recent  # a streaming head's cache: sinks + a ring of recent tokens
    window = dict(sink=args.sink, recent=args.recent, block_q=args.block_q, block_k=args.block_k)
    blocks = dict(block_q=args.block_q, block_k=args.block_k)
    cases = {
        "lambda splash fwd+bwd": (_with_vjp(lambda q, k, v: tpu.lambda_attention(q, k, v, **window)), (q, kv, kv)),
        "causal splash fwd+bwd": (_with_vjp(lambda q, k, v: tpu.flash_attention(q, k, v, **blocks)), (q, kv, kv)),
        "lambda own (traced q_offset) fwd+bwd": (
            lambda q, k, v, off: _with_vjp(lambda q, k, v: tpu.lambda_attention(q, k, v, q_offset=off, **window))(
                q, k, v
            ),
            (q, kv, kv, per_seq),
        ),
        f"causal own chunk of {chunk.shape[1]} vs cache fwd": (
            lambda q, k, v, off: tpu.flash_attention(q, k, v, q_offset=off, kv_len=off + q.shape[1], **blocks),
            (chunk, kv, kv, per_seq),
        ),
        "decode own fwd": (
            lambda q, k, v, lengths: tpu.decode_attention(q, k, v, lengths, block_k=args.block_k),
            (one, kv, kv, per_seq),
        ),
    }
    for t in (chunk.shape[1], 1):  # streaming heads: [ring, new tokens] at explicit positions
        keys = jax.ShapeDtypeStruct((args.batch, ring + t, args.num_kv_heads, args.head_dim), dtype)
        positions = jax.ShapeDtypeStruct((args.batch, ring + t), jnp.int32)
        step = "decode step" if t == 1 else f"chunk of {t}"
        cases[f"streaming own {step} vs ring of {ring} fwd"] = (
            lambda q, k, v, off, pos: tpu.flash_attention(q, k, v, q_offset=off, k_positions=pos, **blocks),
            (
                jax.ShapeDtypeStruct((args.batch, t, args.num_heads, args.head_dim), dtype),
                keys,
                keys,
                per_seq,
                positions,
            ),
        )
    rows = []
    for name, (fn, shapes) in cases.items():
        with _backend.lowering_for("tpu"):
            start = time.perf_counter()
            module = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes).mlir_module()
            seconds = time.perf_counter() - start
            launches = pallas_launches(fn, *shapes)
        rows.append(
            {
                "seq_len": seq_len,
                "kernel": name,
                "export_s": round(seconds, 2),
                "tpu_custom_calls": module.count("stablehlo.custom_call @tpu_custom_call"),
                "launches": launches,
            }
        )
    return rows


def print_export_rows(rows: list[dict]) -> None:
    print("T | kernel | Mosaic calls | export s | launch: grid, blocks (None = squeezed)")
    for r in rows:
        for i, launch in enumerate(r["launches"]):
            head = f"{r['seq_len']} | {r['kernel']} | {r['tpu_custom_calls']} | {r['export_s']}" if i == 0 else " | | |"
            print(f"{head} | {launch['name']}: grid {launch['grid']}, blocks {launch['blocks']}")


SWEEP_TILES = ((128, 128), (128, 64), (64, 64), (64, 128))
SWEEP_LAUNCHES = ((4, 2), (8, 2), (4, 3), (8, 3))  # (num_warps, num_stages)


def sweep_points() -> list[tuple[str, dict]]:
    """(kernel, its keyword arguments) for every point of the sweep, Λ first (target 4 is Λ's; cuDNN serves the
    dense chunks it is fast on), each tile shape and launch with its tiles in runs and in one loop (`one_loop`),
    then flash with its runs."""
    launches = [
        dict(block_q=bq, block_k=bk, num_warps=warps, num_stages=stages)
        for bq, bk in SWEEP_TILES
        for warps, stages in SWEEP_LAUNCHES
    ]
    return [("lambda", dict(launch, one_loop=one_loop)) for launch in launches for one_loop in (False, True)] + [
        ("flash", launch) for launch in launches
    ]


def sweep(args, result: dict) -> None:
    """Forward ms of Λ and flash at every `sweep_points()` point, with cuDNN's causal forward at the same T as the
    yardstick; a point that fails to compile is recorded with its error. `result["sweep"]` grows a row per point
    and is written to --out after each, so a run stopped by a time limit keeps what it measured."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(0), 3)
    rows = result.setdefault("sweep", [])
    kernels = {
        "flash": pallas_kernels.flash_attention,
        "lambda": functools.partial(pallas_kernels.lambda_attention, sink=args.sink, recent=args.recent),
    }
    for seq_len in args.seq_lens:
        q = jax.random.normal(keys[0], (args.batch, seq_len, args.num_heads, args.head_dim), dtype)
        k, v = (
            jax.random.normal(key, (args.batch, seq_len, args.num_kv_heads, args.head_dim), dtype) for key in keys[1:]
        )
        cudnn = median_ms(
            jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")),
            q,
            k,
            v,
            reps=args.reps,
        )
        for name, launch in sweep_points():
            attn = kernels[name]
            row = {"seq_len": seq_len, "kernel": name, **launch, "cudnn_ms": cudnn}
            try:
                row["ms"] = median_ms(jax.jit(functools.partial(attn, **launch)), q, k, v, reps=args.reps)
                row["cudnn_over_this"] = cudnn / row["ms"]
            except Exception as e:  # e.g. shared memory exceeded: record it, keep sweeping
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            write(result, args.out, quiet=True)
            print(
                f"T={seq_len} {name} {launch}: "
                + (f"{row['ms']:.2f} ms, cuDNN causal / this {row['cudnn_over_this']:.2f}x" if "ms" in row else "-"),
                flush=True,
            )


def cudnn_mask_calls(args, seq_len: int, attend=None) -> dict:
    """Forward ms and TFLOP/s of the cuDNN calls a prefill makes at context `seq_len` (`attend`: the engine's one
    cuDNN call, `duo_jax.attention.cudnn._cudnn`, or a stand-in): the whole sequence causal, and for the last
    `args.chunk` queries their prefix c = T - chunk through a padding mask over all T slots (what a chunk at a
    traced offset runs), the same prefix sliced exactly (no mask) and the chunk's own keys causal. Attention FLOPs
    are 4 x rows x keys x H x E, halved where causal."""
    attend = attend or cudnn._cudnn
    dtype = jnp.dtype(args.dtype)
    B, H, K, E, C = args.batch, args.num_heads, args.num_kv_heads, args.head_dim, args.chunk
    c = seq_len - C
    if c <= 0:
        raise SystemExit(f"--cudnn-masks needs --chunk < T, got chunk {C} at T = {seq_len}")
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (B, seq_len, H, E), dtype)
    k, v = (jax.random.normal(key, (B, seq_len, K, E), dtype) for key in keys[1:])
    chunk, prefix = q[:, c:], jnp.full((B,), c, jnp.int32)
    calls = {  # name: (causal, key lengths, q, k, v, query-key pairs attended)
        "causal_whole": (True, None, q, k, v, seq_len**2 / 2),
        "prefix_padded": (False, prefix, chunk, k, v, C * c),
        "prefix_exact": (False, None, chunk, k[:, :c], v[:, :c], C * c),
        "own_causal": (True, None, chunk, k[:, c:], v[:, c:], C**2 / 2),
    }
    row = {}
    for name, (causal, lengths, *operands, pairs) in calls.items():
        call = functools.partial(attend, causal=causal, scale=1 / math.sqrt(E))
        try:
            ms = median_ms(jax.jit(lambda q, k, v, n, call=call: call(q, k, v, n)), *operands, lengths, reps=args.reps)
            row[name] = {"ms": ms, "tflops": 4 * B * pairs * H * E / (ms * 1e-3) / 1e12}
        except Exception as e:  # e.g. a length cuDNN refuses: record it, keep going
            row[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return row


def main(argv=None) -> None:
    args = parse_args(argv)
    backend = jax.default_backend()
    on_accelerator = backend not in ("cpu",)
    result = {
        "backend": backend,
        "device": str(jax.devices()[0]),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    if args.cudnn_masks:
        if backend != "gpu":
            raise SystemExit("--cudnn-masks times cuDNN's calls: it needs a GPU")
        result["cudnn_masks"] = {}
        for seq_len in args.seq_lens:
            row = result["cudnn_masks"][seq_len] = cudnn_mask_calls(args, seq_len)
            cells = [
                f"{n} {r['ms']:.2f} ms, {r['tflops']:.0f} TFLOP/s" if "ms" in r else f"{n} -" for n, r in row.items()
            ]
            print(f"T={seq_len}, chunk {args.chunk}: " + "; ".join(cells), flush=True)
            write(result, args.out, quiet=True)
        write(result, args.out)
        return
    if args.sweep:
        if backend != "gpu":
            raise SystemExit("--sweep times Triton launches against cuDNN: it needs a GPU")
        sweep(args, result)
        write(result, args.out)
        return

    rows = []
    for seq_len in args.seq_lens:
        row = {"seq_len": seq_len, **block_ratio(args, seq_len)}
        if on_accelerator:
            row.update(time_all(args, seq_len, interpret=None))
        rows.append(row)
        print(
            f"T={seq_len}: visited blocks Λ {row['lambda_blocks']} / causal "
            f"{row['causal_blocks']} = {row['block_ratio']:.4f}",
            flush=True,
        )
    result["rows"] = rows
    print()
    print_table(rows)

    if not on_accelerator and args.cpu_smoke:
        smoke = argparse.Namespace(
            **{
                **vars(args),
                "batch": 1,
                "num_heads": 4,
                "num_kv_heads": 2,
                "head_dim": 64,
                "dtype": "float32",
                "sink": 16,
                "recent": 32,
                "block_q": 32,
                "block_k": 32,
                "reps": 1,
            }
        )
        row = {"seq_len": 256, **block_ratio(smoke, 256), **time_all(smoke, 256, interpret=True)}
        result["cpu_smoke"] = row
        print("\nCPU smoke (interpret mode, B=1 T=256 Hq=4 Hkv=2 D=64 fp32, sink 16 recent 32):")
        print_table([row])

    if not on_accelerator and args.tpu_export:
        export_rows = [row for seq_len in args.seq_lens for row in tpu_export_rows(args, seq_len)]
        result["tpu_export"] = export_rows
        print(
            f"\nTPU export from {backend} (B={args.batch} Hq={args.num_heads} Hkv={args.num_kv_heads} "
            f"D={args.head_dim} {args.dtype}, sink {args.sink} recent {args.recent}):"
        )
        print_export_rows(export_rows)

    write(result, args.out)


def write(result: dict, out: pathlib.Path | None, *, quiet: bool = False) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        if not quiet:
            print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
