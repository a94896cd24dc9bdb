"""The driver's count of a GPU's used memory (NVML), read with neither MLX nor a CUDA context.

`streamoe` takes one reading when it is imported (`AT_IMPORT`), before MLX makes its CUDA context; the plan's
`driver` account is what the device's count has grown by since, less MLX's own allocations: the context and the
libraries a CUDA process holds in the GPU's memory, which MLX's counters leave out (0.51 GiB on the H200)."""

from __future__ import annotations

import ctypes


def _nvml() -> ctypes.CDLL | None:
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == 0 else None


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def device_memory_used(index: int = 0) -> int | None:
    """Bytes of GPU `index`'s memory in use, as the driver counts them (every process's allocations, CUDA contexts
    and libraries included); None without an NVIDIA driver. It needs no CUDA context, so a watcher process can poll
    it without taking device memory itself."""
    nvml = _nvml()
    if nvml is None:
        return None
    dev, mem = ctypes.c_void_p(), _NvmlMemory()
    if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(dev)) or nvml.nvmlDeviceGetMemoryInfo(dev, ctypes.byref(mem)):
        return None
    return int(mem.used)


AT_IMPORT: int | None = None  # set by `streamoe/__init__.py`, before anything imports MLX


def note_start() -> None:
    """Take the reading before MLX's context exists (a second call keeps the first)."""
    global AT_IMPORT
    if AT_IMPORT is None:
        AT_IMPORT = device_memory_used()
