"""The Pallas kernels a function launches, read from its jaxpr: name, grid, block shapes.

Used by the tests and `benchmarks/kernels.py` to record what a TPU export runs
(grid and tiles) without a TPU. Nested jaxprs (jit, custom_vjp, vmap, while
bodies) are walked; a `pallas_call` under `vmap` reports its batched grid.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax


def _block_dim(dim: Any) -> int | None:
    """A block dim as an int, None for a squeezed dim."""
    size = getattr(dim, "block_size", dim)
    return size if isinstance(size, int) else None


def _sub_jaxprs(params: dict):
    for value in params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if hasattr(item, "eqns"):
                yield item
            elif hasattr(getattr(item, "jaxpr", None), "eqns"):
                yield item.jaxpr


def _walk(jaxpr, found: list[dict]) -> None:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            grid_mapping = eqn.params["grid_mapping"]
            found.append(
                {
                    "name": str(eqn.params.get("name", "")),
                    "grid": [int(g) for g in grid_mapping.grid],
                    "blocks": [[_block_dim(d) for d in bm.block_shape] for bm in grid_mapping.block_mappings],
                    "scalar_prefetch": int(getattr(grid_mapping, "num_index_operands", 0)),
                }
            )
        for sub in _sub_jaxprs(eqn.params):
            _walk(sub, found)


def pallas_launches(fn: Callable, *args) -> list[dict]:
    """Every `pallas_call` that `fn(*args)` traces, in order (args may be ShapeDtypeStructs)."""
    found: list[dict] = []
    _walk(jax.make_jaxpr(fn)(*args).jaxpr, found)
    return found
