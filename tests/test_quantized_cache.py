"""Quantized KV caches (int8 / int4, `duo_jax.quant`) for every registered method: exact bytes, attention that
dequantizes tile by tile, and decoding close to the full-precision cache."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax import attention
from duo_jax.attention import MaskSpec, xla
from duo_jax.cache import make_layout
from duo_jax.errors import DuoJaxError
from duo_jax.methods import DuoAttention, InfiniGen, cache_nbytes, entry, make_method, registry
from duo_jax.methods.infinigen import host_offload_supported as infinigen_host_offload
from duo_jax.methods.infinigen import skew
from duo_jax.pattern import Pattern
from duo_jax.quant import QuantizedKV, quantize_kv
from tests import test_engine
from tests.conftest import random_attention_inputs, run_method, tiny_config

CONFIG = tiny_config(num_layers=3, max_position_embeddings=256)
GATES = np.array([[0.9, 0.1], [0.2, 0.3], [0.05, 0.8]])  # sparsity 0.5: 3 retrieval heads, mixed layers
SCORES = np.array([[0.5, 0.1], [0.9, 0.2], [0.3, 0.7]])  # HeadKV scores: uneven budgets among retrieval heads


@functools.cache
def infinigen_skew():
    """InfiniGen's skew calibrated on the `model` fixture's weights (a random sample text): the last of the 3
    layers speculates."""
    params = duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.05)
    return skew(params, CONFIG, np.random.default_rng(7).integers(0, CONFIG.vocab_size, 24), partial_ratio=0.25)


# The options each registered method is built with here (`methods`); one not listed is built with a kv_budget of 16
# when it takes one, else with none, so a new method needs a line only where it needs more.
OPTIONS = {
    "duo": dict(pattern=Pattern(GATES), sparsity=0.5, sink=3, recent=7),
    "streaming_llm": dict(start=2, recent=9),
    "h2o": dict(kv_budget=24),
    "tova": dict(kv_budget=24),
    "snapkv": dict(kv_budget=16, window=4),
    "pyramidkv": dict(kv_budget=16, window=4),
    "headkv": dict(kv_budget=16, window=4, scores=SCORES),
    "duo_headkv": dict(
        pattern=Pattern(GATES), sparsity=0.5, sink=3, recent=7, scores=SCORES, kv_budget=14, beta=2.0, window=4
    ),
}


def methods(kv_dtype, context=200):
    """Every registered method, with a quantized cache of `kv_dtype` (None: the model's dtype). InfiniGen is built
    from a skew calibrated once (`infinigen_skew`) rather than on the model, as `make_method` would."""
    built = {}
    for name in registry.names():
        if name == "infinigen":
            built[name] = InfiniGen.from_skew(
                *infinigen_skew(), context=context, kv_budget=12, offload="device", kv_dtype=kv_dtype
            )
            continue
        options = OPTIONS.get(name, dict(kv_budget=16) if "kv_budget" in entry(name).options else {})
        built[name] = make_method(name, CONFIG, context=context, kv_dtype=kv_dtype, **options)
    return built


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "int4"])
def test_cache_bytes_include_the_scales_exactly(kv_dtype):
    E, codes = CONFIG.head_dim, CONFIG.head_dim // (2 if kv_dtype == "int4" else 1)
    for name, method in methods(kv_dtype).items():
        cache = method.init_cache(2, jnp.bfloat16)
        leaves = jax.tree.leaves(cache)
        # codes and scales; besides, int32 positions and float32 scores (h2o, tova), nothing in another dtype
        codes_and_scales = {jnp.dtype(jnp.int8), jnp.dtype(jnp.bfloat16)}
        dtypes = {x.dtype for x in leaves}
        assert codes_and_scales <= dtypes <= codes_and_scales | {jnp.dtype(jnp.int32), jnp.dtype(jnp.float32)}, name
        assert cache_nbytes(cache) == method.expected_cache_bytes(2, 2), name
        spec = method.cache_spec(2, jnp.bfloat16)  # abstract: what a step compiles for
        assert sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(spec)) == cache_nbytes(cache)
    # By hand: duo keeps 3 retrieval heads x 256 slots and 3 streaming heads x 10 slots, K and V, batch 2.
    duo = methods(kv_dtype)["duo"]
    assert duo.expected_cache_bytes(2, 2) == 2 * 2 * (codes + 2) * (3 * 256 + 3 * 10)
    assert duo.expected_cache_bytes(2, 2) < make_method(
        "duo", CONFIG, context=200, pattern=Pattern(GATES), sparsity=0.5, sink=3, recent=7
    ).expected_cache_bytes(2, 2)
    assert E == 16
    # h2o / tova by hand: 24 slots per KV head (2 x 3 layers), K and V, plus an int32 position and fp32 score.
    assert methods(kv_dtype)["h2o"].expected_cache_bytes(2, 2) == 2 * 3 * 2 * 24 * (2 * (codes + 2) + 8)
    # duo_headkv's prefill cache by hand: duo's, plus the retrieval heads' query ring in bf16 (window 4, the
    # 3 retrieval KV heads' 2 query heads each).
    assert methods(kv_dtype)["duo_headkv"].expected_cache_bytes(2, 2) == 2 * (
        2 * (codes + 2) * (3 * 256 + 3 * 10) + 4 * 3 * 2 * E * 2
    )
    # infinigen by hand: 256 slots x 2 KV heads x 3 layers of quantized K and V, plus the partial keys in bf16
    # (its one speculating layer, W channels).
    infinigen = methods(kv_dtype)["infinigen"]
    assert infinigen.widths[:2] == (0, 0) and infinigen.widths[2] >= 4
    assert infinigen.expected_cache_bytes(2, 2) == 2 * 256 * 2 * (3 * 2 * (codes + 2) + infinigen.widths[2] * 2)


def test_every_method_takes_kv_dtype_and_the_registry_refuses_one_without(monkeypatch):
    assert all(entry(name).quantized_kv for name in registry.names())
    with pytest.raises(DuoJaxError, match="kv_dtype must be"):
        make_method("full", CONFIG, context=64, kv_dtype="int2")
    # a method registered without the capability (none is now) is refused with the list of those that have it
    monkeypatch.setitem(
        registry._ENTRIES, "plain", dataclasses.replace(entry("full"), name="plain", quantized_kv=False)
    )
    with pytest.raises(DuoJaxError, match="'plain' does not support a quantized KV cache.*full, duo"):
        make_method("plain", CONFIG, context=64, kv_dtype="int8")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_attention_over_a_quantized_cache_is_attention_over_its_values(kind):
    """Tile by tile (many key blocks, ragged lengths, a ring with explicit positions): the same as attending
    to the dequantized arrays, on the XLA path and on "pallas" (the flash kernel reading codes for the
    contiguous cache, the XLA path for explicit positions; `test_quantized_kernels` covers the kernels)."""
    q, k, v, _ = random_attention_inputs(2, 5, 96, 4, 2, 16, seed=3)
    qk, qv = quantize_kv(k, kind), quantize_kv(v, kind)
    positions = jnp.asarray([[40, 41, 42, 43, 44], [90, 91, 92, 93, 94]], jnp.int32)
    for spec in (
        MaskSpec(positions, jnp.asarray([45, 95], jnp.int32)),
        MaskSpec(
            positions,
            jnp.asarray([96, 96], jnp.int32),
            jnp.asarray(np.random.default_rng(0).permutation(96)[None].repeat(2, 0), jnp.int32),
        ),
    ):
        want = attention.attend(q, qk.dequantize(), qv.dequantize(), spec, impl="reference")
        for impl in ("xla", "pallas"):
            np.testing.assert_allclose(attention.attend(q, qk, qv, spec, impl=impl), want, rtol=2e-5, atol=2e-5)
        tiled = xla.attention(q, qk, qv, spec, block_k=16)  # 6 tiles
        np.testing.assert_allclose(tiled, want, rtol=2e-5, atol=2e-5)
        assert np.abs(want - attention.attend(q, k, v, spec, impl="reference")).max() > 1e-3  # quantized


@pytest.mark.slow
def test_quantized_duo_is_duo_over_round_tripped_keys_and_values():
    """Exact semantics: the engine with an int4 cache (both partitions, packed codes, prefill chunks and decode
    steps) equals the dense per-head-mask reference whose keys and values went through quantize / dequantize.

    An element within ~1e-6 of a rounding boundary may round either way in the two computations (one int4
    step: a visible change); this prompt has none (prompt seed 0 has one, a key at -3.5000005 steps)."""
    config, mask, sink, recent, chunk, kv_dtype = test_engine.CONFIG, test_engine.MIXED, 2, 5, 7, "int4"
    params = duo_jax.init_params(config, jax.random.key(0), scale=0.2)
    prompt = np.random.default_rng(1).integers(0, config.vocab_size, 23).tolist()
    layout = make_layout(config, mask, sink=sink, recent=recent, context=40, kv_dtype=kv_dtype)
    method = DuoAttention(layout)
    sequence, logits, _, _ = run_method(params, config, method, prompt, chunk=chunk, decode_steps=6)
    starts = [(i // chunk) * chunk if i < len(prompt) else i for i in range(len(sequence))]
    ref = test_engine.reference_logits(params, config, sequence, mask, sink, recent, starts, kv_dtype=kv_dtype)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    unquantized = test_engine.reference_logits(params, config, sequence, mask, sink, recent, starts)
    assert np.abs(unquantized - ref).max() > 1e-3


@pytest.fixture(scope="module")
def model():
    # Small weights: a random model with larger ones amplifies any perturbation through its layers far more
    # than a trained one (at scale 0.2 int8 moves logits by ~4%), and the decoded tokens sit close to ties.
    return duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.05), None, "random")


# max |logits - fp32 cache logits| / max |fp32 cache logits| over prefill and teacher-forced decode. Measured on
# this model (print with -s): int8 0.7% (duo) to 0.8% (streaming_llm), int4 12% (duo); the bounds leave
# ~2x headroom. (h2o: its evictions follow the attention, so the int8 cache must keep the fp32 cache's
# tokens too.) (Full attention int8 is the generate test below.)
BOUNDS = {"int8": 0.02, "int4": 0.3}


# Methods whose quantized decode another case covers (the rest of the registry runs in int8, a new method with it).
COVERED = {
    "full": "duo's retrieval heads are its cache",
    "tova": "h2o's cache and eviction",
    "pyramidkv": "snapkv's cache, per-layer budgets",
    "headkv": "snapkv's cache, per-head budgets (duo_headkv's retrieval heads)",
    "infinigen": "test_quantized_infinigen_decodes_close_to_the_fp32_cache",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, kv_dtype",
    [(name, "int8") for name in registry.names() if name not in COVERED] + [("duo", "int4"), ("duo_headkv", "int4")],
)
def test_quantized_cache_decodes_close_to_the_fp32_cache(model, name, kv_dtype):
    prompt = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 37).tolist()
    seq, logits, _, _ = run_method(model.params, CONFIG, methods(None, 64)[name], prompt, chunk=16, decode_steps=8)
    q_seq, q_logits, _, cache = run_method(
        model.params, CONFIG, methods(kv_dtype, 64)[name], prompt, chunk=16, decode_steps=8, force=seq[len(prompt) :]
    )
    if kv_dtype == "int8":
        assert q_seq == seq
    leaves = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, QuantizedKV))
    assert any(isinstance(x, QuantizedKV) for x in leaves)  # every K / V array; besides: int32 positions, h2o's
    assert all(
        isinstance(x, QuantizedKV) or x.dtype == jnp.int32 or x.shape[-1] != CONFIG.head_dim  # scores,
        for x in leaves
    )  # infinigen's partial keys (W < E channels)
    method = methods(kv_dtype, 64)[name]
    if method.decode_method(len(prompt)) != method:  # compressed after prefill (snapkv, duo_headkv): that cache
        decode = method.decode_method(len(prompt))
        unquantized = methods(None, 64)[name].decode_method(len(prompt)).expected_cache_bytes(1, 4)
        assert cache_nbytes(cache) == decode.expected_cache_bytes(1, 4) < unquantized / (3 if kv_dtype == "int8" else 5)
    err = np.abs(q_logits - logits).max() / np.abs(logits).max()
    print(f"{name} {kv_dtype}: relative logits error {err:.4f}")
    assert 1e-5 < err < BOUNDS[kv_dtype]  # quantized, and close


@pytest.mark.slow
@pytest.mark.parametrize("kv_budget, bound", [(64, BOUNDS["int8"]), (12, 0.1)])
def test_quantized_infinigen_decodes_close_to_the_fp32_cache(model, kv_budget, bound):
    """The full K / V quantized, the partial keys not. kv_budget 64: every decode step fetches every cached token,
    so the error is the quantization's alone (measured 0.4%). kv_budget 12: the speculation picks 12 of the
    37..44 cached tokens; the same greedy tokens, and the same error except at a step where the int8 cache's
    perturbed lookahead query ranks another token 12th (measured: 3.8% at 1 of the 8 steps; a discrete choice of
    the method, not quantization noise)."""
    prompt = np.random.default_rng(0).integers(0, CONFIG.vocab_size, 37).tolist()
    fp32, int8 = (
        dataclasses.replace(methods(kv_dtype, 64)["infinigen"], kv_budget=kv_budget) for kv_dtype in (None, "int8")
    )
    seq, logits, _, _ = run_method(model.params, CONFIG, fp32, prompt, chunk=16, decode_steps=8)
    q_seq, q_logits, _, cache = run_method(
        model.params, CONFIG, int8, prompt, chunk=16, decode_steps=8, force=seq[len(prompt) :]
    )
    assert q_seq == seq
    assert isinstance(cache[0].k, QuantizedKV) and isinstance(cache[2].v, QuantizedKV)
    assert cache[2].partial_k.dtype == jnp.float32  # the speculation's partial keys stay in the model's dtype
    assert cache_nbytes(cache) == int8.expected_cache_bytes(1, 4) < fp32.expected_cache_bytes(1, 4) / 2
    err = np.abs(q_logits - logits).max(axis=-1) / np.abs(logits).max()  # per position
    print(f"infinigen int8 budget {kv_budget}: relative logits error per decode step {np.round(err[37:], 4)}")
    assert 1e-5 < err.max() < bound and np.median(err) < BOUNDS["int8"]
    if kv_budget == 12 and int8.host_offload is False and infinigen_host_offload():  # codes and scales on the host
        hosted = dataclasses.replace(int8, offload="host")
        h_seq, h_logits, _, h_cache = run_method(model.params, CONFIG, hosted, prompt, chunk=16, decode_steps=8)
        assert h_seq == seq and cache_nbytes(h_cache) == cache_nbytes(cache)
        np.testing.assert_allclose(h_logits, q_logits, rtol=1e-5, atol=1e-6)
        assert h_cache[2].k.codes.sharding.memory_kind == "pinned_host"


@pytest.mark.slow
def test_generate_with_int8_kv_gives_the_fp32_caches_greedy_tokens(model):
    prompt = np.random.default_rng(1).integers(0, CONFIG.vocab_size, 41).tolist()
    kwargs = dict(max_new_tokens=12, chunk_size=16, stop_at_eos=False)
    full = duo_jax.generate(model, prompt, **kwargs)
    int8 = duo_jax.generate(model, prompt, kv_dtype="int8", **kwargs)
    assert int8.tokens == full.tokens
    assert int8.stats["cache_bytes"] == int8.stats["expected_cache_bytes"] < full.stats["cache_bytes"] / 3
    same = duo_jax.generate(model, prompt, kv_dtype="float32", **kwargs)  # the model's dtype: unquantized
    assert same.stats["cache_bytes"] == full.stats["cache_bytes"]


@pytest.mark.parametrize("name", ["full", "duo"])
def test_quantized_chunks_through_cudnn_without_triton_give_the_xla_paths_logits(monkeypatch, name):
    """A GPU without Triton, bf16, int4 caches ("auto" resolves to "cudnn", the rest to XLA): the prefill chunks of
    the full-attention (retrieval) caches run cuDNN's calls on dequantized keys (the XLA stand-in of its contract,
    counted: each chunk's own keys, then its prefix in segments of 32 slots), a decode step the XLA path; the
    prompts' logits and greedy tokens as the XLA path's. (Decode steps feed each path its own argmax, which a near
    tie can part, so only the prompts' teacher-forced logits are compared.)"""
    from duo_jax.attention import cudnn, dispatch
    from duo_jax.engine import Engine
    from tests.test_paged import all_logits

    calls = []

    def counted(*args, **kwargs):
        calls.append((args[0].shape[1], args[1].shape[1]))  # (queries, keys) of the call
        return cudnn.xla_part(*args, **kwargs)

    engine = Engine(duo_jax.init_params(CONFIG, jax.random.key(0), jnp.bfloat16, scale=0.05), CONFIG)
    method = methods("int4", context=64)[name]
    prompts = [np.random.default_rng(5).integers(1, 128, n).tolist() for n in (37, 20)]
    logits = {}
    for impl in ("xla", "cudnn"):
        if impl == "cudnn":
            monkeypatch.setattr(dispatch, "resolve_impl", lambda impl: "cudnn" if impl in ("auto", "cudnn") else impl)
            monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")
            monkeypatch.setattr(cudnn, "_cudnn", counted)
            monkeypatch.setattr(cudnn, "PREFIX_SEGMENT", 32)
        cache = method.init_cache(len(prompts), engine.dtype)
        logits[impl] = all_logits(engine, method, prompts, cache, chunk=16, steps=1, impl=impl)
    assert sorted(set(calls)) == [(16, 16), (16, 32)]  # a chunk over its own keys, and over a prefix segment
    # bf16 rounding on two paths, three layers deep, the merged calls' outputs each rounded to bf16 (measured: max
    # 0.8% / mean 0.1% of the largest logit; a prefix segment misplaced by 8 slots: 24-40% / 1.3-4.9%). Small weights:
    # at scale 0.2 this random model amplified the rounding to 17% at one position.
    for x, c, prompt in zip(logits["xla"], logits["cudnn"], prompts):
        x, c = x[: len(prompt)], c[: len(prompt)]
        assert np.abs(c - x).max() < 3e-2 * np.abs(x).max() and np.abs(c - x).mean() < 3e-3 * np.abs(x).max()
        np.testing.assert_array_equal(c.argmax(-1), x.argmax(-1))
