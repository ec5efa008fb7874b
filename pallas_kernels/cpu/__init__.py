"""CPU kernels: flash attention in C++ through XLA's FFI (`flash_attention.cc`), forward only.

Semantics: query t of sequence b sits at position q_offset[b] + t; key slot s holds position s (a contiguous
cache, as the flash kernels') or k_positions[b, s] (a ring of cached tokens followed by a chunk, an eviction
cache; -1: empty) and is filled iff s < kv_len[b]; a query sees the filled slots whose position is at or before
its own; one that sees none gives zeros. `flash_attention_received` also sums each key's attention over the
queries (H2O's scores). float32 only. The library is built on first use by the host's C++
compiler into a cache folder (`$DUO_JAX_CACHE`); where that fails `available()` is False and `unavailable()` says
why. Design: docs/kernels.md, "The CPU kernel".
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

SOURCE = pathlib.Path(__file__).with_name("flash_attention.cc")
TARGET = "duo_jax_cpu_flash_attention"  # slot = position
TARGET_AT = "duo_jax_cpu_flash_attention_at"  # keys at explicit positions
TARGET_RECEIVED_AT = "duo_jax_cpu_flash_attention_received_at"  # the same, and the attention each key receives
BLOCK_Q, BLOCK_K = 64, 64  # queries per work item (times the G heads of a KV head: the tile's rows); keys per tile

__all__ = ["available", "build_command", "flash_attention", "flash_attention_received", "unavailable"]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return name
    return None


def build_command(output: str | os.PathLike) -> list[str]:
    """The compiler command that builds the kernel library at `output`."""
    return [
        _compiler() or "g++",
        "-O3",
        "-march=native",
        "-std=c++17",
        "-shared",
        "-fPIC",
        "-w",
        f"-I{jax.ffi.include_dir()}",
        str(SOURCE),
        "-o",
        str(output),
    ]


def _cpu_signature() -> str:
    try:  # -march=native code is for this CPU only: its flags are part of the cache key
        flags = [line for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")]
        return flags[0] if flags else platform.processor()
    except OSError:
        return platform.processor() or platform.machine()


def _library_path() -> pathlib.Path:
    key = hashlib.sha256(
        "\n".join(
            [SOURCE.read_text(), " ".join(build_command("x")), jax.__version__, platform.machine(), _cpu_signature()]
        ).encode()
    ).hexdigest()[:16]
    cache = pathlib.Path(os.environ.get("DUO_JAX_CACHE", pathlib.Path.home() / ".cache" / "duo-jax"))
    return cache / "cpu_kernels" / f"flash_attention-{key}.so"


@functools.cache
def _load() -> tuple[bool, str | None]:
    """Build (once per machine) and register the kernel: (True, None), or (False, why not)."""
    if _compiler() is None:
        return False, "no C++ compiler found ($CXX, g++ or c++)"
    path = _library_path()
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # build aside, then move in: atomic for
                built = pathlib.Path(tmp) / path.name  # processes building at the same time
                result = subprocess.run(build_command(built), capture_output=True, text=True)
                if result.returncode != 0:
                    return False, f"building it failed: {' '.join(build_command(path))}\n{result.stderr[-2000:]}"
                os.replace(built, path)
        except OSError as error:  # an unwritable cache folder ($DUO_JAX_CACHE picks another)
            return False, f"building it in {path.parent} failed: {error}"
    try:
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.CpuFlashAttention), platform="cpu")
        jax.ffi.register_ffi_target(TARGET_AT, jax.ffi.pycapsule(library.CpuFlashAttentionAt), platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_RECEIVED_AT, jax.ffi.pycapsule(library.CpuFlashAttentionReceivedAt), platform="cpu"
        )
    except Exception as error:  # noqa: BLE001 - any failure to load means the XLA path, with the reason
        return False, f"loading {path} failed: {error}"
    return True, None


def available() -> bool:
    """Whether the kernel is built and registered (building it on the first call)."""
    return _load()[0]


def unavailable() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    return _load()[1]


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset,
    kv_len,
    *,
    k_positions=None,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    num_threads: int = 0,
) -> jax.Array:
    """Causal attention: q [B, T, H, E], k / v [B, S, Kh, E] float32 (H a multiple of Kh, E a multiple of 8),
    q_offset / kv_len int32 [B] (or scalars), k_positions None (slot = position) or int32 [B, S] (-1: empty) ->
    [B, T, H, E] float32. `num_threads` 0: XLA's intra-op pool and the calling thread; n: at most n threads.
    Raises RuntimeError where the kernel cannot be built (`unavailable`)."""
    operands, scale = _operands(q, k, v, q_offset, kv_len, k_positions, scale)
    call = jax.ffi.ffi_call(
        TARGET if k_positions is None else TARGET_AT,
        jax.ShapeDtypeStruct(q.shape, jnp.float32),
        vmap_method="sequential",
    )
    return call(*operands, **_attributes(scale, block_q, block_k, num_threads))


def flash_attention_received(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_offset,
    kv_len,
    k_positions: jax.Array,
    weights: jax.Array,
    *,
    scale: float | None = None,
    block_q: int = BLOCK_Q,
    block_k: int = BLOCK_K,
    num_threads: int = 0,
) -> tuple[jax.Array, jax.Array]:
    """`flash_attention` over keys at positions, and the attention each key slot receives: weights float32 [B, T]
    -> (out [B, T, H, E], received float32 [B, Kh, S] = sum over t and the G query heads of KV head kh of
    weights[b, t] * probs[b, t, h, s]), H2O's accumulated attention without materialising the probabilities."""
    operands, scale = _operands(q, k, v, q_offset, kv_len, k_positions, scale)
    B, T = q.shape[:2]
    if weights.shape != (B, T):
        raise ValueError(f"weights must be [B, T] = {(B, T)}, got {weights.shape}")
    blocks = -(-T // min(block_q, T)) if T else 0
    call = jax.ffi.ffi_call(
        TARGET_RECEIVED_AT,
        (
            jax.ShapeDtypeStruct(q.shape, jnp.float32),
            jax.ShapeDtypeStruct((B, k.shape[2], blocks, k.shape[1]), jnp.float32),  # per query block
        ),
        vmap_method="sequential",
    )
    out, received = call(
        *operands, jnp.asarray(weights, jnp.float32), **_attributes(scale, block_q, block_k, num_threads)
    )
    return out, jnp.sum(received, axis=2)


def _operands(q, k, v, q_offset, kv_len, k_positions, scale):
    """The kernel's operands (q, k, v, q_offset, kv_len[, k_positions]) checked, and the scale."""
    ok, why = _load()
    if not ok:
        raise RuntimeError(f"the CPU attention kernel is unavailable: {why}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != jnp.float32:
            raise TypeError(f"the CPU attention kernel takes float32; {name} is {x.dtype}")
    B, T, H, E = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != E or H % k.shape[2] or E % 8:
        raise ValueError(
            f"q [B, T, H, E] and k / v [B, S, Kh, E] with H % Kh == 0 and E % 8 == 0 expected, "
            f"got {q.shape}, {k.shape}, {v.shape}"
        )
    per_batch = [jnp.broadcast_to(jnp.asarray(x, jnp.int32).reshape(-1), (B,)) for x in (q_offset, kv_len)]
    operands = [q, k, v, *per_batch]
    if k_positions is not None:
        if k_positions.shape != k.shape[:2]:
            raise ValueError(f"k_positions must be [B, S] = {k.shape[:2]}, got {k_positions.shape}")
        operands.append(jnp.asarray(k_positions, jnp.int32))
    return operands, 1.0 / float(np.sqrt(E)) if scale is None else float(scale)


def _attributes(scale: float, block_q: int, block_k: int, num_threads: int) -> dict:
    return dict(
        scale=np.float32(scale), block_q=np.int64(block_q), block_k=np.int64(block_k), num_threads=np.int64(num_threads)
    )
