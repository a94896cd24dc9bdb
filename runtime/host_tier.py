"""HostTier: expert records kept in host memory, the second level under a discrete GPU's slots.

On a GPU with memory of its own (CUDA), `--cap` bounds the device and `--host-cap` the host, which is usually the
larger. The host tier is what the host cap leaves after its accounts: records exactly as on disk, page-aligned,
locked in memory where the limit allows (never swapped, never page cache). A device miss found here is copied
over the bus into its slot (`SlotPools.stage`, the same path a disk read takes from staging), with no disk
read; a miss that is not here is read from disk straight into a host slot (if admitted), so the next time it is.

Admission and eviction follow the device's hot tier (`tier.HotTier`, the same policy and pick counts): a read
is admitted over a victim picked less often (`freq`) or always (`lru`). The tier is inclusive: a record may be
both here and in a device slot (an exclusive tier would copy every device eviction back over the bus).

The store (`runtime/store.py`) owns it: placement happens on the thread that queues reads, completion on the
I/O threads, and release on the copy threads, so every change is under one lock. A slot is pinned from the
moment a read or a hit is queued until its bytes have been taken, and is looked up only once its read completed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

from ..formats.direct import aligned_buffer
from .tier import HotTier

Key = tuple[int, int]  # (layer, expert)


def lock_in_memory(buf) -> bool:
    """mlock the buffer (no swapping, pages committed now); False where the limit (RLIMIT_MEMLOCK) refuses."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
        return libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(len(buf))) == 0
    except (OSError, AttributeError, TypeError):
        return False


class HostTier:
    def __init__(self, n_slots: int, stride: int, n_layers: int, n_experts: int, policy: str = "freq"):
        self.n, self.stride = n_slots, stride
        self.buf = aligned_buffer(n_slots * stride)
        self.view = memoryview(self.buf)
        self.locked = lock_in_memory(self.buf)
        self.tier = HotTier(n_slots, 0, n_layers, n_experts, scratch=0, policy=policy)
        self.ready: set[int] = set()  # slots whose record has been read
        self.pins: dict[int, int] = {}  # slot -> holders (reads in flight, bytes not yet taken)
        self.lock = threading.Lock()

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
            v, free = self.tier.victim()
            if v is None or not (free or self.tier.policy == "lru" or self.tier.picks(key) >= self.tier.picks(self.tier.key_of[v])):
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
        """The read into `slot` completed: later lookups find it."""
        with self.lock:
            self.ready.add(slot)

    def forget(self, slot: int) -> None:
        """The read into `slot` failed or was withdrawn: it holds nothing."""
        with self.lock:
            self.ready.discard(slot)
            self.tier.evict(slot)
            self._unpin(slot)

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
