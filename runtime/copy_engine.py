"""CopyEngine: expert records moved by CUDA's copy engine from page-locked host memory straight into their slots.

On a GPU with memory of its own, a record reaches its slot either through the upload ring (a host copy into
host-mapped memory, then a scatter kernel on MLX's stream: 6.9 GB/s on the H200) or, from page-locked host memory,
by the GPU's copy engine writing the slot's bytes directly (`cuMemcpyHtoDAsync`: 25.3 GB/s measured there, no host
copy and no kernel; `bench/fill.py`'s `driver` rows). Page-locked means registered with the driver
(`cuMemHostRegister`): the host tier's committed slots and the read staging ring are, so every record a layer
lands comes from such memory.

The copies run on a stream of their own, outside MLX's ordering, so their callers keep two rules:
- a copy is issued only into a slot no queued kernel reads (after the layer's fence, or into a slot the tier has
  pinned away from the kernels in flight), and
- the copies are waited for (`wait`) before the kernels that read their slots are queued.

The slots' addresses come from host views of the pools, which turn MLX's CUDA buffers into managed memory; the
pools are then advised to stay in device memory (a kernel's read of them measured the same before and after).
Off until the GPU tests have passed with it on the H200 (`tests/test_gpu.py`'s host-tier test runs both paths):
`STREAMOE_COPY_ENGINE=1` turns it on; otherwise records go through the upload ring.
"""

from __future__ import annotations

import ctypes
import os
import threading

import mlx.core as mx
import numpy as np

from .managed import _SET_PREFERRED_LOCATION, _advise, _driver

ENABLED = os.environ.get("STREAMOE_COPY_ENGINE", "0") not in ("", "0")
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit ordering with the legacy default stream
_ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED


class CopyEngine:
    """The driver's copy engine for one process: page-locking host ranges (kept here, so each is given back once),
    copies into device addresses on its own stream, and the one wait for them. A copy from memory that is not
    page-locked is still exact: the driver stages it before the call returns, only slower."""

    def __init__(self, cuda: ctypes.CDLL | None):
        self.cuda = cuda
        self.ranges: dict[int, int] = {}  # page-locked range start -> bytes
        self.guard = threading.Lock()
        if cuda is None:
            return
        self.ctx = ctypes.c_void_p()
        _ok(cuda.cuCtxGetCurrent(ctypes.byref(self.ctx)), "cuCtxGetCurrent")
        cuda.cuMemcpyHtoDAsync_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        cuda.cuMemHostRegister_v2.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        for f in (cuda.cuStreamSynchronize, cuda.cuStreamDestroy_v2, cuda.cuMemHostUnregister, cuda.cuCtxSetCurrent):
            f.argtypes = [ctypes.c_void_p]
        self.stream = ctypes.c_void_p()
        _ok(cuda.cuStreamCreate(ctypes.byref(self.stream), _NON_BLOCKING), "cuStreamCreate")

    def lock(self, ptr: int, nbytes: int) -> bool:
        """Page-lock [ptr, ptr + nbytes) for the GPU. False where the driver refuses (copies from there are then
        staged by the driver: exact, slower)."""
        with self.guard:
            if ptr in self.ranges:
                return True
        if not self._register(ptr, nbytes):
            return False
        with self.guard:
            self.ranges[ptr] = nbytes
        return True

    def unlock(self, ptr: int) -> None:
        """Give a range `lock` took back to pageable memory (before its pages are dropped). No copy from it may be
        in flight: its holders release it only after `wait`."""
        with self.guard:
            if self.ranges.pop(ptr, None) is None:
                return
        self._unregister(ptr)

    # ---- the driver's calls (a test stands in for them where there is no CUDA)
    def _register(self, ptr: int, nbytes: int) -> bool:
        self.cuda.cuCtxSetCurrent(self.ctx)  # the calling thread's context: the I/O threads lock records too
        return self.cuda.cuMemHostRegister_v2(ctypes.c_void_p(ptr), nbytes, 0) in (0, _ALREADY_REGISTERED)

    def _unregister(self, ptr: int) -> None:
        self.cuda.cuCtxSetCurrent(self.ctx)
        self.cuda.cuMemHostUnregister(ctypes.c_void_p(ptr))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of host bytes into device memory on the engine's stream (returns at once)."""
        _ok(self.cuda.cuMemcpyHtoDAsync_v2(dst, ctypes.c_void_p(src), nbytes, self.stream), "cuMemcpyHtoDAsync")

    def wait(self) -> None:
        """Return once every queued copy is in device memory."""
        _ok(self.cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def keep_on_device(self, views: list[np.ndarray]) -> bool:
        """Advise CUDA to keep these buffers (host views of MLX arrays, now managed memory) in device memory."""
        return all(_advise(self.cuda, v.ctypes.data, v.nbytes, _SET_PREFERRED_LOCATION, host=False) for v in views)

    def close(self) -> None:
        for ptr in list(self.ranges):
            self.unlock(ptr)
        if self.cuda is not None and self.stream.value:
            self.cuda.cuStreamDestroy_v2(self.stream)
            self.stream = ctypes.c_void_p()


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def open_copy_engine() -> CopyEngine | None:
    """The copy engine of a CUDA device, or None (another backend, no driver, or not turned on)."""
    if not ENABLED or mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    cuda = _driver()
    if cuda is None:
        return None
    try:
        return CopyEngine(cuda)
    except RuntimeError:
        return None
