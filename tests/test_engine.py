"""The engine running DuoAttention against a dense reference with explicit per-head masks (random tiny models).

The reference states DuoAttention's semantics directly: for a query at position i processed in a chunk that
starts at position c (decode: c = i), a retrieval head sees every key j <= i, a streaming head sees key j
iff j <= i and (j < sink or j >= c - recent). It runs on the model's original head order, in the float64
decoder of tests/reference_decoder.py (a full [T, T] mask per KV head), independent of the engine.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.cache import make_layout
from duo_jax.engine import extend
from duo_jax.methods import DuoAttention
from duo_jax.methods.duo import merge_heads, split_heads
from duo_jax.model import unstack_layers
from duo_jax.quant import quantize_kv
from tests.conftest import run_method, tiny_config
from tests.reference_decoder import decode

CONFIG = tiny_config(num_layers=4)
# Layer 0 all retrieval, layer 1 all streaming, layers 2 and 3 mixed (retrieval head second, then first).
MIXED = np.array([[1, 1], [0, 0], [0, 1], [1, 0]], bool)


def reference_logits(params, config, tokens, retrieval_mask, sink, recent, chunk_starts, kv_dtype=None):
    """Logits [T, V] of one sequence under DuoAttention's masks (chunk_starts[i]: start of i's chunk); with
    `kv_dtype`, every key (after RoPE) and value replaced by the round trip the quantized cache makes:
    rotated by the normalised Hadamard matrix H[i, j] = (-1)^popcount(i & j) / sqrt(E), quantized, dequantized
    and rotated back."""
    T = len(tokens)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    causal = j <= i
    streaming = causal & ((j < sink) | (j >= np.asarray(chunk_starts)[:, None] - recent))

    def mask(layer):
        return np.where(retrieval_mask[layer.index][:, None, None], causal, streaming)  # [K, T, T]

    def round_trip(k, v):
        e = np.arange(k.shape[-1])
        signs = (-1.0) ** np.vectorize(lambda n: bin(n).count("1"))(e[:, None] & e[None, :])
        h = jnp.asarray(signs / math.sqrt(k.shape[-1]), jnp.float32)
        return (np.asarray(quantize_kv(jnp.asarray(x, jnp.float32) @ h, kv_dtype).dequantize() @ h.T) for x in (k, v))

    return decode(params, config, tokens, mask, kv_round_trip=None if kv_dtype is None else round_trip).logits


def run_engine(params, config, prompt, retrieval_mask, *, sink, recent, chunk, decode_steps, impl="auto"):
    """DuoAttention with a raw [L, K] retrieval mask through `run_method`: (sequence, logits at every position)."""
    layout = make_layout(config, retrieval_mask, sink=sink, recent=recent, context=len(prompt) + decode_steps)
    method = DuoAttention(layout)
    sequence, logits, _, _ = run_method(
        params, config, method, prompt, chunk=chunk, decode_steps=decode_steps, impl=impl
    )
    return sequence, logits


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2)


@pytest.fixture(scope="module")
def prompt():
    return np.random.default_rng(0).integers(0, CONFIG.vocab_size, 23).tolist()


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [1, 7, 23])
def test_mixed_pattern_matches_reference(params, prompt, chunk):
    sink, recent, steps = 2, 5, 20
    sequence, logits = run_engine(
        params, CONFIG, prompt, MIXED, sink=sink, recent=recent, chunk=chunk, decode_steps=steps
    )
    starts = [(i // chunk) * chunk if i < len(prompt) else i for i in range(len(sequence))]
    ref = reference_logits(params, CONFIG, sequence, MIXED, sink, recent, starts)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    # The masks matter: full attention over the same tokens gives clearly different logits.
    full = reference_logits(params, CONFIG, sequence, np.ones_like(MIXED), sink, recent, starts)
    assert np.abs(full - ref).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("impl, streaming_chunk", [("xla", None), ("pallas", None), ("xla", 4)], ids=str)
def test_windows_in_one_ring_share_steps_and_each_matches_the_reference(params, prompt, impl, streaming_chunk):
    """A ring of 24 slots (`ring_slots`) holds the window as data: windows (2, 5), (4, 12) and (0, 24) compile one
    prefill step and one decode step between them, and each gives the float64 reference's logits for its own window
    (prefill in chunks of 8, the ring wrapping, decode steps through the one-launch kernels under "pallas", the
    streaming heads' sub-chunks with `streaming_chunk`). Without the window as data it would be compiled in."""
    from dataclasses import replace

    from duo_jax import engine as engine_lib

    def compiles():
        return engine_lib._compiled_extend.cache_info().misses

    steps, chunk, seen = 8, 8, []
    for sink, recent in [(2, 5), (4, 12), (0, 24)]:
        layout = make_layout(CONFIG, MIXED, sink=sink, recent=recent, context=len(prompt) + steps, ring_slots=24)
        method = DuoAttention(layout, streaming_chunk)
        before = compiles()
        sequence, logits, _, _ = run_method(params, CONFIG, method, prompt, chunk=chunk, decode_steps=steps, impl=impl)
        seen.append(compiles() - before)
        step_starts = [(i // chunk) * chunk if i < len(prompt) else i for i in range(len(sequence))]
        if streaming_chunk:  # the streaming heads see each chunk as chunks of 4; the retrieval heads are causal anyway
            step_starts = [
                (i // streaming_chunk) * streaming_chunk if i < len(prompt) else i for i in range(len(sequence))
            ]
        ref = reference_logits(params, CONFIG, sequence, MIXED, sink, recent, step_starts)
        np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4)
    assert seen[1:] == [0, 0], seen  # the later windows ran the first one's executables
    assert DuoAttention(make_layout(CONFIG, MIXED, sink=2, recent=5, context=64)) != DuoAttention(
        make_layout(CONFIG, MIXED, sink=4, recent=3, context=64)
    )  # compiled in, two windows are two methods
    with pytest.raises(duo_jax.DuoJaxError, match="ring_slots must be an integer >= sink \\+ recent = 11"):
        make_layout(CONFIG, MIXED, sink=3, recent=8, context=64, ring_slots=10)
    layout = make_layout(CONFIG, MIXED, sink=3, recent=8, context=64, ring_slots=12)
    with pytest.raises(duo_jax.DuoJaxError, match="ring_slots must be an integer >= sink \\+ recent = 14"):
        replace(layout, recent=11)  # a replaced window is checked too


@pytest.mark.parametrize("impl, kv_dtype", [("auto", None), ("xla", None), ("pallas", None), ("xla", "int8")], ids=str)
def test_a_streaming_chunk_makes_a_long_chunk_prefill_as_short_ones(params, prompt, impl, kv_dtype):
    """`streaming_chunk=4` with chunks of 12 (the prompt's 23 tokens in two): the streaming heads see each chunk as
    three of 4 (the ring's keys before each, sinks past the ring's and within the chunk, a padded tail) while the
    retrieval heads see it whole; the float64 reference is DuoAttention prefilled in chunks of 4. On the CPU kernel
    (auto), the XLA path, the Pallas kernels (interpreted), and over int8 codes."""
    sink, recent, steps, size = 2, 5, 3, 4
    layout = make_layout(CONFIG, MIXED, sink=sink, recent=recent, context=len(prompt) + steps, kv_dtype=kv_dtype)
    sequence, logits, _, _ = run_method(
        params, CONFIG, DuoAttention(layout, streaming_chunk=size), prompt, chunk=12, decode_steps=steps, impl=impl
    )
    starts = [(i // size) * size if i < len(prompt) else i for i in range(len(sequence))]
    ref = reference_logits(params, CONFIG, sequence, MIXED, sink, recent, starts, kv_dtype=kv_dtype)
    np.testing.assert_array_less(np.abs(logits - ref).max(), 1e-4 if kv_dtype is None else 2e-3)
    whole = reference_logits(
        params, CONFIG, sequence, MIXED, sink, recent, [(i // 12) * 12 for i in range(len(sequence))]
    )
    assert np.abs(whole - ref).max() > 1e-2  # the chunks of 12 would give other logits


def test_a_streaming_chunk_takes_chunks_of_its_multiples(params, prompt):
    layout = make_layout(CONFIG, MIXED, sink=2, recent=5, context=32)
    with pytest.raises(duo_jax.DuoJaxError, match="multiple of 4"):
        run_method(params, CONFIG, DuoAttention(layout, streaming_chunk=4), prompt, chunk=6, decode_steps=0)


@pytest.mark.slow
def test_pallas_kernels_in_the_engine_match_the_reference(params, prompt):
    """Retrieval heads through the Pallas flash / split-K decode kernels, streaming heads through the flash
    kernel over their ring's explicit positions (interpreted on CPU)."""
    kwargs = dict(sink=2, recent=5, chunk=7, decode_steps=4)
    _, kernels = run_engine(params, CONFIG, prompt, MIXED, impl="pallas", **kwargs)
    _, reference = run_engine(params, CONFIG, prompt, MIXED, impl="reference", **kwargs)
    np.testing.assert_array_less(np.abs(kernels - reference).max(), 1e-4)


@pytest.mark.slow
def test_one_kernel_decode_in_the_engine_matches_the_reference(params, prompt):
    """A ring tiled by a power-of-two block (4 + 12 slots): the mixed layers' decode steps run both partitions
    in `duo_decode_attention` (interpreted on CPU), the one-kind layers their own kernels."""
    kwargs = dict(sink=4, recent=12, chunk=8, decode_steps=6)
    _, kernels = run_engine(params, CONFIG, prompt, MIXED, impl="pallas", **kwargs)
    _, reference = run_engine(params, CONFIG, prompt, MIXED, impl="reference", **kwargs)
    np.testing.assert_array_less(np.abs(kernels - reference).max(), 1e-4)
    method = DuoAttention(make_layout(CONFIG, MIXED, sink=4, recent=12, context=64))
    cache = method.init_cache(1, jnp.float32)
    step = jax.make_jaxpr(
        lambda c: extend(
            unstack_layers(params),
            c,
            jnp.asarray([30], jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones((1,), jnp.int32),
            config=CONFIG,
            method=method,
            impl="pallas",
        )
    )(cache)
    assert str(step).count("name=duo_decode_attention") == 2  # the two mixed layers


@pytest.mark.slow
def test_one_kernel_decode_over_a_ragged_batch(params):
    """Two sequences of different lengths (one ring still filling, one wrapped) decoded together: the one-launch
    kernel (interpreted) gives the reference's logits at every step."""
    from duo_jax.engine import Engine

    method = DuoAttention(make_layout(CONFIG, MIXED, sink=4, recent=12, context=64))
    engine = Engine(params, CONFIG)
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (2, 30)).astype(np.int32)
    steps = {}
    for impl in ("pallas", "reference"):
        _, cache, lengths = engine.prefill(method, tokens, np.asarray([9, 30]), chunk=16, impl=impl)
        out = []
        for t in range(3):
            logits, cache, lengths = engine.step(method, cache, lengths, jnp.asarray(tokens[:, t]), impl=impl)
            out.append(np.asarray(logits))
        steps[impl] = np.stack(out)
    np.testing.assert_array_less(np.abs(steps["pallas"] - steps["reference"]).max(), 1e-4)


def lowered_extend(
    mask,
    num_tokens: int,
    impl: str = "pallas",
    dtype: str = "float32",
    config=CONFIG,
    sink: int = 4,
    recent: int = 12,
    streaming_chunk: int | None = None,
) -> str:
    """The engine's step for DuoAttention with retrieval `mask` (None: full) over `num_tokens` new tokens per
    sequence (1: decode; more: a prefill chunk), with the engine's weights on a GPU, exported for CUDA."""
    from duo_jax.engine import abstract_params
    from tests.test_backend import cuda_module

    params = abstract_params(config, dtype, fused_qkv=True)
    ints, tokens = jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, num_tokens), jnp.int32)
    method = DuoAttention(make_layout(config, mask, sink=sink, recent=recent, context=256), streaming_chunk)
    cache = jax.eval_shape(lambda: method.init_cache(1, dtype))
    return cuda_module(
        lambda p, c, l, t, n: extend(p, c, l, t, n, config=config, method=method, impl=impl),
        params,
        cache,
        ints,
        tokens,
        ints,
    )


def test_steps_lowered_for_cuda_without_triton_attend_only_through_cudnn(monkeypatch):
    """Decode steps and prefill chunks of full attention and DuoAttention (bf16), exported for CUDA as a GPU without
    Pallas's Triton backend runs them (impl="cudnn", the rest on the XLA path; the cuDNN version check bypassed):
    every attention is a cuDNN call, no Triton kernel, and no loop (the XLA path's key blocks would be loops). duo's
    decode: 1 call per partition (the streaming heads' ring and new token in one); a chunk: 2 per partition."""
    from jax._src.cudnn import fused_attention_stablehlo as binding

    from duo_jax.attention import dispatch
    from tests.test_backend import TRITON, executed

    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")  # no Triton
    counts = {}
    for name, mask in (("duo", MIXED), ("full", None)):
        for T in (1, 64):
            module = lowered_extend(mask, T, impl="cudnn", dtype="bfloat16")
            counts[name, T] = [
                executed(module, op)
                for op in ("custom_call @__cudnn$fmhaSoftmax", f"custom_call @{TRITON}", "stablehlo.while")
            ]
    assert counts == {("duo", 1): [6, 0, 0], ("duo", 64): [12, 0, 0], ("full", 1): [4, 0, 0], ("full", 64): [8, 0, 0]}
    assert executed(lowered_extend(MIXED, 64, impl="xla", dtype="bfloat16"), "stablehlo.while") > 0  # the check bites


def test_decode_step_lowered_for_cuda_through_mosaic_gpu(monkeypatch):
    """impl="mosaic" on a GPU without Pallas's Triton backend (bf16, head dim 64): each mixed layer's decode attention
    is one Mosaic GPU launch over both partitions, which routes the heads itself (no gather of the queries or the
    output), and the one-kind layers' a cuDNN call each."""
    from jax._src.cudnn import fused_attention_stablehlo as binding

    from duo_jax.attention import dispatch
    from tests.test_backend import executed

    monkeypatch.setattr(binding, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(dispatch, "_without_cudnn", lambda impl: "xla")  # no Triton
    config = tiny_config(num_layers=4, head_dim=64)
    counts = {}
    for impl in ("mosaic", "cudnn"):
        module = lowered_extend(MIXED, 1, impl=impl, dtype="bfloat16", config=config, sink=16, recent=48)
        counts[impl] = [
            executed(module, op)
            for op in ("custom_call @mosaic_gpu_v2", "custom_call @__cudnn$fmhaSoftmax", "stablehlo.gather")
        ]
    assert counts["mosaic"][:2] == [2, 2] and counts["cudnn"][:2] == [0, 6]
    assert counts["mosaic"][2] < counts["cudnn"][2]  # the queries' and outputs' head gathers are gone


def test_mosaic_gpu_decode_in_the_engine_matches_the_reference(monkeypatch):
    """One bf16 decode step with impl="mosaic" as a GPU runs it, the Mosaic GPU kernel in its interpreter (the mixed
    layers' attention; the engine writes the caches around it), against the dense reference from the same cache.
    Tolerance: the two differ by 1.9% of the largest logit; with the kernel's heads routed in reverse, by 80%."""
    import pallas_kernels.mosaic_gpu
    from duo_jax.engine import Engine
    from pallas_kernels import _backend
    from tests.mosaic_gpu_interpret import installed

    config = tiny_config(num_layers=4, head_dim=64)
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), duo_jax.init_params(config, jax.random.key(0), scale=0.2))
    method = DuoAttention(make_layout(config, MIXED, sink=16, recent=48, context=128))
    engine = Engine(params, config)
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (2, 80)).astype(np.int32)
    _, cache, lengths = engine.prefill(method, tokens, np.asarray([80, 23]), chunk=32, impl="xla")

    def step(impl):
        out = engine.step(method, jax.tree.map(jnp.copy, cache), lengths, jnp.asarray([3, 4]), impl=impl)
        return np.asarray(out[0])

    reference = step("reference")
    calls, kernel = [], pallas_kernels.mosaic_gpu.duo_decode_attention
    with installed() as interpret:
        monkeypatch.setattr(_backend, "on_gpu", lambda: True)
        monkeypatch.setattr(
            pallas_kernels.mosaic_gpu,
            "duo_decode_attention",
            lambda *a, **k: calls.append(1) or kernel(*a, interpret=interpret, **k),
        )
        mosaic = step("mosaic")
    assert len(calls) == 2  # the two mixed layers
    assert np.abs(mosaic - reference).max() <= 0.1 * np.abs(reference).max()


def test_decode_step_lowered_for_cuda_has_one_kernel_per_layer():
    """A decode step exported for CUDA from this host: one Triton launch per layer (the mixed layers' both
    partitions in `duo_decode_attention`), and no more gathers and scatters than today (gathers counted where they
    run: per call of the private functions JAX lowers `jnp.take` into; scatters: ring writes outside the kernel):
    the counts fail the test when a change adds launches to every step."""
    from tests.test_backend import TRITON, executed

    counts = {}
    for name, mask in (("duo", MIXED), ("full", None)):
        module = lowered_extend(mask, 1)
        counts[name] = [
            executed(module, op) for op in (f"custom_call @{TRITON}", "stablehlo.gather", "stablehlo.scatter")
        ]
    assert counts["full"] == [CONFIG.num_layers, 10, 0]
    # duo gathers less than full: the kernel reads q and the new token and writes its output in the model's head
    # order, and writes both caches itself (full's and the one-kind layers' cache writes gather the new token's
    # rows); layers whose caches keep the model's order reorder nothing. The scatters are the all-streaming
    # layer's ring writes (k and v).
    assert counts["duo"][0] == CONFIG.num_layers and counts["duo"][1] <= 4 and counts["duo"][2] <= 2


def test_prefill_chunk_lowered_for_cuda_has_one_kernel_per_layer():
    """A prefill chunk exported for CUDA from this host: one Triton launch per layer (the mixed layers' both
    partitions in `duo_prefill_attention`), q and the output never gathered into the caches' order: the counts
    fail the test when a change adds launches or gathers to every chunk."""
    from tests.test_backend import TRITON, executed, triton_kernels

    counts = {}
    for name, mask in (("duo", MIXED), ("full", None)):
        module = lowered_extend(mask, 64)
        counts[name] = [executed(module, op) for op in (f"custom_call @{TRITON}", "stablehlo.gather", "stablehlo.pad")]
        if name == "duo":  # the two mixed layers
            names = [launch["name"] for launch in triton_kernels(module)]
            assert sum(n.startswith("duo_prefill_attention") for n in names) == 2
    assert counts["duo"][0] == counts["full"][0] == CONFIG.num_layers
    # no more gathers than full (before the one-launch kernel: 6 launches and 12 gathers against full's 4 and 10),
    # and no padded copy of a ring + chunk (16 + 64 slots, tiled by blocks of 16; before: 9 pads)
    assert counts["duo"][1] <= counts["full"][1] and counts["duo"][2] == counts["full"][2] == 0


def test_a_chunk_in_streaming_chunks_lowered_for_cuda_runs_each_partition_in_one_kernel():
    """A chunk of 64 with streaming_chunk=16, exported for CUDA: each mixed layer's retrieval heads in one flash
    kernel over the chunk, its streaming heads in one over the four sub-chunks as a batch (no one-launch kernel,
    which would see the chunk whole on every head); a layer of one kind in one kernel."""
    from tests.test_backend import triton_kernels

    launches = triton_kernels(lowered_extend(MIXED, 64, streaming_chunk=16))
    assert [launch["name"] for launch in launches] == ["block_sparse_attention_fwd"] * 6  # 1 + 1 + 2 + 2
    # grid (batch, heads, blocks): the retrieval heads' batch of 1 (layers 0, 2, 3), the streaming heads' batch of
    # 4 sub-chunks (layers 1, 2, 3)
    assert sorted(launch["grid"][0] for launch in launches) == [1] * 3 + [4] * 3


@pytest.mark.slow
def test_sink_zero_and_streaming_only(params, prompt):
    mask = np.zeros_like(MIXED)
    sequence, logits = run_engine(params, CONFIG, prompt, mask, sink=0, recent=3, chunk=4, decode_steps=6)
    starts = [(i // 4) * 4 if i < len(prompt) else i for i in range(len(sequence))]
    np.testing.assert_array_less(
        np.abs(logits - reference_logits(params, CONFIG, sequence, mask, 0, 3, starts)).max(), 1e-4
    )


@pytest.mark.slow
def test_full_attention_matches_forward(params, prompt):
    sequence, logits = run_engine(params, CONFIG, prompt, None, sink=2, recent=5, chunk=7, decode_steps=8)
    dense = np.asarray(duo_jax.forward(params, CONFIG, jnp.asarray([sequence]))[0])
    np.testing.assert_array_less(np.abs(logits - dense).max(), 1e-4)


@pytest.mark.slow
def test_window_covering_the_sequence_is_full_attention(params, prompt):
    _, logits = run_engine(params, CONFIG, prompt, MIXED, sink=4, recent=40, chunk=5, decode_steps=10)
    sequence, full = run_engine(params, CONFIG, prompt, None, sink=4, recent=40, chunk=5, decode_steps=10)
    np.testing.assert_array_less(np.abs(logits - full).max(), 1e-4)


def test_heads_split_by_the_pattern_and_merge_back():
    """Each layer's retrieval heads (with their query groups) and streaming heads, in the model's order; the
    merge is the inverse. The weights are never reordered."""
    mask = np.array([[0, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 1]], bool)
    layout = make_layout(tiny_config(num_layers=4, num_heads=6, num_kv_heads=3), mask, sink=1, recent=2, context=8)
    np.testing.assert_array_equal(layout.retrieval_mask, mask)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 6, 4)), jnp.float32)  # query heads, groups of 2
    for l, m in enumerate(mask):
        heads = np.repeat(m, 2)
        retrieval, streaming = split_heads(layout, l, x)
        np.testing.assert_array_equal(retrieval, x[:, :, heads])
        np.testing.assert_array_equal(streaming, x[:, :, ~heads])
        np.testing.assert_array_equal(merge_heads(layout, l, retrieval, streaming), x)


@pytest.mark.slow
def test_weights_are_prepared_once_per_model(params, prompt):
    """generate() runs the model's one engine: the second call, and a call with another method, prepare no
    weights and leave no more arrays alive than the first (no per-call or per-method copy of the weights)."""
    from duo_jax.engine import Engine

    model = duo_jax.Model(CONFIG, params, None, "random")
    kwargs = dict(max_new_tokens=4, chunk_size=8, stop_at_eos=False)
    first = duo_jax.generate(model, prompt, **kwargs)
    engine = Engine.of(model)
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    live = lambda: sum(x.nbytes for x in jax.live_arrays())  # noqa: E731
    before = live()
    again = duo_jax.generate(model, prompt, **kwargs)
    duo = duo_jax.generate(
        model, prompt, pattern=duo_jax.Pattern(MIXED.astype(float)), sparsity=0.5, sink=2, recent=5, **kwargs
    )
    assert Engine.of(model) is engine and again.tokens == first.tokens
    assert again.stats["prepare_s"] < 0.01 and duo.stats["prepare_s"] < 0.01
    assert live() - before < weights / 4
    assert engine.params.layers[0].wq is not params.layers.wq  # unstacked once: layers are the step's arguments
    replaced = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(5)), None, "random")
    assert Engine.of(replaced) is not engine  # another model's weights get their own engine


def test_an_engine_does_not_keep_its_weights_alive():
    import gc
    import weakref

    from duo_jax.engine import Engine
    from duo_jax.model import _MEMOS, unstack_layers

    model = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(6)), None, "random")
    engine = Engine.of(model)
    assert engine.copied  # stacked weights: one per-layer copy, reused by another front over the same arrays
    assert Engine.of(duo_jax.Model(CONFIG, model.params, None, "another front")) is engine
    anchor = weakref.ref(model.params.layers.wq)
    key = id(anchor())
    assert key in _MEMOS
    del model, engine
    gc.collect()
    assert anchor() is None and key not in _MEMOS

    # Per-layer weights (duo_jax.load's default): the engine runs on the model's own arrays, nothing is copied
    # or kept, and the weights still die with the model.
    model = duo_jax.Model(CONFIG, unstack_layers(duo_jax.init_params(CONFIG, jax.random.key(7))), None, "random")
    engine = Engine.of(model)
    assert not engine.copied and engine.params is model.params
    anchor = weakref.ref(model.params.layers[0].wq)
    key = id(anchor())
    assert key in _MEMOS
    del model, engine
    gc.collect()
    assert anchor() is None and key not in _MEMOS


def test_one_shape_is_one_executable_however_it_is_asked_for():
    """Callers that pass the defaults by keyword, by position or not at all get the same executable (the compile
    a benchmark does ahead of its timings is the one the engine then runs)."""
    from duo_jax.engine import compiled_extend
    from duo_jax.methods import make_method

    method = make_method("full", CONFIG, context=32)
    first = compiled_extend(CONFIG, method, 1, 8, "float32")
    assert compiled_extend(CONFIG, method, 1, 8, "float32", "auto", False, None, None) is first
    assert compiled_extend(CONFIG, method, 1, 8, "float32", weight_format=None, impl="auto") is first


def test_an_executable_the_engine_drops_is_freed():
    """The engine's caches bound what it keeps; JAX's own trace and lowering caches kept every executable lowered
    through the module's jitted functions alive besides (a long run over varied shapes grew to the kernel's mapping
    limit). Each is now lowered through a function of its own, which those caches let go with it."""
    import gc

    from duo_jax import engine
    from duo_jax.methods import make_method

    client = jax.devices()[0].client
    live = lambda: (gc.collect(), len(client.live_executables()))[1]  # noqa: E731
    method = make_method("full", CONFIG, context=48)  # a shape no other test compiles
    step = engine.compiled_decode(CONFIG, method, 3, "float32", "xla", True, 16, ())
    compiled = live()
    engine._compiled_decode.cache_clear()
    del step
    assert live() < compiled


def test_threads_asking_for_one_shape_at_once_compile_it_once(monkeypatch):
    """Concurrent first calls (a web app's threads) each compiled the same executable; now one compiles and the
    others wait for it."""
    import threading

    from duo_jax import engine
    from duo_jax.methods import make_method

    method = make_method("full", CONFIG, context=40)  # a shape no other test compiles
    start, results = threading.Barrier(4), []
    before = engine._compiled_extend.cache_info().misses

    def ask():
        start.wait()
        results.append(engine.compiled_extend(CONFIG, method, 2, 8, "float32", "xla"))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert engine._compiled_extend.cache_info().misses - before == 1
    assert all(r is results[0] for r in results)


def test_threads_asking_for_a_models_engine_at_once_get_one_copy(monkeypatch):
    """Concurrent first generate calls on a model whose engine holds a copy of its weights (stacked weights, or any
    model on a GPU) made a copy each; now one builds it and the others get that one."""
    import threading
    import time

    from duo_jax.engine import Engine

    model = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(8)), None, "random")  # stacked: copied
    build = Engine.__init__

    def slow_build(self, *args, **kwargs):  # a copy of real weights takes a while: widen the race's window
        time.sleep(0.2)
        build(self, *args, **kwargs)

    monkeypatch.setattr(Engine, "__init__", slow_build)
    start, engines = threading.Barrier(4), []

    def ask():
        start.wait()
        engines.append(Engine.of(model))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(engines) == 4 and all(e is engines[0] for e in engines)


def test_the_step_refuses_stacked_weights():
    """`extend` unrolls per-layer weights; stacked ones are a clear error naming the conversion, not a failure
    deep inside tracing."""
    from duo_jax.engine import extend
    from duo_jax.methods import make_method

    method = make_method("full", CONFIG, context=128)
    with pytest.raises(duo_jax.DuoJaxError, match="per-layer weights.*unstack_layers"):
        extend(
            duo_jax.init_params(CONFIG, jax.random.key(0)),
            method.init_cache(1, "float32"),
            jnp.zeros(1, jnp.int32),
            jnp.zeros((1, 1), jnp.int32),
            jnp.ones(1, jnp.int32),
            config=CONFIG,
            method=method,
        )


def test_a_step_on_device_tokens_makes_no_host_round_trip(params, monkeypatch):
    """Engine.step fed the argmax of its own logits (a device array) never converts it to numpy (on a GPU that
    is a device-to-host copy and a sync per step; on CPU no transfer guard can see it, so numpy is watched),
    and gives the logits that host tokens give."""
    from duo_jax import engine as engine_lib
    from duo_jax.methods import make_method

    class Numpy:  # numpy, refusing to convert device arrays
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def asarray(x, *args, **kwargs):
            assert not isinstance(x, jax.Array), "Engine.step brought device tokens to the host"
            return np.asarray(x, *args, **kwargs)

    engine, method = engine_lib.Engine(params, CONFIG), make_method("full", CONFIG, context=32)
    cache, lengths = method.init_cache(1, jnp.float32), jnp.zeros((1,), jnp.int32)
    logits, cache, lengths = engine.step(method, cache, lengths, np.asarray([3]))
    token = jnp.argmax(logits, axis=-1)
    host_logits, _, _ = engine.step(method, jax.tree.map(jnp.copy, cache), lengths, np.asarray(token))
    monkeypatch.setattr(engine_lib, "np", Numpy())
    logits, cache, lengths = engine.step(method, cache, lengths, token)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(host_logits))


def test_prefill_transfers_host_values_explicitly(params):
    """The prefill driver puts its per-chunk host values (tokens, lengths, which sequences end in the chunk) with
    explicit transfers and builds the empty cache in one program: an implicit transfer (jnp.asarray of numpy, an
    eager op on a Python scalar) runs a staging executable, which kept the host waiting for the previous chunk.
    A ragged batch, so that the last-token selection runs, gives the same logits under the guard."""
    from duo_jax import engine as engine_lib

    engine = engine_lib.Engine(params, CONFIG)
    method = DuoAttention(make_layout(CONFIG, MIXED, sink=2, recent=4, context=64))
    tokens = np.random.default_rng(1).integers(0, CONFIG.vocab_size, (3, 40)).astype(np.int32)
    lengths = np.asarray([40, 9, 17])
    want, _, _ = engine.prefill(method, tokens, lengths, chunk=16)
    with jax.transfer_guard_host_to_device("disallow"):
        got, cache, _ = engine.prefill(method, tokens, lengths, chunk=16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    for b, n in enumerate(lengths):  # each sequence's logits at its own last prompt token
        alone, _, _ = engine.prefill(method, tokens[b : b + 1, :n], np.asarray([n]), chunk=16)
        np.testing.assert_allclose(np.asarray(got[b]), np.asarray(alone[0]), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="Linux's memory-mapping limit")
def test_a_compile_near_the_mapping_limit_drops_the_cached_executables(params, monkeypatch):
    """Past MAPS_IN_USE_FRACTION of vm.max_map_count a new compile first drops the cached executables, with a
    warning (XLA:CPU maps each executable's code; past the limit a compile aborts the process)."""
    from duo_jax import engine as engine_lib
    from duo_jax.methods import make_method

    engine, method = engine_lib.Engine(params, CONFIG), make_method("full", CONFIG, context=32)
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (1, 20)).astype(np.int32)
    want, _, _ = engine.prefill(method, tokens, np.asarray([20]), chunk=8)
    assert engine_lib._compiled_extend.cache_info().currsize >= 1
    monkeypatch.setattr(engine_lib, "MAPS_IN_USE_FRACTION", 0.0)
    with pytest.warns(RuntimeWarning, match="vm.max_map_count"):
        got, _, _ = engine.prefill(method, tokens, np.asarray([20]), chunk=16)  # a new shape: a compile
    assert engine_lib._compiled_extend.cache_info().currsize == 1  # the executables before it were dropped
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", [None, "int8"])
def test_fused_qkv_gives_the_separate_weights_logits(params, weights):
    """An engine holding q/k/v as one weight (what a GPU gets by default) prefills, steps and decodes on the
    device to the logits and tokens of the separate weights, in float32 and int8 (per-channel scales kept)."""
    from duo_jax.engine import Engine
    from duo_jax.model import quantize_weights
    from duo_jax.sampling import Sampling

    weights_in = quantize_weights(params, weights)
    method = DuoAttention(make_layout(CONFIG, MIXED, sink=4, recent=12, context=64))
    tokens = np.random.default_rng(2).integers(0, CONFIG.vocab_size, (2, 30)).astype(np.int32)
    out = {}
    for fused in (False, True):
        engine = Engine(weights_in, CONFIG, fuse_qkv=fused)
        assert engine.fused_qkv is fused and (engine.params.layers[1].wqkv is not None) is fused
        logits, cache, lengths = engine.prefill(method, tokens, np.asarray([9, 30]), chunk=16)
        step, cache, lengths = engine.step(method, cache, lengths, jnp.asarray(tokens[:, 0]))
        decoded, _, _, _ = engine.decode_loop(
            method, cache, lengths, jnp.asarray(tokens[:, 1]), max_new_tokens=5, sampling=Sampling(0.8, 0.9, 5)
        )
        out[fused] = (np.asarray(logits), np.asarray(step), np.asarray(decoded))
    for separate, fused in zip(out[False], out[True]):
        np.testing.assert_allclose(fused, separate, rtol=1e-5, atol=1e-5)
    fused_layer = Engine(weights_in, CONFIG, fuse_qkv=True).params.layers[0]
    assert fused_layer.wq is None and fused_layer.wk is None and fused_layer.wv is None
    H, K = CONFIG.num_heads, CONFIG.num_kv_heads
    assert fused_layer.wqkv.shape == (CONFIG.hidden_size, H + 2 * K, CONFIG.head_dim)


def test_fused_qkv_is_one_projection_in_the_lowered_step():
    """Exported for CUDA, the decode step over fused weights has two dots fewer per layer (q, k and v in one),
    and the engine fuses by default on a GPU only (a mesh refuses an explicit fuse_qkv=True)."""
    from duo_jax.engine import Engine, abstract_params
    from tests.test_backend import cuda_module

    method = DuoAttention(make_layout(CONFIG, MIXED, sink=4, recent=12, context=256))
    cache = jax.eval_shape(lambda: method.init_cache(1, jnp.float32))
    ints, token = jax.ShapeDtypeStruct((1,), jnp.int32), jax.ShapeDtypeStruct((1, 1), jnp.int32)
    dots = {}
    for fused in (False, True):
        module = cuda_module(
            lambda p, c, l, t, n: extend(p, c, l, t, n, config=CONFIG, method=method, impl="pallas"),
            abstract_params(CONFIG, "float32", fused_qkv=fused),
            cache,
            ints,
            token,
            ints,
        )
        dots[fused] = module.count("stablehlo.dot_general")
    assert dots[True] == dots[False] - 2 * CONFIG.num_layers
    assert Engine(duo_jax.init_params(CONFIG, jax.random.key(1)), CONFIG).fused_qkv is (jax.default_backend() == "gpu")
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(duo_jax.DuoJaxError, match="fuse_qkv=True is for one device"):
        Engine(duo_jax.init_params(CONFIG, jax.random.key(1)), CONFIG, mesh, fuse_qkv=True)


def test_a_cache_not_the_methods_is_refused_naming_what_differs(params):
    """A cache built for another method, capacity or batch size than the step's: it failed deep in attention (a
    concatenate or vmap error), ran on silently (another capacity), or was the compiled executable's TypeError.
    Each step names the first array that differs and the fix, from shapes only (under a user's jit too); a batch-1
    row of a batched paged cache, as `extend_row` cuts it, still steps."""
    from duo_jax.engine import Engine, decode, extend_row
    from duo_jax.methods import make_method
    from duo_jax.methods.paged import paged
    from duo_jax.sampling import Sampling

    engine = Engine(params, CONFIG)
    duo = DuoAttention(make_layout(CONFIG, MIXED, sink=2, recent=4, context=64))
    full, longer = make_method("full", CONFIG, context=64), make_method("full", CONFIG, context=300)

    def step(method, cache, rows=1):
        zeros, ones = jnp.zeros(rows, jnp.int32), jnp.ones(rows, jnp.int32)
        return jax.jit(lambda c: extend(engine.params, c, zeros, ones[:, None], ones, config=CONFIG, method=method))(
            cache
        )

    fix = r"; it was built for another method, capacity, window or batch size: build it with engine.init_cache\("
    with pytest.raises(duo_jax.DuoJaxError, match=r"does not fit method 'duo' at batch 1: cache\[0\]\.stream.*" + fix):
        step(duo, engine.init_cache(full, 1))
    capacity = r"cache\[0\]\.retrieval_k is float32\[1, 384, 2, 16\], the method's is float32\[1, 128, 2, 16\]"
    with pytest.raises(duo_jax.DuoJaxError, match=capacity):  # it ran, on the other capacity
        step(full, engine.init_cache(longer, 1))
    with pytest.raises(duo_jax.DuoJaxError, match=r"at batch 2: cache\[0\]\.retrieval_k is float32\[1, "):
        step(full, engine.init_cache(full, 1), rows=2)
    pages = paged(full, page_size=16)
    with pytest.raises(duo_jax.DuoJaxError, match="it holds a tuple of 4 DuoLayerCache, the method's a PagedCache"):
        step(pages, engine.init_cache(full, 1))
    one, token = jnp.zeros(1, jnp.int32), jnp.asarray([3], jnp.int32)
    with pytest.raises(duo_jax.DuoJaxError, match=capacity):
        engine.step(full, engine.init_cache(longer, 1), one, token)
    with pytest.raises(duo_jax.DuoJaxError, match="at batch 1: cache.*engine.init_cache\\(method, 1\\)"):
        engine.prefill(full, np.ones((1, 8), np.int32), np.asarray([8]), chunk=8, cache=engine.init_cache(full, 2))
    with pytest.raises(duo_jax.DuoJaxError, match=capacity):
        engine.decode_loop(full, engine.init_cache(longer, 1), one, token, max_new_tokens=4)
    with pytest.raises(duo_jax.DuoJaxError, match=capacity):
        seeds, rule = jnp.zeros(1, jnp.uint32), Sampling().rows(1)
        decode(engine.params, engine.init_cache(longer, 1), one, token, seeds, one, rule, config=CONFIG, method=full,
               greedy=True, max_tokens=4)  # fmt: skip
    batched, two = engine.init_cache(pages, 2), jnp.zeros(2, jnp.int32)
    with pytest.raises(duo_jax.DuoJaxError, match=r"'full_paged' at batch 2: cache\.block_tables is int32\[2, 24\]"):
        other = engine.init_cache(paged(longer, page_size=16), 2)
        extend_row(engine.params, other, one[0], two, token[:, None], token, config=CONFIG, method=pages)
    # a row view keeps the pools of the whole batch (twice a batch-1 cache's pages): accepted
    _, _, lengths = step(pages, pages.take_row(batched, 1))
    assert lengths.tolist() == [1]


def test_token_ids_must_be_integers(params):
    """Float or bool token ids: extend and decode failed on JAX's indexing (bool: a NonConcreteBooleanIndexError),
    while Engine.step and prefill cast them to int32 silently (3.7 ran as token 3). Each refuses them by name."""
    from duo_jax.engine import Engine, decode
    from duo_jax.methods import make_method
    from duo_jax.sampling import Sampling

    engine, full = Engine(params, CONFIG), make_method("full", CONFIG, context=32)
    one, seeds = jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.uint32)
    for tokens, got in ((jnp.asarray([[3.7]]), r"float32\[1, 1\]"), (jnp.asarray([[True]]), r"bool\[1, 1\]")):
        with pytest.raises(
            duo_jax.DuoJaxError, match=r"tokens must be an integer array of token ids \[B, T\], got " + got
        ):
            extend(engine.params, full.init_cache(1, "float32"), one, tokens, one + 1, config=CONFIG, method=full)
    with pytest.raises(
        duo_jax.DuoJaxError, match=r"tokens must be an integer array of token ids \[B\], got float64\[1\]"
    ):
        engine.step(full, full.init_cache(1, "float32"), one, np.asarray([3.7]))
    with pytest.raises(duo_jax.DuoJaxError, match=r"tokens must be .* \[B, T\], got float64\[1, 2\]"):
        engine.prefill(full, np.asarray([[3.7, 4.2]]), np.asarray([2]), chunk=8)
    with pytest.raises(duo_jax.DuoJaxError, match=r"token must be an integer array of token ids \[B\], got float32"):
        engine.decode_loop(full, full.init_cache(1, "float32"), one, jnp.asarray([3.7]), max_new_tokens=4)
    with pytest.raises(duo_jax.DuoJaxError, match=r"token must be an integer array of token ids \[B\], got bool"):
        decode(engine.params, full.init_cache(1, "float32"), one, jnp.asarray([True]), seeds, one, Sampling().rows(1),
               config=CONFIG, method=full, greedy=True, max_tokens=4)  # fmt: skip


def test_a_decode_of_no_token_is_refused(params):
    """max_new_tokens (decode_loop) or max_tokens (decode, compiled_decode) below 1: decode_loop returned the first
    token anyway, decode failed on JAX's indexing or broadcasting. Now a DuoJaxError naming the value."""
    from duo_jax.engine import Engine, compiled_decode, decode
    from duo_jax.methods import make_method
    from duo_jax.sampling import Sampling

    engine, full = Engine(params, CONFIG), make_method("full", CONFIG, context=32)
    one, token, seeds = jnp.zeros(1, jnp.int32), jnp.asarray([3], jnp.int32), jnp.zeros(1, jnp.uint32)
    for n in (0, -2):
        with pytest.raises(duo_jax.DuoJaxError, match=f"max_new_tokens must be an integer >= 1 .*got {n}"):
            engine.decode_loop(full, full.init_cache(1, "float32"), one, token, max_new_tokens=n)
        with pytest.raises(duo_jax.DuoJaxError, match=f"max_tokens must be an integer >= 1 .*got {n}"):
            decode(engine.params, full.init_cache(1, "float32"), one, token, seeds, one, Sampling().rows(1),
                   config=CONFIG, method=full, greedy=True, max_tokens=n)  # fmt: skip
    with pytest.raises(duo_jax.DuoJaxError, match="max_tokens must be an integer >= 1 .*got 0"):
        compiled_decode(CONFIG, full, 1, "float32", "xla", True, 0, ())


def test_a_sampling_rule_for_another_batch_is_refused(params):
    """decode's rule of arrays for another batch than the tokens: one of 3 rows for 2 failed to broadcast, one of 1
    row silently ruled both rows. decode_loop given a rule per row failed converting it to a number. Both are named."""
    from duo_jax.engine import Engine, decode
    from duo_jax.errors import InvalidOption
    from duo_jax.methods import make_method
    from duo_jax.sampling import Sampling

    engine, full = Engine(params, CONFIG), make_method("full", CONFIG, context=32)
    two, tokens, seeds = jnp.zeros(2, jnp.int32), jnp.asarray([3, 4], jnp.int32), jnp.zeros(2, jnp.uint32)
    rule = Sampling(0.8, 0.9, 5)
    for rows in (3, 1):
        with pytest.raises(InvalidOption, match=rf"temperature has shape \[{rows}\], not one value per row .*\(2\)"):
            decode(engine.params, full.init_cache(2, "float32"), two, tokens, seeds, two[0] + 3, rule.rows(rows),
                   config=CONFIG, method=full, greedy=False, max_tokens=4)  # fmt: skip
    with pytest.raises(duo_jax.DuoJaxError, match="decode_loop's sampling is one rule for every row"):
        engine.decode_loop(full, full.init_cache(2, "float32"), two, tokens, max_new_tokens=4, sampling=rule.rows(2))
