"""Continuous batching: a host loop that runs many requests through a fixed number of slots of one paged cache.

The engine's compiled `extend` runs every step ([slots, chunk] while some slot is prefilling, [slots, 1] when all
decode). Between steps the scheduler
  * admits queued requests into free slots (FIFO) when the pool has the pages their tokens so far need;
  * feeds each running request its next tokens: up to `chunk` prompt tokens (chunked prefill), or its last
    sampled token (decode), in the same step: newcomers prefill while the others decode;
  * hands out pages as sequences grow (`PagePool`, one page per `page_size` tokens, the same page index in
    every layer's pool) and, when the pool is empty, preempts the most recently admitted request: its pages
    are freed and it goes back to the front of the queue with the tokens it has, to be fed again (recompute:
    its prompt in chunks, its generated tokens one by one, as the first time) when pages free up. No request writes a page it does not hold, so none corrupts another;
  * samples each request's next token with its own options (`Sampling`, a seed: the key of its n-th token
    is fold_in(key(seed), n), so its tokens do not depend on what it is batched with) and stops it at
    `max_tokens`, at EOS (unless `stop_at_eos=False`) or at one of its `stop_ids`, freeing its pages.

Prefix reuse (shared pages for a shared prompt prefix) is not implemented yet.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import queue
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from duo_jax.engine import Engine, compiled_extend
from duo_jax.errors import DuoJaxError
from duo_jax.methods.paged import PagedDuo
from duo_jax.sampling import Sampling, sample


class PagePool:
    """The free pages of a pool of `num_pages` (indices into every layer's pool)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise DuoJaxError(f"asked for {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def give_back(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


def pages_for_memory(method: PagedDuo, memory_bytes: int, dtype) -> int:
    """How many pages fit `memory_bytes` of retrieval K/V (every layer's pool together)."""
    per_page = 2 * method.page_size * method.layout.head_dim * jnp.dtype(dtype).itemsize * sum(
        method.layout.num_retrieval)
    return max(1, memory_bytes // max(per_page, 1))


_ids = itertools.count()


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
    on_token: Callable | None = None
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    tokens: list[int] = dataclasses.field(default_factory=list)  # generated so far
    finish_reason: str | None = None  # "stop" (EOS or a stop id) or "length"
    preemptions: int = 0
    done: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)

    @property
    def sequence(self) -> list[int]:
        return self.prompt + self.tokens


@dataclasses.dataclass(eq=False)
class _Slot:
    request: Request
    admitted: int  # admission order (the newest is preempted first)
    fed: int = 0  # tokens of request.sequence in the cache
    pages: list[int] = dataclasses.field(default_factory=list)


@functools.partial(jax.jit, static_argnums=3)
def _sample_rows(logits, seeds, counts, sampling: Sampling):
    """Row b's token sampled with key fold_in(key(seeds[b]), counts[b]): the same whatever the batch."""
    return jax.vmap(lambda row, s, n: sample(row[None], jax.random.fold_in(jax.random.key(s), n), sampling)[0])(
        logits, seeds, counts)


class Scheduler:
    """Continuous batching of `Request`s over `method`'s paged cache with `slots` sequences per step."""

    def __init__(self, engine: Engine, method: PagedDuo, *, slots: int, chunk: int = 64, impl: str = "auto"):
        if not isinstance(method, PagedDuo) or method.num_pages is None:
            raise DuoJaxError("the scheduler needs a paged method with a pool size: "
                              "duo_jax.methods.paged.paged(method, num_pages=...)")
        if slots < 1 or chunk < 1:
            raise DuoJaxError(f"slots and chunk must be positive, got {slots}, {chunk}")
        if engine.mesh is not None:
            raise DuoJaxError("the scheduler runs on one device; serve with an engine built without a mesh")
        self.engine, self.method, self.slots, self.chunk, self.impl = engine, method, slots, chunk, impl
        self.pool = PagePool(method.num_pages)
        self.cache = method.empty_cache(slots, engine.dtype)
        self.tables = np.full((slots, method.pages_per_sequence), method.num_pages, np.int32)
        self.lengths = np.zeros(slots, np.int32)
        self.running: list[_Slot | None] = [None] * slots
        self.queue: collections.deque[Request] = collections.deque()
        self.inbox: queue.Queue[Request] = queue.Queue()
        self.eos_ids = frozenset(engine.config.eos_token_ids)
        self._admissions = itertools.count()
        self._tables_changed = True
        self.counters = collections.Counter()  # requests, finished, tokens, prompt_tokens, steps, preemptions

    # --- requests -------------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """A clear error for a request this scheduler can never serve."""
        config, n = self.engine.config, len(request.prompt)
        if n == 0:
            raise DuoJaxError("the prompt is empty; it needs at least one token")
        if min(request.prompt) < 0 or max(request.prompt) >= config.vocab_size:
            raise DuoJaxError(f"prompt token ids must lie in [0, {config.vocab_size})")
        if request.max_tokens < 1:
            raise DuoJaxError(f"max_tokens must be positive, got {request.max_tokens}")
        s = request.sampling
        if s.temperature < 0 or not 0 < s.top_p <= 1 or s.top_k < 0:
            raise DuoJaxError("need temperature >= 0, 0 < top_p <= 1 and top_k >= 0")
        total = n + request.max_tokens
        limit = min(self.method.max_tokens, config.max_position_embeddings)
        if total > limit:
            raise DuoJaxError(f"prompt ({n} tokens) + max_tokens ({request.max_tokens}) = {total} exceeds the "
                              f"{limit} tokens a sequence can hold")
        if self._pages(total - 1) > self.pool.num_pages:
            raise DuoJaxError(f"the request needs {self._pages(total - 1)} pages; the pool has "
                              f"{self.pool.num_pages}")

    def submit(self, request: Request) -> Request:
        """Queue a request (thread-safe); it runs from the next step on."""
        self.check(request)
        self.inbox.put(request)
        return request

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

    def _preempt_newest(self) -> None:
        b = max((b for b, s in enumerate(self.running) if s), key=lambda b: self.running[b].admitted)
        request = self._release(b)
        request.preemptions += 1
        self.counters["preemptions"] += 1
        self.queue.appendleft(request)

    def _admit(self) -> None:
        while True:
            try:
                self.queue.append(self.inbox.get_nowait())
                self.counters["requests"] += 1
            except queue.Empty:
                break
        for b in range(self.slots):
            if not self.queue:
                return
            if self.running[b] is None:
                request = self.queue[0]
                if self._pages(len(request.sequence)) > self.pool.num_free:
                    return  # first come, first served: wait for pages
                self.queue.popleft()
                self.running[b] = _Slot(request, next(self._admissions))

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

    def step(self) -> bool:
        """Admit, run one compiled step over every slot, sample, retire finished requests. False when idle."""
        self._admit()
        # Oldest first, so that pages go to the requests that have waited longest.
        for b in sorted((b for b, s in enumerate(self.running) if s), key=lambda b: self.running[b].admitted):
            slot = self.running[b]
            if slot is not None:
                self._grow(b, slot.fed + self._feed(slot))
        active = [b for b, s in enumerate(self.running) if s]
        if not active:
            return False
        feed = {b: self._feed(self.running[b]) for b in active}
        T = self.chunk if max(feed.values()) > 1 else 1
        tokens = np.zeros((self.slots, T), np.int32)
        n_valid = np.zeros(self.slots, np.int32)
        for b, n in feed.items():
            slot = self.running[b]
            tokens[b, :n] = slot.request.sequence[slot.fed: slot.fed + n]
            n_valid[b] = n
        if self._tables_changed:
            self.cache = dataclasses.replace(self.cache, block_tables=jnp.asarray(self.tables.copy()))
            self._tables_changed = False
        run = compiled_extend(self.engine.config, self.method, self.slots, T, self.engine.dtype, self.impl,
                              weights=self.engine.weights)
        # Copies: on CPU jnp.asarray may alias a numpy buffer, and the step runs asynchronously while the host
        # updates self.lengths / self.tables for the next one.
        lengths = jnp.asarray(self.lengths.copy())
        logits, self.cache, _ = run(self.engine.params, self.cache, lengths, jnp.asarray(tokens), jnp.asarray(n_valid),
                                    self.method.state())
        self.counters["steps"] += 1
        ready = []
        for b, n in feed.items():
            slot = self.running[b]
            slot.fed += n
            self.lengths[b] += n
            if slot.fed == len(slot.request.sequence):
                ready.append(b)
            if slot.fed <= len(slot.request.prompt):
                self.counters["prompt_tokens"] += n
        self._sample(logits, ready)
        return True

    def _sample(self, logits: jax.Array, rows: list[int]) -> None:
        by_rule = collections.defaultdict(list)
        for b in rows:
            by_rule[self.running[b].request.sampling].append(b)
        for sampling, group in by_rule.items():
            requests = [self.running[b].request for b in group]
            new = _sample_rows(logits[jnp.asarray(group)], jnp.asarray([r.seed for r in requests], jnp.uint32),
                               jnp.asarray([len(r.tokens) for r in requests], jnp.int32), sampling)
            for b, request, token in zip(group, requests, np.asarray(new).tolist()):
                request.tokens.append(token)
                self.counters["tokens"] += 1
                if request.stop_at_eos and token in self.eos_ids or token in request.stop_ids:
                    request.finish_reason = "stop"
                elif len(request.tokens) >= request.max_tokens:
                    request.finish_reason = "length"
                if request.on_token is not None:
                    request.on_token(request, token)
                if request.finish_reason is not None:
                    self._release(b)
                    self.counters["finished"] += 1
                    if request.on_token is not None:
                        request.on_token(request, None)
                    request.done.set()

    def run(self) -> None:
        """Step until every submitted request has finished."""
        while self.step() or not self.idle:
            pass

    def serve_forever(self, stop: threading.Event, poll_s: float = 0.01) -> None:
        """Step while there is work; wait for requests when idle; return once `stop` is set and the requests
        already submitted have finished (none is dropped on shutdown)."""
        try:
            while True:
                if not self.step():
                    if stop.is_set() and self.idle:
                        return
                    time.sleep(poll_s)
        except Exception:  # a failed step: end every request (finish_reason "error") rather than leave it waiting
            self._admit()
            for request in [slot.request for slot in self.running if slot] + list(self.queue):
                request.finish_reason = "error"
                if request.on_token is not None:
                    request.on_token(request, None)
                request.done.set()
            raise

    def pages_in_use(self) -> int:
        return self.pool.num_pages - self.pool.num_free
