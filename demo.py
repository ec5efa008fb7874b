"""The duo-jax demo: needle in a haystack on SmolLM2-135M-Instruct, full attention vs DuoAttention vs
StreamingLLM holding exactly as many KV-cache bytes as DuoAttention.

Loads the embedded SmolLM2-135M-Instruct (fp32 on CPU) and its shipped head pattern, hides the San Francisco
needle in the evaluation half of the Paul Graham essays at a few depths of a few context lengths, and asks
for it in the three modes (`python -m duo_jax.eval niah` runs bigger grids). The prompts of one length go
through one batched `generate` call per mode. The prompts are token ids in the DuoAttention paper's completion
format ("... Answer: The best thing to do in San Francisco is"), so the model's chat template is not applied
(generate wraps only text prompts and conversations). Prints the accuracy table and the KV cache per mode, and
writes the heat maps (depth x length, green found / red missed) and niah.json to --out.

    python demo.py                       # the default grid: a few minutes on 2 CPU cores (README.md)
    python demo.py --pattern PATH        # another head pattern (a folder or full_attention_heads.tsv)
"""

from __future__ import annotations

import argparse
import sys
import time

# Sized to run well inside 15 minutes on 2 CPU cores; why these sizes: docs/evaluation.md.
LENGTHS = [1024, 2048, 4096]
DEPTHS = [0.1, 0.5, 0.9]
CHUNK_SIZE = 256  # prefill chunk: the fastest on CPU (docs/evaluation.md)
MAX_NEW_TOKENS = 16  # generated after each prompt: the answer's few words
MODEL = "smollm2-135m"


def check_grid(lengths: list[int], depths: list[float], context: int) -> None:
    """Refuse a grid the run would change or fail on after loading: a length below 1 or past the model's
    `context` (less the tokens generated), and a repeated length or depth (the grid runs each once)."""
    from duo_jax.errors import DuoJaxError

    most = context - MAX_NEW_TOKENS
    for n in lengths:
        if not 1 <= n <= most:
            raise DuoJaxError(
                f"--lengths: each must be at least 1 and at most {most}, the model's context ({context} tokens) "
                f"less the {MAX_NEW_TOKENS} generated; got {n}"
            )
    for option, values in (("--lengths", lengths), ("--depths", depths)):
        repeated = sorted({v for v in values if values.count(v) > 1})
        if repeated:
            raise DuoJaxError(f"{option}: {repeated[0]} is given more than once; pass each value once")


def main(argv: list[str] | None = None) -> int:
    from duo_jax.errors import HelpFormatter

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--pattern",
        default="default",
        help="DuoAttention head pattern: 'default' (the model's shipped one), a folder or a TSV",
    )
    parser.add_argument("--sparsity", type=float, default=0.5, help="fraction of streaming heads in duo")
    parser.add_argument("--lengths", type=int, nargs="+", default=LENGTHS, help="context lengths (tokens)")
    parser.add_argument("--depths", type=float, nargs="+", default=DEPTHS, help="needle depths in [0, 1]")
    parser.add_argument("--out", default="results/demo", help="folder for niah.json and the heat maps")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    import jax.numpy as jnp

    import duo_jax
    from duo_jax.config import get_config
    from duo_jax.errors import check_output_folder
    from duo_jax.eval import report
    from duo_jax.eval.niah import accuracy_table, run_niah
    from duo_jax.pattern import exact_sparsity, resolve_pattern

    try:
        check_output_folder(args.out)
        exact_sparsity(args.sparsity)  # before the full-attention runs, not after them
        check_grid(args.lengths, args.depths, get_config(MODEL).max_position_embeddings)  # before loading
        model = duo_jax.load(MODEL, dtype=jnp.float32)
        pattern = resolve_pattern(args.pattern, model.config)
        print(
            f"SmolLM2-135M-Instruct, {model.config.num_layers} layers x {model.config.num_kv_heads} KV heads; "
            f"pattern {args.pattern}: {pattern}\nNIAH: lengths {sorted(args.lengths)}, depths {sorted(args.depths)}, "
            f"modes full / duo (sparsity {args.sparsity}, sink 64, recent 256) / streaming (same KV bytes as duo)"
        )
        results = run_niah(
            model,
            ["full", "duo", "streaming"],
            pattern=pattern,
            lengths=args.lengths,
            depths=args.depths,
            sparsity=args.sparsity,
            max_new_tokens=MAX_NEW_TOKENS,
            chunk_size=CHUNK_SIZE,
            out_dir=args.out,
        )
    except (duo_jax.DuoJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    lengths = results["lengths"]
    print(f"\nNeedle in a haystack, accuracy ({report.describe_machine(results['machine'])}):\n")
    print(accuracy_table(results, lengths))
    rows = []
    for mode, r in results["modes"].items():
        window = r["settings"][lengths[-1]]
        rows.append(
            [
                mode,
                *[report.human_bytes(r["cache_bytes"][n]) for n in lengths],
                "-" if window["sink"] is None else f"{window['sink']} + {window['recent']}",
            ]
        )
    print("\nKV cache per sequence (float32):\n")
    print(report.markdown_table(["mode", *[f"@ {n}" for n in lengths], f"streaming window @ {lengths[-1]}"], rows))
    longest, middle = lengths[-1], results["depths"][len(results["depths"]) // 2]
    print(f"\nAnswers at {longest} tokens, depth {middle:.0%} (the prompt ends '... San Francisco is'):")
    for mode, r in results["modes"].items():
        cell = next(c for c in r["cells"] if c["length"] == longest and c["depth"] == middle)
        print(f"  {mode:9s} {'found ' if cell['correct'] else 'missed'} {cell['generated'].strip()[:90]!r}")
    print(f"\nwrote {', '.join(results['files'])}\ntotal {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
