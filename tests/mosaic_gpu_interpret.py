"""Pallas Mosaic GPU's interpreter (`jax._src.pallas.mosaic_gpu.interpret`), completed for `pallas_kernels.mosaic_gpu`:
it runs a kernel's values on the CPU, but lacks what those kernels use, which `installed()` adds while a test runs:
- `wgmma` over an operand held in registers (P in P V), and, in JAX 0.10, over one read transposed (how Kᵀ enters
  Q Kᵀ): its callback reads every operand as a shared-memory buffer (JAX 0.10: untransposed);
- a CPU rule for `plgpu.layout_cast`, which is the identity on values.
The `wgmma` callback's arguments changed in JAX 0.11 (a mesh location and a thread for the device and thread ids);
each form has its completion below.
Register layouts, which the interpreter does not model, are checked by lowering the kernel for CUDA
(`jax.export`), which runs Mosaic GPU's own lowering on this host."""

from __future__ import annotations

import contextlib
import inspect

import jax
import numpy as np
import pytest
from jax._src.pallas.mosaic.interpret import utils as interpret_utils
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
from jax._src.state import types as state_types
from jax.interpreters import mlir

PARAMS = InterpretGPUParams()


def _buffer_range(transforms):
    """(the buffer's index range, the permutation of a trailing transpose or None)."""
    transforms = list(gpu_callbacks._remove_noop_transforms(transforms))
    permutation = None
    if transforms and isinstance(transforms[-1], state_types.TransposeTransform):
        permutation = tuple(transforms.pop().permutation)
    return interpret_utils.to_range(tuple(jax.tree.map(int, transforms))), permutation


def _wgmma(
    *,
    token,
    device_id,
    grid_point_coords,
    thread_id,
    acc_allocation_key_as_array,
    acc_transforms,
    acc_dtype,
    a_allocation_key_as_array,
    a_transforms,
    b_allocation_key_as_array,
    b_transforms,
    source_info=None,
):
    """The interpreter's `wgmma` callback, reading a transposed operand as its transpose and a register operand
    (passed as its value, 2-D, not an allocation key) as it is."""
    memory = gpu_callbacks._get_shared_memory()
    thread = memory.get_global_thread_id(int(device_id), int(thread_id))
    logging = interpret_utils.GPULoggingInfo(
        device_id=int(device_id),
        grid_point_coords=tuple(int(x) for x in grid_point_coords),
        thread_id=int(thread_id),
        source_info=source_info,
    )

    def read(key, transforms):
        if np.ndim(key) == 2:
            return np.asarray(key)
        index, permutation = _buffer_range(transforms)
        value, _, _ = memory.get_buffer_content(
            gpu_callbacks.HostAllocationKey.from_array(key), index, thread, logging_info=logging
        )
        return value if permutation is None else np.transpose(value, permutation)

    a, b = read(a_allocation_key_as_array, a_transforms), read(b_allocation_key_as_array, b_transforms)
    acc_key = gpu_callbacks.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_range, _ = _buffer_range(acc_transforms)
    acc, _, _ = memory.get_buffer_content(acc_key, acc_range, thread, logging_info=logging)
    result = acc + np.matmul(a, b, dtype=acc_dtype)
    memory.store_buffer_content(acc_key, acc_range, result, thread, logging_info=logging)
    return token


def _wgmma_mesh(
    *,
    token,
    mesh_location,
    thread,
    acc_allocation_key_as_array,
    acc_transforms,
    a_allocation_key_as_array,
    a_transforms,
    b_allocation_key_as_array,
    b_transforms,
    source_info=None,
):
    """JAX >= 0.11's `wgmma` callback (which reads transposed operands itself), reading a register operand (passed as
    its value, 2-D, not an allocation key) as it is."""
    if np.ndim(a_allocation_key_as_array) != 2:
        return _ORIGINAL[0](
            token=token,
            mesh_location=mesh_location,
            thread=thread,
            acc_allocation_key_as_array=acc_allocation_key_as_array,
            acc_transforms=acc_transforms,
            a_allocation_key_as_array=a_allocation_key_as_array,
            a_transforms=a_transforms,
            b_allocation_key_as_array=b_allocation_key_as_array,
            b_transforms=b_transforms,
            source_info=source_info,
        )
    memory = gpu_callbacks._get_shared_memory()
    logging = gpu_callbacks.memory.GPULoggingInfo(mesh_location, thread, source_info)

    def access(key, transforms):
        key = gpu_callbacks.HostAllocationKey.from_array(key)
        return key, memory.access(key, jax.tree.map(int, gpu_callbacks._remove_noop_transforms(transforms)))

    b_key, b_access = access(b_allocation_key_as_array, b_transforms)
    b, _, _ = memory.get_buffer_content(b_key, b_access, thread, logging_info=logging)
    acc_key, acc_access = access(acc_allocation_key_as_array, acc_transforms)
    acc, _, _ = memory.get_buffer_content(acc_key, acc_access, thread, logging_info=logging)
    result = acc + np.matmul(np.asarray(a_allocation_key_as_array), b, dtype=acc.dtype)
    memory.store_buffer_content(acc_key, acc_access, result, thread, logging_info=logging)
    return token


_ORIGINAL = [gpu_callbacks.wgmma]
_layout_cast_rule = False


@contextlib.contextmanager
def installed():
    """The completions above while the block runs (the `wgmma` callback restored after it). A JAX whose interpreter
    calls `wgmma` with other arguments than either form skips the test."""
    global _layout_cast_rule
    arguments = inspect.signature(_ORIGINAL[0]).parameters.keys()
    completion = next((f for f in (_wgmma, _wgmma_mesh) if inspect.signature(f).parameters.keys() == arguments), None)
    if completion is None:
        pytest.skip(f"the Mosaic GPU interpreter of JAX {jax.__version__} calls wgmma in a form not completed here")
    if not _layout_cast_rule:  # a lowering rule cannot be unregistered; the identity is right for any CPU caller
        mlir.register_lowering(gpu_core.layout_cast_p, lambda ctx, x, **params: [x], platform="cpu")
        _layout_cast_rule = True
    gpu_callbacks.wgmma = completion
    try:
        yield PARAMS
    finally:
        gpu_callbacks.wgmma = _ORIGINAL[0]
