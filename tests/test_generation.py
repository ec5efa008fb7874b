"""generate(): batching, patterns, sampling, compilation and argument errors on a tiny random model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.engine import Engine, batch_bucket
from duo_jax.errors import DuoJaxError, LoadError
from duo_jax.generation import generate, plan_generation, run_generation
from duo_jax.model import greedy_reference
from duo_jax.pattern import Pattern, PatternError
from tests.conftest import tiny_config

CONFIG = tiny_config(num_layers=3, max_position_embeddings=256)
GATES = np.array([[0.9, 0.1], [0.2, 0.3], [0.05, 0.8]])  # sparsity 0.5 -> 3 retrieval heads, mixed layers


@pytest.fixture(scope="module")
def model():
    return duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(1), scale=0.2), None, "random")


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (30, 17, 41)]


@pytest.mark.slow
def test_full_attention_is_plain_greedy_decoding(model, prompts):
    out = generate(model, prompts[0], max_new_tokens=10, chunk_size=8, stop_at_eos=False)
    assert out.tokens == [greedy_reference(model.params, CONFIG, prompts[0], 10)]
    assert out.text is None
    assert out.stats["cache_bytes"] == out.stats["full_cache_bytes"] == out.stats["expected_cache_bytes"]


@pytest.mark.slow
def test_sparsity_zero_is_full_attention(model, prompts):
    full = generate(model, prompts[0], max_new_tokens=10, chunk_size=8, stop_at_eos=False)
    duo = generate(
        model,
        prompts[0],
        pattern=Pattern(GATES),
        sparsity=0.0,
        sink=1,
        recent=2,
        max_new_tokens=10,
        chunk_size=8,
        stop_at_eos=False,
    )
    assert duo.tokens == full.tokens


@pytest.mark.slow
def test_duo_saves_memory_and_changes_the_output(model, prompts):
    kwargs = dict(max_new_tokens=10, chunk_size=8, stop_at_eos=False, sink=2, recent=4)
    duo = generate(model, prompts[2], pattern=Pattern(GATES), sparsity=0.5, **kwargs)
    streaming = generate(model, prompts[2], pattern=Pattern(GATES), sparsity=1.0, **kwargs)
    full = generate(model, prompts[2], **kwargs)
    assert duo.stats["retrieval_heads"] == 3 and streaming.stats["retrieval_heads"] == 0
    assert streaming.stats["cache_bytes"] < duo.stats["cache_bytes"] < full.stats["cache_bytes"]
    assert duo.stats["cache_bytes"] == duo.stats["expected_cache_bytes"]
    assert streaming.tokens != full.tokens  # a 6-token window on random weights changes the continuation


@pytest.mark.slow
@pytest.mark.parametrize("pattern", [None, Pattern(GATES)])
def test_batch_of_different_lengths_equals_each_alone(model, prompts, pattern):
    kwargs = dict(pattern=pattern, sink=2, recent=5, max_new_tokens=8, chunk_size=8, stop_at_eos=False)
    batch = generate(model, prompts, **kwargs)
    alone = [generate(model, p, **kwargs).tokens[0] for p in prompts]
    assert batch.tokens == alone


@pytest.mark.slow
def test_a_window_wider_than_the_capacity_is_full_attention_in_fulls_memory(model, prompts):
    """sink + recent past the capacity (51 tokens: 128 slots): every head sees every earlier token, so streaming
    heads decode as full attention does, and their ring takes the capacity's slots, not the window's 208."""
    kwargs = dict(max_new_tokens=10, chunk_size=8, stop_at_eos=False, sink=8, recent=200)
    full = generate(model, prompts[2], **kwargs)
    for sparsity in (0.5, 1.0):
        duo = generate(model, prompts[2], pattern=Pattern(GATES), sparsity=sparsity, **kwargs)
        assert duo.tokens == full.tokens
        assert duo.stats["cache_bytes"] == duo.stats["expected_cache_bytes"] == full.stats["cache_bytes"]


@pytest.mark.slow
def test_a_streaming_chunk_keeps_a_ragged_batch_as_its_own_chunks_would(model, prompts):
    """duo with streaming_chunk=8 prefills a batch of 30, 17 and 41 tokens in chunks of 16, 24 or 48 (sub-chunks
    wholly past a short prompt among them) to the tokens of chunks of 8; without it, chunks of 24 decode others."""
    kwargs = dict(pattern=Pattern(GATES), sparsity=0.5, sink=2, recent=5, max_new_tokens=6, stop_at_eos=False)
    eights = generate(model, prompts, chunk_size=8, **kwargs).tokens
    for chunk_size in (16, 24, 48):
        assert generate(model, prompts, chunk_size=chunk_size, streaming_chunk=8, **kwargs).tokens == eights
    assert generate(model, prompts, chunk_size=24, **kwargs).tokens != eights
    # a prompt bucket that is no multiple of 12 (64 for 41 tokens) is rounded up to one, below chunk_size
    assert generate(model, prompts, chunk_size=96, streaming_chunk=12, **kwargs).tokens == (
        generate(model, prompts, chunk_size=12, **kwargs).tokens
    )
    with pytest.raises(DuoJaxError, match=r"chunk_size \(20\) must be a multiple of duo's streaming_chunk \(8\)"):
        generate(model, prompts, chunk_size=20, streaming_chunk=8, **kwargs)
    with pytest.raises(DuoJaxError, match=r"chunk_size \(128\) must be a multiple of duo's streaming_chunk \(48\)"):
        generate(model, [prompts[0][:5]], chunk_size=128, streaming_chunk=48, **kwargs)  # a short prompt passed
    with pytest.raises(DuoJaxError, match="streaming_chunk must be an integer >= 1"):
        generate(model, prompts, streaming_chunk=0, **kwargs)


@pytest.mark.slow
def test_stops_at_eos(model, prompts):
    first = generate(model, prompts[1], max_new_tokens=6, stop_at_eos=False).tokens[0]
    eos_model = duo_jax.Model(
        CONFIG.__class__(**{**vars(CONFIG), "eos_token_ids": (first[2],)}), model.params, None, "random"
    )
    out = generate(eos_model, prompts[1], max_new_tokens=6)
    assert out.tokens[0] == first[: first.index(first[2]) + 1]


@pytest.mark.slow
def test_sampling_is_seeded_and_top_k_one_is_greedy(model, prompts):
    greedy = generate(model, prompts[0], max_new_tokens=8, stop_at_eos=False).tokens
    assert (
        generate(model, prompts[0], max_new_tokens=8, temperature=1.0, top_k=1, seed=3, stop_at_eos=False).tokens
        == greedy
    )
    a = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=1, stop_at_eos=False).tokens
    b = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=1, stop_at_eos=False).tokens
    c = generate(model, prompts[0], max_new_tokens=8, temperature=2.0, seed=2, stop_at_eos=False).tokens
    assert a == b and a != c
    nucleus = generate(
        model, prompts[0], max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=5, stop_at_eos=False
    ).tokens
    assert nucleus == greedy  # the smallest nucleus is the argmax token


def test_a_rows_draw_is_its_own_whatever_the_batch(model, prompts):
    """Row b draws with seed + b (or its own seed from a list): its tokens are those it gets alone with that seed
    (with one key for the batch, a prompt's tokens depended on its row), and equal prompts draw differently."""
    options = dict(max_new_tokens=6, temperature=1.5, top_k=40, stop_at_eos=False)
    a, b = prompts[0], prompts[1]
    alone = {seed: generate(model, a, seed=seed, **options).tokens[0] for seed in (5, 6)}
    assert generate(model, [b, a], seed=[9, 5], **options).tokens[1] == alone[5]
    assert generate(model, [b, a], seed=5, **options).tokens[1] == alone[6]
    twice = generate(model, [a, a], seed=5, **options).tokens
    assert twice == [alone[5], alone[6]] and alone[5] != alone[6]


def test_batch_buckets():
    sizes = (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 25, 33, 100)
    assert [batch_bucket(n) for n in sizes] == [1, 2, 3, 4, 6, 8, 8, 12, 16, 16, 24, 32, 40, 104]


def test_a_batch_runs_as_its_bucket_and_its_padding_rows_start_finished(model, prompts):
    """Five prompts run as 6 rows (`batch_bucket`) and compile nothing that six prompts of the same lengths did
    not; each prompt's tokens are its own, and the statistics are theirs. The padding row (a copy of the shortest
    prompt, drawing with the first row's seed) starts finished: a batch whose prompts stop at EOS stops there, not
    at max_new_tokens."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    rng = np.random.default_rng(4)
    prompts = [*prompts, *(rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (23, 35))]
    options = dict(max_new_tokens=16, temperature=1.0, seed=11, chunk_size=16)
    free = generate(model, prompts, stop_at_eos=False, **options)
    assert free.stats["batch_rows"] == 6 and free.stats["decode_steps"] == 15
    one = generate(model, prompts[0], stop_at_eos=False, **options).stats  # the same capacity: the statistics are
    for key in ("cache_bytes", "expected_cache_bytes", "full_cache_bytes"):  # the prompts', not the padding's
        assert free.stats[key] == 5 * one[key], key
    eos = tuple(sorted({row[3] for row in free.tokens}))  # each prompt stops by its fourth token
    eos_model = duo_jax.Model(dataclasses.replace(CONFIG, eos_token_ids=eos), model.params, None, "random")
    stopped = generate(eos_model, prompts, **options)
    alone = [generate(eos_model, p, **dict(options, seed=11 + b)).tokens[0] for b, p in enumerate(prompts)]
    assert stopped.tokens == alone and all(len(t) <= 4 for t in alone)
    assert stopped.stats["decode_steps"] == max(len(t) for t in alone) - 1
    before = len(compiles)
    six = generate(model, [*prompts, prompts[1][:5]], stop_at_eos=False, **options)
    assert len(compiles) == before and six.tokens[:5] == free.tokens and six.stats["batch_rows"] == 6
    assert plan_generation(model, prompts, pad_batch=False, max_new_tokens=16).batch == 5  # exactly the prompts


def test_new_sampling_values_compile_nothing(model, prompts):
    """temperature / top_p / top_k are runtime values of the compiled loop: each new value compiled the decode loop
    and the first-token sampler again (9-12 s a value on SmolLM2)."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    options = dict(max_new_tokens=5, stop_at_eos=False)
    generate(model, prompts[0], temperature=0.7, **options)  # warm-up
    before = len(compiles)
    for rule in (dict(temperature=0.9), dict(temperature=1.3, top_p=0.8), dict(temperature=0.5, top_k=7)):
        generate(model, prompts[0], seed=3, **rule, **options)
    assert len(compiles) == before


@pytest.mark.slow
def test_calls_inside_one_bucket_compile_nothing(model):
    """Prompt lengths 33..64 (one prefill chunk bucket), max_new_tokens 17..32 (one token-buffer bucket), one
    128-slot capacity: after a warm-up, 20 calls of random sizes compile nothing."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    rng = np.random.default_rng(5)
    generate(model, [1] * 40, max_new_tokens=20, chunk_size=256, stop_at_eos=False)  # warm-up: compiles
    before = len(compiles)
    for _ in range(20):
        prompt = rng.integers(0, CONFIG.vocab_size, int(rng.integers(33, 65))).tolist()
        out = generate(model, prompt, max_new_tokens=int(rng.integers(17, 33)), chunk_size=256, stop_at_eos=False)
        assert out.stats["chunk_size"] == 64
    assert len(compiles) == before
    generate(model, [1] * 40, max_new_tokens=4, stop_at_eos=False, context=200)
    assert len(compiles) > before  # the counter works: a new capacity is a new executable


def _python_loop(model, prompts, *, max_new_tokens, sampling, eos_ids, seed=0):
    """Reference decoding: one `extend` step and one draw per token, driven from Python (row b's token n drawn with
    fold_in(key(seed + b), n))."""
    import jax.numpy as jnp

    from duo_jax.engine import extend
    from duo_jax.methods import make_method
    from duo_jax.model import unstack_layers
    from duo_jax.sampling import sample_seeded

    method = make_method("full", CONFIG, context=max(map(len, prompts)) + max_new_tokens)
    params = unstack_layers(model.params)
    B, T = len(prompts), max(map(len, prompts))
    padded = np.zeros((B, T), np.int32)
    for b, p in enumerate(prompts):
        padded[b, : len(p)] = p
    cache = method.init_cache(B, jnp.float32)
    logits, cache, lengths = extend(
        params,
        cache,
        jnp.zeros((B,), jnp.int32),
        jnp.asarray(padded),
        jnp.asarray([len(p) for p in prompts]),
        config=CONFIG,
        method=method,
    )
    seeds, rule = np.arange(seed, seed + B, dtype=np.uint32), sampling.rows(B)

    def draw(logits, n):
        if sampling.greedy:
            return np.asarray(jnp.argmax(logits, -1))
        return np.asarray(sample_seeded(logits, seeds, np.full(B, n, np.int32), rule))

    rows = [draw(logits, 0)]
    while len(rows) < max_new_tokens and not np.isin(np.stack(rows, 1), eos_ids).any(axis=1).all():
        logits, cache, lengths = extend(
            params,
            cache,
            lengths,
            jnp.asarray(rows[-1])[:, None],
            jnp.ones((B,), jnp.int32),
            config=CONFIG,
            method=method,
        )
        rows.append(draw(logits, len(rows)))
    out = []
    for row in np.stack(rows, 1).tolist():
        hits = [i for i, t in enumerate(row) if t in eos_ids]
        out.append(row[: hits[0] + 1] if hits else row)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.9, top_k=20, top_p=0.8)], ids=["greedy", "top-k-p"])
def test_device_loop_matches_a_python_loop_with_eos_mid_batch(model, prompts, sampling):
    from duo_jax.sampling import Sampling

    batch = [prompts[0], prompts[1]]
    free = _python_loop(model, batch, max_new_tokens=12, sampling=Sampling(**sampling), eos_ids=())
    eos = free[1][4]  # the second sequence stops at its 5th token; the first runs on unless it meets it too
    eos_model = duo_jax.Model(dataclasses.replace(CONFIG, eos_token_ids=(eos,)), model.params, None, "random")
    ref = _python_loop(eos_model, batch, max_new_tokens=12, sampling=Sampling(**sampling), eos_ids=(eos,))
    out = generate(eos_model, batch, max_new_tokens=12, chunk_size=64, **sampling)
    assert out.tokens == ref
    assert len(out.tokens[1]) <= 5 and out.tokens[1][-1] == eos


def test_decode_is_a_pure_function_under_a_users_jit(model, prompts):
    """engine.decode under the caller's own jax.jit gives generate's tokens."""
    import jax.numpy as jnp

    from duo_jax.engine import decode, extend
    from duo_jax.methods import make_method
    from duo_jax.model import unstack_layers
    from duo_jax.sampling import Sampling

    method = make_method("full", CONFIG, context=64)
    params = unstack_layers(model.params)

    @jax.jit
    def my_generate(params, prompt, limit):
        logits, cache, lengths = extend(
            params,
            method.init_cache(1, jnp.float32),
            jnp.zeros((1,), jnp.int32),
            prompt,
            jnp.full((1,), prompt.shape[1], jnp.int32),
            config=CONFIG,
            method=method,
        )
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        tokens, steps, _, _ = decode(
            params,
            cache,
            lengths,
            first,
            jnp.zeros((1,), jnp.uint32),
            limit,
            Sampling().rows(1),
            config=CONFIG,
            method=method,
            greedy=True,
            max_tokens=16,
        )
        return tokens, steps

    tokens, steps = my_generate(params, jnp.asarray([prompts[0]]), jnp.int32(9))
    assert int(steps) == 9
    want = generate(model, prompts[0], max_new_tokens=16, stop_at_eos=False).tokens[0]
    assert np.asarray(tokens)[0, :10].tolist() == want[:10]
    # a limit past the buffer stops at its end (it ran on, writing each extra token over the last column)
    tokens, steps = my_generate(params, jnp.asarray([prompts[0]]), jnp.int32(30))
    assert int(steps) == 15 and np.asarray(tokens)[0].tolist() == want
    cache, one = method.init_cache(1, jnp.float32), jnp.ones((1,), jnp.int32)
    with pytest.raises(DuoJaxError, match="method must be a built Method, got str 'full'"):  # an AttributeError
        extend(params, cache, one - 1, one[:, None], one, config=CONFIG, method="full")


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(pattern=Pattern(GATES), sparsity=1.5), PatternError, r"\[0, 1\]"),
        (dict(pattern=Pattern(GATES), sparsity=-0.1), PatternError, r"\[0, 1\]"),
        (dict(pattern=Pattern(np.ones((4, 2)))), PatternError, "4x2.*3x2"),
        (dict(chunk_size=0), DuoJaxError, "chunk_size must be an integer >= 1"),
        (dict(chunk_size=8.5), DuoJaxError, "chunk_size must be an integer >= 1, got 8.5"),
        (dict(stop_at_eos="no"), DuoJaxError, "stop_at_eos must be True or False"),
        (dict(pad_batch=None), DuoJaxError, "pad_batch must be True or False"),
        (dict(seed="a"), DuoJaxError, "seed must be an integer"),
        (dict(sink=-1), DuoJaxError, "sink must be an integer >= 0"),
        (dict(sink=2.5), DuoJaxError, "sink must be an integer >= 0"),
        (dict(recent=-5), DuoJaxError, "recent must be an integer >= 0"),
        (dict(context=0), DuoJaxError, "context must be an integer >= 1"),
        (dict(max_new_tokens=250), DuoJaxError, "exceeds the model's context of 256"),
        (dict(context=32), DuoJaxError, "exceeds the cache capacity"),
        (dict(max_new_tokens=0), DuoJaxError, "max_new_tokens must be an integer >= 1"),
        (dict(top_p=0.0), DuoJaxError, "top_p"),
        (dict(temperature=float("nan")), DuoJaxError, "temperature must be a finite number"),
        (dict(top_k=1.5), DuoJaxError, "top_k must be an integer"),
        (dict(stop=["\n"]), DuoJaxError, r"generate\(\) takes no option 'stop'.*stop strings are the server's"),
        (dict(kv_bugdet=64), DuoJaxError, r"takes no option 'kv_bugdet'"),
        (dict(kv_budget=64), DuoJaxError, "method 'full' does not take kv_budget"),  # another method's option
        (dict(seed=2**32), DuoJaxError, "seed must be an integer >= 0 and <= 4294967295"),  # was seed 0 again
        # a setting that would be ignored, or a budget that would be overshot, is refused:
        (dict(sparsity=0.9), DuoJaxError, "method 'full' has no head pattern, so no sparsity to set; pass a pattern"),
        (dict(method="h2o", kv_budget=8, sparsity=0.5), DuoJaxError, "method 'h2o' has no head pattern"),
        (dict(pattern=Pattern(GATES), kv_budget=64, sparsity=0.2), DuoJaxError, "kv_budget or sparsity, not both"),
        (dict(pattern=Pattern(GATES), kv_budget=8, sink=4, recent=12), DuoJaxError, "below duo's streaming window"),
        (dict(method="streaming_llm", sink=4, start=8), DuoJaxError, "sink=4 and start=8 name one option"),
        (dict(pattern=Pattern(GATES), recent=0), DuoJaxError, "streaming heads need recent >= 1"),  # a ring of none
        (dict(method="streaming_llm", recent=0), DuoJaxError, "recent >= 1"),
        (dict(context=10**6), DuoJaxError, "context=1000000 is past the model's 256 positions"),  # a 10^6 cache
        (dict(chat="yes"), DuoJaxError, "chat must be None, True or False, got 'yes'"),  # was taken as True
        (dict(chat=0), DuoJaxError, "chat must be None, True or False, got 0"),
        (dict(prompt_tail_steps=1.5), DuoJaxError, "prompt_tail_steps must be an integer >= 0, got 1.5"),  # was 1
        (dict(pattern=GATES), DuoJaxError, r"pattern must be a Pattern.*duo_jax.Pattern\(gates\)"),
    ],
)
def test_bad_arguments_are_clear_errors(model, prompts, kwargs, error, message):
    with pytest.raises(error, match=message):
        generate(model, prompts[0], **kwargs)


@pytest.mark.slow
def test_a_top_k_at_or_above_the_vocabulary_is_no_limit(model, prompts):
    """top_k >= the vocabulary keeps every token: the tokens of top_k 0 (no error from lax.top_k)."""
    options = dict(max_new_tokens=4, temperature=1.0, seed=3, stop_at_eos=False)
    free = generate(model, prompts[0], **options).tokens
    assert generate(model, prompts[0], top_k=CONFIG.vocab_size, **options).tokens == free
    assert generate(model, prompts[0], top_k=50_000, **options).tokens == free


def test_a_chat_message_of_no_text_and_a_method_off_the_mesh_are_refused_before_any_work(model, prompts):
    with pytest.raises(DuoJaxError, match="a chat message's content must be a string, got NoneType"):
        generate(model, [{"role": "user", "content": None}])  # the template's TypeError before
    with pytest.raises(DuoJaxError, match="a chat message alone in a batch"):
        generate(model, [[1, 2, 3], {"role": "user", "content": "there"}])  # "got dict of object with shape ()"
    with pytest.raises(DuoJaxError, match="mesh must be a jax.sharding.Mesh, got str 'data=1,model=1'"):
        plan_generation(model, prompts[0], mesh="data=1,model=1")  # an AttributeError before
    mesh = duo_jax.sharding.make_generation_mesh(data=1, model=1)
    with pytest.raises(DuoJaxError, match="method 'h2o' does not run on a device mesh"):
        plan_generation(model, prompts[0], method="h2o", kv_budget=8, mesh=mesh)  # refused by the run before


def test_bad_prompts_are_clear_errors(model):
    with pytest.raises(DuoJaxError, match="empty"):
        generate(model, [[]])
    with pytest.raises(DuoJaxError, match=r"token ids must lie in \[0, 128\)"):
        generate(model, [5, 900])
    with pytest.raises(LoadError, match="needs a tokenizer"):
        generate(model, "hello")


@pytest.mark.parametrize(
    "prompts, message",
    [
        (None, "got NoneType"),
        (7, "got int"),
        ({"role": "user"}, "got dict"),
        ([1.5, 2.0], "integer token ids; got list of float64"),  # truncated to [1, 2] before
        (np.array([3.0, 4.0]), "got ndarray of float64"),
        ([True, False], "got list of bool"),
        ([[[1, 2]]], r"with shape \(1, 2\)"),
        ([[1, "a"]], "integer token ids"),
    ],
)
def test_prompts_neither_text_nor_integer_ids_are_clear_errors(model, prompts, message):
    with pytest.raises(DuoJaxError, match=message):
        plan_generation(model, prompts, max_new_tokens=2, chunk_size=8)


def test_numpy_integers_are_integer_options(model, prompts):
    plan = plan_generation(
        model, prompts, max_new_tokens=np.int64(4), chunk_size=np.int32(8), top_k=np.int16(3), context=np.int64(64)
    )
    assert plan.chunk == 8 and plan.sampling.top_k == 3 and plan.capacity == 64
    assert plan_generation(model, prompts, max_new_tokens=np.int64(4)).capacity == 128  # a bucket


def test_integer_arrays_are_token_id_prompts(model, prompts):
    """A 1-D integer array is one prompt, a 2-D one a batch: the ids of the same lists."""
    as_lists = plan_generation(model, [prompts[0][:4], prompts[1][:4]], max_new_tokens=2, chunk_size=8).ids
    batch = np.asarray(as_lists, np.int32)
    assert plan_generation(model, batch, max_new_tokens=2, chunk_size=8).ids == as_lists
    assert plan_generation(model, jnp.asarray(batch[0]), max_new_tokens=2, chunk_size=8).ids == as_lists[:1]
    assert plan_generation(model, tuple(np.int64(t) for t in batch[1]), max_new_tokens=2, chunk_size=8).ids == [
        as_lists[1]
    ]


def test_a_caller_owned_engine_runs_the_same_generation(model, prompts):
    """generate(engine=) runs on the caller's engine: the same tokens; an engine of other weights is refused."""
    engine = Engine(model.params, CONFIG)
    kwargs = dict(max_new_tokens=6, chunk_size=8, stop_at_eos=False, pattern=Pattern(GATES), sparsity=0.5)
    own = generate(model, prompts[1], engine=engine, **kwargs)
    assert own.tokens == generate(model, prompts[1], **kwargs).tokens
    other = Engine(duo_jax.init_params(CONFIG, jax.random.key(7), scale=0.2), CONFIG)
    with pytest.raises(DuoJaxError, match="engine= was built from other weights"):
        generate(model, prompts[1], engine=other, **kwargs)
    plan = plan_generation(model, [prompts[1]], **kwargs)  # the plan / run path too: it ran the other weights
    with pytest.raises(DuoJaxError, match="engine= was built from other weights"):
        run_generation(model, other, plan)


def test_generate_inside_jit_says_what_to_use(model, prompts):
    """generate is a host loop: traced inside the caller's jax.jit it failed with JAX's tracer conversion error."""
    with pytest.raises(DuoJaxError, match="cannot be traced inside jax.jit: .* extend / decode"):
        jax.jit(lambda ids: generate(model, ids, max_new_tokens=2).tokens)(jnp.asarray([prompts[0]]))


def test_a_built_method_refuses_the_options_it_would_ignore(model, prompts):
    """A built Method carries its settings: generate's method options and context beside it were ignored (the
    tokens were the built method's), as kv_dtype already was not."""
    from duo_jax.methods import make_method

    built = make_method("duo", CONFIG, context=256, pattern=Pattern(GATES), sparsity=0.5, sink=2, recent=6)
    for options, named in [
        (dict(sparsity=1.0), "sparsity"),
        (dict(sink=1, recent=1), "sink, recent"),
        (dict(kv_budget=3), "kv_budget"),
        (dict(pattern=Pattern(GATES)), "pattern"),
    ]:
        with pytest.raises(DuoJaxError, match=f"{named} configure the method generate builds, but method= is"):
            plan_generation(model, prompts, method=built, max_new_tokens=4, **options)
    with pytest.raises(DuoJaxError, match="context=400 asks for more than the built method's capacity of 256"):
        plan_generation(model, prompts, method=built, max_new_tokens=4, context=400)
    assert plan_generation(model, prompts, method=built, max_new_tokens=4, context=200).method is built  # a check
    assert plan_generation(model, prompts, method=built, max_new_tokens=4).method is built


def test_plan_checks_and_plans_before_any_device_work(model, prompts):
    """plan_generation decides what generate runs: capacity bucket, chunk, method; bad options fail there."""
    plan = plan_generation(model, prompts, max_new_tokens=20, chunk_size=16, pattern=Pattern(GATES), sparsity=0.5)
    assert plan.ids == prompts and plan.method.name == "duo" and plan.chunk == 16
    assert plan.capacity >= max(map(len, prompts)) + 20 and plan.eos_ids == tuple(CONFIG.eos_token_ids)
    with pytest.raises(DuoJaxError, match="prompt_tail_steps must lie in"):
        plan_generation(model, prompts, prompt_tail_steps=17)


def test_the_old_name_of_impl_still_works_with_a_warning(model, prompts):
    kwargs = dict(max_new_tokens=4, chunk_size=8, stop_at_eos=False)
    with pytest.warns(DeprecationWarning, match="renamed generate\\(impl=\\)"):
        old = generate(model, prompts[0], attention_impl="xla", **kwargs)
    assert old.tokens == generate(model, prompts[0], impl="xla", **kwargs).tokens
    with pytest.raises(DuoJaxError, match="impl \\(the attention implementation\\) must be one of"):
        generate(model, prompts[0], impl="cuda", **kwargs)


@pytest.mark.parametrize(
    "method, options",
    [("snapkv", dict(kv_budget=32, prompt_tail_steps=3)), ("h2o", dict(kv_budget=24)), ("duo", dict(pattern=GATES))],
)
def test_compile_steps_compiles_everything_a_generation_runs(model, prompts, method, options):
    """After `compile_steps(engine, plan)` (what a caller runs ahead, in another thread), running the plan compiles
    no step: SnapKV decodes (and steps the prompt's tail) with another method than it prefills with
    (`decode_method`), known before the prefill. So `prefill_s` and `decode_s` hold no compile either."""
    from duo_jax import engine as engine_lib
    from duo_jax.generation import compile_steps, run_generation

    def compiles():
        return engine_lib._compiled_extend.cache_info().misses + engine_lib._compiled_decode.cache_info().misses

    if "pattern" in options:
        options = dict(options, pattern=Pattern(options["pattern"]))
    plan = plan_generation(model, [prompts[0], prompts[2]], method=method, max_new_tokens=5, chunk_size=24, **options)
    engine = Engine.of(model)
    before = compiles()
    compile_steps(engine, plan)
    assert compiles() > before  # this test's shapes are its own: the counter sees them
    before = compiles()
    out = run_generation(model, engine, plan)
    assert compiles() == before and out.stats["method"] == method and len(out.tokens[0]) == 5
