"""Shared test helpers: tiny model configs and random Hugging Face checkpoints written to disk."""

import dataclasses
import gc
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The tests' shapes are tiny, so their time is mostly XLA:CPU compiling, and most of that is LLVM's optimisation
# passes, which the tests do not need (docs/setup.md, below the make targets). Their subprocesses: `xla_flags`.
TEST_XLA_FLAGS = "--xla_backend_optimization_level=0"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from duo_jax.config import ModelConfig  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def xla_flags(*flags: str) -> str:
    """XLA_FLAGS for a test's subprocess: `flags` and the tests' own (TEST_XLA_FLAGS)."""
    return " ".join((*flags, TEST_XLA_FLAGS))


@pytest.fixture(scope="module", autouse=True)
def _release_executables():
    """Drop every compiled executable after each test module. XLA:CPU maps each executable's code into memory,
    and the whole suite in one process compiles enough of them to pass Linux's default limit of 65,530
    mappings per process (`vm.max_map_count`): the compiler then segfaults mid-suite. Two modules hold ~10k
    mappings; cleared, a process goes back to ~600."""
    yield
    from duo_jax import engine, training

    engine.clear_compiled()
    training._train_step.cache_clear()
    gc.collect()


@pytest.fixture(autouse=True)
def _forget_cudnn_probes():
    """Forget the cuDNN probes' outcomes after each test: a test that stands a patched call in for cuDNN (and
    `unavailable` passing) may run a probe that depends on it, whose cached outcome must not reach other tests."""
    yield
    from duo_jax.attention import cudnn

    probes = (cudnn.unavailable, cudnn.paged_unavailable, cudnn.gradient_unavailable, cudnn.lambda_unavailable)
    for probe in (*probes, cudnn.window_unavailable, cudnn.partial_unavailable):
        probe.cache_clear()


def tiny_config(**overrides) -> ModelConfig:
    """2 layers, hidden 64, GQA 4 query / 2 KV heads: small enough to compile in seconds."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=512,
        name="tiny",
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture
def tiny():
    return tiny_config()


def rel_err(x, ref) -> float:
    """max |x - ref| / max |ref|."""
    return float(jnp.max(jnp.abs(x - ref)) / jnp.max(jnp.abs(ref)))


def random_attention_inputs(batch, seq_q, seq_k, num_heads, num_kv_heads, head_dim, seed=0):
    """Random fp32 q [B, T, Hq, D], k / v [B, S, Hkv, D] and an output cotangent like q."""
    kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(kq, (batch, seq_q, num_heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    return q, k, v, jax.random.normal(kc, q.shape, jnp.float32)


def random_decode_inputs(batch, seq_k, num_heads, num_kv_heads, head_dim, seed=0):
    """Random fp32 decode inputs: one query per sequence q [B, Hq, D], a cache k / v [B, S, Hkv, D]."""
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (batch, num_heads, head_dim), jnp.float32)
    k = jax.random.normal(kk, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    v = jax.random.normal(kv, (batch, seq_k, num_kv_heads, head_dim), jnp.float32)
    return q, k, v


def run_method(params, config, method, prompt, *, chunk, decode_steps, impl="auto", force=None):
    """One prompt through the engine with a KV-cache method: chunked prefill (`Engine.prefill`, every chunk's
    logits), then greedy decoding one `Engine.step` at a time (or, with `force`, decoding that feeds force[i]
    at step i: teacher forcing, to compare logits of two caches).

    Returns (tokens of the whole sequence, logits [len(sequence), V] at every position, the chunks as
    (start, end) spans (a decode step is a chunk of one), the final cache).
    """
    from duo_jax.engine import Engine

    engine = Engine(params, config)
    logits = []
    keep = lambda out, start, n_valid: logits.extend(np.asarray(out[0, : n_valid[0]]))  # noqa: E731
    _, cache, lengths = engine.prefill(
        method, np.asarray([prompt], np.int32), np.asarray([len(prompt)]), chunk=chunk, impl=impl, on_chunk=keep
    )
    method, cache = method.after_prefill(cache, lengths)
    sequence = list(prompt)
    for _ in range(decode_steps):
        sequence.append(int(np.argmax(logits[-1])) if force is None else int(force[len(sequence) - len(prompt)]))
        out, cache, lengths = engine.step(method, cache, lengths, jnp.asarray([sequence[-1]]), impl=impl)
        logits.append(np.asarray(out[0]))
    assert int(lengths[0]) == len(sequence)
    chunks = [(s, min(s + chunk, len(prompt))) for s in range(0, len(prompt), chunk)]
    chunks += [(i, i + 1) for i in range(len(prompt), len(sequence))]
    return sequence, np.stack(logits), chunks, cache


class BPETokenizer:
    """A real byte-level BPE tokenizer (vocab 2000) trained in memory on the start of the essays."""

    def __init__(self):
        from tokenizers import ByteLevelBPETokenizer

        from duo_jax.data import load_haystack

        self.backend = ByteLevelBPETokenizer()
        self.backend.train_from_iterator([load_haystack(max_chars=200_000)], vocab_size=2000, show_progress=False)

    def encode(self, text):
        return self.backend.encode(text).ids

    def decode(self, ids):
        return self.backend.decode([int(i) for i in ids])


@pytest.fixture(scope="session")
def tokenizer():
    """Token lengths like a real model's, without loading one."""
    return BPETokenizer()


@dataclasses.dataclass
class FakeDevice:
    """A device whose allocator reports `limit` bytes, `in_use` of them taken (as a GPU's or TPU's does): what
    `duo_jax.device_memory` reads, on a CPU that reports none."""

    limit: int
    in_use: int = 0
    process_index: int = 0

    def memory_stats(self):
        return {"bytes_limit": self.limit, "bytes_in_use": self.in_use}
