"""What the benchmarks share: arguments, the model and its modes, timing of our `generate` and of the Hugging
Face transformers peer, and writing a result (printed table, JSON, PNG).

Timing conventions (the same on both sides):
- TTFT (time to first token): the prompt's prefill plus picking the first new token. Ours: `generate`'s loop
  (`time_ours`; compilation is reported apart, in ``compile_s``). The peer: from `model.generate`'s call to
  its first new token, read with a streamer that timestamps every token.
- Decode: the median time per new token after the first (each step timed on its own; the median shrugs off
  bursts from other jobs on a shared machine; the mean is kept in the JSON), greedy, all N tokens always
  generated (ours: no EOS check; the peer: ``min_new_tokens=N``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

PEER = "hf"  # the Hugging Face transformers (PyTorch) column's name


# --- arguments -------------------------------------------------------------------------------------------


def parser(doc: str, name: str) -> argparse.ArgumentParser:
    """A parser whose description is the module docstring, with --out (default results/benchmarks/<name>)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=_Formatter)
    p.add_argument(
        "--out",
        type=output_folder,
        default=REPO / "results" / "benchmarks" / name,
        help="folder for <name>.json and <name>.png",
    )
    return p


def output_folder(text: str) -> pathlib.Path:
    """--out, checked as the command line is parsed: a benchmark writes its results at its end, so a path it
    cannot write would cost the run (`duo_jax.errors.check_output_folder`)."""
    from duo_jax.errors import DuoJaxError, check_output_folder

    try:
        return check_output_folder(text)
    except DuoJaxError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    pass


def add_model_args(
    p: argparse.ArgumentParser, *, peer: bool = True, duo: bool = True, single_thread: bool = True
) -> None:
    """--model / --chunk-size / --dtype, with duo's --pattern / --sparsity / --sink / --recent (for a benchmark
    that runs duo), --no-peer (one whose peer is optional) and --single-thread (one not always on one thread)."""
    p.add_argument("--model", default="smollm2-135m", help="config name (see configs/), HF directory or .gguf")
    if duo:
        p.add_argument(
            "--pattern",
            default="default",
            help="head pattern of duo: a folder / full_attention_heads.tsv, or 'default' (the model's own)",
        )
        p.add_argument("--sparsity", type=float, default=0.5, help="duo: fraction of streaming heads")
        p.add_argument("--sink", type=int, default=64, help="duo: attention-sink tokens of a streaming head")
        p.add_argument("--recent", type=int, default=256, help="duo: recent tokens of a streaming head")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=256,
        help="prompt tokens per prefill step (on CPU 256 beat 128 and 512 for SmolLM2)",
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="ours and the peer's weights and cache (fp32: CPU has no fast bf16 matmuls)",
    )
    if peer:
        p.add_argument("--no-peer", action="store_true", help="skip the Hugging Face transformers peer")
    if single_thread:
        p.add_argument(
            "--single-thread",
            action="store_true",
            help="one CPU thread on both sides (XLA without its Eigen thread pool, torch.set_num_threads(1)): "
            "steadier numbers on a machine shared with other jobs; default: each library's own",
        )


def setup_threads(args: argparse.Namespace) -> None:
    """Apply --single-thread. Must run before JAX first initialises (XLA reads its flags once)."""
    if getattr(args, "single_thread", False):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false").strip()


def load(args: argparse.Namespace):
    """(model, duo's resolved Pattern) from the parsed model arguments."""
    import jax.numpy as jnp

    import duo_jax
    from duo_jax.pattern import resolve_pattern

    model = duo_jax.load(args.model, dtype=jnp.dtype(args.dtype))
    pattern = resolve_pattern(args.pattern, model.config)
    return model, pattern


def mode(name: str, model, pattern, args: argparse.Namespace, context: int, kv_dtype: str | None = None):
    """`duo_jax.eval.modes.ModeSettings` of mode `name` ("full" or "duo") at `context` tokens (its KV cache
    quantized with `kv_dtype` "int8" / "int4")."""
    from duo_jax.eval.modes import mode_settings

    return mode_settings(
        name,
        model.config,
        pattern,
        sparsity=args.sparsity,
        sink=args.sink,
        recent=args.recent,
        context=context,
        kv_dtype=kv_dtype,
    )


def text_prompt(model, length: int) -> list[int]:
    """`length` tokens of real prose (the evaluation half of the Paul Graham essays), BOS first when the
    tokenizer adds one."""
    from duo_jax.data.haystack import EVALUATION_HAYSTACK, haystack_tokens
    from duo_jax.eval.niah import bos_id

    bos = bos_id(model.tokenizer)
    ids = haystack_tokens(model.tokenizer, EVALUATION_HAYSTACK, length - (bos is not None))
    return ([bos] if bos is not None else []) + ids


# --- timing ----------------------------------------------------------------------------------------------


def run_generate(model, ids: Sequence[int], settings, *, new_tokens: int, chunk_size: int, context: int | None = None):
    """One greedy `duo_jax.generate` of `new_tokens` tokens with a cache of `context` tokens (default: just
    enough); its `Generation` (stats: cache_bytes, the sum of the cache arrays' nbytes, prefill_s, ...)."""
    from duo_jax import generate

    return generate(
        model,
        [list(ids)],
        max_new_tokens=new_tokens,
        chunk_size=chunk_size,
        stop_at_eos=False,
        context=context or len(ids) + new_tokens,
        **settings.generate_kwargs(),
    )


def time_ours(model, ids: Sequence[int], settings, *, new_tokens: int, chunk_size: int) -> dict:
    """`duo_jax.generate`'s work for one prompt with every step timed on its own: the model's engine runs the
    prefill (`Engine.prefill`, generate's chunk bucket), then greedy single-token steps (`Engine.step`) timed
    one by one, each ending with the token on the host (generate runs these steps in one device loop,
    `Engine.decode_loop`; a per-step median needs them apart). Returns ttft_s, decode_ms (median per new token
    after the first; robust to bursts from other jobs), decode_ms_mean, tokens_per_s, compile_s, cache_bytes
    and the generated tokens."""
    import jax.numpy as jnp

    from duo_jax.engine import Engine, bucket, compiled_extend
    from duo_jax.methods import cache_nbytes

    engine = Engine.of(model)
    method = settings.build(model.config, len(ids) + new_tokens, model=model)
    chunk = min(chunk_size, bucket(len(ids)))
    start = time.perf_counter()
    for n in (chunk, 1):  # compile generate's prefill and the single-token step outside the timings
        compiled_extend(model.config, method, 1, n, engine.dtype, **engine.weight_layout)
    compile_s = time.perf_counter() - start

    start = time.perf_counter()
    logits, cache, lengths = engine.prefill(method, np.asarray([ids], np.int32), np.asarray([len(ids)]), chunk=chunk)
    token = np.asarray(jnp.argmax(logits, axis=-1))
    ttft_s = time.perf_counter() - start
    steps, tokens = [], [int(token[0])]
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        logits, cache, lengths = engine.step(method, cache, lengths, jnp.asarray(token, jnp.int32))
        token = np.asarray(jnp.argmax(logits, axis=-1))
        steps.append(time.perf_counter() - start)
        tokens.append(int(token[0]))
    decode_ms = 1e3 * float(np.median(steps)) if steps else float("nan")
    return dict(
        ttft_s=ttft_s,
        decode_ms=decode_ms,
        decode_ms_mean=1e3 * float(np.mean(steps)) if steps else float("nan"),
        tokens_per_s=_per_s(decode_ms),
        compile_s=compile_s,
        cache_bytes=cache_nbytes(cache),
        tokens=tokens,
    )


class Peer:
    """The same weights in Hugging Face transformers (PyTorch, SDPA attention, dynamic cache), loaded from the
    same file as ours: `from_pretrained(dir, gguf_file=name)` for a GGUF, `from_pretrained(dir)` otherwise."""

    def __init__(self, model, dtype: str, *, single_thread: bool = False):
        import torch
        import transformers

        source = pathlib.Path(model.source)
        kwargs = dict(dtype=getattr(torch, dtype))
        if source.suffix == ".gguf":
            source, kwargs["gguf_file"] = source.parent, source.name
        if single_thread:
            torch.set_num_threads(1)
        self.torch = torch
        self.model = transformers.AutoModelForCausalLM.from_pretrained(source, **kwargs).eval()
        self.attention = self.model.config._attn_implementation
        self.time(list(range(1, 65)), new_tokens=4)  # warm-up: first-call allocations and kernel selection

    def time(self, ids: Sequence[int], *, new_tokens: int) -> dict:
        """One greedy `model.generate` of `new_tokens` tokens: ttft_s, decode_ms (median per new token after the
        first), decode_ms_mean, tokens_per_s."""
        from transformers.generation.streamers import BaseStreamer

        class Clock(BaseStreamer):  # generate() puts the prompt first, then each new token as it is picked
            def __init__(self):
                self.times = []

            def put(self, value):
                self.times.append(time.perf_counter())

            def end(self):
                pass

        clock = Clock()
        with self.torch.inference_mode():
            start = time.perf_counter()
            self.model.generate(
                self.torch.tensor([list(ids)]),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                streamer=clock,
                pad_token_id=0,
            )
        token_times = np.asarray(clock.times[1:])  # one per new token
        steps = np.diff(token_times)
        decode_ms = 1e3 * float(np.median(steps)) if len(steps) else float("nan")
        return dict(
            ttft_s=token_times[0] - start,
            decode_ms=decode_ms,
            decode_ms_mean=1e3 * float(np.mean(steps)) if len(steps) else float("nan"),
            tokens_per_s=_per_s(decode_ms),
        )


def _per_s(ms: float) -> float:
    return 1e3 / ms if np.isfinite(ms) and ms > 0 else float("nan")


# --- results ---------------------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float:
    """a / b, NaN when either is missing."""
    if a is None or b is None or not np.isfinite(a) or not np.isfinite(b) or b == 0:
        return float("nan")
    return a / b


def triton_disabled() -> bool:
    """Whether DUO_JAX_DISABLE_TRITON runs this process as a GPU without Pallas's Triton backend."""
    from pallas_kernels import _backend

    return _backend.triton_disabled()


def attention_label(impl: str) -> str:
    """The attention implementation a benchmark ran, as its tables name it."""
    return impl + (" without Triton" if triton_disabled() else "")


def write_result(
    out_dir: pathlib.Path,
    name: str,
    *,
    title: str,
    headers: Sequence[str],
    rows: Sequence[Sequence[Any]],
    data: dict,
    plot: Callable[[pathlib.Path], Any] | None = None,
    notes: Sequence[str] = (),
) -> dict:
    """Print `title`, the machine, the table and `notes`; write <name>.json (table, data, machine, command)
    and, with `plot(path)`, <name>.png. Returns the JSON's content."""
    from duo_jax.eval import report

    out_dir = pathlib.Path(out_dir)
    machine = report.machine_info()
    table = report.markdown_table(headers, rows)
    print(f"\n{title}\n{report.describe_machine(machine)}\n\n{table}")
    for note in notes:
        print(note)
    files = []
    if plot is not None:
        files.append(plot(out_dir / f"{name}.png"))
    files.append(out_dir / f"{name}.json")
    result = dict(
        benchmark=name,
        title=title,
        command=" ".join(["DUO_JAX_DISABLE_TRITON=1"] * triton_disabled() + ["python"] + sys.argv),
        machine=machine,
        table=dict(headers=list(headers), rows=[list(r) for r in rows]),
        notes=list(notes),
        files=[str(f) for f in files],
        **data,
    )
    report.write_json(files[-1], result)
    print(f"\nwrote {', '.join(str(f) for f in files)}")
    return result


def run_workers(
    script: str, meshes: Sequence[str], axes: tuple[str, ...], worker_args: Sequence[str]
) -> list[dict] | None:
    """The mesh specs (`duo_jax.sharding.parse_mesh` over `axes`) grouped by their device count n, each group
    run as `script --worker *worker_args --meshes ...` in a process with n host CPU devices; the JSON lines they
    print, or None (after printing the failing worker's stderr)."""
    import math
    import subprocess

    from duo_jax import sharding

    by_devices: dict[int, list[str]] = {}
    for spec in meshes:
        by_devices.setdefault(math.prod(sharding.parse_mesh(spec, axes).values()), []).append(spec)
    results = []
    for n, specs in sorted(by_devices.items()):
        env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
        run = subprocess.run(
            [sys.executable, script, "--worker", *worker_args, "--meshes", *specs],
            env=env,
            capture_output=True,
            text=True,
        )
        if run.returncode:
            print(run.stderr[-3000:], file=sys.stderr)
            return None
        results += [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return results


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a benchmark's main: a DuoJaxError or OSError is `error: ...` on one line to stderr, exit 2.
    (duo_jax is imported only when needed: XLA's thread flags must be set before JAX loads.)"""
    try:
        return main(argv)
    except Exception as e:
        from duo_jax.errors import DuoJaxError

        if not isinstance(e, (DuoJaxError, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
