"""Compare KV-cache methods on one model at the same KV budget: full attention, DuoAttention, all-streaming heads
and every other method of the registry, one task per subcommand. Each prints a table and writes JSON and PNG
results to --out (default results/<task>).

    python -m duo_jax.eval niah --modes full duo h2o snapkv --kv-budget 0.25
    python -m duo_jax.eval perplexity --length 4096 --prefix 3584 --modes full h2o tova --kv-budget 0.25

Modes, budgets (--kv-budget, --kv-dtype, --pattern, --scores) and outputs: docs/evaluation.md.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

from duo_jax.errors import DuoJaxError, HelpFormatter, check_output_folder, integer_argument, read_user_text
from duo_jax.eval.longbench import DEFAULT_MARGIN, NO_CHAT_TASKS, PROTOCOLS, check_max_length
from duo_jax.eval.longbench_metrics import FUZZY
from duo_jax.eval.modes import MODES, check_kv_budgets, check_kv_dtype_modes
from duo_jax.eval.niah import DEFAULT_LENGTHS as NIAH_LENGTHS
from duo_jax.eval.niah import PROTOCOLS as NIAH_PROTOCOLS
from duo_jax.eval.passkey import DEFAULT_LENGTHS as PASSKEY_LENGTHS
from duo_jax.eval.passkey import check_passkey_options
from duo_jax.eval.ruler import DEFAULT_LENGTHS as RULER_LENGTHS
from duo_jax.eval.samples import DUO_BUDGETS, check_decode_last, check_duo_budget
from duo_jax.quant import KV_DTYPES
from duo_jax.sampling import check_number

# lengths, samples, batch sizes, digits, limits, tokens to generate
count = integer_argument("an integer >= 1", 1)


def _common(parser: argparse.ArgumentParser, task: str, budgets: bool = False) -> None:
    """The options every evaluation takes; budgets: --kv-budget takes several (one run per budget)."""
    parser.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    parser.add_argument(
        "--pattern",
        default="default",
        help="head pattern for mode duo: a folder / full_attention_heads.tsv, or 'default' for the model's shipped one",
    )
    parser.add_argument(
        "--modes",
        "--methods",
        "--method",
        dest="modes",
        nargs="+",
        choices=MODES,
        metavar="MODE",
        default=["full", "duo", "streaming"],
        help=f"modes (KV-cache methods) to compare, from: {', '.join(MODES)}",
    )
    parser.add_argument(
        "--kv-budget",
        type=float,
        default=None,
        metavar="B",
        nargs="+" if budgets else None,
        help="tokens kept per KV head by every mode but full: a fraction B in (0, 1] of the evaluated length, or "
        "B >= 2 tokens for every prompt (the KV size of the SnapKV / PyramidKV / HeadKV papers) (default: duo's "
        "budget at --sparsity)"
        + ("; several, all fractions or all token counts: every mode at each" if budgets else ""),
    )
    parser.add_argument(
        "--scores",
        default="default",
        help="HeadKV head scores for headkv / duo_headkv: a folder / .tsv from python -m "
        "duo_jax.head_scores, or 'default' for the model's shipped ones",
    )
    parser.add_argument("--sparsity", type=float, default=0.5, help="duo: fraction of streaming heads")
    parser.add_argument("--sink", type=int, default=64, help="attention-sink tokens of a streaming head")
    parser.add_argument(
        "--recent",
        type=int,
        default=256,
        help="recent tokens of duo's streaming heads (streaming mode: widened to duo's budget)",
    )
    parser.add_argument(
        "--chunk-size",
        type=int,
        default=256,
        help="prompt tokens per prefill step (on CPU 256 beat 128 and 512 for SmolLM2)",
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="weights and cache dtype; auto: float32 on CPU, bfloat16 elsewhere",
    )
    parser.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default=None,
        help="quantize every mode's KV cache (absmax per token and head, bf16 scales; "
        "duo_jax.quant; every mode has one) (default: --dtype)",
    )
    parser.add_argument(
        "--streaming-chunk",
        type=int,
        default=None,
        metavar="N",
        help="duo modes: the streaming heads see a prefill chunk longer than N (--chunk-size a multiple of N) as "
        "chunks of N: the output of --chunk-size N at a longer one (docs/methods.md)",
    )
    if budgets:
        parser.add_argument(
            "--decode-last",
            type=int,
            default=None,
            metavar="N",
            help="h2o / tova (LongBench's duoattention protocol: every mode): prefill all but the prompt's last N "
            "tokens in one chunk, then decode those one at a time (DuoAttention's protocol: 50); 0: none "
            "(default: 0; the duoattention protocol: 50)",
        )
        parser.add_argument(
            "--duo-budget",
            choices=DUO_BUDGETS,
            default=None,
            help="how duo meets a fractional --kv-budget F: fitted, its heads and window fitted so that it keeps F of "
            "each prompt; heads, F of its heads retrieval heads (sparsity 1 - F), as DuoAttention's own evaluations "
            "give its budgets (default: fitted; LongBench's duoattention protocol: heads)",
        )
        parser.add_argument(
            "--compile-ahead",
            type=integer_argument("an integer >= 0", 0),
            default=1,
            metavar="N",
            help="while a sample generates, N threads compile the steps of the next N samples (0: none): "
            "compilation overlaps generation; more helps on a host with spare CPU cores; the outputs are the same",
        )
    parser.add_argument("--out", default=f"results/{task}", help="folder for the JSON and PNG results")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m duo_jax.eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    tasks = parser.add_subparsers(dest="task", required=True)
    defaults = HelpFormatter

    niah = tasks.add_parser("niah", help="needle in a haystack: depth x length heat maps", formatter_class=defaults)
    _common(niah, "niah")
    niah.add_argument("--lengths", type=count, nargs="+", default=list(NIAH_LENGTHS), help="context lengths (tokens)")
    niah.add_argument(
        "--depths", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in [0, 1]"
    )
    niah.add_argument(
        "--haystack",
        default=None,
        help="'paul_graham:evaluation' (the essays' held-out half), 'paul_graham', 'austen' or a folder of .txt files "
        "(default: paul_graham:evaluation; the duoattention protocol: paul_graham, its files whole)",
    )
    niah.add_argument("--max-new-tokens", type=count, default=None, help="default: 32 (the duoattention protocol: 51)")
    niah.add_argument(
        "--decode-last",
        type=int,
        default=0,
        metavar="N",
        help="h2o / tova: prefill all but the prompt's last N tokens, then decode those one at a time with eviction "
        "(DuoAttention's appendix runs its NIAH baselines with 50)",
    )
    niah.add_argument(
        "--protocol",
        choices=NIAH_PROTOCOLS,
        default="niah",
        help="niah: this repository's prompts and key-word score; duoattention: DuoAttention's NIAH script (its "
        "needle, prompt, insertion and word-overlap score; docs/evaluation.md)",
    )
    niah.add_argument("--batch-size", type=count, default=None, help="prompts per generate call (default: all depths)")

    passkey = tasks.add_parser(
        "passkey", help="numeric passkey retrieval accuracy per length", formatter_class=defaults
    )
    _common(passkey, "passkey")
    passkey.add_argument(
        "--lengths", type=count, nargs="+", default=list(PASSKEY_LENGTHS), help="context lengths (tokens)"
    )
    passkey.add_argument("--depths-per-length", type=count, default=5, help="passkey depths, evenly spaced in [0, 1]")
    passkey.add_argument("--digits", type=count, default=5, help="digits of each passkey")
    passkey.add_argument("--seed", type=int, default=0, help="seed of the passkeys")
    passkey.add_argument("--max-new-tokens", type=count, default=12, help="tokens generated per prompt")
    passkey.add_argument(
        "--batch-size", type=count, default=None, help="prompts per generate call (default: all depths)"
    )

    ppl = tasks.add_parser("perplexity", help="perplexity per position bucket on long text", formatter_class=defaults)
    _common(ppl, "perplexity")
    ppl.add_argument(
        "--source",
        default="paul_graham:evaluation",
        help="'paul_graham:evaluation' (the essays' held-out half), 'paul_graham', 'austen' or a folder of .txt files",
    )
    ppl.add_argument("--length", type=count, default=4096, help="tokens per window")
    ppl.add_argument("--samples", type=count, default=2, help="windows (consecutive, one batch)")
    ppl.add_argument(
        "--bucket-edges",
        type=int,
        nargs="+",
        default=None,
        help="position bucket edges from 0 to --length; None: doubling buckets 0 512 1024 ... length",
    )
    ppl.add_argument(
        "--prefix",
        type=int,
        default=None,
        help="prompt tokens per window; the rest is decoded one token per step after the method "
        "compresses the prompt (default: the whole window is prompt)",
    )
    longbench = tasks.add_parser(
        "longbench", help="LongBench (v1) / LongBench-E from LongBench's own files", formatter_class=defaults
    )
    _common(longbench, "longbench", budgets=True)
    longbench.add_argument(
        "--data",
        required=True,
        metavar="DIR",
        help="folder of LongBench's <task>.jsonl files (data.zip of huggingface.co/datasets/THUDM/LongBench, unzipped)",
    )
    longbench.add_argument("--tasks", nargs="+", default=None, help="tasks to run (default: all of them)")
    longbench.add_argument(
        "--e",
        "--longbench-e",
        dest="longbench_e",
        action="store_true",
        help="LongBench-E: the <task>_e.jsonl files, scores per length bucket",
    )
    longbench.add_argument(
        "--max-length",
        type=int,
        default=None,
        help=f"prompt tokens kept (middle truncation); default: the model's context - {DEFAULT_MARGIN} (the "
        "duoattention protocol: its model2maxlen.json)",
    )
    longbench.add_argument("--limit", type=count, default=None, help="first N samples of each task")
    longbench.add_argument(
        "--fuzzy",
        choices=FUZZY,
        default="difflib",
        help="code similarity's fuzz.ratio: difflib (fuzzywuzzy as LongBench installs it) or "
        "rapidfuzz (fuzzywuzzy with python-Levenshtein)",
    )
    longbench.add_argument(
        "--chat",
        choices=["auto", "on", "off"],
        default="auto",
        help=f"chat template (never for {', '.join(NO_CHAT_TASKS)}); auto: for instruct / chat models "
        "(the duoattention protocol: off)",
    )
    longbench.add_argument(
        "--protocol",
        choices=PROTOCOLS,
        default="longbench",
        help="longbench: THUDM's LongBench; duoattention: DuoAttention's fork of it, as its paper ran it (no chat "
        "template, its max lengths, the last 50 prompt tokens decoded in every mode, duo's budget as its share of "
        "retrieval heads, its cuts of the predictions; docs/longbench.md)",
    )

    ruler = tasks.add_parser(
        "ruler", help="RULER's synthetic tasks (NIAH, variable tracking, word extraction, QA)", formatter_class=defaults
    )
    _common(ruler, "ruler", budgets=True)
    ruler.add_argument(
        "--lengths",
        type=count,
        nargs="+",
        default=list(RULER_LENGTHS),
        help="sequence lengths in the model's tokens (prompt + tokens to generate)",
    )
    ruler.add_argument("--samples", type=count, default=10, help="samples per task and length")
    ruler.add_argument("--tasks", nargs="+", default=None, help="RULER tasks (default: all; QA only with --qa-data)")
    ruler.add_argument("--seed", type=int, default=42, help="seed of every sample")
    ruler.add_argument(
        "--qa-data",
        default=None,
        metavar="DIR",
        help="folder with RULER's squad.json and hotpotqa.json for qa_1 / qa_2",
    )
    ruler.add_argument(
        "--haystack",
        default="paul_graham:evaluation",
        help="the essay haystack: 'paul_graham:evaluation' (held out) or a folder of .txt files",
    )
    ruler.add_argument(
        "--chat",
        choices=["auto", "on", "off"],
        default="auto",
        help="chat template around the task text; auto: for instruct / chat models",
    )

    merge = tasks.add_parser(
        "ruler-merge",
        help="one RULER table and figure from several runs' ruler.json (a grid run in pieces)",
        formatter_class=defaults,
    )
    merge.add_argument("files", nargs="+", metavar="RULER_JSON", help="ruler.json files of runs with the same settings")
    merge.add_argument(
        "--out", default="results/ruler_merged", help="folder for ruler.md, ruler.json, ruler_budget.png"
    )

    args = parser.parse_args(argv)
    if args.task == "ruler-merge":
        return args
    if getattr(args, "limit", None) is not None and args.limit < 1:
        parser.error(f"--limit must be at least 1, got {args.limit}")
    # the library's own checks, before the model loads
    budgets = args.kv_budget if isinstance(args.kv_budget, list) else [args.kv_budget]
    checks = [("--kv-budget", functools.partial(check_kv_budgets, budgets))]
    checks.append(("--decode-last", functools.partial(check_decode_last, getattr(args, "decode_last", None) or 0)))
    if getattr(args, "duo_budget", None) is not None:
        checks.append(("--duo-budget", functools.partial(check_duo_budget, args.duo_budget, budgets)))
    if getattr(args, "max_length", None) is not None:
        checks.append(("--max-length", functools.partial(check_max_length, args.max_length)))
    checks.append(("--kv-dtype", functools.partial(check_kv_dtype_modes, args.modes, args.kv_dtype)))
    # Every value checked here, whichever modes use it: a bad one failed after a whole mode ran, or was ignored
    checks.append(("--sparsity", functools.partial(check_number, "sparsity", args.sparsity, minimum=0, maximum=1)))
    checks.append(("--sink", functools.partial(check_number, "sink", args.sink, integer=True, minimum=0)))
    checks.append(("--recent", functools.partial(check_number, "recent", args.recent, integer=True, minimum=1)))
    if args.streaming_chunk is not None:
        checks.append(
            ("--streaming-chunk", functools.partial(check_number, "streaming_chunk", args.streaming_chunk, minimum=1))
        )
    if args.task == "passkey":
        checks.append(("--seed / --digits", functools.partial(check_passkey_options, args.seed, args.digits)))
    for flag, check in checks:
        try:
            check()
        except DuoJaxError as e:
            parser.error(f"{flag}: {e}")
    if args.pattern != "default" and not Path(args.pattern).exists():
        parser.error(
            f"--pattern: {args.pattern} does not exist (a folder with full_attention_heads.tsv, the file, or 'default')"
        )
    if args.task == "perplexity" and args.prefix is not None and not 1 <= args.prefix < args.length:
        parser.error(f"--prefix must lie in [1, --length) = [1, {args.length}), got {args.prefix}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.task == "ruler-merge":
        return merge_ruler(args.files, args.out)

    import jax
    import jax.numpy as jnp

    import duo_jax
    from duo_jax import methods
    from duo_jax.eval import report
    from duo_jax.eval.niah import accuracy_table, run_niah
    from duo_jax.eval.passkey import run_passkey
    from duo_jax.eval.perplexity import perplexity_table, run_perplexity
    from duo_jax.eval.samples import Settings
    from duo_jax.methods.headkv import resolve_scores
    from duo_jax.pattern import resolve_pattern

    dtype = args.dtype if args.dtype != "auto" else ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    start = time.perf_counter()
    try:
        check_output_folder(args.out)  # before the runs, which write there only at their end
        model = duo_jax.load(args.model, dtype=jnp.dtype(dtype))
        specs = [methods.entry(m) for m in args.modes if m in methods.METHODS]
        needs_pattern = any(spec.takes_pattern for spec in specs)
        pattern = resolve_pattern(args.pattern, model.config) if needs_pattern else None
        scores = resolve_scores(args.scores, model.config) if any("scores" in s.options for s in specs) else None
        common = dict(
            pattern=pattern,
            scores=scores,
            kv_budget=args.kv_budget,
            kv_dtype=args.kv_dtype,
            streaming_chunk=args.streaming_chunk,
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
            chunk_size=args.chunk_size,
            out_dir=args.out,
        )
        settings = Settings(
            pattern=pattern,
            scores=scores,
            sparsity=args.sparsity,
            sink=args.sink,
            recent=args.recent,
            chunk_size=args.chunk_size,
            kv_dtype=args.kv_dtype,
            streaming_chunk=args.streaming_chunk,
            compile_ahead=getattr(args, "compile_ahead", 1),
            duo_budget=getattr(args, "duo_budget", None),
        )
        chat = {"auto": None, "on": True, "off": False}[getattr(args, "chat", "auto")]
        if args.task == "longbench":
            from duo_jax.eval.longbench import run_longbench, tables

            results = run_longbench(
                model,
                args.modes,
                data_dir=args.data,
                kv_budgets=args.kv_budget,
                settings=settings,
                tasks=args.tasks,
                longbench_e=args.longbench_e,
                max_length=args.max_length,
                limit=args.limit,
                chat=chat,
                out_dir=args.out,
                decode_last=args.decode_last,
                fuzzy=args.fuzzy,
                protocol=args.protocol,
            )
            table = tables(results)
        elif args.task == "ruler":
            from duo_jax.eval.ruler import run_ruler, tables

            results = run_ruler(
                model,
                args.modes,
                lengths=args.lengths,
                samples=args.samples,
                kv_budgets=args.kv_budget,
                settings=settings,
                tasks=args.tasks,
                seed=args.seed,
                qa_data=args.qa_data,
                chat=chat,
                haystack=args.haystack,
                out_dir=args.out,
                decode_last=args.decode_last or 0,
            )
            table = tables(results)
        elif args.task == "niah":
            results = run_niah(
                model,
                args.modes,
                lengths=args.lengths,
                depths=args.depths,
                haystack=args.haystack,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                protocol=args.protocol,
                decode_last=args.decode_last,
                **common,
            )
            table = accuracy_table(results, results["lengths"])
        elif args.task == "passkey":
            results = run_passkey(
                model,
                args.modes,
                lengths=args.lengths,
                depths_per_length=args.depths_per_length,
                digits=args.digits,
                seed=args.seed,
                max_new_tokens=args.max_new_tokens,
                batch_size=args.batch_size,
                **common,
            )
            table = accuracy_table(results, results["lengths"])
        else:
            results = run_perplexity(
                model,
                args.modes,
                source=args.source,
                length=args.length,
                samples=args.samples,
                edges=args.bucket_edges,
                prefix=args.prefix,
                **common,
            )
            table = perplexity_table(results)
    except (duo_jax.DuoJaxError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"\n{args.task} on {model.config.name} ({dtype}), {report.describe_machine(results['machine'])}:\n")
    print(table)
    print(f"\nwrote {', '.join(results['files'])}  [{time.perf_counter() - start:.0f} s]")
    return 0


def merge_ruler(files: list[str], out_dir: str) -> int:
    """`ruler-merge`: the runs of several ruler.json files as one table (`duo_jax.eval.ruler.merge_results`)."""
    from duo_jax.eval.ruler import merge_results, tables, write_outputs

    try:
        out = check_output_folder(out_dir)
        overwritten = [path for path in files if Path(path).resolve() == (out / "ruler.json").resolve()]
        if overwritten:  # the merged file holds no predictions: the part would be lost
            raise DuoJaxError(f"--out {out_dir} would write over {overwritten[0]}, a part: pass another folder")
        parts = []
        for path in files:
            parts.append((path, json.loads(read_user_text(path, DuoJaxError, "; ruler-merge reads ruler.json files"))))
        results = merge_results(parts)
    except (DuoJaxError, OSError, json.JSONDecodeError, KeyError) as e:
        what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        print(
            f"error: {what} (ruler-merge reads the ruler.json that `python -m duo_jax.eval ruler` writes)",
            file=sys.stderr,
        )
        return 2
    write_outputs(results, out_dir)
    print(tables(results))
    print(f"\nwrote {', '.join(results['files'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
