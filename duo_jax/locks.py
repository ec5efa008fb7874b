"""Built once per key, however many threads ask at once.

`generate` may be called from several threads (a web app, an evaluation pool). What it builds once and keeps (a
compiled executable per shape, the engine holding a copy of the weights, InfiniGen's calibration) is looked up
then built on a miss; without a lock, every thread that misses at the same moment builds its own copy (minutes of
compile, or a copy of the weights, each). `KeyedLocks` serialises the builds of one key and lets other keys proceed;
`lru_cache_once` is `functools.lru_cache` built that way.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Hashable, Iterator


class KeyedLocks:
    """A lock per key, alive while a thread holds or waits for it."""

    def __init__(self):
        self._guard = threading.Lock()
        self._locks: dict[Hashable, list] = {}  # key -> [lock, threads holding or waiting]

    @contextlib.contextmanager
    def held(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if not entry[1]:
                    del self._locks[key]


def lru_cache_once(maxsize: int) -> Callable:
    """`functools.lru_cache(maxsize)` whose miss for a key runs once: threads asking for the same key while it is
    built wait for it and get the cached result (`cache_info` / `cache_clear` as lru_cache's)."""

    def decorate(build: Callable) -> Callable:
        cached = functools.lru_cache(maxsize=maxsize)(build)
        locks = KeyedLocks()

        @functools.wraps(build)
        def once(*key):
            with locks.held(key):
                return cached(*key)

        once.cache_info, once.cache_clear = cached.cache_info, cached.cache_clear
        return once

    return decorate
