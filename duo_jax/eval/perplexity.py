"""Perplexity on long text per position bucket, compared across attention modes in one run.

`evaluate_perplexity` cuts the text of a haystack source into `samples` windows of `length` tokens and
teacher-forces them through the engine as generation prefills a prompt (`Engine.prefill`, chunks of `chunk_size`,
the mode's cache carried from chunk to chunk); with `prefix` P the first P tokens are the prompt and the rest is
decoded one token per step after the method compresses the prompt. The negative log-likelihood is averaged per
position bucket (`bucket_edges`, `bucket_stats`); a bucket's perplexity is exp(mean NLL). Design:
docs/evaluation.md, "Perplexity".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.cache import full_cache_bytes
from duo_jax.data.haystack import EVALUATION_HAYSTACK, haystack_tokens
from duo_jax.engine import Engine
from duo_jax.errors import DuoJaxError
from duo_jax.eval import report
from duo_jax.eval.modes import (
    ModeSettings,
    budget_tokens,
    check_kv_dtype_modes,
    check_modes,
    mode_settings,
    warn_if_calibrated_on,
)
from duo_jax.eval.niah import bos_id
from duo_jax.loading import Model
from duo_jax.methods.base import cache_nbytes
from duo_jax.pattern import Pattern


def bucket_edges(length: int, first: int = 512) -> list[int]:
    """[0, first, 2*first, 4*first, ..., length]: doubling buckets, the last one cut at `length`."""
    edges, edge = [0], first
    while edge < length:
        edges.append(edge)
        edge *= 2
    return edges + [length]


@jax.jit
def token_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target]: logits float32 [B, T, V], targets int32 [B, T] -> [B, T]."""
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0]


def engine_nll(
    model: Model, tokens: np.ndarray, settings: ModeSettings, *, chunk_size: int, prefix: int | None = None
) -> tuple[np.ndarray, int]:
    """NLL of every token but the first: tokens int [B, T] -> float64 [B, T - 1] (entry t is token t + 1),
    teacher-forced through the engine with the KV-cache method of `settings`: the first `prefix` tokens
    (default: all) in prefill chunks (`Engine.prefill`, every chunk's logits), the rest one decode step per
    token (docs/evaluation.md, "Perplexity"). Also returns the bytes of the cache it filled (all B sequences)."""
    B, T = tokens.shape
    P = T if prefix is None else prefix
    if not 1 <= P <= T:
        raise DuoJaxError(f"prefix must lie in [1, {T}] (the window length), got {P}")
    engine = Engine.of(model)
    method = settings.build(model.config, context=T, model=model)
    chunk = P if settings.one_chunk_prefill else min(chunk_size, P)
    targets = np.zeros((B, max(-(-P // chunk) * chunk, T) + 1), np.int32)  # targets[:, p]: token p + 1
    targets[:, : T - 1] = tokens[:, 1:]
    nll = []

    def score(logits, start, n_valid):
        piece = np.asarray(token_nll(logits, jnp.asarray(targets[:, start : start + logits.shape[1]])))
        nll.append(piece[:, : int(n_valid[0])])

    _, cache, lengths = engine.prefill(method, tokens[:, :P], np.full((B,), P), chunk=chunk, on_chunk=score)
    if P < T:
        method, cache = method.after_prefill(cache, lengths)
        for position in range(P, T):
            logits, cache, lengths = engine.step(method, cache, lengths, jnp.asarray(tokens[:, position]))
            nll.append(np.asarray(token_nll(logits[:, None], jnp.asarray(targets[:, position : position + 1]))))
    return np.concatenate(nll, axis=1)[:, : T - 1].astype(np.float64), cache_nbytes(cache)


def bucket_stats(nll: np.ndarray, edges: Sequence[int]) -> list[dict]:
    """Per bucket [a, b) of predicted-token positions: tokens, mean NLL and perplexity. nll [B, T - 1]
    (entry t is token t + 1, so position 0, which nothing predicts, is never counted)."""
    positions = np.arange(1, nll.shape[1] + 1)
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        values = nll[:, (positions >= a) & (positions < b)]
        mean = float(values.mean()) if values.size else float("nan")
        out.append(dict(start=int(a), end=int(b), tokens=int(values.size), nll=mean, ppl=float(np.exp(mean))))
    return out


def text_windows(model: Model, source: str, length: int, samples: int) -> np.ndarray:
    """`samples` consecutive windows of `length` tokens of `source` (BOS first when the tokenizer adds one)."""
    if model.tokenizer is None:
        raise DuoJaxError("perplexity on text needs the model's tokenizer (none was found with the weights)")
    bos = bos_id(model.tokenizer)
    body = length - (bos is not None)
    ids = np.asarray(haystack_tokens(model.tokenizer, source, body * samples), np.int32).reshape(samples, body)
    if bos is not None:
        ids = np.concatenate([np.full((samples, 1), bos, np.int32), ids], axis=1)
    return ids


def evaluate_perplexity(
    model: Model,
    tokens: np.ndarray,
    modes: Sequence[str],
    *,
    pattern: Pattern | None,
    sparsity: float = 0.5,
    sink: int = 64,
    recent: int = 256,
    chunk_size: int = 512,
    edges: Sequence[int] | None = None,
    prefix: int | None = None,
    kv_budget: float | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    progress: bool = True,
) -> dict:
    """Per-bucket NLL / perplexity of token windows [B, T] in every mode: {"modes": {mode: {...}}}.
    prefix: prompt tokens (the rest is decoded; None: all prompt); kv_budget: a fraction of T or a number of
    tokens kept per KV head by every mode but full (`duo_jax.eval.modes.budget_tokens`; None: duo's budget);
    `scores`: HeadKV scores for headkv / duo_headkv;
    kv_dtype: "int8" / "int4" quantizes every mode's KV cache (None: the model's dtype); streaming_chunk: the duo
    modes' (`duo_jax.eval.modes.mode_settings`)."""
    from tqdm.auto import tqdm

    modes = check_modes(modes)
    check_kv_dtype_modes(modes, kv_dtype)  # before any mode runs
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise DuoJaxError(f"need token windows [samples, length >= 2], got shape {tokens.shape}")
    T = tokens.shape[1]
    edges = list(edges) if edges is not None else bucket_edges(T)
    if edges[0] != 0 or edges[-1] != T or any(a >= b for a, b in zip(edges[:-1], edges[1:])):
        raise DuoJaxError(f"bucket edges must rise strictly from 0 to the window length {T}, got {edges}")
    results = {}
    for mode in tqdm(modes, desc="perplexity", unit="mode", disable=not progress):
        settings = mode_settings(
            mode,
            model.config,
            pattern,
            sparsity=sparsity,
            sink=sink,
            recent=recent,
            context=T,
            kv_budget=budget_tokens(kv_budget, T),
            scores=scores,
            kv_dtype=kv_dtype,
            streaming_chunk=streaming_chunk,
        )
        start = time.perf_counter()
        nll, cache_bytes = engine_nll(model, tokens, settings, chunk_size=chunk_size, prefix=prefix)
        if prefix is not None and prefix < T:
            decoded = float(nll[:, prefix - 1 :].mean())  # entry t is token t + 1: tokens prefix .. T - 1
            extra = dict(decoded_nll=decoded, decoded_ppl=float(np.exp(decoded)))
        else:
            extra = {}
        mean = float(nll.mean())
        results[mode] = dict(
            settings=settings.describe(),
            nll=mean,
            ppl=float(np.exp(mean)),
            buckets=bucket_stats(nll, edges),
            cache_bytes=cache_bytes // tokens.shape[0],  # per sequence
            full_cache_bytes=full_cache_bytes(model.config, 1, T, model.params.dtype.itemsize),
            seconds=time.perf_counter() - start,
            **extra,
        )
    return dict(edges=edges, modes=results)


def perplexity_table(results: dict) -> str:
    """Markdown: one row per mode, perplexity per bucket, overall, over the decoded tokens (with a prefix), and
    the KV cache per sequence."""
    edges = results["edges"]
    decoded = all("decoded_ppl" in r for r in results["modes"].values())
    headers = ["mode", *[f"[{_k(a)}, {_k(b)})" for a, b in zip(edges[:-1], edges[1:])], "all"]
    headers += ["decoded tokens"] if decoded else []
    headers += ["KV cache", "of full"]
    rows = [
        [
            mode,
            *[b["ppl"] for b in r["buckets"]],
            r["ppl"],
            *([r["decoded_ppl"]] if decoded else []),
            report.human_bytes(r["cache_bytes"]),
            f"{r['cache_bytes'] / r['full_cache_bytes']:.1%}",
        ]
        for mode, r in results["modes"].items()
    ]
    return report.markdown_table(headers, rows)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def run_perplexity(
    model: Model,
    modes: Sequence[str],
    *,
    pattern: Pattern | None,
    source: str = EVALUATION_HAYSTACK,
    length: int = 4096,
    samples: int = 2,
    sparsity: float = 0.5,
    sink: int = 64,
    recent: int = 256,
    chunk_size: int = 512,
    edges: Sequence[int] | None = None,
    prefix: int | None = None,
    kv_budget: float | None = None,
    scores: Pattern | None = None,
    kv_dtype: str | None = None,
    streaming_chunk: int | None = None,
    out_dir: str | Path | None = None,
    progress: bool = True,
) -> dict:
    """Perplexity of `samples` windows of `length` tokens of `source`; writes perplexity.json and
    perplexity.png (perplexity per bucket, one line per mode) into `out_dir` when given. kv_dtype: "int8" /
    "int4" quantizes every mode's KV cache (None: the model's dtype); streaming_chunk: the duo modes'."""
    if length > model.config.max_position_embeddings:
        raise DuoJaxError(f"length {length} exceeds the model's context of {model.config.max_position_embeddings}")
    if samples < 1:
        raise DuoJaxError(f"samples must be >= 1, got {samples}")
    start = time.perf_counter()
    overlap = warn_if_calibrated_on(source, check_modes(modes), pattern, scores)
    tokens = text_windows(model, source, length, samples)
    results = evaluate_perplexity(
        model,
        tokens,
        modes,
        pattern=pattern,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        chunk_size=chunk_size,
        edges=edges,
        prefix=prefix,
        kv_budget=kv_budget,
        scores=scores,
        kv_dtype=kv_dtype,
        streaming_chunk=streaming_chunk,
        progress=progress,
    )
    results = dict(
        task="perplexity",
        model=model.config.name,
        source_text=source,
        calibration_overlap=overlap,
        length=length,
        samples=samples,
        sparsity=sparsity,
        sink=sink,
        recent=recent,
        chunk_size=chunk_size,
        prefix=prefix,
        kv_budget=kv_budget,
        kv_dtype=kv_dtype,
        streaming_chunk=streaming_chunk,
        dtype=str(model.params.dtype),
        wall_s=time.perf_counter() - start,
        machine=report.machine_info(),
        **results,
    )
    if out_dir is not None:
        out_dir = Path(out_dir)
        mids = [(b["start"] + b["end"]) / 2 for b in next(iter(results["modes"].values()))["buckets"]]
        plot = report.line_plot(
            out_dir / "perplexity.png",
            mids,
            {m: [b["ppl"] for b in r["buckets"]] for m, r in results["modes"].items()},
            xlabel="token position (bucket middle)",
            ylabel="perplexity",
            logx=True,
            title=f"{model.config.name} on {source}, {samples} x {length} tokens",
        )
        results["files"] = [str(plot), str(out_dir / "perplexity.json")]
        report.write_json(out_dir / "perplexity.json", results)
    return results
