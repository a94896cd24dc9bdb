"""Where CUDA managed memory lives: keeping the upload ring on the host.

MLX's CUDA backend keeps an array in device memory until the host touches it (a numpy view, as the ring's
host views are); from then on the buffer is managed memory. A managed buffer the host writes and a kernel
then reads migrates page by page twice per use: back to the host when `SlotPools.stage` rewrites it, to
the GPU when the copy into the slot reads it. The faults cost more than the bytes, and the layer's one
sync waits for them. Advised to stay in host memory and mapped for the GPU, the ring is written in
place by the host and read by the copy kernel over the bus, with no fault at all.

The advice is a hint about placement, never about contents: correctness still rests on the ring's
fence (`SlotPools.stage` evaluates every queued update before a row of the ring is rewritten). Where the
driver API is missing or refuses, nothing changes but speed. `STREAMOE_UPLOAD_ADVICE=0` turns it off
(for `bench/fill.py`'s comparison).
"""

from __future__ import annotations

import ctypes
import os

import mlx.core as mx
import numpy as np

ENABLED = os.environ.get("STREAMOE_UPLOAD_ADVICE", "1") not in ("", "0")
_SET_PREFERRED_LOCATION, _SET_ACCESSED_BY = 3, 5  # CUmem_advise
_LOCATION_DEVICE, _LOCATION_HOST = 1, 2  # CUmemLocationType
_CPU = -1  # CU_DEVICE_CPU, for the pre-12.2 signature


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


def _driver() -> ctypes.CDLL | None:
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    if cuda.cuInit(0) != 0:
        return None
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0:
        return None
    if not ctx.value:  # this thread has no context yet: MLX's runtime uses device 0's primary one
        if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), 0) != 0 or cuda.cuCtxSetCurrent(ctx) != 0:
            return None
    return cuda


def _advise(cuda: ctypes.CDLL, ptr: int, n: int, advice: int, host: bool) -> bool:
    if hasattr(cuda, "cuMemAdvise_v2"):
        f = cuda.cuMemAdvise_v2
        f.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, _Location]
        return f(ptr, n, advice, _Location(_LOCATION_HOST if host else _LOCATION_DEVICE, 0)) == 0
    f = cuda.cuMemAdvise
    f.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_int]
    return f(ptr, n, advice, _CPU if host else 0) == 0


def keep_on_host(views: list[np.ndarray]) -> bool:
    """Advise CUDA to keep these buffers (host views of MLX arrays) in host memory, mapped for GPU 0.
    Returns whether the advice took; False on every backend but CUDA."""
    if not ENABLED or mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return False
    cuda = _driver()
    if cuda is None:
        return False
    ok = True
    for v in views:
        ptr, n = v.ctypes.data, v.nbytes
        ok = ok and _advise(cuda, ptr, n, _SET_PREFERRED_LOCATION, host=True)
        ok = ok and _advise(cuda, ptr, n, _SET_ACCESSED_BY, host=False)
    return ok


def host_pool(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A zeroed array in host memory that the device's kernels read in place: on CUDA, made on MLX's CPU stream
    (managed memory from its allocation, never a device buffer) and advised to stay on the host, mapped for the
    GPU, so a kernel reading it pulls the bytes over the bus and no page migrates into device memory. Elsewhere
    a plain array (the CPU backend's and Metal's are host memory already)."""
    pool = mx.zeros(shape, dtype=dtype, stream=mx.cpu)
    mx.eval(pool)
    keep_on_host([np.frombuffer(memoryview(pool).cast("B"), dtype=np.uint8)])
    return pool
