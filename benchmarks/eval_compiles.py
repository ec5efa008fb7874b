"""What compilation costs a per-sample evaluation (LongBench, RULER): prompts of varied lengths generated one at a
time through the evaluations' own loop (`duo_jax.eval.samples.generate_missing`), in every run (mode at a KV
budget), once per `--compile-ahead` setting, each in a fresh process (nothing compiled before it). Per run: how
many samples compiled new steps and how many executables (the engine's prefill and decode caches), the seconds
spent compiling and generating, and the run's wall time under each setting side by side.

    python benchmarks/eval_compiles.py                       # SmolLM2-135M fp32, 8 prompts of 600-2400 tokens
    python benchmarks/eval_compiles.py --modes full duo streaming snapkv --kv-budget default 0.25 0.5
    python benchmarks/eval_compiles.py --modes h2o tova snapkv pyramidkv headkv --kv-budget 0.5

The script reads only the loop's records and the engine's compile caches, so it also runs on older checkouts
that have those (the before / after comparison in BENCHMARKS.md; there `--compile-ahead 0` alone).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import common


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, "eval_compiles")
    common.add_model_args(p, peer=False)
    p.add_argument("--modes", nargs="+", default=["full", "duo", "streaming"], help="modes (as the evaluations')")
    p.add_argument(
        "--kv-budget",
        type=lambda text: None if text == "default" else float(text),
        nargs="+",
        default=[None, 0.5],
        help="fractions of each prompt or token counts (as the evaluations'), or 'default': duo's own budget",
    )
    p.add_argument("--samples", type=int, default=8, help="prompts, their lengths spread evenly over --lengths")
    p.add_argument("--lengths", type=int, nargs=2, default=[600, 2400], help="shortest and longest prompt tokens")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sample (LongBench's QA: 32)")
    p.add_argument(
        "--compile-ahead", type=int, nargs="+", default=[0, 1], help="settings compared (the first: the reference)"
    )
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    common.setup_threads(args)
    if args.worker is not None:
        print(json.dumps(measure(args, args.worker)))
        return 0

    argv = sys.argv[1:] if argv is None else list(argv)
    results = {}
    for ahead in args.compile_ahead:
        run = subprocess.run(
            [sys.executable, __file__, *argv, "--worker", str(ahead)], capture_output=True, text=True, env=os.environ
        )
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return 1
        results[ahead] = json.loads(run.stdout.strip().splitlines()[-1])
    reference, rows = results[args.compile_ahead[0]], []
    for name, records in reference["runs"].items():
        compile_s = sum(r["compile_s"] for r in records)
        work_s = sum(r["work_s"] for r in records)
        walls = [results[a]["wall_s"][name] for a in args.compile_ahead]
        rows.append(
            [
                name,
                sum(r["executables"] > 0 for r in records),
                sum(r["executables"] for r in records),
                round(compile_s, 1),
                round(work_s, 1),
                f"{compile_s / (compile_s + work_s):.0%}",
                *(round(w, 1) for w in walls),
                *(common.ratio(walls[0], w) for w in walls[1:]),
                f"{sum(r['reserved_cache_bytes'] for r in records) / sum(r['cache_bytes'] for r in records):.2f}",
            ]
        )
    first, others = args.compile_ahead[0], args.compile_ahead[1:]
    common.write_result(
        args.out,
        "eval_compiles",
        title=f"Per-sample evaluation: compilation over {args.samples} prompts of "
        f"{reference['lengths'][0]}-{reference['lengths'][-1]} tokens",
        headers=[
            "run",
            f"samples that compiled (of {args.samples})",
            "executables compiled",
            "compile s",
            "prefill + decode s",
            "compilation's share",
            *(f"wall s, compile-ahead {a}" for a in args.compile_ahead),
            *(f"speed-up, {a} vs {first}" for a in others),
            "reserved / kept cache bytes",
        ],
        rows=rows,
        data=dict(args={k: str(v) for k, v in vars(args).items()}, workers=results),
        notes=[
            f"model {args.model} ({args.dtype}), {args.new_tokens} new tokens, chunk {args.chunk_size}, "
            f"duo sparsity {args.sparsity}, sink {args.sink}, recent {args.recent}; the compile and generation "
            f"columns from the compile-ahead {first} process (with compile-ahead they overlap)"
        ],
    )
    return 0


def measure(args, ahead: int) -> dict:
    """One process's measurement: every run through `generate_missing` with `compile_ahead=ahead`; per sample the
    executables compiled since the previous sample finished, its record's compile / prefill / decode seconds and
    cache bytes; per run the wall time from the previous run's last sample to its own last."""
    import numpy as np

    from duo_jax import engine
    from duo_jax.eval import samples
    from duo_jax.methods.headkv import resolve_scores

    model, pattern = common.load(args)
    headkv = any(m in ("headkv", "duo_headkv") for m in args.modes)  # the model's shipped HeadKV scores
    settings = samples.Settings(
        pattern=pattern,
        scores=resolve_scores("default", model.config) if headkv else None,
        sparsity=args.sparsity,
        sink=args.sink,
        recent=args.recent,
        chunk_size=args.chunk_size,
    )
    if hasattr(settings, "compile_ahead"):  # an older checkout's loop has no such setting: it compiles nothing ahead
        settings.compile_ahead = ahead
    elif ahead:
        raise SystemExit("this checkout's evaluations cannot compile ahead: pass --compile-ahead 0")
    longest = common.text_prompt(model, args.lengths[1])
    lengths = np.linspace(*args.lengths, args.samples).round().astype(int).tolist()
    group = [samples.Sample(str(i), longest[:n], args.new_tokens) for i, n in enumerate(lengths)]
    runs = samples.make_runs(args.modes, args.kv_budget)

    dropped = dict(misses=0, last=0)  # near the host's memory-mapping limit the engine drops its executables

    def compiled() -> int:
        misses = sum(f.cache_info().misses for f in (engine._compiled_extend, engine._compiled_decode))
        if misses < dropped["last"]:  # the caches were cleared (their counts with them) since the last sample
            dropped["misses"] += dropped["last"]
        dropped["last"] = misses
        return dropped["misses"] + misses

    # The loop's score callback sees each finished sample's record; its fingerprint names the run.
    run_of = {
        samples.sample_fingerprint(model, run, s.prompt_ids, s.max_new_tokens, settings): run.name
        for run in runs
        for s in group
    }
    records = {run.name: [] for run in runs}
    last = dict(compiled=compiled(), time=time.perf_counter())
    wall = {}

    def note(key, record) -> float:
        name, now, count = run_of[record["fingerprint"]], time.perf_counter(), compiled()
        records[name].append(
            dict(
                prompt_tokens=record["prompt_tokens"],
                executables=count - last["compiled"],
                compile_s=record["compile_s"],
                work_s=record["prefill_s"] + record["decode_s"],
                cache_bytes=record["cache_bytes"],
                reserved_cache_bytes=record.get("reserved_cache_bytes", record["cache_bytes"]),
            )
        )
        wall[name] = wall.get(name, 0.0) + now - last["time"]
        last.update(compiled=count, time=now)
        return 0.0

    with tempfile.TemporaryDirectory() as out:
        samples.generate_missing(
            model,
            runs,
            {"task": group},
            settings,
            file=lambda run, key: os.path.join(out, run.name, f"{key}.jsonl"),
            score=note,
            desc=f"compile-ahead {ahead}",
            progress=False,
        )
    return dict(lengths=lengths, runs=records, wall_s=wall)


if __name__ == "__main__":
    sys.exit(common.run(main))
