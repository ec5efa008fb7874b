"""Memory of generating on a loaded model: how many copies of the weights are alive while `generate` decodes.

Loads the model as a user does (`duo_jax.load(name, dtype)`, its default layout) and calls `duo_jax.generate`
twice. Just before each call's decode loop starts (the prefill done, the cache filled) it sums the bytes of
every live device array (`jax.live_arrays()`: the weights, the engine's, the cache, the logits), and reports
that minus the weights and the cache, in units of the weights' size. The process's peak resident memory
(`ru_maxrss`, compilation included) is reported too. Uses only `duo_jax.load`, `duo_jax.generate` and
`Engine.decode_loop`, so it also runs on older checkouts (the before / after figures in BENCHMARKS.md).

    python benchmarks/weights_memory.py              # SmolLM2-135M fp32, a 512-token prompt, 32 new tokens
"""

from __future__ import annotations

import resource
import sys

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "weights_memory")
    common.add_model_args(p, peer=False, duo=False)
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per call")
    args = p.parse_args(argv)
    common.setup_threads(args)

    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax.engine import Engine

    model = duo_jax.load(args.model, dtype=jnp.dtype(args.dtype))
    weights = sum(x.nbytes for x in jax.tree.leaves(model.params))
    rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # noqa: E731  (Linux: KiB)
    rss_loaded = rss()
    live = []
    decode_loop = Engine.decode_loop

    def measured(self, method, cache, *a, **k):  # the moment the cache is full and the weights are in use
        live.append(
            dict(
                live_bytes=sum(x.nbytes for x in jax.live_arrays()),
                cache_bytes=sum(x.nbytes for x in jax.tree.leaves(cache)),
            )
        )
        return decode_loop(self, method, cache, *a, **k)

    Engine.decode_loop = measured
    ids = common.text_prompt(model, args.prompt)
    rows, calls = [], []
    for call in (1, 2):
        out = duo_jax.generate(
            model, [ids], max_new_tokens=args.new_tokens, chunk_size=args.chunk_size, stop_at_eos=False
        )
        m = live[-1]
        extra = m["live_bytes"] - weights - m["cache_bytes"]
        calls.append(
            dict(
                m, weights_bytes=weights, extra_bytes=extra, prepare_s=out.stats.get("prepare_s"), peak_rss_bytes=rss()
            )
        )
        rows.append(
            [
                call,
                weights / 2**20,
                m["cache_bytes"] / 2**20,
                m["live_bytes"] / 2**20,
                extra / 2**20,
                common.ratio(extra, weights),
                out.stats.get("prepare_s"),
                rss() / 2**20,
            ]
        )
    headers = [
        "call",
        "weights MiB",
        "cache MiB",
        "live device MiB at decode",
        "live - weights - cache MiB",
        "(live - weights - cache) / weights",
        "prepare s",
        "peak RSS MiB (process)",
    ]
    common.write_result(
        args.out,
        "weights_memory",
        title=f"generate(): live device memory beyond weights + cache, "
        f"{args.prompt}-token prompt, {args.new_tokens} new tokens",
        headers=headers,
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, calls=calls, peak_rss_after_load_bytes=rss_loaded),
        notes=[
            f"model {model.config.name} ({args.dtype}), full attention, chunk {args.chunk_size}; "
            f"peak RSS after loading: {rss_loaded / 2**20:.0f} MiB"
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(common.run(main))
