"""SnapKV and PyramidKV in the engine against a float64 numpy model that states the method directly.

The reference runs the whole sequence (prompt, then the tokens after it) with explicit per-head key sets:
a prompt token sees every earlier token (exact prefill); at the end of the prompt each layer selects, per KV
head, from its own float64 attention: the last `window` queries' softmax over the prompt, summed over the
window and the head's query heads, on the prefix keys only; torch-style pooling (padding -inf / zero,
average divided by the kernel); the `budget` best (earlier token on ties) plus the window; a token after the
prompt sees its head's kept tokens and every token after the prompt up to itself. With a sliding window W on a
layer, every query sees only the keys i - W < j <= i (the votes included), and no token out of every later
query's window (j <= P - W) is selected or kept.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import duo_jax
from duo_jax.engine import extend
from duo_jax.errors import DuoJaxError
from duo_jax.generation import generate
from duo_jax.methods import cache_nbytes, make_method
from duo_jax.methods.headkv import make_headkv
from duo_jax.methods.snapkv import SnapKV, make_pyramidkv, make_snapkv, pyramid_budgets
from duo_jax.model import unstack_layers
from tests.conftest import tiny_config
from tests.reference_decoder import decode, softmax64

CONFIG = tiny_config(max_position_embeddings=128)
WINDOW = 6


# --- the float64 reference ----------------------------------------------------------------------------


def reference_selection(q, k, budgets, window, kernel, pooling, sliding=None):
    """Kept prompt positions per KV head (sets), from the prompt's rotated q [P, H, E] and k [P, K, E]; with the
    layer's `sliding` window W, votes under it and nothing out of every later window (j <= P - W) kept."""
    P, H, E = q.shape
    K = k.shape[1]
    G = H // K
    W = sliding or P + 1
    prefix = max(P - window, 0)
    votes = np.zeros((K, prefix))
    for i in range(prefix, P):
        first = max(i - W + 1, 0)
        for h in range(H):
            probs = np.zeros(i + 1)
            probs[first:] = softmax64(k[first : i + 1, h // G] @ q[i, h] / math.sqrt(E))
            votes[h // G] += probs[:prefix]
    pad = kernel // 2
    padded = np.pad(votes, ((0, 0), (pad, pad)), constant_values=-np.inf if pooling == "max" else 0.0)
    windows = np.stack([padded[:, j : j + kernel] for j in range(prefix)], axis=-1)  # [K, kernel, prefix]
    pooled = windows.max(axis=1) if pooling == "max" else windows.sum(axis=1) / kernel
    visible = np.arange(prefix) > P - W
    window_tokens = set(range(max(prefix, P - W + 1), P))
    return [
        set(
            j
            for j in np.argsort(-np.where(visible, pooled[h], -np.inf), kind="stable")[: budgets[h]].tolist()
            if visible[j]
        )
        | window_tokens
        for h in range(K)
    ]


def reference_logits(
    params,
    config,
    tokens,
    prompt_len,
    budgets,
    *,
    window=WINDOW,
    kernel=5,
    pooling="avg",
    streaming=None,
    sink=0,
    recent=0,
    chunk_starts=None,
):
    """Logits [T, V] of one sequence and the kept positions [L][K] (sets), all float64; each layer within its
    sliding window (`config.layer_window`).

    `streaming` ([L][K] bools) marks DuoAttention streaming heads: a query at position i in a chunk that starts
    at chunk_starts[i] sees the keys j <= i with j < sink or j >= chunk_starts[i] - recent."""
    T = len(tokens)
    kept_all = []

    def seen(layer):
        l = layer.index
        sliding = config.layer_window(l)
        P = prompt_len
        kept = reference_selection(layer.q[:P], layer.k[:P], budgets[l], window, kernel, pooling, sliding)
        kept_all.append(kept)
        keys = np.zeros((config.num_kv_heads, T, T), bool)
        for kv, i in np.ndindex(config.num_kv_heads, T):
            if streaming is not None and streaming[l][kv]:
                visible = [j for j in range(i + 1) if j < sink or j >= chunk_starts[i] - recent]
            elif i < P:
                visible = list(range(i + 1))
            else:
                visible = sorted(kept[kv]) + list(range(P, i + 1))
            keys[kv, i, [j for j in visible if sliding is None or i - j < sliding]] = True
        return keys

    return decode(params, config, tokens, seen).logits, kept_all


# --- driving the engine -------------------------------------------------------------------------------


def run_engine(params, config, method, prompts, continuations, *, chunk=8, first=3):
    """Prefill `prompts` (ragged) in chunks, compress, then feed `continuations` (equal lengths): the first
    `first` tokens as one chunk, the rest one token per step. Returns per-sequence logits [T, V], the
    compressed cache, the decode method, and the cache bytes before compression."""
    prepared = unstack_layers(params)
    B = len(prompts)
    lens = np.array([len(p) for p in prompts])
    cache, lengths = method.init_cache(B, jnp.float32), jnp.zeros((B,), jnp.int32)
    logits = [[] for _ in prompts]

    def feed(tokens, n_valid, m):
        nonlocal cache, lengths
        out, cache, lengths = extend(
            prepared,
            cache,
            lengths,
            jnp.asarray(tokens, jnp.int32),
            jnp.asarray(n_valid, jnp.int32),
            config=config,
            method=m,
            all_logits=True,
        )
        for b in range(B):
            logits[b].extend(np.asarray(out[b, : n_valid[b]]))

    for start in range(0, lens.max(), chunk):
        n_valid = np.clip(lens - start, 0, chunk)
        tokens = np.zeros((B, chunk), np.int32)
        for b, p in enumerate(prompts):
            tokens[b, : n_valid[b]] = p[start : start + n_valid[b]]
        feed(tokens, n_valid, method)
    prefill_bytes = cache_nbytes(cache)
    assert prefill_bytes == method.expected_cache_bytes(B, 4)
    decode, cache = method.after_prefill(cache, lengths)
    assert cache_nbytes(cache) == decode.expected_cache_bytes(B, 4)
    cont = np.asarray(continuations)
    feed(cont[:, :first], [first] * B, decode)
    for t in range(first, cont.shape[1]):
        feed(cont[:, t : t + 1], [1] * B, decode)
    return [np.stack(l) for l in logits], cache, decode, prefill_bytes


def kept_sets(cache, decode, b):
    """Kept prompt positions [L][K] (sets) of sequence b in a compressed cache."""
    out = []
    for layer, slots in zip(cache, decode.head_slots):
        positions = np.asarray(layer.positions[b])
        bounds = np.cumsum((0,) + slots)
        out.append([set(positions[s:e][positions[s:e] >= 0].tolist()) for s, e in zip(bounds[:-1], bounds[1:])])
    return out


@pytest.fixture(scope="module")
def params():
    return duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2)


@pytest.fixture(scope="module")
def sequences():
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (45, 38)]
    return prompts, rng.integers(0, CONFIG.vocab_size, (2, 7)).tolist()


def check_against_reference(params, method, prompts, continuations, kernel, pooling):
    logits, cache, decode, _ = run_engine(params, CONFIG, method, prompts, continuations)
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        ref, kept = reference_logits(
            params, CONFIG, prompt + cont, len(prompt), method.budgets, kernel=kernel, pooling=pooling
        )
        assert kept_sets(cache, decode, b) == kept
        for l, row in enumerate(method.budgets):  # the budget binds: each head keeps exactly budget + window
            assert [len(s) for s in kept[l]] == [n + WINDOW for n in row]
        np.testing.assert_array_less(np.abs(logits[b] - ref).max(), 1e-4)
    return logits, cache, decode


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, options",
    [
        (make_snapkv, dict(kernel=5, pooling="avg")),
        (make_pyramidkv, dict(kernel=7, pooling="max", beta=4.0)),
    ],
)
def test_matches_the_float64_reference(params, sequences, make, options):
    prompts, continuations = sequences
    method = make(CONFIG, context=64, kv_budget=16, window=WINDOW, **options)
    if make is make_pyramidkv:
        assert method.budgets == ((18, 18), (2, 2))  # k = 10: top 10 / 4 -> 2, bottom 20 - 2
    logits, _, decode = check_against_reference(
        params, method, prompts, continuations, options["kernel"], options["pooling"]
    )
    assert decode.name == method.name
    # The compression matters: full attention gives clearly different logits after the prompt.
    full, _, _, _ = run_engine(params, CONFIG, make_method("full", CONFIG, context=64), prompts, continuations)
    assert np.abs(full[0][45:] - logits[0][45:]).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, options",
    [
        (make_snapkv, dict(kernel=5, pooling="avg")),
        (make_headkv, dict(kernel=7, pooling="max", scores=np.array([[0.9, 0.1], [0.3, 0.7]]), beta=1.25)),
    ],
)
def test_windowed_layer_matches_the_float64_reference(params, sequences, make, options):
    """Layer 1 with a 20-token window (layer 0 none), the prompts 45 and 38 tokens: layer 1's votes are the
    windowed attention's, and each head keeps its budget's best among the 13 visible prefix tokens
    (P - 20 < j < P - 6) plus the observation window, never a token out of the window. Kept sets and logits
    (ragged batch, chunked prefill, a 3-token chunk then decode steps) are the reference's."""
    config = dataclasses.replace(CONFIG, sliding_window=20, window_layers=(1,))
    prompts, continuations = sequences
    method = make(config, context=64, kv_budget=16, window=WINDOW, **options)
    logits, cache, decode, _ = run_engine(params, config, method, prompts, continuations)
    for b, (prompt, cont) in enumerate(zip(prompts, continuations)):
        P = len(prompt)
        ref, kept = reference_logits(
            params, config, prompt + cont, P, method.budgets, kernel=options["kernel"], pooling=options["pooling"]
        )
        assert kept_sets(cache, decode, b) == kept
        for n, heads in zip(method.budgets[1], kept[1]):
            assert P - 20 < min(heads) and len(heads) == min(n, 13) + WINDOW
        np.testing.assert_array_less(np.abs(logits[b] - ref).max(), 1e-4)
    unwindowed, _, _, _ = run_engine(
        params, CONFIG, make(CONFIG, context=64, kv_budget=16, window=WINDOW, **options), prompts, continuations
    )
    assert np.abs(unwindowed[0] - logits[0]).max() > 1e-2  # the window changed the result


@pytest.mark.slow
@pytest.mark.parametrize(
    "make, options",
    [
        (make_snapkv, dict(kernel=5, pooling="avg")),
        (make_pyramidkv, dict(kernel=7, pooling="max", beta=4.0)),
        (make_headkv, dict(kernel=7, pooling="max", scores=np.array([[0.9, 0.1], [0.3, 0.7]]), beta=1.25)),
    ],
)
def test_budgets_as_data_share_steps_and_each_matches_the_reference(params, sequences, make, options):
    """With budget_slots 24 the decode cache is shaped for a kv_budget of 24 and the budgets are runtime data, the
    room for new tokens 16 whatever the capacity: kv_budgets 16, 10 and 24 (window 6) run one set of compiled steps
    (prefill chunks, the compression, decode), and each keeps the tokens and gives the logits of the float64
    reference at its own budgets (the ranks past a head's budget left empty)."""
    from duo_jax.methods import snapkv

    prompts, continuations = sequences
    compiled = []
    for kv_budget in (16, 10, 24):
        method = make(CONFIG, context=64, kv_budget=kv_budget, window=WINDOW, budget_slots=24, room=16, **options)
        before = extend._cache_size() + snapkv._compress._cache_size()
        _, _, decode = check_against_reference(
            params, method, prompts, continuations, options["kernel"], options["pooling"]
        )
        compiled.append(extend._cache_size() + snapkv._compress._cache_size() - before)
        assert decode.room == 16 and decode == method.decode_method(45)
    assert compiled[0] > 0 and compiled[1:] == [0, 0], compiled
    with pytest.raises(DuoJaxError, match="budget_slots \\(12\\) must be at least kv_budget \\(16\\)"):
        make(CONFIG, context=64, kv_budget=16, window=WINDOW, budget_slots=12, **options)


def test_room_bounds_the_tokens_generated(params):
    """A room for new tokens smaller than what generate would write is refused before anything runs (the ring would
    otherwise overwrite the oldest generated tokens)."""
    model = duo_jax.Model(CONFIG, params, None, "random")
    method = make_snapkv(CONFIG, context=100, kv_budget=12, window=4, room=8)
    generate(model, [5, 6, 7, 8, 9, 10], method=method, max_new_tokens=8, context=100)
    with pytest.raises(
        DuoJaxError, match="max_new_tokens \\(9\\) \\+ prompt_tail_steps \\(0\\) exceeds the snapkv cache's room of 8"
    ):
        generate(model, [5, 6, 7, 8, 9, 10], method=method, max_new_tokens=9, context=100)


@pytest.mark.slow
def test_budget_covering_the_prompt_is_full_attention(params, sequences):
    prompts, continuations = sequences
    method = make_snapkv(CONFIG, context=64, kv_budget=45, window=WINDOW)
    logits, cache, decode, prefill_bytes = run_engine(params, CONFIG, method, prompts, continuations)
    full, _, _, _ = run_engine(params, CONFIG, make_method("full", CONFIG, context=64), prompts, continuations)
    for ours, theirs in zip(logits, full):
        np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4)
    assert kept_sets(cache, decode, 1) == [[set(range(38))] * 2] * 2
    # A full prefill cache plus the query ring: [B, C, K, E] K and V and [B, window, H, E] per layer.
    assert prefill_bytes == 2 * 2 * (2 * 128 * 2 + WINDOW * 4) * 16 * 4
    # Decode: the held prompt (45 + the window, capped at the 128-token block) and room for 128 new tokens.
    assert decode.head_slots == ((45, 45), (45, 45)) and decode.room == 128


def test_short_prompts_shrink_the_decode_cache(params):
    method = make_snapkv(CONFIG, context=300, kv_budget=200, window=WINDOW)
    decode = method.decode_method(longest=100)
    assert decode.head_slots == ((128, 128), (128, 128))  # every prompt fits in one 128-token block
    assert decode.room == 384  # capacity 384; the prompts take part of the first block
    assert method.decode_method(longest=300).head_slots == ((200, 200), (200, 200))
    assert method.decode_method(longest=300).room == 384 - 256


@pytest.mark.slow
def test_pyramid_moves_the_bottom_surplus_up_for_a_short_prompt(params, sequences):
    """A bottom budget larger than the prompt's prefix: the bottom keeps the prefix and the top the rest, as the
    original PyramidKV (not truncated); the engine then matches the float64 reference with those budgets."""
    prompt, cont = sequences[0][0], sequences[1][0]  # 45 tokens: a prefix of 39 before the 6-token window
    method = make_pyramidkv(CONFIG, context=64, kv_budget=30, window=WINDOW, beta=4.0, kernel=5, pooling="avg")
    assert method.budgets == ((42, 42), (6, 6))  # k = 24: top 24 / 4 = 6, bottom 48 - 6 = 42 > 39
    logits, cache, decode, _ = run_engine(params, CONFIG, method, [prompt], [cont])
    spread = ((39, 39), (9, 9))  # bottom = the prefix, top = 48 - 39: the 48 tokens are all kept
    assert method.prompt_budgets(45) == spread and method.prompt_budgets(100) == method.budgets
    assert decode.head_slots == ((45, 45), (15, 15))
    ref, kept = reference_logits(params, CONFIG, prompt + cont, len(prompt), spread, kernel=5, pooling="avg")
    assert kept_sets(cache, decode, 0) == kept and [len(s) for s in kept[1]] == [15, 15]
    np.testing.assert_array_less(np.abs(logits[0] - ref).max(), 1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("make", [make_pyramidkv, make_snapkv, make_headkv])
@pytest.mark.parametrize("budget_slots", [None, 64])
def test_a_row_keeps_what_it_keeps_alone(params, make, budget_slots):
    """Prompts of 40 and 100 tokens in one batch: each row gives its tokens alone (greedy, float32). PyramidKV
    re-spreads its pyramid by each row's own prefix (it took the longest's for every row, so the short one kept
    fewer tokens than its budget, and others), the decode cache shaped for the most any row's gives a layer."""
    model = duo_jax.Model(CONFIG, params, None, "random")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, CONFIG.vocab_size, n).tolist() for n in (40, 100)]
    options = dict(kv_budget=40, window=WINDOW, budget_slots=budget_slots)
    if make is make_headkv:
        options["scores"] = rng.random((CONFIG.num_layers, CONFIG.num_kv_heads))
    method = make(CONFIG, context=112, **options)
    kwargs = dict(method=method, max_new_tokens=8, chunk_size=32, stop_at_eos=False)
    batch = generate(model, prompts, **kwargs).tokens
    assert batch == [generate(model, [p], **kwargs).tokens[0] for p in prompts]
    if make is make_pyramidkv and budget_slots is None:
        assert method.prompt_budgets(40) != method.prompt_budgets(100)  # the short row's pyramid is its own
        shaped = method.decode_method(100, [40, 100]).head_slots
        assert all(a >= b for both in zip(shaped, method.decode_method(40).head_slots) for a, b in zip(*both))


@pytest.mark.parametrize("make", [make_pyramidkv, make_headkv])
def test_budgets_as_data_shape_the_decode_cache_by_length_buckets(make):
    """Under `budget_slots`, at half of each prompt of 300 to 3,000 tokens (PyramidKV re-spreads its pyramid by the
    prompt's own prefix, HeadKV's strongest heads are capped by the prompt), the decode cache's shape follows the
    buckets of the prompt's length and of its budget, not the length: before, it moved with every 128 tokens of the
    prompt, one compile each. Every head's slots still hold what the prompt keeps (its budget, capped by the
    prompt)."""
    from duo_jax.cache import capacity_bucket
    from duo_jax.methods.snapkv import held_tokens

    config = tiny_config(num_layers=12, max_position_embeddings=4096)
    scores = np.random.default_rng(0).random((config.num_layers, config.num_kv_heads))
    options = dict(scores=scores) if make is make_headkv else {}
    shapes = {}
    for n in range(300, 3000, 11):
        budget, capacity = n // 2, capacity_bucket(n + 4)
        method = make(config, context=capacity, kv_budget=budget, budget_slots=capacity_bucket(budget), **options)
        decode = method.decode_method(n, [n])
        shapes.setdefault((capacity_bucket(n), capacity, capacity_bucket(budget)), set()).add(decode.head_slots)
        held = held_tokens(method.capacity, n) - method.window
        for row, slots in zip(method.prompt_budgets(n), decode.head_slots):
            assert all(min(b, held) <= s - method.window for b, s in zip(row, slots))
    assert all(len(shaped) == 1 for shaped in shapes.values()), {k: len(v) for k, v in shapes.items()}


def test_pyramid_budgets():
    assert pyramid_budgets(1, 100) == [100]
    budgets = pyramid_budgets(32, 100)  # top 100 / 20 = 5, bottom 195
    assert budgets[0] == 195 and budgets[-1] == 5 and sum(budgets) == 3200
    assert all(a >= b for a, b in zip(budgets, budgets[1:]))
    assert sum(pyramid_budgets(5, 7, beta=3.0)) == 35
    assert pyramid_budgets(3, 7, beta=1.0) == [7, 7, 7]
    assert pyramid_budgets(4, 10, beta=4.0, prefix=12) == [12, 11, 9, 8]  # bottom 17.5 > 12: 12 .. 8, sum 40
    assert pyramid_budgets(4, 10, beta=4.0, prefix=18) == pyramid_budgets(4, 10, beta=4.0)  # the prefix holds it
    with pytest.raises(DuoJaxError, match="beta must be >= 1"):
        pyramid_budgets(4, 10, beta=0.5)


@pytest.mark.slow
def test_generate_compresses_and_decode_does_not_recompile(params):
    model = duo_jax.Model(CONFIG, params, None, "random")
    method = make_snapkv(CONFIG, context=100, kv_budget=12, window=4)
    prompt = np.random.default_rng(2).integers(0, CONFIG.vocab_size, 30).tolist()
    kwargs = dict(method=method, chunk_size=8, stop_at_eos=False, context=100)
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _secs, **_: compiles.append(event) if event.endswith("backend_compile_duration") else None
    )
    short = generate(model, prompt, max_new_tokens=17, **kwargs)
    before = len(compiles)
    long = generate(model, prompt, max_new_tokens=32, **kwargs)  # the same token-buffer bucket (32)
    assert len(compiles) == before
    assert long.tokens[0][:17] == short.tokens[0]
    assert long.stats["method"] == "snapkv"
    assert long.stats["cache_bytes"] == long.stats["expected_cache_bytes"]


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(kv_budget=4), "at least the observation window"),
        (dict(kv_budget=None), "needs kv_budget"),
        (dict(kv_budget=40, kernel=4), "positive odd number"),
        (dict(kv_budget=40, pooling="mean"), "pooling must be one of"),
        (dict(kv_budget=40, window=0), "at least 1 token"),
    ],
)
def test_bad_options_are_clear_errors(options, message):
    with pytest.raises(DuoJaxError, match=message):
        make_snapkv(CONFIG, context=64, **dict(dict(window=WINDOW), **options))


def test_budgets_must_fit_the_heads():
    with pytest.raises(DuoJaxError, match="budgets must be"):
        SnapKV(4, 2, 16, 128, ((3, 3, 3),))
