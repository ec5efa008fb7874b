"""What every TPU kernel here shares: interpret mode, Mosaic compiler params, layouts.

``interpret``: None runs TPU interpret mode off TPU and compiles with Mosaic on a TPU (or inside
`pallas_kernels._backend.lowering_for("tpu")`); False compiles; a ``pltpu.InterpretParams`` is TPU interpret mode
with those settings; True is JAX's generic Pallas interpreter, which works under ``jax.checkpoint``. Prefill
kernels work on [B, H, T, D] (`heads_major`), decode on the cache viewed as [B, S, H * D]. Design:
docs/kernels.md, "Interpret mode and layout".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _backend

try:  # JAX >= 0.7: TPU interpret mode with the TPU memory model.
    from jax.experimental.pallas.tpu import InterpretParams as _InterpretParams
except ImportError:  # pragma: no cover - older JAX.
    _InterpretParams = None

LANES = 128  # TPU vector lanes: the last dim of a block is a multiple of this or whole.


def interpret_mode(interpret: Any) -> Any:
    """The ``interpret=`` value for a TPU ``pallas_call`` (see the module docstring): None becomes
    False on (or when lowering for) a TPU and TPU interpret params elsewhere; anything else is kept."""
    if interpret is not None:
        return interpret
    if _backend.backend() == "tpu":
        return False
    return _InterpretParams() if _InterpretParams is not None else True


def compiler_params(dimension_semantics: tuple[str, ...], interpret: Any) -> Any:
    """Mosaic compiler params (None in interpret mode)."""
    if interpret:
        return None
    return _backend._tpu_params_cls()(dimension_semantics=dimension_semantics)


def check_tpu_block(name: str, value: int) -> None:
    """Sequence blocks are multiples of 128: a lane tile, so a block is also legal as the last dim
    of a [.., block] row (TPU tiles a block's last two dims by (8, 128))."""
    if not isinstance(value, (int, np.integer)) or value <= 0 or value % LANES:
        raise ValueError(
            f"{name} must be a positive multiple of {LANES} on TPU "
            f"(the (8, 128) tiling of a block's last two dims), got {value!r}."
        )


def tpu_block(block: int, length: int) -> int:
    """`block` (checked by `check_tpu_block`) shrunk to the multiple of 128 covering `length`."""
    return min(block, -(-length // LANES) * LANES)


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """Zero-pads `axis` up to a multiple of `multiple`."""
    extra = -x.shape[axis] % multiple
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths)


def heads_major(x: jax.Array) -> jax.Array:
    """[B, L, H, D] -> [B, H, L, D] (a copy: docs/kernels.md)."""
    return jnp.swapaxes(x, 1, 2)
