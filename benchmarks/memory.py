"""KV-cache memory of DuoAttention vs full attention, measured and by shape (batch 1).

1. --model (SmolLM2-135M by default) with its pattern, measured: the cache `duo_jax.generate` allocates
   (its ``cache_bytes``: the sum of the cache arrays' nbytes) at a capacity of C tokens, full vs duo, next to
   the theoretical ratio r + (1 - r) * (sink + recent) / C (r: the share of retrieval heads; C: the context
   rounded up to the cache block).
2. Llama-3-8B's shape with its published pattern (configs/patterns/llama3-8b) in bf16 from 8k to 1M tokens,
   by `jax.eval_shape` on the caches (nothing is allocated), and the largest context whose cache fits next
   to the bf16 weights in --hbm-gib of device memory: the memory planner's answer (`duo_jax.plan`, weights +
   cache, activations not counted; `python -m duo_jax.plan` adds XLA's temp memory and quantized options). The paper
   reports 1.67x
   less memory for GQA models at 50% retrieval heads.
3. Peak device memory where the backend reports it (`jax.devices()[0].memory_stats()`; the CPU backend
   reports none).

    python benchmarks/memory.py                        # SmolLM2 at 2k / 4k / 8k, Llama-3-8B at 8k .. 1M
    python benchmarks/memory.py --pattern PATH --contexts 1024 4096 --out results/benchmarks/memory
"""

from __future__ import annotations

import sys

import common

LLAMA = "llama3-8b"


def theoretical_ratio(retrieval_share: float, window: int, capacity: int) -> float:
    """duo / full cache bytes: r + (1 - r) * (sink + recent) / C."""
    return retrieval_share + (1 - retrieval_share) * window / capacity


def llama_rows(contexts, *, sparsity: float, sink: int, recent: int, hbm_gib: float) -> tuple[list, dict]:
    """Llama-3-8B-shaped cache bytes full vs duo (bf16, by eval_shape) and the largest context in `hbm_gib`
    next to the bf16 weights: the memory planner's (`duo_jax.plan.plan`, weights + cache, temp not compiled)."""
    import jax.numpy as jnp

    import duo_jax
    from duo_jax.cache import round_capacity
    from duo_jax.eval.modes import mode_settings, num_retrieval_heads
    from duo_jax.pattern import Pattern
    from duo_jax.plan import plan, tree_bytes

    config = duo_jax.get_config(LLAMA)
    pattern = Pattern.for_model(LLAMA)
    share = num_retrieval_heads(config, sparsity) / (config.num_layers * config.num_kv_heads)
    planned = plan(
        config, hbm_bytes=int(hbm_gib * 2**30), sparsity=sparsity, pattern=pattern, sink=sink, recent=recent, temp=False
    )
    fits = dict(full=planned["max_context_full"], duo=planned["max_context_duo"])
    rows, data = (
        [],
        dict(weight_bytes=planned["weight_bytes"], retrieval_share=share, largest_context=fits, contexts={}),
    )
    weight_bytes = planned["weight_bytes"]
    for context in contexts:
        sizes = {}
        for name in ("full", "duo"):
            method = mode_settings(
                name, config, pattern, sparsity=sparsity, sink=sink, recent=recent, context=context
            ).build(config, context)
            sizes[name] = tree_bytes(method.cache_spec(1, jnp.bfloat16))
        theory = theoretical_ratio(share, sink + recent, round_capacity(context))
        data["contexts"][context] = dict(sizes, theoretical_ratio=theory)
        rows.append(
            [
                context,
                _gib(sizes["full"]),
                _gib(sizes["duo"]),
                sizes["duo"] / sizes["full"],
                theory,
                sizes["full"] / sizes["duo"],
                _gib(weight_bytes + sizes["full"]),
                _gib(weight_bytes + sizes["duo"]),
            ]
        )
    return rows, data


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "memory")
    common.add_model_args(p, peer=False)
    p.add_argument(
        "--contexts", type=int, nargs="+", default=[2048, 4096, 8192], help="capacities measured on --model (tokens)"
    )
    p.add_argument(
        "--llama-contexts",
        type=int,
        nargs="+",
        default=[8192, 32768, 131072, 262144, 524288, 1048576],
        help="Llama-3-8B-shaped contexts (tokens)",
    )
    p.add_argument("--hbm-gib", type=float, default=80.0, help="device memory for the 'largest context' estimate")
    args = p.parse_args(argv)
    common.setup_threads(args)

    import jax

    from duo_jax.cache import round_capacity
    from duo_jax.eval import report
    from duo_jax.eval.modes import num_retrieval_heads

    model, pattern = common.load(args)
    config = model.config
    share = num_retrieval_heads(config, args.sparsity) / (config.num_layers * config.num_kv_heads)
    prompt = common.text_prompt(model, 16)
    measured, rows = {}, []
    for context in args.contexts:
        sizes = {}
        for name in ("full", "duo"):
            settings = common.mode(name, model, pattern, args, context)
            sizes[name] = common.run_generate(
                model, prompt, settings, new_tokens=1, chunk_size=args.chunk_size, context=context
            ).stats["cache_bytes"]
        theory = theoretical_ratio(share, args.sink + args.recent, round_capacity(context))
        measured[context] = dict(sizes, theoretical_ratio=theory)
        rows.append(
            [
                context,
                report.human_bytes(sizes["full"]),
                report.human_bytes(sizes["duo"]),
                sizes["duo"] / sizes["full"],
                theory,
                sizes["full"] / sizes["duo"],
            ]
        )
    stats = jax.devices()[0].memory_stats()
    peak = None if stats is None else stats.get("peak_bytes_in_use")
    peak_note = (
        f"peak device memory: {report.human_bytes(peak)}"
        if peak is not None
        else f"peak device memory: not reported by the {jax.default_backend()} backend "
        "(jax.devices()[0].memory_stats() is None)"
    )

    llama, llama_data = llama_rows(
        args.llama_contexts, sparsity=args.sparsity, sink=args.sink, recent=args.recent, hbm_gib=args.hbm_gib
    )
    fits = llama_data["largest_context"]
    llama_table = report.markdown_table(
        [
            "context",
            "full KV GiB",
            "duo KV GiB",
            "duo / full",
            "theory",
            "saving",
            "weights+full GiB",
            "weights+duo GiB",
        ],
        llama,
    )
    notes = [
        peak_note,
        f"\nLlama-3-8B shape, bf16, published pattern at sparsity {args.sparsity}"
        f" (r = {llama_data['retrieval_share']:.3f}),"
        f" by jax.eval_shape; weights {_gib(llama_data['weight_bytes'])} GiB:\n\n{llama_table}\n",
        f"largest context next to the weights in {args.hbm_gib:g} GiB: full {fits['full']:,} tokens, "
        f"duo {fits['duo']:,} tokens ({fits['duo'] / fits['full']:.2f}x)",
    ]

    def plot(path):
        x = args.llama_contexts
        return report.line_plot(
            path,
            x,
            {
                f"{LLAMA} full": [llama_data["contexts"][c]["full"] / 2**30 for c in x],
                f"{LLAMA} duo": [llama_data["contexts"][c]["duo"] / 2**30 for c in x],
            },
            xlabel="context (tokens)",
            ylabel="KV cache (GiB, bf16, batch 1)",
            logx=True,
            logy=True,
            title=f"KV cache, Llama-3-8B shape, sparsity {args.sparsity}",
        )

    title = (
        f"KV cache, {config.name} ({args.dtype}, batch 1) as generate allocates it: full vs duo at sparsity "
        f"{args.sparsity} (r = {share:.3f}, sink {args.sink}, recent {args.recent}); "
        "theory = r + (1 - r)(sink + recent) / C"
    )
    common.write_result(
        args.out,
        "memory",
        title=title,
        headers=["capacity C", "full KV", "duo KV", "duo / full", "theory", "saving"],
        rows=rows,
        data=dict(
            args={k: str(v) for k, v in vars(args).items()},
            measured=measured,
            peak_device_bytes=peak,
            llama3_8b=llama_data,
        ),
        plot=plot,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
