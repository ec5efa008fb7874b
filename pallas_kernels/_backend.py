"""Backend selection for the Pallas kernels: interpret mode and compiler params.

On CPU the kernels run in interpret mode; on GPU they always lower through Triton (they are written in its style),
and `triton_unavailable` says, once per process, why a probe kernel could not run where JAX no longer supports
that backend; TPU has its own kernels (`pallas_kernels.tpu`). `backend` and `lowering_for` (lowering for a platform
that is not present) serve both sets. Design: docs/kernels.md, "Backends".
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

_target: str | None = None  # set by `lowering_for`
# The GPU a host without one lowers the Triton kernels for, where JAX wants to know (its compute capability)
ABSTRACT_GPU = dict(device_kind="NVIDIA H100 80GB HBM3", num_cores=132, platform="gpu")


def backend() -> str:
    """The platform the kernels are lowered for: "cpu", "gpu" or "tpu" (the default device's, unless
    `lowering_for` says otherwise)."""
    if _target is not None:
        return _target
    platform = jax.default_backend()
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def on_gpu() -> bool:
    """Whether the device (or the platform being lowered for) is a GPU."""
    return backend() == "gpu"


@contextlib.contextmanager
def lowering_for(platform: str) -> Iterator[None]:
    """Trace the kernels for `platform` ("gpu" or "tpu") whatever the local device: with
    ``jax.export.export(..., platforms=["cuda"])`` a CPU-only host lowers them through Triton exactly as a
    GPU host would (used by the tests to check the GPU path, and to export for a GPU from a CPU machine)."""
    global _target
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"platform must be 'cpu', 'gpu' or 'tpu', got {platform!r}")
    previous, _target = _target, platform
    try:
        with _abstract_gpu() if platform == "gpu" else contextlib.nullcontext():
            yield
    finally:
        _target = previous


def _abstract_gpu() -> contextlib.AbstractContextManager:
    """Where JAX reads the GPU that Triton lowers for from the device (JAX >= 0.11: its compute capability, from
    `jax._src.pallas.triton.gpu_info`) and this host has none: an abstract mesh whose abstract device is
    ABSTRACT_GPU. Elsewhere nothing (JAX 0.10 lowers without one; a GPU host names its own)."""
    try:
        import jax._src.pallas.triton.gpu_info  # noqa: F401  (the import is the check)
        from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh
    except ImportError:
        return contextlib.nullcontext()
    if jax.default_backend() in ("gpu", "cuda", "rocm"):
        return contextlib.nullcontext()
    return use_abstract_mesh(AbstractMesh((), (), abstract_device=AbstractDevice(**ABSTRACT_GPU)))


def exporting() -> bool:
    """True inside `lowering_for`: the kernels are traced for a platform other than (or without) the local
    device, so nothing can be probed by running it."""
    return _target is not None


# Set (to anything but "" or "0") to run as a GPU without Pallas's Triton backend: `auto` then takes cuDNN and the
# XLA path, as where JAX no longer ships it (to measure that route, or to avoid a Triton that misbehaves).
DISABLE_TRITON = "DUO_JAX_DISABLE_TRITON"


def triton_disabled() -> bool:
    """Whether DUO_JAX_DISABLE_TRITON asks this process to run as a GPU without Pallas's Triton backend."""
    return os.environ.get(DISABLE_TRITON, "") not in ("", "0")


@functools.cache
def triton_unavailable() -> str | None:
    """None when a Pallas kernel with Triton compiler params compiles and runs on the default device and
    returns the right values; otherwise why not (the exception, the wrong result, or DUO_JAX_DISABLE_TRITON).
    Probed once per process, eagerly even when called while a jit is being traced."""
    if triton_disabled():
        return f"disabled by the environment ({DISABLE_TRITON}={os.environ[DISABLE_TRITON]})"
    try:
        from jax.experimental import pallas as pl

        def add_one(x_ref, o_ref):
            o_ref[...] = x_ref[...] + 1.0

        with jax.core.eval_context():  # eager, and out of any trace this is called in
            x = jnp.arange(16 * 16, dtype=jnp.float32).reshape(16, 16)
            out = pl.pallas_call(
                add_one,
                out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                compiler_params=_triton_params_cls()(num_warps=1, num_stages=1),
            )(x)
            if not bool(jnp.all(out == x + 1.0)):
                return "a probe kernel compiled through Triton but returned wrong values"
    except Exception as e:  # noqa: BLE001 - any failure means the backend cannot serve the kernels
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def fit_tiles(block_q: int, block_k: int, dtype, interpret: bool) -> tuple[int, int]:
    """The (block_q, block_k) a compiled Triton kernel can hold: each program keeps its query tile and its
    double-buffered key / value tiles in shared memory, so 32-bit types get at most 64 x 64 tiles, the bytes of
    16-bit types' 128 x 128 (docs/kernels.md, "Tile sizes on a GPU"). Elsewhere the blocks are returned as given."""
    if interpret or backend() != "gpu" or jnp.dtype(dtype).itemsize < 4:
        return block_q, block_k
    return min(block_q, 64), min(block_k, 64)


def resolve_interpret(interpret: bool | None) -> bool:
    """``interpret=None`` means interpret exactly when no Pallas compiler exists."""
    if interpret is None:
        return backend() not in ("gpu", "tpu")
    return bool(interpret)


def _triton_params_cls():
    try:  # JAX >= 0.6: jax.experimental.pallas.triton.CompilerParams.
        from jax.experimental.pallas import triton as pltriton

        return pltriton.CompilerParams
    except (ImportError, AttributeError):  # Older JAX.
        from jax.experimental.pallas import gpu as plgpu

        return plgpu.TritonCompilerParams


def _tpu_params_cls():
    from jax.experimental.pallas import tpu as pltpu

    cls = getattr(pltpu, "CompilerParams", None)
    return cls if cls is not None else pltpu.TPUCompilerParams


def compiler_params(
    *, interpret: bool, num_warps: int, num_stages: int, dimension_semantics: tuple[str, ...] | None = None
) -> Any:
    """Compiler params for a ``pallas_call`` on the current backend (or None)."""
    if interpret:
        return None
    platform = backend()
    if platform == "gpu":
        return _triton_params_cls()(num_warps=num_warps, num_stages=num_stages)
    if platform == "tpu":
        cls = _tpu_params_cls()
        return cls() if dimension_semantics is None else cls(dimension_semantics=dimension_semantics)
    return None
