"""CPU attention: the C++ kernel (`pallas_kernels.cpu`) vs the blocked XLA path vs torch's SDPA, per layer.

The workload is a SmolLM2-135M prefill's attention (9 query / 3 KV heads, head dim 64, fp32, batch 1): a
prompt of L tokens in chunks of C, each chunk's queries against a cache of L + 128 slots at its offset, which
is what `generate` runs per layer; torch runs one `scaled_dot_product_attention(is_causal=True)` over the whole
prompt (K / V repeated to the query heads, as transformers does on CPU). Wall ms per layer, the median of
--repeats interleaved runs. torch is timed in a process of its own: in a process that has run XLA computations
its threads were measured ~1.7x slower at 4k (XLA's pool competes for the cores), which would flatter ours. Also
times the kernel on one thread (`num_threads=1`), and reports the CPU time other processes took per round,
so a measurement on a loaded machine shows as such.

    python benchmarks/cpu_attention.py                               # L 1k / 2k / 4k, C 256 / 512
    python benchmarks/cpu_attention.py --lengths 4096 --chunks 512 --repeats 11
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import common

H, KH, E = 9, 3, 64


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), to count other processes' load."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def torch_times(lengths, repeats: int) -> dict:
    """{(L, threads): [ms, ...]} for torch's SDPA over the whole prompt, 2 (default) threads and 1."""
    import torch

    threads = (torch.get_num_threads(), 1)
    runs = {}
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, n, length, E, generator=g) for n in (H, KH, KH))
        for t in threads:

            def run(q=q, k=k, v=v, t=t):
                torch.set_num_threads(t)
                with torch.inference_mode():
                    torch.nn.functional.scaled_dot_product_attention(
                        q, k.repeat_interleave(H // KH, 1), v.repeat_interleave(H // KH, 1), is_causal=True
                    )

            run()
            runs[(length, t)] = run
    times = {key: [] for key in runs}
    for _ in range(repeats):
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append((time.perf_counter() - start) * 1e3)
    return {f"{length},{t}": ms for (length, t), ms in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "cpu_attention")
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096], help="prompt lengths L")
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 512], help="prefill chunk sizes C")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timed runs (the median is reported)")
    p.add_argument("--torch-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torch_worker:  # the torch side, in its own process
        print(json.dumps(torch_times(args.lengths, args.repeats)))
        return 0

    torch_run = subprocess.run(
        [
            sys.executable,
            __file__,
            "--torch-worker",
            "--repeats",
            str(args.repeats),
            "--lengths",
            *map(str, args.lengths),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    torch_ms = json.loads(torch_run.stdout.strip().splitlines()[-1])

    import jax
    import jax.numpy as jnp
    import numpy as np

    import pallas_kernels.cpu
    from duo_jax.attention import prefix_spec, xla

    if not pallas_kernels.cpu.available():
        raise SystemExit(f"the CPU kernel cannot run here: {pallas_kernels.cpu.unavailable()}")
    systems = {
        "kernel": lambda q, k, v, start, spec: pallas_kernels.cpu.flash_attention(q, k, v, start, spec.kv_len),
        "kernel 1 thread": lambda q, k, v, start, spec: pallas_kernels.cpu.flash_attention(
            q, k, v, start, spec.kv_len, num_threads=1
        ),
        "xla": lambda q, k, v, start, spec: xla.attention(q, k, v, spec),
    }
    rng = np.random.default_rng(0)
    runs = {}
    for length in args.lengths:
        k, v = (jnp.asarray(rng.standard_normal((1, length + 128, KH, E)), jnp.float32) for _ in range(2))
        for chunk in args.chunks:
            q = jnp.asarray(rng.standard_normal((1, chunk, H, E)), jnp.float32)
            for name, attend in systems.items():
                step = jax.jit(
                    lambda q, k, v, start, attend=attend, chunk=chunk, slots=length + 128: attend(
                        q, k, v, start, prefix_spec(1, chunk, q_offset=start, kv_len=start + chunk, num_keys=slots)
                    )
                )

                def run(step=step, q=q, k=k, v=v, length=length, chunk=chunk):
                    for start in range(0, length, chunk):
                        out = step(q, k, v, jnp.int32(start))
                    out.block_until_ready()

                run()
                runs[(length, chunk, name)] = run
    times = {key: [] for key in runs}
    foreign = []
    for _ in range(args.repeats):
        busy, own = machine_busy_seconds(), time.process_time()
        for key, run in runs.items():
            start = time.perf_counter()
            run()
            times[key].append((time.perf_counter() - start) * 1e3)
        foreign.append(machine_busy_seconds() - busy - (time.process_time() - own))

    ms = {f"{length},{chunk},{name}": statistics.median(t) for (length, chunk, name), t in times.items()}
    torch_median = {key: statistics.median(t) for key, t in torch_ms.items()}
    torch_threads = max(int(key.split(",")[1]) for key in torch_median)
    rows = []
    for length in args.lengths:
        peer, peer_one = torch_median[f"{length},{torch_threads}"], torch_median[f"{length},1"]
        for chunk in args.chunks:
            kernel, one, xla_ms = (ms[f"{length},{chunk},{n}"] for n in systems)
            rows.append(
                [length, chunk, kernel, one, xla_ms, peer, peer_one, xla_ms / kernel, peer / kernel, one / kernel]
            )
    headers = [
        "prompt",
        "chunk",
        "kernel ms",
        "kernel 1-thread ms",
        "xla ms",
        f"torch ms ({torch_threads} threads)",
        "torch 1-thread ms",
        "kernel vs xla",
        "kernel vs torch",
        "kernel 2 threads vs 1",
    ]
    common.write_result(
        args.out,
        "cpu_attention",
        title="CPU attention per layer: SmolLM2 prefill (9 / 3 heads, head dim 64, fp32)",
        headers=headers,
        rows=rows,
        data=dict(ms=ms, torch_ms=torch_median, other_processes_cpu_s_per_round=foreign, repeats=args.repeats),
        notes=[
            f"median of {args.repeats} interleaved runs; CPU seconds other processes used per round: "
            + " ".join(f"{x:.2f}" for x in foreign),
            "ratios are speed-ups (> 1: the kernel is faster)",
        ],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))
