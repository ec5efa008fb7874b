"""Continuous batching over the paged cache: every request gets exactly the greedy tokens it gets alone (from
`generate` on the contiguous cache), whoever it shares steps with, however the pool runs short."""

import collections

import jax
import numpy as np
import pytest

import duo_jax
from duo_jax.cache import make_layout
from duo_jax.engine import Engine
from duo_jax.errors import DuoJaxError
from duo_jax.methods.duo import DuoAttention
from duo_jax.methods.paged import paged
from duo_jax.sampling import Sampling
from duo_jax.serve import Request, Scheduler
from duo_jax.serve.scheduler import SchedulerBusy
from tests.conftest import tiny_config

CONFIG = tiny_config()
CHUNK, NEW = 8, 8
MODEL = duo_jax.Model(CONFIG, duo_jax.init_params(CONFIG, jax.random.key(0), scale=0.2), None, "random")
PROMPTS = [np.random.default_rng(i).integers(1, 128, n).tolist() for i, n in enumerate((19, 11, 26, 9, 14))]
MAX_TOKENS = (8, 3, 6, 8, 5)  # some leave early


@pytest.fixture(scope="module", params=["duo", "full"])
def setup(request):
    """(contiguous method, each prompt's solo greedy tokens)."""
    mask = np.array([[True, False], [False, True]]) if request.param == "duo" else None
    method = DuoAttention(make_layout(CONFIG, mask, sink=2, recent=5, context=64))
    solo = [
        duo_jax.generate(MODEL, p, method=method, max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False).tokens[0]
        for p in PROMPTS
    ]
    return method, solo


def scheduler(method, num_pages, slots=3, **options):
    return Scheduler(
        Engine.of(MODEL),
        paged(method, page_size=4, num_pages=num_pages),
        slots=slots,
        chunk=CHUNK,
        impl="xla",
        **options,
    )


def assert_no_page_leaked(s):
    assert s.pool.num_free == s.pool.num_pages and s.pages_in_use() == 0
    assert (s.tables == s.pool.num_pages).all() and not any(s.running)


@pytest.mark.slow
def test_requests_joining_and_leaving_get_their_solo_tokens(setup):
    """Five requests over three slots: two start, a third joins mid-way (prefilling while the others decode),
    the rest queue for slots that requests leaving early free; each gets its solo greedy tokens."""
    method, solo = setup
    s = scheduler(method, num_pages=64)
    requests = [Request(p, max_tokens=n, stop_at_eos=False) for p, n in zip(PROMPTS, MAX_TOKENS)]
    for r in requests[:2]:
        s.submit(r)
    for _ in range(2):
        s.step()
    assert not requests[0].tokens and len(requests[1].tokens) == 1  # 0 still prefilling (19 tokens, chunks of 8)
    for r in requests[2:]:
        s.submit(r)
    s.run()
    for r, expected, n in zip(requests, solo, MAX_TOKENS):
        assert r.tokens == expected[:n] and r.finish_reason == "length"
    assert_no_page_leaked(s)


@pytest.mark.slow
def test_a_short_pool_queues_and_preempts_and_all_complete(setup):
    """A pool of 10 pages of 4 tokens cannot hold three of these requests at once: newcomers wait for pages,
    growing requests preempt the newest (recomputed later), and every request still gets its solo tokens."""
    method, solo = setup
    s = scheduler(method, num_pages=10)
    requests = [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PROMPTS]
    peak = 0
    while s.step() or not s.idle:
        peak = max(peak, s.pages_in_use())
        assert s.pages_in_use() == sum(len(slot.pages) for slot in s.running if slot)
    assert peak <= 10 and s.counters["preemptions"] > 0
    for r, expected in zip(requests, solo):
        assert r.tokens == expected
    assert_no_page_leaked(s)


@pytest.mark.slow
def test_stops_and_per_request_sampling(setup):
    """A stop id ends a request at that token; a sampled request (its own temperature, top-k and seed) gets the
    same tokens alone and in a batch of greedy ones, and different ones with another seed."""
    method, solo = setup
    s = scheduler(method, num_pages=64)
    stopped = s.submit(Request(PROMPTS[0], max_tokens=NEW, stop_ids=(solo[0][2],), stop_at_eos=False))
    rule = Sampling(temperature=1.5, top_k=20)
    alone = s.submit(Request(PROMPTS[1], max_tokens=NEW, sampling=rule, seed=7))
    s.run()
    assert stopped.tokens == solo[0][: solo[0].index(solo[0][2]) + 1] and stopped.finish_reason == "stop"
    batch = [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PROMPTS[2:4]]
    again = s.submit(Request(PROMPTS[1], max_tokens=NEW, sampling=rule, seed=7))
    other = s.submit(Request(PROMPTS[1], max_tokens=NEW, sampling=rule, seed=8))
    s.run()
    assert again.tokens == alone.tokens != other.tokens
    assert [r.tokens for r in batch] == solo[2:4]
    assert_no_page_leaked(s)


@pytest.mark.slow
def test_stop_strings_end_a_request_at_the_token_that_completes_them(setup):
    """A stop string ends a request at the first token after which the detokenized text holds it, as decoding
    all its tokens at every step would find it: stop strings spanning tokens, and characters split across
    tokens (a piece of a character decodes to U+FFFD until its last byte comes), through a short pool that
    preempts requests (their text goes on from the tokens they kept)."""
    method, solo = setup
    pieces = {i: [b"a", b"b", b"ab", b" ", b"\xc3", b"\xa9", b"\xe2\x82", b"\xac", b"xy"][i % 9] for i in range(128)}

    def detokenize(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    def first_stop(tokens, stops):  # a text's trailing U+FFFD may be a character still arriving: not matched yet
        texts = (detokenize(tokens[:i]).rstrip("\ufffd") for i in range(1, len(tokens) + 1))
        return next((i + 1 for i, text in enumerate(texts) if any(x in text for x in stops)), None)

    texts = [detokenize(t) for t in solo]
    stops = [[t[len(t) // 2 : len(t) // 2 + 2] or "?"] for t in texts]  # from each solo text: all found
    stops[1] = ["never", "\u20ac" if "\u20ac" in texts[1] else texts[1][-1:]]  # a character split across tokens
    s = scheduler(method, num_pages=10, detokenize=detokenize)
    requests = [s.submit(Request(p, max_tokens=NEW, stop=tuple(x), stop_at_eos=False)) for p, x in zip(PROMPTS, stops)]
    s.run()
    assert s.counters["preemptions"] > 0
    for r, expected, x in zip(requests, solo, stops):
        end = first_stop(expected, x)
        assert r.tokens == expected[: end or NEW] and r.finish_reason == ("length" if end is None else "stop")
    assert_no_page_leaked(s)


def test_a_full_queue_refuses_until_it_drains(setup):
    method, _ = setup
    with pytest.raises(DuoJaxError, match="max_queued must be positive"):
        scheduler(method, num_pages=64, max_queued=0)
    s = scheduler(method, num_pages=64, max_queued=2)
    waiting = [s.submit(Request(p, max_tokens=2, stop_at_eos=False)) for p in PROMPTS[:2]]
    with pytest.raises(SchedulerBusy, match="2 requests are waiting"):
        s.submit(Request(PROMPTS[2], max_tokens=2, stop_at_eos=False))
    assert s.counters["busy"] == 1 and s.num_queued == 2
    s.step()  # both take a slot
    assert s.num_queued == 0
    late = s.submit(Request(PROMPTS[2], max_tokens=2, stop_at_eos=False))
    s.run()
    assert all(r.finish_reason == "length" for r in [*waiting, late])


def test_bad_requests_are_refused(setup):
    method, _ = setup
    s = scheduler(method, num_pages=4)
    with pytest.raises(DuoJaxError, match="empty"):
        s.submit(Request([], max_tokens=2))
    with pytest.raises(DuoJaxError, match="token ids"):
        s.submit(Request([1, 500], max_tokens=2))
    with pytest.raises(DuoJaxError, match="exceeds"):
        s.submit(Request([1] * 120, max_tokens=10))  # capacity: 128
    with pytest.raises(DuoJaxError, match="pages"):
        s.submit(Request([1] * 20, max_tokens=4))  # 23 tokens: 6 pages of 4, the pool has 4
    assert s.idle


@pytest.mark.slow
def test_int8_weights_are_served_as_generate_runs_them():
    """The scheduler compiles its steps for the engine's weight format (int8 weights: codes and scales)."""
    from duo_jax.model import quantize_weights

    model = duo_jax.Model(CONFIG, quantize_weights(MODEL.params), None, "random")
    method = DuoAttention(make_layout(CONFIG, None, sink=0, recent=0, context=64))
    alone = duo_jax.generate(
        model, PROMPTS[0], method=method, max_new_tokens=5, chunk_size=CHUNK, stop_at_eos=False
    ).tokens[0]
    s = Scheduler(Engine.of(model), paged(method, page_size=4, num_pages=16), slots=2, chunk=CHUNK, impl="xla")
    request = s.submit(Request(PROMPTS[0], max_tokens=5, stop_at_eos=False))
    s.run()
    assert request.tokens == alone


SHARED = np.random.default_rng(10).integers(1, 128, 24).tolist()
TAILS = [np.random.default_rng(11 + i).integers(1, 128, n).tolist() for i, n in enumerate((5, 9, 6))]
# A, B: the shared 24 tokens + their own; C: 17 of them (2 reuse units of 8) + its own; D: A again.
PREFIXED = [SHARED + TAILS[0], SHARED + TAILS[1], SHARED[:17] + TAILS[2], SHARED + TAILS[0]]


def run_prefixed(method, prefix_cache, num_pages=64):
    """A alone for 4 steps (its prompt registered), then B, C, D join it; once all end, E (= B) comes."""
    s = Scheduler(
        Engine.of(MODEL),
        paged(method, page_size=4, num_pages=num_pages),
        slots=3,
        chunk=CHUNK,
        impl="xla",
        prefix_cache=prefix_cache,
    )
    requests = [s.submit(Request(PREFIXED[0], max_tokens=NEW, stop_at_eos=False))]
    for _ in range(4):
        s.step()
    requests += [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PREFIXED[1:]]
    peak = 0
    while s.step() or not s.idle:
        peak = max(peak, s.pages_in_use())
        held = collections.Counter(page for slot in s.running if slot for page in slot.pages)
        assert all(s.pool.refs[p] == held[p] for p in range(s.pool.num_pages))  # reference counts are exact
        assert s.pages_in_use() == len(held)
    requests.append(s.submit(Request(PREFIXED[1], max_tokens=NEW, stop_at_eos=False)))
    s.run()
    assert_no_page_leaked(s)
    assert not any(s.pool.refs)
    return s, requests, peak


def test_prefix_reuse_gives_the_tokens_of_no_reuse_with_fewer_pages(setup):
    """Requests sharing a prompt prefix share its pages (and, for duo, the streaming heads' state copied from a
    snapshot) instead of prefilling it again: each gets the greedy tokens `generate` gives it alone, fewer
    pages are held at the peak, and every page comes back. The reused tokens are counted exactly: B and D
    reuse 24 tokens of A (D's own last token is fed again), C 16 (two units of 8 of its 17 shared tokens), E
    (= B) 32 of B's pages, still registered after B ended."""
    method, _ = setup
    solo = [
        duo_jax.generate(MODEL, p, method=method, max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False).tokens[0]
        for p in PREFIXED
    ]
    shared, requests, peak = run_prefixed(method, True)
    alone, plain, peak_plain = run_prefixed(method, False)
    for r, q, expected in zip(requests, plain, solo + [solo[1]]):
        assert r.tokens == q.tokens == expected
    assert shared.counters["prefix_tokens"] == 24 + 16 + 24 + 32 and shared.counters["prefix_hits"] == 4
    assert alone.counters["prefix_tokens"] == 0
    assert shared.counters["prompt_tokens"] == alone.counters["prompt_tokens"] - 96
    assert peak < peak_plain


def test_prefix_reuse_survives_preemption(setup):
    """A pool too small for the shared-prefix requests at once: preempted requests are recomputed (reusing
    what is still registered), reference counts stay exact, and all get their solo tokens."""
    method, _ = setup
    solo = [
        duo_jax.generate(MODEL, p, method=method, max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False).tokens[0]
        for p in PREFIXED
    ]
    s, requests, peak = run_prefixed(method, True, num_pages=10)  # the pool of the test above: no compile
    assert peak <= 10 and s.counters["preemptions"] > 0
    for r, expected in zip(requests, solo + [solo[1]]):
        assert r.tokens == expected


def test_a_stopped_scheduler_refuses_at_once(setup):
    """Once serve_forever has drained and returned, submit raises (a request would otherwise wait forever)."""
    import threading

    from duo_jax.serve.scheduler import SchedulerClosed

    method, solo = setup
    s, stop = scheduler(method, num_pages=64), threading.Event()
    thread = threading.Thread(target=s.serve_forever, args=(stop,))
    thread.start()
    request = s.submit(Request(PROMPTS[1], max_tokens=3, stop_at_eos=False))
    assert request.done.wait(60) and request.tokens == solo[1][:3]
    stop.set()
    thread.join(60)
    with pytest.raises(SchedulerClosed, match="shutting down"):
        s.submit(Request(PROMPTS[1], max_tokens=3))


def test_steps_transfer_host_values_explicitly():
    """After its executables are compiled, a step (prefill chunks, decode, sampling, the prefix snapshots) makes no
    implicit host-to-device transfer: each would run a staging executable per step."""
    layout = make_layout(CONFIG, np.array([[True, False], [False, True]]), sink=2, recent=5, context=64)
    s = scheduler(DuoAttention(layout), num_pages=64)
    for p in PROMPTS[:3]:
        s.submit(Request(p, max_tokens=6, stop_at_eos=False))
    for _ in range(3):
        s.step()
    with jax.transfer_guard_host_to_device("disallow"):
        for _ in range(6):
            s.step()


def test_a_pool_memory_that_holds_no_page_is_refused(capsys):
    """`--kv-memory-mb` sizes the pool: below one page it was one page regardless; the CLI's port is checked too."""
    from duo_jax.serve.__main__ import main as serve_main
    from duo_jax.serve.scheduler import pages_for_memory

    method = paged(DuoAttention(make_layout(CONFIG, None, sink=2, recent=5, context=64)), page_size=4)
    per_page = 2 * 4 * CONFIG.head_dim * 4 * CONFIG.num_layers * CONFIG.num_kv_heads  # float32 K and V, every layer
    assert pages_for_memory(method, 3 * per_page + 1, np.float32, slots=2) == 3
    with pytest.raises(DuoJaxError, match="holds no page: one page of 4 tokens takes"):
        pages_for_memory(method, per_page - 1, np.float32, slots=2)
    with pytest.raises(SystemExit):
        serve_main(["--port", "70000"])  # uvicorn started with it before
    assert "--port: must be a port number in [0, 65535], got 70000" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve_main(["--max-queued", "0"])
    assert "--max-queued: must be a positive integer, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # full attention: the window was ignored
        serve_main(["--sink", "4", "--recent", "16"])
    assert "--sink and --recent set the streaming heads' window: pass --pattern" in capsys.readouterr().err


def test_the_servers_context_stops_at_the_models_positions(monkeypatch, capsys):
    """`--context` past the model's positions (no request may go there) sizes nothing past them, and says so; the
    banner names the context. uvicorn is stubbed: the CLI builds everything, then returns."""
    import uvicorn

    from duo_jax.serve.__main__ import main as serve_main

    config = tiny_config(max_position_embeddings=256)
    model = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(0)), None, "random")
    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: model)
    built = []

    class Web:  # uvicorn.Server, run at once (its Config would point logging at pytest's captured stderr)
        def __init__(self, cfg):
            built.append(cfg)

        def run(self):
            pass

    monkeypatch.setattr(uvicorn, "Server", Web)
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: app)
    assert serve_main(["--model", "tiny", "--context", "100000", "--page-size", "16", "--no-warm-up"]) == 0
    err = capsys.readouterr().err
    assert "--context 100000 is past tiny's 256 positions; sequences hold at most 256 tokens" in err
    assert "context 256," in err and len(built) == 1


def test_the_server_refuses_a_sparsity_without_a_pattern(monkeypatch, capsys):
    """`--sparsity` without `--pattern` served full attention and said nothing: now one error line, status 2."""
    from duo_jax.serve.__main__ import main as serve_main

    config = tiny_config(max_position_embeddings=256)
    model = duo_jax.Model(config, duo_jax.init_params(config, jax.random.key(0)), None, "random")
    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: model)
    assert serve_main(["--model", "tiny", "--sparsity", "0.9", "--no-warm-up"]) == 2
    assert "error: method 'full' has no head pattern, so no sparsity to set" in capsys.readouterr().err


def test_a_request_cancelled_before_the_scheduler_saw_it_is_cancelled():
    """A client that disconnects between its submit and the step that reads the inbox: the step read the inbox,
    then the request was submitted and cancelled. The cancel finds it (it ran to its end for no client before)."""
    s = scheduler(DuoAttention(make_layout(CONFIG, None, sink=0, recent=0, context=64)), num_pages=16)
    s._admit_inbox()  # the step has read the (empty) inbox ...
    request = s.submit(Request(PROMPTS[0], max_tokens=NEW))  # ... then this arrives and its client leaves
    s.cancel(request)
    s._cancel_requested()
    assert request.finish_reason == "cancelled" and s.counters["cancelled"] == 1 and not s.queue
    s.run()
    assert request.tokens == [] and s.idle


def test_a_character_still_arriving_is_no_stop_string():
    """The text searched for stop strings ends inside a character while its bytes arrive (U+FFFD until the last
    one): a stop string holding U+FFFD matched that placeholder and ended "Hi 🌟 there" at "Hi "."""
    pieces = {1: b"Hi ", 2: b"\xf0\x9f", 3: b"\x8c\x9f", 4: b" there", 5: b"\xff"}

    def detokenize(ids):
        return b"".join(pieces[i] for i in ids).decode("utf-8", errors="replace")

    class Fake:  # what `_stop_string` reads of a scheduler
        pass

    fake = Fake()
    fake.detokenize = detokenize
    request = Request([1], stop=("\ufffd",))
    found = []
    for token in (2, 3, 4, 5, 4):
        request.tokens.append(token)
        found.append(Scheduler._stop_string(fake, request))
    assert found == [False, False, False, False, True]  # the real U+FFFD of an invalid byte, once more text follows
    request = Request([1], stop=("Hi",))  # the prompt's text is no part of the generation's
    request.tokens.append(4)
    assert not Scheduler._stop_string(fake, request)


def test_the_page_pool_bounds_a_sequence_in_one_place(setup):
    """`check` and `max_new_tokens` read one bound: every page's tokens, plus the last token (never written)."""
    method, _ = setup
    s = scheduler(method, num_pages=5)  # 5 pages of 4 tokens: 21 tokens
    assert s.pool_limit == 21 and s.max_new_tokens(15) == 6
    s.check(Request(PROMPTS[0][:15], max_tokens=6))
    with pytest.raises(DuoJaxError, match="the request needs 6 pages; the pool has 5") as error:
        s.check(Request(PROMPTS[0][:15], max_tokens=7))
    assert "--kv-memory-mb" in str(error.value) and error.value.param == "max_tokens"


def test_a_bad_seed_is_refused_at_submit(setup):
    """A seed outside [0, 2**32) from the Python API raised inside a step, failing every request running in it."""
    method, _ = setup
    s = scheduler(method, num_pages=5)
    for seed in (-1, 2**32):
        with pytest.raises(DuoJaxError, match="seed must be an integer"):
            s.check(Request(PROMPTS[0][:8], max_tokens=2, seed=seed))


def stub_uvicorn(monkeypatch, model):
    """`duo_jax.load` gives `model`; uvicorn runs nothing: the CLI builds everything and returns. The apps built."""
    import uvicorn

    built = []

    class Web:  # uvicorn.Server, run at once (its Config would point logging at pytest's captured stderr)
        def __init__(self, app):
            built.append(app)

        def run(self):
            pass

    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: model)
    monkeypatch.setattr(uvicorn, "Server", Web)
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: app)
    return built


def test_a_pool_whose_pages_hold_no_bytes_gets_the_pages_its_slots_use(monkeypatch, capsys, tmp_path):
    """Every head streaming (sparsity 1): pages hold no K / V, so the memory's bytes // 0-byte pages made a pool
    of as many pages as bytes (a MemoryError building its free list). It gets the pages its slots can fill, and
    serves each request the tokens it gets alone."""
    from duo_jax import Pattern
    from duo_jax.serve.__main__ import main as serve_main
    from duo_jax.serve.scheduler import pages_for_memory

    method = DuoAttention(make_layout(CONFIG, np.zeros((2, 2), bool), sink=2, recent=5, context=64))
    # a capacity of 128 tokens (the context rounded up to 128): 32 pages of 4 a sequence
    assert pages_for_memory(paged(method, page_size=4), 512 << 20, np.float32, slots=3) == 3 * 32
    s = scheduler(method, num_pages=3 * 32)
    requests = [s.submit(Request(p, max_tokens=NEW, stop_at_eos=False)) for p in PROMPTS[:3]]
    s.run()
    for request in requests:
        solo = duo_jax.generate(
            MODEL, request.prompt, method=method, max_new_tokens=NEW, chunk_size=CHUNK, stop_at_eos=False
        )
        assert request.tokens == list(solo.tokens[0])
    assert s.counters["preemptions"] == 0

    stub_uvicorn(monkeypatch, MODEL)
    folder = Pattern(np.full((2, 2), 0.5)).save(tmp_path)
    argv = ["--model", "tiny", "--pattern", str(folder), "--sparsity", "1", "--context", "256", "--no-warm-up"]
    assert serve_main(argv + ["--page-size", "16", "--slots", "2"]) == 0
    assert "32 pages of 16 tokens, 2 slots" in capsys.readouterr().err  # 2 slots x 256 / 16 pages


def test_a_chunk_longer_than_a_sequence_is_refused():
    """Every prompt step runs at T = chunk: a chunk past what a sequence holds only padded every prompt (a
    5-token request compiled and ran a step of 100,000 positions). The longest useful chunk is accepted."""
    method = DuoAttention(make_layout(CONFIG, None, sink=0, recent=0, context=64))  # a sequence holds 128
    with pytest.raises(DuoJaxError, match=r"chunk \(--chunk\) 129 is larger than the 128 tokens a sequence"):
        Scheduler(Engine.of(MODEL), paged(method, page_size=4, num_pages=8), slots=1, chunk=129, impl="xla")
    assert Scheduler(Engine.of(MODEL), paged(method, page_size=4, num_pages=8), slots=1, chunk=128).chunk == 128


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--kv-memory-mb", "nan"], "--kv-memory-mb: must be a positive, finite number of MiB, got 'nan'"),
        (["--kv-memory-mb", "inf"], "--kv-memory-mb: must be a positive, finite number of MiB, got 'inf'"),
        (["--kv-memory-mb", "-1"], "--kv-memory-mb: must be a positive, finite number of MiB, got '-1'"),
        (["--kv-memory-mb", "0"], "--kv-memory-mb: must be a positive, finite number of MiB, got '0'"),
        (["--kv-memory-mb", "1e308"], "--kv-memory-mb: must be a number of MiB whose bytes a float holds"),
        (["--max-request-bytes", "-1"], "--max-request-bytes: must be a positive integer, got -1"),
        (["--max-request-bytes", "0"], "--max-request-bytes: must be a positive integer, got 0"),
        (["--allowed-hosts", ""], "--allowed-hosts: must name at least one Host ('*': any), got ''"),
        (["--allowed-hosts", " , "], "--allowed-hosts: must name at least one Host ('*': any), got ' , '"),
        (["--sink", "-1"], "--sink: must be an integer >= 0, got -1"),
        (["--recent", "0"], "--recent: must be a positive integer, got 0"),
        (["--chunk", "0"], "--chunk: must be a positive integer, got 0"),
        (["--slots", "0"], "--slots: must be a positive integer, got 0"),
    ],
)
def test_the_server_refuses_bad_settings_before_loading(monkeypatch, capsys, argv, message):
    """Each was a traceback (--kv-memory-mb nan / inf), a server refusing every request (--max-request-bytes 0:
    413; --allowed-hosts '': 421, /health included), or ignored without --pattern (--sink, --recent)."""
    from duo_jax.serve.__main__ import main as serve_main

    monkeypatch.setattr(duo_jax, "load", lambda *a, **kw: pytest.fail("loaded a model"))
    with pytest.raises(SystemExit) as exit_:
        serve_main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_pool_short_of_the_context_says_so_and_models_reports_what_it_holds(monkeypatch, capsys):
    """A pool of fewer pages than one sequence of the context fills started silently, /v1/models promising the
    context; a request past the pool then got an error naming no option. Now a note names --kv-memory-mb and the
    memory a full sequence needs, and max_model_len is what the pool holds."""
    from starlette.testclient import TestClient

    from duo_jax.serve.__main__ import main as serve_main

    built = stub_uvicorn(monkeypatch, MODEL)
    per_page = 2 * 128 * CONFIG.head_dim * 4 * CONFIG.num_layers * CONFIG.num_kv_heads  # float32 K and V
    mib = 1.5 * per_page / 2**20  # one page of 128 tokens
    argv = ["--model", "tiny", "--context", "512", "--kv-memory-mb", str(mib), "--allowed-hosts", "testserver"]
    assert serve_main(argv + ["--no-warm-up"]) == 0
    err = capsys.readouterr().err
    full = -(-4 * per_page // 2**20)  # 511 tokens written: 4 pages, in whole MiB
    assert "holds 1 page of 128 tokens: a request holds at most 129 tokens (prompt + new), not the context's 512" in err
    assert f"--kv-memory-mb {full} holds one of the full context" in err
    card = TestClient(built[0]).get("/v1/models").json()["data"][0]  # no lifespan: the scheduler does not start
    assert card["max_model_len"] == 129
    capsys.readouterr()
    assert serve_main(["--model", "tiny", "--context", "512", "--no-warm-up"]) == 0  # the default pool holds it
    assert "note: --kv-memory-mb" not in capsys.readouterr().err
