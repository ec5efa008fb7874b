"""The scheduler's mixed steps split JetStream's way (a decode step over the batch, then one chunk of the oldest
prefilling request alone on its row of the cache): the same greedy tokens as padded steps and as `generate`
alone, fewer positions computed, every page back; and the engine pieces this rests on (a row fed nothing is
left unchanged, `extend_row` changes its row only)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.cache import make_layout
from duo_jax.engine import Engine, compiled_extend, compiled_extend_row
from duo_jax.errors import DuoJaxError
from duo_jax.methods.duo import DuoAttention
from duo_jax.methods.paged import paged
from duo_jax.serve import Request, Scheduler
from tests.conftest import tiny_config

CONFIG = tiny_config()
CHUNK, NEW = 8, 6
MODEL = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), None, "random")
PROMPTS = [np.random.default_rng(20 + i).integers(1, 128, n).tolist() for i, n in enumerate((13, 27, 18, 9))]


def method_of(name):
    mask = np.array([[True, False], [False, True]]) if name == "duo" else None
    return DuoAttention(make_layout(CONFIG, mask, sink=2, recent=5, context=64))


@functools.cache
def solo(name):
    """Each prompt's greedy tokens from `generate` alone."""
    return [
        duo_jax.generate(
            MODEL, p, method=method_of(name), max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False
        ).tokens[0]
        for p in PROMPTS
    ]


def serve(method, mixed):
    """Request 0 alone for 3 steps (it decodes from step 2), then 1 and 2 join (prefilling while 0 decodes);
    3 joins after 3 more steps. Returns (the scheduler, the requests)."""
    s = Scheduler(
        Engine.of(MODEL), paged(method, page_size=4, num_pages=48), slots=3, chunk=CHUNK, impl="xla", mixed=mixed
    )
    requests = [s.submit(Request(PROMPTS[0], max_tokens=NEW, stop_at_eos=False))]
    for _ in range(3):
        s.step()
    requests += [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PROMPTS[1:3]]
    for _ in range(3):
        s.step()
    requests.append(s.submit(Request(PROMPTS[3], max_tokens=NEW, stop_at_eos=False)))
    s.run()
    assert s.pool.num_free == s.pool.num_pages and s.pages_in_use() == 0 and not any(s.pool.refs)
    assert (s.tables == s.pool.num_pages).all() and not any(s.running)
    return s, requests


@pytest.mark.slow
@pytest.mark.parametrize("name", ["duo", "full"])
def test_split_mixed_steps_give_the_padded_and_solo_tokens_with_fewer_positions(name):
    split, split_requests = serve(method_of(name), "split")
    padded, padded_requests = serve(method_of(name), "padded")
    for r, q, expected in zip(split_requests, padded_requests, solo(name)):
        assert r.tokens == q.tokens == expected and r.finish_reason == "length"
    # Mixed steps ran as two calls (a decode step, a prefill chunk alone) under split, one under padded.
    assert split.counters["calls"] > split.counters["steps"] and padded.counters["calls"] == padded.counters["steps"]
    assert split.counters["row_tokens"] < padded.counters["row_tokens"]
    assert split.counters["prompt_tokens"] == padded.counters["prompt_tokens"] == sum(map(len, PROMPTS))
    assert split.counters["tokens"] == padded.counters["tokens"] == NEW * len(PROMPTS)


@pytest.mark.slow
def test_a_short_pool_preempts_under_split_and_all_complete():
    """10 pages of 4 tokens: prefilling requests wait their turn, growing ones preempt the newest; the tokens
    are still the solo ones and every page comes back."""
    s = Scheduler(
        Engine.of(MODEL), paged(method_of("duo"), page_size=4, num_pages=10), slots=3, chunk=CHUNK, impl="xla"
    )
    requests = [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PROMPTS]
    while s.step() or not s.idle:
        assert s.pages_in_use() == sum(len(slot.pages) for slot in s.running if slot) <= 10
    assert s.counters["preemptions"] > 0
    assert [r.tokens for r in requests] == solo("duo")
    assert s.pool.num_free == s.pool.num_pages and not any(s.running)


@pytest.mark.slow
def test_rows_fed_nothing_are_unchanged_and_extend_row_changes_its_row_only():
    method = paged(method_of("duo"), page_size=4, num_pages=12)
    engine = Engine.of(MODEL)
    tables = np.full((2, method.pages_per_sequence), 12, np.int32)
    tables[0, :3], tables[1, :3] = [0, 1, 2], [3, 4, 5]
    fill = compiled_extend(CONFIG, method, 2, CHUNK, engine.dtype, "xla")
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, 128, (2, CHUNK)), jnp.int32)
    cache = dataclasses.replace(method.empty_cache(2, engine.dtype), block_tables=jnp.asarray(tables))
    _, cache, lengths = fill(
        engine.params, cache, jnp.zeros(2, jnp.int32), tokens, jnp.asarray([8, 8], jnp.int32), None
    )
    before = jax.tree.map(np.array, cache)

    # A T = 1 step feeding row 1 only: row 0's streaming rows and pages stay as they were.
    step = compiled_extend(CONFIG, method, 2, 1, engine.dtype, "xla")
    _, after, new_lengths = step(engine.params, cache, lengths, tokens[:, :1], jnp.asarray([0, 1], jnp.int32), None)
    assert np.asarray(new_lengths).tolist() == [8, 9]
    for old, new in zip(before.layers, after.layers):
        np.testing.assert_array_equal(old.streaming_k[0], new.streaming_k[0])
        np.testing.assert_array_equal(old.streaming_v[0], new.streaming_v[0])
        np.testing.assert_array_equal(old.pages_k[:, :3], new.pages_k[:, :3])
    before = jax.tree.map(np.array, after)

    # A chunk for row 0 alone: row 1 and its pages unchanged, row 0's as `extend` at batch 1 gives them.
    row = compiled_extend_row(CONFIG, method, 2, CHUNK, engine.dtype, "xla")
    logits, after, new_lengths = row(
        engine.params, after, jnp.asarray(0, jnp.int32), new_lengths, tokens[1:], jnp.asarray([5], jnp.int32), None
    )
    assert logits.shape == (1, CONFIG.vocab_size) and np.asarray(new_lengths).tolist() == [13, 9]
    alone = compiled_extend(CONFIG, method, 1, CHUNK, engine.dtype, "xla")
    expected, part, _ = alone(
        engine.params,
        method.take_row(jax.tree.map(jnp.asarray, before), 0),
        jnp.asarray([8], jnp.int32),
        tokens[1:],
        jnp.asarray([5], jnp.int32),
        None,
    )
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))
    for old, new, ref in zip(before.layers, after.layers, part.layers):
        np.testing.assert_array_equal(old.streaming_k[1], new.streaming_k[1])
        np.testing.assert_array_equal(np.asarray(ref.streaming_k[0]), new.streaming_k[0])
        np.testing.assert_array_equal(old.pages_k[:, 3:], new.pages_k[:, 3:])
        np.testing.assert_array_equal(np.asarray(ref.pages_v), new.pages_v)


def test_unknown_mixed_policy_is_refused():
    with pytest.raises(DuoJaxError, match="mixed"):
        Scheduler(
            Engine.of(MODEL), paged(method_of("full"), page_size=4, num_pages=8), slots=2, chunk=CHUNK, mixed="ragged"
        )
