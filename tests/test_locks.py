"""Built once per key: `KeyedLocks` and `lru_cache_once` under threads (the engine's uses: tests/test_engine.py)."""

import threading

from duo_jax.locks import KeyedLocks, lru_cache_once


def test_a_key_is_built_once_while_other_keys_go_on():
    calls, start, fast_done = [], threading.Barrier(5), threading.Event()

    @lru_cache_once(8)
    def build(key):
        calls.append(key)
        if key == "slow":  # finishes only once "fast" is built: a lock over every key would stall here
            assert fast_done.wait(timeout=10)
        return object()

    results = {}

    def ask(i, key):
        start.wait()
        results[i] = build(key)
        if key == "fast":
            fast_done.set()

    threads = [threading.Thread(target=ask, args=(i, "slow" if i < 4 else "fast")) for i in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(calls) == ["fast", "slow"]  # each key built once
    assert len(results) == 5 and len({id(results[i]) for i in range(4)}) == 1  # every thread got the one built
    assert build.cache_info().currsize == 2
    build.cache_clear()
    assert build.cache_info().currsize == 0


def test_a_keys_lock_lives_while_held_or_awaited():
    locks = KeyedLocks()
    with locks.held("a"):
        assert list(locks._locks) == ["a"]
    assert locks._locks == {}
    try:
        with locks.held("b"):
            raise ValueError
    except ValueError:
        pass
    assert locks._locks == {}  # released on an exception too
