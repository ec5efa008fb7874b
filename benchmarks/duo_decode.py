"""One layer's decode attention on a GPU at Llama-3-8B's shapes: DuoAttention's one-launch kernels (Triton, and
Pallas Mosaic GPU at each tile and stage setting) against full attention's cuDNN and Triton decode, with the bytes
each reads and the share of the HBM bandwidth that makes.

One layer, B sequences at `context` tokens each, 32 query / 8 KV heads of dim 128, bf16 caches of random values.
Full attention reads all 8 heads' caches; DuoAttention `--retrieval` heads' caches plus the other heads' rings of
sink + recent slots and the new token (heads routed by a fixed permutation, as a pattern orders them). A kernel
that cannot run here (Triton missing, a Mosaic GPU compile error) is a row with its error instead of a time, so a
first run on a new GPU or JAX still reports the rest. The median of `--reps` timed calls after a compile; the
bandwidth is measured in the same process (a sum over 8 GiB).

  python benchmarks/duo_decode.py --contexts 8192 32768 131072 --out OUT
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import common  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
MOSAIC_SETTINGS = ((64, 4), (128, 2))  # (block_k, stages) that fit a Hopper block's shared memory at head dim 128


def parse_args(argv):
    p = common.parser(__doc__, "duo_decode")
    p.add_argument("--contexts", type=int, nargs="+", default=[8192, 32768, 131072], help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    p.add_argument("--retrieval", type=int, default=4, help="retrieval heads of the layer's 8 KV heads (1-7)")
    p.add_argument("--sink", type=int, default=64, help="streaming heads' sink tokens")
    p.add_argument("--recent", type=int, default=256, help="streaming heads' recent tokens")
    p.add_argument("--reps", type=int, default=20, help="timed calls per kernel (median)")
    args = p.parse_args(argv)
    if not 1 <= args.retrieval < KV_HEADS:
        p.error(f"--retrieval must be 1-{KV_HEADS - 1}: the layer needs both kinds of head")
    return args


def layer_inputs(batch: int, context: int, retrieval: int, ring: int, seed: int = 0) -> dict:
    """The layer's arrays (bf16): q [B, 32, 128] and the new token's k / v [B, 8, 128] in the model's head order, the
    full cache [B, C, 8, 128], the retrieval heads' cache and the ring (the caches' order), the lengths, the order."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    keys = jax.random.split(jax.random.key(seed), 7)
    normal = lambda key, shape: jax.random.normal(key, shape, jnp.bfloat16)  # noqa: E731
    return dict(
        q=normal(keys[0], (batch, HEADS, HEAD_DIM)),
        k_new=normal(keys[1], (batch, KV_HEADS, HEAD_DIM)),
        v_new=normal(keys[2], (batch, KV_HEADS, HEAD_DIM)),
        cache_k=normal(keys[3], (batch, context, KV_HEADS, HEAD_DIM)),
        cache_v=normal(keys[4], (batch, context, KV_HEADS, HEAD_DIM)),
        ring_k=normal(keys[5], (batch, ring, KV_HEADS - retrieval, HEAD_DIM)),
        ring_v=normal(keys[6], (batch, ring, KV_HEADS - retrieval, HEAD_DIM)),
        lengths=jnp.full((batch,), context, jnp.int32),
        ring_lengths=jnp.full((batch,), ring, jnp.int32),
        order=tuple(int(h) for h in np.random.default_rng(seed).permutation(KV_HEADS)),
    )


def kernels(x: dict, retrieval: int) -> dict:
    """Name -> (the jitted kernel, its arguments)."""
    import functools

    import jax

    import pallas_kernels
    import pallas_kernels.mosaic_gpu
    from duo_jax import attention
    from duo_jax.attention.dispatch import decode_splits

    # the retrieval heads' cache: the first `retrieval` heads of the caches' order, as the engine holds it
    k_r, v_r = x["cache_k"][:, :, :retrieval], x["cache_v"][:, :, :retrieval]
    duo_args = (x["q"], k_r, v_r, x["lengths"], x["ring_k"], x["ring_v"], x["ring_lengths"], x["k_new"], x["v_new"])
    splits = decode_splits(x["q"].shape[0], retrieval)
    full_args = (x["q"], x["cache_k"], x["cache_v"], x["lengths"])
    table = {
        "full, cuDNN": (functools.partial(attention.decode_attention, impl="cudnn"), full_args),
        "full, Triton": (functools.partial(attention.decode_attention, impl="pallas"), full_args),
        "duo, Triton one launch": (
            functools.partial(pallas_kernels.duo_decode_attention, kv_order=x["order"], block_k=128, num_splits=splits),
            duo_args,
        ),
    }
    for block_k, stages in MOSAIC_SETTINGS:
        table[f"duo, Mosaic GPU {block_k} x {stages}"] = (
            functools.partial(
                pallas_kernels.mosaic_gpu.duo_decode_attention,
                kv_order=x["order"],
                block_k=block_k,
                stages=stages,
                num_splits=splits,
            ),
            duo_args,
        )
    return {name: (jax.jit(fn), args) for name, (fn, args) in table.items()}


def bytes_read(batch: int, context: int, retrieval: int, ring: int, duo: bool) -> int:
    """The keys and values a step reads (bf16): every head's cache for full; the retrieval heads' caches and the
    rings for duo."""
    slots = retrieval * context + (KV_HEADS - retrieval) * ring if duo else KV_HEADS * context
    return batch * slots * HEAD_DIM * 2 * 2


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax
    from gpu_llama8b import measure_bandwidth
    from kernels import median_ms

    if jax.default_backend() != "gpu":
        print("error: this benchmark times GPU kernels; run it on a GPU", file=sys.stderr)
        return 2
    bandwidth = measure_bandwidth()
    ring = args.sink + args.recent
    rows, results = [], {}
    for context in args.contexts:
        x = layer_inputs(args.batch, context, args.retrieval, ring)
        timed = {}
        for name, (fn, fn_args) in kernels(x, args.retrieval).items():
            try:
                timed[name] = median_ms(fn, *fn_args, reps=args.reps)
            except Exception as e:  # a kernel this GPU or JAX cannot compile or run: reported, the rest timed
                timed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        full = timed.get("full, cuDNN")
        full = full if isinstance(full, float) else None
        for name, ms in timed.items():
            nbytes = bytes_read(args.batch, context, args.retrieval, ring, duo=name.startswith("duo"))
            if isinstance(ms, float):
                share = nbytes / (ms * 1e-3) / bandwidth
                rows.append([context, name, ms, nbytes / 1e9, share, common.ratio(full, ms)])
            else:
                rows.append([context, name, ms, nbytes / 1e9, None, None])
        results[context] = timed
        del x
    common.write_result(
        args.out,
        "duo_decode",
        title=(
            f"One layer's decode attention at Llama-3-8B's shapes, batch {args.batch}, {args.retrieval} of 8 KV heads "
            f"retrieval, ring {args.sink} + {args.recent}"
        ),
        headers=["context", "kernel", "ms", "GB read", "share of bandwidth", "full cuDNN / this"],
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, bandwidth=bandwidth, results=results),
        notes=[f"HBM bandwidth {bandwidth / 1e12:.2f} TB/s (measured)"],
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
