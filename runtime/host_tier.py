"""HostTier: expert records kept in host memory, the second level under a discrete GPU's slots.

On a GPU with memory of its own (CUDA), `--cap` bounds the device and `--host-cap` the host, which is usually the
larger. The host tier is what the host cap leaves after its accounts: records exactly as on disk, page-aligned,
locked in memory where the limit allows (never swapped, never page cache). A device miss found here is copied
over the bus into its slot (`SlotPools.stage`, the same path a disk read takes from staging), with no disk
read; a miss that is not here is read from disk straight into a host slot (if admitted), so the next time it is.

Admission and eviction follow the device's hot tier (`tier.HotTier`, the same policy and pick counts): a read
is admitted over a victim picked less often (`freq`) or always (`lru`). The tier is inclusive: a record may be
both here and in a device slot (an exclusive tier would copy every device eviction back over the bus).

The host cap is kept by measurement, not only by the plan: what a CUDA process holds beside its accounts (the
driver's and libraries' own buffers, compiled kernels) grows after open and is not known in advance. So a slot's
pages are committed only when a record first lands in it and the process's host memory leaves room (`room`, given
the resident set once per layer), and when the process nears the cap the least valuable records are given back
to the system (their pages dropped) until it fits again. What grows and shrinks again between two measurements
(a kernel compiled) the kernel's high-water mark shows: the room the tier leaves widens to the largest such
transient seen. A committed slot is locked in memory where the limit allows (pinned: never swapped out); on CUDA
it is page-locked through the driver (`runtime/copy_engine.py`), so the GPU's copy engine moves it into a device
slot with no host copy.

The store (`runtime/store.py`) owns it: placement happens on the thread that queues reads, completion on the
I/O threads, and release on the copy threads, so every change is under one lock. A slot is pinned from the
moment a read or a hit is queued until its bytes have been taken, and is looked up only once its read completed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import threading
import time
from collections.abc import Callable

from ..formats.direct import aligned_buffer
from .copy_engine import CopyEngine
from .plan import host_growth
from .tier import HotTier

Key = tuple[int, int]  # (layer, expert)


# anonymous mmap memory is shared (shmem): on Linux only MADV_REMOVE frees its pages (elsewhere MADV_DONTNEED)
DROP = getattr(mmap, "MADV_REMOVE", getattr(mmap, "MADV_DONTNEED", 0))
MEASURE_S = 0.005  # the process's host memory is measured at most this often (a /proc read: 40-100 us each)


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


class HostTier:
    def __init__(self, n_slots: int, stride: int, n_layers: int, n_experts: int, policy: str = "freq",
                 cap: int | None = None, engine: CopyEngine | None = None):
        """`cap`: the host cap the process's host memory (`plan.host_rss`) must stay under; None: not checked.
        `engine`: CUDA's copy engine: a filled slot is page-locked through it (registered with the driver), so the
        engine copies it straight into a device slot, rather than locked with `mlock`."""
        self.n, self.stride, self.cap, self.engine = n_slots, stride, cap, engine
        self.buf = aligned_buffer(n_slots * stride)
        self.view = memoryview(self.buf)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.libc = _libc()
        self.locking = self.libc is not None
        # its free slots have no pages (never used, or given back): one is committed only while there is room
        self.tier = HotTier(n_slots, 0, n_layers, n_experts, scratch=0, policy=policy)
        self.headroom = 0 if cap is not None else n_slots * stride  # bytes that more committed slots may take
        self.margin = host_growth()  # what the cap leaves to the rest of the process between two measurements
        self.measured = self.peak = 0  # the last measurement, and the highest peak seen
        self.ready: set[int] = set()  # slots whose record has been read
        self.pins: dict[int, int] = {}  # slot -> holders (reads in flight, bytes not yet taken)
        self.lock = threading.Lock()
        self.due = 0.0  # when `check` next measures

    def record(self, slot: int) -> memoryview:
        return self.view[slot * self.stride: (slot + 1) * self.stride]

    def take(self, key: Key) -> tuple[int | None, bool]:
        """(slot, ready) for a record about to be needed: a ready slot holding it (a hit, nothing to read), else a
        slot admitted for it to be read into (`ready` False), else None (declined: read through staging only).
        The slot is pinned until `release`; a record with a read in flight is neither (None, False)."""
        with self.lock:
            s = self.tier.lookup(key)
            if s is not None:
                if s not in self.ready:
                    return None, False
                self._pin(s)
                return s, True
            v = self.tier.take_free() if self.headroom >= self.stride else None
            if v is not None:
                self.headroom -= self.stride
            else:
                v = self.tier.occupied_victim()
                if v is None or not (self.tier.policy == "lru" or self.tier.picks(key) >= self.tier.picks(self.tier.key_of[v])):
                    return None, False
            self.ready.discard(v)
            self.tier.assign(v, key)
            self._pin(v)
            return v, False

    def has(self, key: Key) -> bool:
        """Whether the record is here now (a guess for it would cost no disk read)."""
        with self.lock:
            s = self.tier.lookup(key)
            return s is not None and s in self.ready

    def _pin(self, s: int) -> None:
        self.pins[s] = self.pins.get(s, 0) + 1
        self.tier.pinned.add(s)

    def filled(self, slot: int) -> None:
        """The read into `slot` completed: later lookups find it. Its pages are locked where the limit allows."""
        if self.engine is not None:
            self.engine.lock(self.base + slot * self.stride, self.stride)
        elif self.locking and self.libc.mlock(ctypes.c_void_p(self.base + slot * self.stride), ctypes.c_size_t(self.stride)):
            self.locking = False  # RLIMIT_MEMLOCK: the rest stay unlocked (correct, only swappable)
        with self.lock:
            self.ready.add(slot)

    def forget(self, slot: int) -> None:
        """The read into `slot` failed or was withdrawn: it holds nothing."""
        with self.lock:
            self.ready.discard(slot)
            self.tier.evict(slot)
            self._unpin(slot)

    def check(self, measure: Callable[[], tuple[int, int | None]]) -> None:
        """`room(*measure())`, at most every MEASURE_S. Measured once a layer, a `--cap 4 --host-cap 24` token read
        /proc 40 times; between two measurements the tier counts its own commits (`take`), and `margin` is left for
        the rest of the process's growth."""
        if self.cap is None:
            return
        now = time.monotonic()
        if now >= self.due:
            self.due = now + MEASURE_S
            self.room(*measure())

    def room(self, host_bytes: int, peak: int | None = None) -> None:
        """The process holds `host_bytes` of host memory now: more slots may be committed while that stays under
        the cap (less `margin`); over it, unpinned records are given back, least valuable first, until it is not.
        `peak`: the most it has held (the kernel's high-water mark, where it compares): a new peak above this
        measurement and the last was a transient between them, which the margin holds from now on."""
        if self.cap is None:
            return
        with self.lock:
            if peak is not None:  # the first measurement's peak is the process's before the tier (opening): no transient
                if self.measured and peak > self.peak:
                    self.margin = max(self.margin, peak - max(host_bytes, self.measured))
                self.peak = max(self.peak, peak)
            self.measured = host_bytes
            self.headroom = self.cap - self.margin - host_bytes
            while self.headroom < 0:
                v = self.tier.occupied_victim()
                if v is None:
                    return  # every record is in use: the next measurement tries again
                self.tier.evict(v)  # free again, its pages dropped below
                self.ready.discard(v)
                offset = v * self.stride
                if self.engine is not None:
                    self.engine.unlock(self.base + offset)
                elif self.libc is not None:
                    self.libc.munlock(ctypes.c_void_p(self.base + offset), ctypes.c_size_t(self.stride))
                self.buf.madvise(DROP, offset, self.stride)
                self.headroom += self.stride

    def release(self, slot: int) -> None:
        """A holder is done with the slot's bytes."""
        with self.lock:
            self._unpin(slot)

    def _unpin(self, s: int) -> None:
        n = self.pins.get(s, 0) - 1
        if n > 0:
            self.pins[s] = n
        else:
            self.pins.pop(s, None)
            self.tier.pinned.discard(s)

    def note_picks(self, layer: int, experts: list[int]) -> None:
        """The device tier's picks count toward admission here too (one policy for both levels)."""
        with self.lock:
            self.tier.note_picks(layer, experts)
