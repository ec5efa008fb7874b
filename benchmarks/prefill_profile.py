"""Where prefill time goes, ours against the Hugging Face transformers peer, in process CPU seconds.

Wall-clock TTFT (`benchmarks/prefill.py`) is at the mercy of other jobs on a shared machine; this profile runs
both sides on one thread (XLA without its Eigen pool, `torch.set_num_threads(1)`) and counts the work done
(`time.process_time`, the minimum of --repeats runs after a warm-up), so its ratios hold under load. Per
prompt length it measures
- ours: `Engine.prefill` (the compiled chunked extend `generate` runs) for full attention and DuoAttention;
  and full attention with every attention call replaced by its queries ("no attention": embedding, norms,
  projections, RoPE, cache writes, MLP, LM head and the per-chunk steps);
- ours, attention alone: the attention `generate` runs on CPU (`duo_jax.attention.attend`, impl "auto": the C++
  kernel of `pallas_kernels.cpu`) and the blocked XLA path (`duo_jax.attention.xla`), each over the same chunk
  schedule, query / KV heads and cache capacity, times the number of layers;
- the peer: one `model(ids, logits_to_keep=1)` forward (what its TTFT is), and its attention alone:
  `scaled_dot_product_attention(is_causal=True)` over the whole prompt (its GQA K/V expanded, as transformers
  does on CPU), times the number of layers.
The "rest" columns are a whole prefill minus its attention alone (ours: the kernel's).

    python benchmarks/prefill_profile.py                       # SmolLM2-135M, 1k and 2k, fp32
    python benchmarks/prefill_profile.py --lengths 1024 --repeats 3 --out results/benchmarks/prefill_profile
"""

from __future__ import annotations

import os
import time

import common


def cpu_seconds(fn, repeats: int) -> float:
    """The least process CPU time of `repeats` calls of fn, after one untimed call (compilation, warm-up)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "prefill_profile")
    common.add_model_args(p, peer=False, single_thread=False)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048], help="prompt lengths (tokens)")
    p.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (the minimum is kept)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    import pallas_kernels.cpu
    from duo_jax import attention as attention_module
    from duo_jax.attention import xla
    from duo_jax.attention.masks import prefix_spec
    from duo_jax.engine import Engine, bucket, clear_compiled

    model, pattern = common.load(args)
    peer = common.Peer(model, args.dtype, single_thread=True)
    config, engine = model.config, Engine.of(model)
    L, H, K, E = config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim
    dtype = jnp.dtype(args.dtype)

    def ours(name: str, ids, no_attention: bool = False) -> float:
        method = common.mode(name, model, pattern, args, len(ids) + 1).build(config, len(ids) + 1, model=model)
        chunk = min(args.chunk_size, bucket(len(ids)))
        attention, kernel, traced = xla.attention, pallas_kernels.cpu.flash_attention, []
        if no_attention:  # every attention call returns its queries: same shapes, no attention work
            xla.attention = lambda q, k, v, spec, **kw: traced.append(q.shape) or q
            pallas_kernels.cpu.flash_attention = lambda q, *args, **kw: traced.append(q.shape) or q
        clear_compiled()  # `extend`'s traces too: else the patched attention is never traced
        try:
            seconds = cpu_seconds(
                lambda: jax.block_until_ready(
                    engine.prefill(method, np.asarray([ids], np.int32), np.asarray([len(ids)]), chunk=chunk)
                ),
                args.repeats,
            )
            if no_attention and not traced:
                raise RuntimeError(
                    "the 'no attention' prefill traced no attention call: the profile would "
                    "time full attention under that name"
                )
            return seconds
        finally:
            xla.attention, pallas_kernels.cpu.flash_attention = attention, kernel
            clear_compiled()

    def ours_attention(length: int, impl: str) -> float:
        method = common.mode("full", model, pattern, args, length + 1).build(config, length + 1, model=model)
        capacity = engine.init_cache(method, 1)
        capacity = max(x.shape[1] for x in jax.tree.leaves(capacity) if x.ndim == 4)  # the retrieval slots
        chunk = min(args.chunk_size, bucket(length))
        rng = np.random.default_rng(0)
        k, v = (jnp.asarray(rng.standard_normal((1, capacity, K, E)), dtype) for _ in range(2))
        q = jnp.asarray(rng.standard_normal((1, chunk, H, E)), dtype)
        step = jax.jit(
            lambda q, k, v, start: attention_module.attend(
                q, k, v, prefix_spec(1, chunk, q_offset=start, kv_len=start + chunk, num_keys=capacity), impl=impl
            )
        )

        def run():
            for start in range(0, length, chunk):
                step(q, k, v, jnp.int32(start)).block_until_ready()

        return L * cpu_seconds(run, args.repeats)

    def peer_forward(ids) -> float:
        x = torch.tensor([list(ids)])
        with torch.inference_mode():
            return cpu_seconds(lambda: peer.model(x, logits_to_keep=1), args.repeats)

    def peer_attention(length: int) -> float:
        tdtype = getattr(torch, args.dtype)
        q = torch.randn(1, H, length, E, dtype=tdtype)
        k, v = (torch.randn(1, K, length, E, dtype=tdtype) for _ in range(2))

        def run():
            with torch.inference_mode():
                torch.nn.functional.scaled_dot_product_attention(
                    q, k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1), is_causal=True
                )

        return L * cpu_seconds(run, args.repeats)

    measures = {
        "full": lambda n, ids: ours("full", ids),
        "duo": lambda n, ids: ours("duo", ids),
        "no attention": lambda n, ids: ours("full", ids, no_attention=True),
        "attention": lambda n, ids: ours_attention(n, "auto"),
        "xla attention": lambda n, ids: ours_attention(n, "xla"),
        common.PEER: lambda n, ids: peer_forward(ids),
        f"{common.PEER} attention": lambda n, ids: peer_attention(n),
    }
    cpu = {}
    with tqdm(total=len(args.lengths) * len(measures), desc="prefill profile", unit="measure") as bar:
        for n in args.lengths:
            ids = common.text_prompt(model, n)
            cpu[n] = {}
            for name, measure in measures.items():
                bar.set_postfix_str(f"{name} @ {n}")
                cpu[n][name] = measure(n, ids)
                bar.update()

    rows = []
    for n, c in cpu.items():
        rows.append(
            [
                n,
                c["full"],
                c["duo"],
                c["no attention"],
                c["attention"],
                c["xla attention"],
                c["full"] - c["attention"],
                c[common.PEER],
                c[f"{common.PEER} attention"],
                c[common.PEER] - c[f"{common.PEER} attention"],
                common.ratio(c[common.PEER], c["full"]),
                common.ratio(c[common.PEER], c["duo"]),
                common.ratio(c["full"], c["duo"]),
                common.ratio(c[f"{common.PEER} attention"], c["attention"]),
            ]
        )
    headers = [
        "prompt",
        "full CPU-s",
        "duo CPU-s",
        "no attention CPU-s",
        "attention CPU-s",
        "xla attention CPU-s",
        "full rest CPU-s",
        f"{common.PEER} CPU-s",
        f"{common.PEER} attention CPU-s",
        f"{common.PEER} rest CPU-s",
        f"full vs {common.PEER}",
        f"duo vs {common.PEER}",
        "duo vs full",
        f"attention vs {common.PEER}'s",
    ]
    common.write_result(
        args.out,
        "prefill_profile",
        title=f"Prefill profile, {args.model} {args.dtype}, one CPU thread, "
        f"chunks of {args.chunk_size} (process CPU seconds, min of {args.repeats})",
        headers=headers,
        rows=rows,
        data=dict(
            cpu_seconds={str(n): c for n, c in cpu.items()}, chunk_size=args.chunk_size, peer_attention=peer.attention
        ),
        notes=["ratios are speed-ups (> 1: the first named is faster)"],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(common.run(main))
