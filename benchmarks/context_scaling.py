"""Does attention cost follow the tokens held, or the cache's capacity? The same prompt through `generate` with
a small and a large `context` (the cache capacity reserved), for full and duo; and, at Llama-3-8B shapes,
XLA's temp memory of one compiled prefill chunk at two capacities (abstract: nothing is allocated).

    python benchmarks/context_scaling.py                       # SmolLM2-135M fp32 on this machine
    python benchmarks/context_scaling.py --no-llama            # skip the Llama-3-8B memory analysis

Ratios are large-capacity time / small-capacity time (1.0: the capacity costs nothing). Each time is the
median of --repeats calls after a warm-up call (compilation excluded); calls interleave the capacities.
"""

from __future__ import annotations

import sys

import common


def llama_temp_bytes(capacity: int, chunk: int) -> int:
    """XLA's temp bytes for one `chunk`-token prefill step of Llama-3-8B (bf16, full attention) over a cache of
    `capacity` slots, compiled for the host's backend from shapes alone."""
    import jax
    import jax.numpy as jnp

    from duo_jax.config import get_config
    from duo_jax.engine import extend
    from duo_jax.methods import make_method
    from duo_jax.model import init_params, unstack_layers

    config = get_config("llama3-8b")
    method = make_method("full", config, context=capacity)
    params = jax.eval_shape(lambda: unstack_layers(init_params(config, jax.random.key(0), jnp.bfloat16)))
    cache = method.cache_spec(1, jnp.bfloat16)
    i32 = jax.ShapeDtypeStruct((1,), jnp.int32)
    lowered = extend.lower(
        params, cache, i32, jax.ShapeDtypeStruct((1, chunk), jnp.int32), i32, config=config, method=method
    )
    return int(lowered.compile().memory_analysis().temp_size_in_bytes)


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "context_scaling")
    common.add_model_args(p, peer=False)
    p.add_argument("--prefill-tokens", type=int, default=512, help="prompt of the prefill comparison")
    p.add_argument("--prefill-contexts", type=int, nargs=2, default=[640, 8192], help="small and large capacity")
    p.add_argument("--decode-prompt", type=int, default=256, help="prompt before the decode comparison")
    p.add_argument("--decode-tokens", type=int, default=64, help="tokens decoded per call")
    p.add_argument("--decode-contexts", type=int, nargs=2, default=[384, 8192], help="small and large capacity")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per (mode, capacity)")
    p.add_argument("--no-llama", action="store_true", help="skip the Llama-3-8B memory analysis")
    p.add_argument("--llama-capacities", type=int, nargs=2, default=[32768, 131072])
    args = p.parse_args(argv)
    common.setup_threads(args)
    import numpy as np
    from tqdm.auto import tqdm

    model, pattern = common.load(args)
    rows, data = [], dict(args={k: str(v) for k, v in vars(args).items()})
    jobs = [
        ("prefill", args.prefill_tokens, 1, args.prefill_contexts),
        ("decode", args.decode_prompt, args.decode_tokens, args.decode_contexts),
    ]
    with tqdm(total=2 * 2 * 2 * (args.repeats + 1), desc="context scaling", unit="call") as bar:
        for kind, prompt_len, new_tokens, contexts in jobs:
            ids = common.text_prompt(model, prompt_len)
            for name in ("full", "duo"):
                times = {c: [] for c in contexts}
                for r in range(args.repeats + 1):  # call 0 compiles and warms up
                    for context in contexts:
                        settings = common.mode(name, model, pattern, args, context)
                        out = common.run_generate(
                            model, ids, settings, new_tokens=new_tokens, chunk_size=args.chunk_size, context=context
                        )
                        if r:
                            times[context].append(
                                out.stats["prefill_s"] if kind == "prefill" else 1e3 / out.stats["decode_tokens_per_s"]
                            )
                        bar.update()
                small, large = (float(np.median(times[c])) for c in contexts)
                unit = "s" if kind == "prefill" else "ms/token"
                rows.append(
                    [
                        kind,
                        name,
                        prompt_len,
                        f"{contexts[0]} / {contexts[1]}",
                        f"{small:.4g} {unit}",
                        f"{large:.4g} {unit}",
                        large / small,
                    ]
                )
                data[f"{kind}_{name}"] = dict(contexts=contexts, small=small, large=large, runs=times, unit=unit)

    notes = [
        f"model {model.config.name} ({args.dtype}), chunk {args.chunk_size}, duo sparsity {args.sparsity} "
        f"(sink {args.sink}, recent {args.recent}); median of {args.repeats} calls"
    ]
    if not args.no_llama:
        small_cap, large_cap = args.llama_capacities
        temp = {c: llama_temp_bytes(c, args.prefill_tokens) for c in (small_cap, large_cap)}
        rows.append(
            [
                "temp memory",
                "full (Llama-3-8B, bf16)",
                args.prefill_tokens,
                f"{small_cap} / {large_cap}",
                f"{temp[small_cap] / 2**30:.3f} GiB",
                f"{temp[large_cap] / 2**30:.3f} GiB",
                temp[large_cap] / temp[small_cap],
            ]
        )
        data["llama_temp_bytes"] = temp
        notes.append("temp memory: XLA memory analysis of one compiled prefill chunk (extend), abstract shapes")
    common.write_result(
        args.out,
        "context_scaling",
        title="Cost of the reserved capacity (large / small)",
        headers=["what", "mode", "prompt", "capacities", "small", "large", "large / small"],
        rows=rows,
        data=data,
        notes=notes,
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
