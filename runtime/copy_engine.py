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

The slots' addresses come from host views of the pools, so the pools are managed memory (`device_pool`), advised
to stay in device memory (a kernel's read of them measured the same as of a device array).
On by default where there is a CUDA device: on the H200 it moved a `--cap 4 --host-cap 24` token's records at 9.57
tok/s against 4.97 through the ring, with identical logits (`tests/test_gpu.py`'s host-tier test runs both paths).
`STREAMOE_COPY_ENGINE=0` turns it off; records then go through the upload ring.
"""

from __future__ import annotations

import ctypes
import os
import threading

import mlx.core as mx
import numpy as np

from .managed import _LOCATION_DEVICE, _LOCATION_HOST, _SET_PREFERRED_LOCATION, _advise, _driver, _Location

ENABLED = os.environ.get("STREAMOE_COPY_ENGINE", "1") not in ("", "0")
# A layer's copies in one driver call: off until `tests/test_gpu.py`'s host-tier test has passed with it on the H200.
BATCH = os.environ.get("STREAMOE_COPY_BATCH", "0") not in ("", "0")
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit ordering with the legacy default stream
_ALREADY_REGISTERED = 712  # CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED
_CONCURRENT_MANAGED_ACCESS = 89  # CU_DEVICE_ATTRIBUTE_CONCURRENT_MANAGED_ACCESS


class CopyEngine:
    """The driver's copy engine for one process: page-locking host ranges (kept here, so each is given back once),
    copies into device addresses on its own stream, and the one wait for them. A copy from memory that is not
    page-locked is still exact: the driver stages it before the call returns, only slower."""

    def __init__(self, cuda: ctypes.CDLL | None):
        self.cuda = cuda
        self.ranges: dict[int, int] = {}  # page-locked range start -> bytes
        self.guard = threading.Lock()
        self.batch = None
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
        self.batch = _batch_copy(cuda) if BATCH else None

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

    def copy_many(self, dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray) -> None:
        """Queue the copies srcs[i] -> dsts[i] of sizes[i] bytes (uint64 arrays) on the engine's stream. In one
        driver call where the driver has `cuMemcpyBatchAsync` (CUDA 12.8 on): a `--cap 4 --host-cap 24` token on
        the H200 lands about 2,200 segments, and one `cuMemcpyHtoDAsync` each cost about 9 us of this thread. Else
        (or where the driver refuses the batch) one call per copy."""
        if self.batch is not None and len(dsts):
            dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
            if self.batch(dsts, srcs, sizes, self.stream) == 0:
                return
            self.batch = None  # refused (an older driver, or memory it will not batch): one call each from now on
        for d, s, n in zip(dsts.tolist(), srcs.tolist(), sizes.tolist(), strict=True):
            self.copy(d, s, n)

    def wait(self) -> None:
        """Return once every queued copy is in device memory."""
        _ok(self.cuda.cuStreamSynchronize(self.stream), "cuStreamSynchronize")

    def device_pool(self, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
        """A zeroed array for slots this engine writes, managed memory from its allocation and moved into device
        memory before it is returned. Made on the device and then given a host view, MLX would copy it into managed
        memory and free the device copy only at a later sync: at open the pools held twice their bytes of device
        memory (on the H200 at `--cap 4` the driver counted 6.6 GiB for a moment, 4.5 after). Made on the CPU
        stream, MLX allocates it as managed memory at once; the host holds one pool's pages until it moves."""
        pool = mx.zeros(shape, dtype=dtype, stream=mx.cpu)
        mx.eval(pool)
        view = np.frombuffer(memoryview(pool).cast("B"), dtype=np.uint8)
        self.to_device(view.ctypes.data, view.nbytes)
        return pool

    def to_device(self, ptr: int, nbytes: int) -> None:
        """Advise CUDA to keep this managed range in device memory, move it there now, and wait for the move (so
        the next pool's host pages are made only after this one's are gone)."""
        _advise(self.cuda, ptr, nbytes, _SET_PREFERRED_LOCATION, host=False)
        _prefetch_to_device(self.cuda, ptr, nbytes, self.stream)
        self.wait()

    def close(self) -> None:
        for ptr in list(self.ranges):
            self.unlock(ptr)
        if self.cuda is not None and self.stream.value:
            self.cuda.cuStreamDestroy_v2(self.stream)
            self.stream = ctypes.c_void_p()


class _CopyAttributes(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("src_access_order", ctypes.c_int), ("src_hint", _Location), ("dst_hint", _Location),
                ("flags", ctypes.c_uint)]


_SRC_IN_STREAM_ORDER = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: the sources stay valid until the engine's `wait`


def _batch_copy(cuda: ctypes.CDLL):
    """The driver's batched copy as a function (dsts, srcs, sizes, stream) -> CUresult, or None where it has none.
    CUDA 13 exports it as `cuMemcpyBatchAsync_v2`; 12.8 as `cuMemcpyBatchAsync`, with a failure index before the
    stream."""
    attrs = _CopyAttributes(_SRC_IN_STREAM_ORDER, _Location(_LOCATION_HOST, 0), _Location(_LOCATION_DEVICE, 0), 0)
    first = (ctypes.c_size_t * 1)(0)
    fail = ctypes.c_size_t(0)
    u64p = ctypes.POINTER(ctypes.c_uint64)
    head = [u64p, u64p, u64p, ctypes.c_size_t, ctypes.POINTER(_CopyAttributes), ctypes.POINTER(ctypes.c_size_t),
            ctypes.c_size_t]

    def ptr(a: np.ndarray):
        return a.ctypes.data_as(u64p)

    if hasattr(cuda, "cuMemcpyBatchAsync_v2"):
        f = cuda.cuMemcpyBatchAsync_v2
        f.argtypes = [*head, ctypes.c_void_p]
        return lambda d, s, n, stream: f(ptr(d), ptr(s), ptr(n), len(d), ctypes.byref(attrs), first, 1, stream)
    if hasattr(cuda, "cuMemcpyBatchAsync"):
        f = cuda.cuMemcpyBatchAsync
        f.argtypes = [*head, ctypes.POINTER(ctypes.c_size_t), ctypes.c_void_p]
        return lambda d, s, n, stream: f(ptr(d), ptr(s), ptr(n), len(d), ctypes.byref(attrs), first, 1,
                                         ctypes.byref(fail), stream)
    return None


def _prefetch_to_device(cuda: ctypes.CDLL, ptr: int, nbytes: int, stream: ctypes.c_void_p) -> bool:
    """Queue a managed range's move into GPU 0's memory on `stream` (False where the driver refuses: the pages then
    move at the first kernel's touch, as advised)."""
    if hasattr(cuda, "cuMemPrefetchAsync_v2"):  # CUDA 12.2 on: a location and flags
        f = cuda.cuMemPrefetchAsync_v2
        f.argtypes = [ctypes.c_uint64, ctypes.c_size_t, _Location, ctypes.c_uint, ctypes.c_void_p]
        return f(ptr, nbytes, _Location(_LOCATION_DEVICE, 0), 0, stream) == 0
    f = cuda.cuMemPrefetchAsync
    f.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return f(ptr, nbytes, 0, stream) == 0


def _ok(rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what}: CUDA error {rc}")


def open_copy_engine() -> CopyEngine | None:
    """The copy engine of a CUDA device, or None (another backend, no driver, not turned on, or a device whose
    managed memory cannot stay in device memory: without concurrent managed access, as on Windows and WSL, MLX
    makes a buffer the host touches page-locked host memory, and pools there would be read over the bus)."""
    if not ENABLED or mx.default_device() != mx.gpu or not mx.cuda.is_available():
        return None
    cuda = _driver()
    if cuda is None:
        return None
    managed = ctypes.c_int(0)
    if cuda.cuDeviceGetAttribute(ctypes.byref(managed), _CONCURRENT_MANAGED_ACCESS, 0) != 0 or not managed.value:
        return None
    try:
        return CopyEngine(cuda)
    except RuntimeError:
        return None
