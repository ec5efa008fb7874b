"""Device memory: what a device has free, the check that an allocation fits before it is made, and XLA's
out-of-memory errors explained.

XLA reports an allocation that does not fit as a `jax.errors.JaxRuntimeError` whose message starts with
`RESOURCE_EXHAUSTED` and says "Out of memory" (GPU, CPU) or "Ran out of memory" (TPU): true, but it names neither
what the bytes were for nor what to change, and on a GPU it comes after the compile. `generate`, the server's
scheduler and gate training check their largest allocation (the KV cache, the page pool, a train step) against
the devices' free memory before making it, where the backend reports its memory (`Device.memory_stats()` on GPU
and TPU; the CPU reports none), and re-raise XLA's error as `DeviceMemoryError` naming the sizes and the options
that shrink them (`explain_out_of_memory`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator

import jax
import numpy as np
from jax.experimental import multihost_utils

from duo_jax.errors import DeviceMemoryError

# XLA's out-of-memory messages: "Out of memory while trying to allocate ..." (GPU's BFC allocator), "Out of memory
# allocating ..." (CPU), "Ran out of memory in memory space hbm" (TPU's compiler), "Error allocating device buffer:
# Attempting to allocate <size>. That was not possible." (TPU's runtime; "reserve" too). RESOURCE_EXHAUSTED alone is
# not enough: XLA:GPU's autotuner also reports "Failed to get configs" under it.
_OUT_OF_MEMORY = re.compile(
    r"RESOURCE_EXHAUSTED.*(\bout of memory|attempting to (allocate|reserve) .* not possible)", re.IGNORECASE | re.DOTALL
)


def gib(n: int) -> str:
    """Bytes as GiB, for messages."""
    return f"{n / 2**30:.2f} GiB"


def free_bytes(devices: Iterable[jax.Device]) -> tuple[int, jax.Device, int] | None:
    """(free bytes, device, its limit) of the device among `devices` with the least free memory (its allocator's
    `bytes_limit - bytes_in_use`), or None where a device reports no limit (the CPU backend)."""
    least = None
    for device in devices:
        if device.process_index != jax.process_index():  # another process's: it reports its own
            continue
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        if least is None or free < least[0]:
            least = (free, device, stats["bytes_limit"])
    return least


def fits(need: int, devices: Iterable[jax.Device]) -> bool:
    """Whether `need` bytes per device fit each of `devices`' free memory (True where the backend reports none).
    With several processes every one must call it, and the answer is theirs together: a plan that falls back to a
    smaller shape where it does not fit must fall back on every process, or their collectives would not match."""
    free = free_bytes(devices)
    fit = free is None or need <= free[0]
    if jax.process_count() > 1:
        return bool(multihost_utils.process_allgather(np.int32(fit)).all())
    return fit


def check_fits(need: int, devices: Iterable[jax.Device], what: str, fixes: str) -> None:
    """DeviceMemoryError when `need` bytes per device (for `what`) exceed the free memory of one of `devices`; no
    check where the backend reports no memory. `fixes`: the options that shrink the need, for the message. With
    several processes every one must call it: they decide together (one refusing alone would leave the others
    waiting for it in their first collective)."""
    free = free_bytes(devices)
    short = free is not None and need > free[0]
    if jax.process_count() > 1 and bool(multihost_utils.process_allgather(np.int32(short)).any()) and not short:
        raise DeviceMemoryError(
            f"{what} needs {gib(need)} per device, more than another process's devices have free: {fixes}"
        )
    if short:
        available, device, limit = free
        raise DeviceMemoryError(
            f"{what} needs {gib(need)} per device, and {device} has {gib(available)} free of {gib(limit)} (the "
            f"rest holds the weights and other arrays): {fixes}"
        )


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is XLA's report of an allocation that did not fit."""
    return isinstance(error, jax.errors.JaxRuntimeError) and bool(_OUT_OF_MEMORY.search(str(error)))


@contextlib.contextmanager
def explain_out_of_memory(what: str, fixes: str) -> Iterator[None]:
    """Re-raise XLA's out-of-memory error inside the block as DeviceMemoryError: `what` ran out of device memory,
    and `fixes`; XLA's own first line follows, and its error is chained (`__cause__`)."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if not is_out_of_memory(e):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise DeviceMemoryError(f"out of device memory while {what}: {fixes} (XLA: {first[:300]})") from e
