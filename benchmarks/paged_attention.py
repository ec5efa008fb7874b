"""Paged decode attention: reading the pages in place vs gathering them into a contiguous cache first.

One decode step of B sequences over a paged retrieval cache (pool [K, N, P, E], block tables [B, M]), each
sequence holding `--length` tokens of an M * P-slot capacity, through `duo_jax.attention.attend` with the
default impl ("auto": the Pallas kernels on GPU, JAX's paged attention on TPU, the XLA path on CPU):

  * gathered  - the previous path: the sequences' pages gathered into [B, M * P, K, E] (`gather_pages`), then
                the contiguous cache's attention (the split-K kernel on GPU, the blocked XLA path on CPU);
  * in place  - `PagedKV`: the paged kernel follows the block tables (GPU / TPU), the XLA path gathers one key
                tile of slots at a time (CPU);
  * XLA       - in place on the XLA path (`impl="xla"`): what a GPU without Pallas's Triton backend ran before
                cuDNN served pages;
  * cuDNN     - in place through cuDNN's paged attention (`duo_jax.attention.cudnn`), what such a GPU runs now;
                measured where its probe passes (an NVIDIA GPU), else left out with the reason.

Reports the median time of a jitted step and XLA's temporary buffer bytes for it (`memory_analysis`: the
gathered copy shows there), per capacity.

  python benchmarks/paged_attention.py --capacities 4096 16384 65536 --out results/paged_attention_cpu.json
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from duo_jax import attention  # noqa: E402
from duo_jax.attention import MaskSpec, cudnn  # noqa: E402
from duo_jax.attention.pages import PagedKV  # noqa: E402
from duo_jax.methods.paged import gather_pages  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--capacities", type=int, nargs="+", default=[4096, 16384, 65536], help="M * P per sequence")
    p.add_argument("--length", type=int, default=1024, help="tokens each sequence holds")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--num-heads", type=int, default=8, help="query heads (retrieval heads of one layer)")
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", type=pathlib.Path, default=None)
    return p.parse_args(argv)


def case(args, capacity: int):
    """A pool of just the pages the batch holds (+ one), pages shuffled; tables: none (N) past each length."""
    rng = np.random.default_rng(0)
    P, B, K, E = args.page_size, args.batch, args.num_kv_heads, args.head_dim
    M, used = capacity // P, -(-args.length // P)
    N = B * used + 1
    dtype = jnp.dtype(args.dtype)
    tables = np.full((B, M), N, np.int32)
    tables[:, :used] = rng.permutation(B * used).reshape(B, used)
    pool = lambda: jnp.asarray(rng.standard_normal((K, N, P, E)), dtype)  # noqa: E731
    q = jnp.asarray(rng.standard_normal((B, 1, args.num_heads, E)), dtype)
    lengths = jnp.full((B,), args.length, jnp.int32)
    return q, pool(), pool(), jnp.asarray(tables), lengths


def gathered(q, kp, vp, tables, lengths):
    spec = MaskSpec(lengths[:, None] - 1, lengths)
    return attention.attend(q, gather_pages(kp, tables), gather_pages(vp, tables), spec)


def in_place(q, kp, vp, tables, lengths, attend=attention.attend):
    spec = MaskSpec(lengths[:, None] - 1, lengths)
    return attend(q, PagedKV(kp, tables), PagedKV(vp, tables), spec)


def measure(fn, inputs, reps: int) -> dict:
    compiled = jax.jit(fn).lower(*inputs).compile()
    jax.block_until_ready(compiled(*inputs))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times.append(time.perf_counter() - start)
    memory = compiled.memory_analysis()
    return dict(
        ms=1e3 * statistics.median(times), temp_mib=None if memory is None else memory.temp_size_in_bytes / 2**20
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    no_cudnn = cudnn.paged_unavailable(
        args.page_size, args.head_dim, args.num_heads // args.num_kv_heads, jnp.dtype(args.dtype)
    )
    if no_cudnn is not None:
        print(f"cuDNN paged attention left out: {no_cudnn}", flush=True)
    xla = functools.partial(in_place, attend=functools.partial(attention.attend, impl="xla"))
    paths = dict(gathered=gathered, in_place=in_place, xla=xla)
    if no_cudnn is None:
        paths["cudnn"] = functools.partial(in_place, attend=cudnn.attention)
    rows = []
    for capacity in args.capacities:
        inputs = case(args, capacity)
        want = gathered(*inputs).astype(jnp.float32)
        row = dict(capacity=capacity)
        for name, fn in paths.items():
            err = float(jnp.max(jnp.abs(fn(*inputs).astype(jnp.float32) - want)))
            row[name] = dict(measure(fn, inputs, args.reps), max_abs_diff=err)
        rows.append(row)
        cells = " | ".join(
            f"{name} {row[name]['ms']:8.2f} ms ({row['xla']['ms'] / row[name]['ms']:5.2f}x XLA), temp "
            f"{row[name]['temp_mib']:7.1f} MiB, |diff| {row[name]['max_abs_diff']:.1e}"
            for name in paths
        )
        print(f"capacity {capacity:>6}: {cells}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                dict(
                    args={k: str(v) for k, v in vars(args).items()},
                    rows=rows,
                    cudnn_left_out=no_cudnn,
                    device=jax.devices()[0].device_kind,
                    jax=jax.__version__,
                    machine=platform.machine(),
                ),
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
