"""Continuous batching: a host loop that runs many requests through a fixed number of slots of one paged cache.

`Scheduler.submit` queues a `Request`; `step` admits queued requests into free slots when the `PagePool` has their
pages, feeds each running request its next prompt chunk or sampled token through the engine's compiled `extend`
(prefill beside decode as the `mixed` policy says), samples, and finishes requests at their stop conditions or on
`cancel`, freeing their pages; `run` and `serve_forever` loop over it. When pages run out the most recently
admitted request is preempted and recomputed later. A request's tokens depend only on its prompt, options and
seed, not on what it is batched with or on prefix reuse (`prefix_cache`). Design: docs/serving.md.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import math
import queue
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax import device_memory
from duo_jax.engine import Engine, cache_device_bytes, compiled_extend, compiled_extend_row, devices_of
from duo_jax.errors import DuoJaxError, InvalidOption
from duo_jax.methods.paged import PagedDuo
from duo_jax.model import check_token_ids
from duo_jax.sampling import Sampling, check_sampling, check_seed, sample_seeded
from duo_jax.tokenizer import TextStream


class SchedulerClosed(DuoJaxError):
    """The scheduler no longer takes requests (shut down, or failed for good); the message says why."""


class SchedulerBusy(DuoJaxError):
    """The scheduler's queue is full (`max_queued` requests wait for a slot): try again later."""


class PagePool:
    """The pages of a pool of `num_pages` (indices into every layer's pool): reference counts, the free pages,
    and the registry of full pages by the digest of the tokens up to their end (`page_digests`). A free
    page that is registered keeps its content until `take` hands it out again (the least recently freed
    first; never-registered pages go first), so `lookup` can still find it."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # holding nothing reusable
        self._cached_free: collections.OrderedDict[int, None] = collections.OrderedDict()  # registered, unused
        self.refs = [0] * num_pages
        self._by_digest: dict[bytes, int] = {}
        self._digest: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached_free)

    def take(self, n: int) -> list[int]:
        if n > self.num_free:
            raise DuoJaxError(f"asked for {n} pages, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.pop()
            else:
                page, _ = self._cached_free.popitem(last=False)
                del self._by_digest[self._digest.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def share(self, pages: list[int]) -> None:
        """One more user of each of `pages` (registered pages found by `lookup`)."""
        for page in pages:
            if self.refs[page] == 0:
                del self._cached_free[page]
            self.refs[page] += 1

    def give_back(self, pages: list[int]) -> None:
        """One user fewer; a page nobody uses is free (the tail of a sequence first, so that its head, the
        part other prompts are likelier to share, stays registered longest)."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self._digest:
                    self._cached_free[page] = None
                else:
                    self._free.append(page)

    def register(self, page: int, digest: bytes) -> None:
        """`page` holds the tokens named by `digest` (kept if another page already does)."""
        if digest not in self._by_digest and page not in self._digest:
            self._by_digest[digest], self._digest[page] = page, digest

    def lookup(self, digest: bytes) -> int | None:
        return self._by_digest.get(digest)


def page_digests(tokens: list[int], page_size: int) -> list[bytes]:
    """The name of each full page of `tokens`: sha256 of the previous page's name and this page's tokens, so a
    name stands for every token up to the page's end."""
    out, parent = [], b""
    for start in range(0, len(tokens) - page_size + 1, page_size):
        parent = hashlib.sha256(parent + np.asarray(tokens[start : start + page_size], np.int64).tobytes()).digest()
        out.append(parent)
    return out


@jax.jit
@jax.jit
def _streaming_rows(streaming, b):
    """Slot b's streaming state (each layer's sink + ring rows of K and V), in one program."""
    return jax.tree.map(lambda x: x[b], streaming)


def _slot(b: int) -> jax.Array:
    """A slot index for the programs above, transferred explicitly."""
    return jax.device_put(np.int32(b))


@jax.jit
def _set_streaming_rows(streaming, b, rows):
    return jax.tree.map(lambda x, r: x.at[b].set(r), streaming, rows)


def find_stop(text: str, stops) -> tuple[str, bool]:
    """(`text` cut before the first occurrence of any of `stops`, whether one occurs)."""
    cut = min((i for i in (text.find(stop) for stop in stops) if i >= 0), default=-1)
    return (text, False) if cut < 0 else (text[:cut], True)


def page_bytes(method: PagedDuo, dtype) -> int:
    """Bytes of one page over every layer's pool (the retrieval heads' K and V); 0 when no head is a retrieval head."""
    return 2 * method.page_size * method.layout.head_dim * jnp.dtype(dtype).itemsize * sum(method.layout.num_retrieval)


def pages_for_memory(method: PagedDuo, memory_bytes: int, dtype, *, slots: int) -> int:
    """How many pages fit `memory_bytes` of retrieval K/V (every layer's pool together); fewer than one raises.
    Pages that hold no bytes (every head streaming) only count tokens in the block tables: then as many as `slots`
    sequences of the full capacity use, so that none is ever preempted."""
    per_page = page_bytes(method, dtype)
    if not per_page:
        return slots * method.pages_per_sequence
    if memory_bytes < per_page:
        raise DuoJaxError(
            f"the page pool's memory ({memory_bytes / 2**20:g} MiB) holds no page: one page of "
            f"{method.page_size} tokens takes {per_page / 2**20:g} MiB over every layer's retrieval heads"
        )
    return memory_bytes // per_page


_ids = itertools.count()

# What shrinks the server's memory, for `duo_jax.device_memory`'s errors (the options of `python -m duo_jax.serve`).
MEMORY_FIXES = (
    "give the page pool less memory (--kv-memory-mb), serve fewer --slots (each keeps its streaming heads' sink and "
    "ring), or load smaller weights and cache (--dtype bfloat16)"
)


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request and, as it runs, its output. `on_token(request, token)` is called (from the
    scheduler's thread) for every new token, and `on_token(request, None)` once when it finishes."""

    prompt: list[int]
    max_tokens: int = 16
    sampling: Sampling = Sampling()
    seed: int = 0
    stop_at_eos: bool = True
    stop_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings (needs the scheduler's detokenize)
    on_token: Callable | None = None
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    finish_reason: str | None = None  # "stop" (EOS, a stop id or string), "length", "cancelled" or "error"
    error: str | None = None  # with finish_reason "error": what failed
    preemptions: int = 0
    done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
    _text: TextStream | None = dataclasses.field(default=None, init=False, repr=False)  # of `tokens`, for `stop`

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


@dataclasses.dataclass(eq=False)
class _Slot:
    request: Request
    admitted: int  # admission order (the newest is preempted first)
    fed: int = 0  # tokens of request.sequence in the cache
    pages: list[int] = dataclasses.field(default_factory=list)
    digests: list[bytes] = dataclasses.field(default_factory=list)  # of the prompt's full pages
    registered: int = 0  # pages registered for reuse (a prefix of `pages`)


MIXED = ("split", "padded")


class Scheduler:
    """Continuous batching of `Request`s over `method`'s paged cache with `slots` sequences per step, feeding
    prompts `chunk` tokens per step (at most what a sequence holds: more would only be padding). `mixed`: how a
    step runs prefill beside decode, "split" or "padded" (docs/serving.md). `prefix_cache`: reuse shared prompt
    prefixes (docs/serving.md), keeping at most `prefix_snapshots` streaming-head states; `detokenize(ids) -> str`
    serves requests' `stop` strings. `max_queued`: how many requests may wait for a slot (None: any number);
    `submit` refuses more with SchedulerBusy."""

    def __init__(
        self,
        engine: Engine,
        method: PagedDuo,
        *,
        slots: int,
        chunk: int = 64,
        impl: str = "auto",
        mixed: str = "split",
        prefix_cache: bool = True,
        prefix_snapshots: int = 32,
        detokenize: Callable | None = None,
        max_queued: int | None = None,
    ):
        if not isinstance(method, PagedDuo) or method.num_pages is None:
            raise DuoJaxError(
                "the scheduler needs a paged method with a pool size: "
                "duo_jax.methods.paged.paged(method, num_pages=...)"
            )
        if slots < 1 or chunk < 1:
            raise DuoJaxError(f"slots and chunk must be positive, got {slots}, {chunk}")
        if mixed not in MIXED:
            raise DuoJaxError(f"mixed must be one of {MIXED}, got {mixed!r}")
        if max_queued is not None and max_queued < 1:
            raise DuoJaxError(f"max_queued must be positive (or None: no limit), got {max_queued}")
        if prefix_snapshots < 0:
            raise DuoJaxError(f"prefix_snapshots must be >= 0, got {prefix_snapshots}")
        if engine.mesh is not None:
            raise DuoJaxError("the scheduler runs on one device; serve with an engine built without a mesh")
        self.engine, self.method, self.slots, self.chunk, self.impl = engine, method, slots, chunk, impl
        self.mixed = mixed
        if chunk > self.sequence_limit:  # no prompt fills it: every prefill step would compute padding
            raise DuoJaxError(
                f"chunk (--chunk) {chunk} is larger than the {self.sequence_limit} tokens a sequence can hold: every "
                f"prompt would be padded to {chunk} positions per step; pass a chunk of at most {self.sequence_limit}"
            )
        what = f"the server's KV cache ({method.num_pages} pages of {method.page_size} tokens, {slots} slots)"
        need = cache_device_bytes(method, slots, engine.dtype)
        device_memory.check_fits(need, devices_of(engine.params, None), what, MEMORY_FIXES)
        with device_memory.explain_out_of_memory(f"allocating {what}", MEMORY_FIXES):
            self.cache = method.empty_cache(slots, engine.dtype)
        self.pool = PagePool(method.num_pages)  # after the memory check: its host lists grow with the pages
        self.tables = np.full((slots, method.pages_per_sequence), method.num_pages, np.int32)
        self.lengths = np.zeros(slots, np.int32)
        self.running: list[_Slot | None] = [None] * slots
        self.queue: collections.deque[Request] = collections.deque()
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.eos_ids = frozenset(engine.config.eos_token_ids)
        self._admissions = itertools.count()
        self._tables_changed = True
        self.prefix_cache, self.prefix_snapshots, self.detokenize = prefix_cache, prefix_snapshots, detokenize
        self.max_queued = max_queued
        self.reuse_unit = math.lcm(method.page_size, chunk)  # a prefix is reused up to a multiple of this
        layout = method.layout
        self._streaming = any(n < layout.num_kv_heads for n in layout.num_retrieval) and layout.streaming_slots > 0
        self.snapshots: collections.OrderedDict[bytes, object] = collections.OrderedDict()  # digest -> rows
        self.cancelled: queue.Queue[Request] = queue.Queue()
        # requests, finished, cancelled, busy (refused: the queue was full), tokens, prompt_tokens, prefix_tokens,
        # prefix_hits, steps, preemptions, calls (compiled calls), row_tokens (batch x T of every call)
        self.counters = collections.Counter()
        self.closed: str | None = None  # why submit refuses (shut down, or failed for good); None while serving
        self._lock = threading.RLock()  # submit holds it around check_room

    # --- requests -------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """A clear error for a request this scheduler can never serve: InvalidOption whose `param` names the
        `Request` field at fault (prompt, max_tokens, the sampling's, seed or stop)."""
        config, n = self.engine.config, len(request.prompt)
        if n == 0:
            raise InvalidOption("the prompt is empty; it needs at least one token", "prompt")
        try:
            check_token_ids(request.prompt, config.vocab_size, "prompt token ids")
        except DuoJaxError as e:
            raise InvalidOption(str(e), "prompt") from None
        if request.max_tokens < 1:
            raise InvalidOption(f"max_tokens must be positive, got {request.max_tokens}", "max_tokens")
        check_sampling(request.sampling.temperature, request.sampling.top_p, request.sampling.top_k)
        check_seed(request.seed)  # a bad one raised inside a step, failing every request running in it
        total = n + request.max_tokens
        limit = self.sequence_limit
        at_fault = "prompt" if n >= limit else "max_tokens"  # a prompt that leaves no room is at fault itself
        if total > limit:
            raise InvalidOption(
                f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds the "
                f"{limit} tokens a sequence can hold",
                at_fault,
            )
        if not all(isinstance(stop, str) and stop for stop in request.stop):
            raise InvalidOption(f"stop strings must be non-empty strings, got {request.stop!r}", "stop")
        if request.stop and self.detokenize is None:
            raise InvalidOption("stop strings need a tokenizer: build the Scheduler with detokenize=", "stop")
        if total > self.pool_limit:
            raise InvalidOption(
                f"the request needs {self._pages(total - 1)} pages; the pool has {self.pool.num_pages}, so a sequence "
                f"holds at most {self.pool_limit} tokens: give the pool more pages (the server's --kv-memory-mb)",
                "prompt" if n >= self.pool_limit else "max_tokens",
            )

    @property
    def sequence_limit(self) -> int:
        """Tokens one sequence can hold (prompt + new): the method's capacity and the model's positions."""
        return min(self.method.max_tokens, self.engine.config.max_position_embeddings)

    @property
    def pool_limit(self) -> int:
        """Tokens one sequence can hold with every page of the pool: the last token's K/V is never written."""
        return self.pool.num_pages * self.method.page_size + 1

    @property
    def longest_sequence(self) -> int:
        """Tokens the longest request served here can hold (prompt + new): the sequence's limit (the method's and
        the model's positions) or, when smaller, the page pool's."""
        return min(self.sequence_limit, self.pool_limit)

    def max_new_tokens(self, prompt_tokens: int) -> int:
        """The most new tokens a prompt of `prompt_tokens` can have here: `longest_sequence` less the prompt
        (< 1: none)."""
        return self.longest_sequence - prompt_tokens

    def submit(self, request: Request) -> Request:
        """Queue a request (thread-safe); it runs from the next step on. SchedulerClosed once the scheduler
        has stopped serving (shut down, or failed for good); SchedulerBusy while `max_queued` requests wait."""
        self.check(request)
        with self._lock:
            if self.closed is not None:
                raise SchedulerClosed(self.closed)
            self.check_room()
            self.inbox.put(request)
        return request

    def check_room(self) -> None:
        """SchedulerBusy (counted) while `max_queued` requests wait for a slot, as `submit` would raise it: a
        server calls it before reading a request's body too."""
        with self._lock:
            full = self.max_queued is not None and self.num_queued >= self.max_queued
            self.counters["busy"] += full
        if full:
            raise SchedulerBusy(f"{self.num_queued} requests are waiting for a slot (the limit); try again later")

    @property
    def num_queued(self) -> int:
        """Requests submitted that wait for a slot (preempted ones included)."""
        return self.inbox.qsize() + len(self.queue)

    def cancel(self, request: Request) -> None:
        """End `request` (thread-safe) before its next step: its pages are freed, `finish_reason` becomes
        "cancelled" and `on_token(request, None)` is called. Nothing happens if it already finished."""
        self.cancelled.put(request)

    @property
    def idle(self) -> bool:
        return self.inbox.empty() and not self.queue and not any(self.running)

    # --- the loop -------------------------------------------------------------------------------------

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.method.page_size)

    def _release(self, b: int) -> Request:
        slot = self.running[b]
        self.pool.give_back(slot.pages)
        self.tables[b] = self.pool.num_pages
        self.running[b], self.lengths[b] = None, 0
        self._tables_changed = True
        return slot.request

    def _finish(self, request: Request, reason: str) -> None:
        """Record the end of a request no longer in a slot or the queue, and tell its caller."""
        request.finish_reason = reason
        self.counters["finished"] += 1
        if request.on_token is not None:
            request.on_token(request, None)
        request.done.set()

    def _cancel_requested(self) -> None:
        while True:
            try:
                request = self.cancelled.get_nowait()
            except queue.Empty:
                return
            if request.done.is_set():
                continue
            running = [b for b, s in enumerate(self.running) if s and s.request is request]
            if not running and request not in self.queue:
                # submitted after this step read the inbox, and cancelled since: its submit was queued before its
                # cancel, so reading the inbox again finds it (else it would run to its end for no client)
                self._admit_inbox()
            if running:
                self._release(running[0])
            elif request in self.queue:
                self.queue.remove(request)
            else:
                continue  # not submitted here
            self.counters["cancelled"] += 1
            self._finish(request, "cancelled")

    def _preempt_newest(self) -> None:
        b = max((b for b, s in enumerate(self.running) if s), key=lambda b: self.running[b].admitted)
        request = self._release(b)
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.queue.appendleft(request)

    def _admit_inbox(self) -> None:
        while True:
            try:
                self.queue.append(self.inbox.get_nowait())
                self.counters["requests"] += 1
            except queue.Empty:
                return

    def _admit(self) -> None:
        self._admit_inbox()
        self._cancel_requested()
        for b in range(self.slots):
            if not self.queue:
                return
            if self.running[b] is None:
                request = self.queue[0]
                digests = page_digests(request.prompt, self.method.page_size) if self.prefix_cache else []
                reused, shared = self._reusable(request, digests)
                unused = sum(1 for page in shared if self.pool.refs[page] == 0)  # free now, held once shared
                if self._pages(len(request.sequence)) - len(shared) > self.pool.num_free - unused:
                    return  # first come, first served: wait for pages
                self.queue.popleft()
                self.pool.share(shared)
                slot = _Slot(
                    request,
                    next(self._admissions),
                    fed=reused,
                    pages=list(shared),
                    digests=digests,
                    registered=len(shared),
                )
                self.running[b] = slot
                if reused:
                    self.tables[b, : len(shared)] = shared
                    self.lengths[b] = reused
                    self._tables_changed = True
                    self.counters["prefix_hits"] += 1
                    self.counters["prefix_tokens"] += reused
                    if self._streaming:
                        key = digests[len(shared) - 1]
                        self.snapshots.move_to_end(key)
                        rows = self.snapshots[key]
                        self._set_streaming(_set_streaming_rows(self._streaming_arrays(), _slot(b), rows))

    def _reusable(self, request: Request, digests: list[bytes]) -> tuple[int, list[int]]:
        """(tokens of the request's prompt already in the pool, the pages holding them): whole pages, a
        multiple of `reuse_unit` tokens, at most up to the last token to feed, and (DuoAttention) ending where
        a streaming snapshot was taken."""
        limit = min(len(request.prompt), len(request.sequence) - 1) // self.method.page_size
        pages = []
        for digest in digests[:limit]:
            page = self.pool.lookup(digest)
            if page is None:
                break
            pages.append(page)
        reused = len(pages) * self.method.page_size // self.reuse_unit * self.reuse_unit
        while reused and self._streaming and digests[reused // self.method.page_size - 1] not in self.snapshots:
            reused -= self.reuse_unit
        return reused, pages[: reused // self.method.page_size]

    def _streaming_arrays(self):
        return tuple((layer.streaming_k, layer.streaming_v) for layer in self.cache.layers)

    def _set_streaming(self, arrays) -> None:
        self.cache = dataclasses.replace(
            self.cache,
            layers=tuple(
                dataclasses.replace(layer, streaming_k=k, streaming_v=v)
                for layer, (k, v) in zip(self.cache.layers, arrays)
            ),
        )

    def _remember_prefix(self, b: int, fed_before: int) -> None:
        """Register slot b's prompt pages written so far; snapshot its streaming state at a reuse boundary."""
        slot, P = self.running[b], self.method.page_size
        written = min(slot.fed, len(slot.request.prompt)) // P
        while slot.registered < written:
            self.pool.register(slot.pages[slot.registered], slot.digests[slot.registered])
            slot.registered += 1
        fed = slot.fed
        if (
            self._streaming
            and self.prefix_snapshots
            and fed_before < fed <= len(slot.request.prompt)
            and fed % self.reuse_unit == 0
        ):
            key = slot.digests[fed // P - 1]
            if key not in self.snapshots:
                self.snapshots[key] = _streaming_rows(self._streaming_arrays(), _slot(b))
                while len(self.snapshots) > self.prefix_snapshots:
                    self.snapshots.popitem(last=False)

    def _grow(self, b: int, tokens: int) -> bool:
        """Pages for `tokens` tokens in slot b, preempting newer requests while the pool is short; False when
        slot b itself was preempted."""
        slot = self.running[b]
        while self._pages(tokens) > len(slot.pages):
            if self.pool.num_free == 0:
                self._preempt_newest()
                if self.running[b] is not slot:
                    return False
                continue
            page = self.pool.take(1)[0]
            self.tables[b, len(slot.pages)] = page
            slot.pages.append(page)
            self._tables_changed = True
        return True

    def _feed(self, slot: _Slot) -> int:
        """Tokens slot's request feeds this step: its prompt in chunks of `chunk` from position 0, then one
        token at a time, also when a preempted request recomputes its generated tokens: DuoAttention's
        streaming heads see what decoding saw only through the same chunks (`duo_jax.methods.duo`)."""
        prompt = len(slot.request.prompt)
        return min(self.chunk, prompt - slot.fed) if slot.fed < prompt else 1

    def _prefilling(self, slot: _Slot) -> bool:
        return slot.fed < len(slot.request.prompt)

    def _plan(self) -> dict[int, int]:
        """Tokens each slot feeds this step (slot -> count; the slots that feed nothing left out), with the pages
        they need taken (oldest first, so that pages go to the requests that have waited longest; preempting
        the newest while short, which may change the plan: planned again until every fed slot has its pages).
        Under "split", a step with decoding slots feeds one prefilling request only, the oldest."""
        while True:
            order = sorted((b for b, s in enumerate(self.running) if s), key=lambda b: self.running[b].admitted)
            feed = {b: self._feed(self.running[b]) for b in order}
            prefilling = [b for b in order if self._prefilling(self.running[b])]
            if self.mixed == "split" and 0 < len(prefilling) < len(order):
                for b in prefilling[1:]:
                    del feed[b]
            short = [b for b, n in feed.items() if self._pages(self.running[b].fed + n) > len(self.running[b].pages)]
            if not short:
                return feed
            for b in short:
                if self.running[b] is not None:  # not preempted by an older slot's growth
                    self._grow(b, self.running[b].fed + feed[b])

    def _run(self, feed: dict[int, int], row: int | None = None) -> jax.Array:
        """One compiled call feeding feed[b] tokens to each slot b: over every slot at T = the longest feed
        ([slots, chunk] or [slots, 1]; logits [slots, V]), or, with `row`, slot `row` alone at [1, chunk]
        (logits [1, V])."""
        T = self.chunk if row is not None or max(feed.values()) > 1 else 1
        batch = 1 if row is not None else self.slots
        tokens, n_valid = np.zeros((batch, T), np.int32), np.zeros(batch, np.int32)
        for b, n in feed.items():
            slot, i = self.running[b], 0 if row is not None else b
            tokens[i, :n] = slot.request.sequence[slot.fed : slot.fed + n]
            n_valid[i] = n
        if self._tables_changed:
            self.cache = dataclasses.replace(self.cache, block_tables=jax.device_put(self.tables.copy()))
            self._tables_changed = False
        config, dtype = self.engine.config, self.engine.dtype
        # Transfers (jnp.asarray of host values would run a staging executable each). Copies: on CPU a transfer may
        # alias a numpy buffer, and the step runs asynchronously while the host updates self.lengths / self.tables
        # for the next one.
        lengths = jax.device_put(self.lengths.copy())
        args = (jax.device_put(tokens), jax.device_put(n_valid), self.method.state())
        if row is None:
            run = compiled_extend(config, self.method, self.slots, T, dtype, self.impl, **self.engine.weight_layout)
            logits, self.cache, _ = run(self.engine.params, self.cache, lengths, *args)
        else:
            run = compiled_extend_row(config, self.method, self.slots, T, dtype, self.impl, **self.engine.weight_layout)
            logits, self.cache, _ = run(self.engine.params, self.cache, jax.device_put(np.int32(row)), lengths, *args)
        self.counters["calls"] += 1
        self.counters["row_tokens"] += batch * T
        return logits

    def step(self) -> bool:
        """Admit, run the step's compiled calls (one, or under "split" a decode step and one prefill chunk),
        sample, retire finished requests. False when idle."""
        self._admit()
        feed = self._plan()
        if not feed:
            return False
        # Under "split", prompt chunks (feeds of more than one token: only prefilling slots have them) run
        # each alone unless every slot has one; a chunk of a single token rides in the T = 1 step.
        chunks = [b for b, n in feed.items() if n > 1]
        alone = chunks if self.mixed == "split" and len(chunks) < self.slots else []
        calls = []  # (logits, {slot: its row of the logits})
        batched = {b: n for b, n in feed.items() if b not in alone}
        if batched:
            calls.append((self._run(batched), {b: b for b in batched}))
        for b in alone:
            calls.append((self._run({b: feed[b]}, row=b), {b: 0}))
        self.counters["steps"] += 1
        ready = set()
        for b, n in feed.items():
            slot = self.running[b]
            slot.fed += n
            self.lengths[b] += n
            if slot.fed == len(slot.request.sequence):
                ready.add(b)
            if slot.fed <= len(slot.request.prompt):
                self.counters["prompt_tokens"] += n
            if self.prefix_cache:
                self._remember_prefix(b, slot.fed - n)
        for logits, rows in calls:
            self._sample(logits, {b: i for b, i in rows.items() if b in ready})
        return True

    def _sample(self, logits: jax.Array, rows: dict[int, int]) -> None:
        """Sample the next token of each slot b in `rows` from its row rows[b] of `logits`: one call over every
        row, each by its request's rule (a fixed shape and runtime rules: no compile when the batch's make-up
        or the requests' options change; rows not in `rows` are ignored)."""
        n = logits.shape[0]
        seeds, counts, rules = np.zeros(n, np.uint32), np.zeros(n, np.int32), [Sampling()] * n
        for b, i in rows.items():
            request = self.running[b].request
            seeds[i], counts[i], rules[i] = request.seed, len(request.tokens), request.sampling
        new = np.asarray(sample_seeded(logits, *jax.device_put((seeds, counts, Sampling.stack(rules)))))
        for b, i in rows.items():
            request, token = self.running[b].request, int(new[i])
            request.tokens.append(token)
            self.counters["tokens"] += 1
            reason = None
            if (
                request.stop_at_eos
                and token in self.eos_ids
                or token in request.stop_ids
                or request.stop
                and self._stop_string(request)
            ):
                reason = "stop"
            elif len(request.tokens) >= request.max_tokens:
                reason = "length"
            if request.on_token is not None:
                request.on_token(request, token)
            if reason is not None:
                self._release(b)
                self._finish(request, reason)

    def _stop_string(self, request: Request) -> bool:
        """Whether the text of the request's tokens now holds one of its stop strings. The text grows by the
        new token's (`TextStream`), and only where a stop string could have been completed is searched."""
        if request._text is None:
            request._text = TextStream(self.detokenize, after=request.prompt)
        stream = request._text
        settled = stream.settled  # the text searched already, but for a stop string's length of it
        text = stream.extend(request.tokens[len(stream.ids) :])
        if stream.pending:  # a character still arriving is no U+FFFD to match (a stop string may hold one)
            text = text.rstrip("\ufffd")  # the settled text never ends in one: only the pending tail's go
        start = max(len(settled) - max(map(len, request.stop)) + 1, 0) if text.startswith(settled) else 0
        return any(text.find(stop, start) >= 0 for stop in request.stop)

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.step() or not self.idle:
            pass

    def serve_forever(self, stop: threading.Event, poll_s: float = 0.01, max_failures: int = 3) -> None:
        """Step while there is work; wait for requests when idle; return once `stop` is set and the requests
        already submitted have finished (none is dropped on shutdown).

        Supervision: a step that raises fails the requests it was running (finish_reason "error", `error`
        says what failed; their pages freed) and the loop goes on with the queued ones. `max_failures` failed
        steps in a row (none served in between) mean the scheduler cannot go on: it closes (`submit` refuses
        at once), fails every request left, and raises, for its owner to exit."""
        failures = 0
        while True:
            try:
                worked = self.step()
                failures = 0
            except Exception as e:
                failures += 1
                error = f"the scheduler failed while serving this request ({type(e).__name__}: {e})"
                self._fail([slot.request for slot in self.running if slot], error, release=True)
                if failures >= max_failures:
                    self.close(
                        f"the scheduler stopped after {failures} failed steps in a row ({type(e).__name__}: {e})"
                    )
                    raise
                continue
            if not worked:
                if stop.is_set() and self.idle:
                    self.close("the server is shutting down")
                    return
                time.sleep(poll_s)

    def close(self, reason: str) -> None:
        """Refuse new requests from now on (`reason`), and fail the ones not finished."""
        with self._lock:
            self.closed = reason
        self._admit_inbox()
        self._fail([slot.request for slot in self.running if slot] + list(self.queue), reason, release=True)
        self.queue.clear()

    def _fail(self, requests: list[Request], error: str, release: bool) -> None:
        for b, slot in enumerate(self.running):
            if release and slot is not None and slot.request in requests:
                self._release(b)
        for request in requests:
            if not request.done.is_set():
                request.error = error
                self._finish(request, "error")

    def warm_up(self) -> None:
        """Compile what serving runs, before the first request waits for it: a step with every slot prefilling
        a chunk, a decode step, a chunk alone on one row (split), the sampler on both logits shapes and a prefix
        reuse, by serving a few throwaway requests (sampled, so that the sampler's filtering is compiled). The counters
        start again from zero."""
        limit = self.sequence_limit
        n = min(self.chunk, limit - 2)
        vocab = self.engine.config.vocab_size
        requests = [
            Request(
                [(b * n + i) % vocab for i in range(n)],
                max_tokens=2,
                stop_at_eos=False,
                sampling=Sampling(1.0, 0.9, 8),
                seed=b,
            )
            for b in range(self.slots)
        ]
        try:
            for request in requests:
                self.check(request)
        except DuoJaxError:
            return  # too small a pool or context for these shapes: the first requests compile them
        for request in requests:
            self.inbox.put(request)
        self.run()
        self.inbox.put(Request([(i + 1) % vocab for i in range(n)], max_tokens=1, stop_at_eos=False))
        self.run()
        if n + 1 < limit:  # a prompt that extends the first one reuses its prefix (when a whole reuse unit)
            self.inbox.put(Request(requests[0].prompt + [0], max_tokens=1, stop_at_eos=False))
            self.run()
        self.counters.clear()

    def pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free
