"""ExpertStore: expert records read from the layer files into host staging this process owns.

The disk never writes into memory a device may be using: every record lands, with one page-cache-free
read, in an entry of a small ring of page-aligned host buffers (anonymous mmap, never seen by MLX), and
the slot pools copy it from there (`runtime/experts.py`). That is what keeps a CUDA device's managed
memory out of the DMA path (O_DIRECT into managed pages that a kernel touches loses pages), and it costs
one memcpy per record, far below the read itself.

A read waits for a free ring entry inside its I/O thread, so any number of reads can be queued while the
staging memory stays at `ring` records: the consumer fills a slot from an entry and releases it.

Reads come at two priorities. A demand read (`read`) is a record a layer is waiting for; a guess (`guess`)
is read ahead for a layer not yet reached, and starts only while no demand read is queued or running, so
guesses take the disk's spare time (a layer's host work and compute, when the disk would otherwise idle)
and never share it with the reads a layer waits for. A guess that is then picked is promoted (`promote`):
if it has not started it goes to the front of the demand queue.

On a discrete GPU the store may also own a host tier (`runtime/host_tier.py`): a read of a record held there
completes at once with no disk read, and a record read from disk goes straight into a host slot when the tier
admits it. Either way the caller gets an entry (`record`, `release`) as from the ring: entries from `ring` up
are host slots.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from concurrent.futures import Future, as_completed
from pathlib import Path

from ..formats.config import ModelArgs
from ..formats.direct import aligned_buffer, drop_cache, open_uncached
from ..formats.errors import fail
from ..formats.layout import detect_format, record_layouts
from ..formats.manifest import Manifest, safe_path
from ..formats.record import RecordLayout
from .host_tier import HostTier
from .plan import host_memory

GUESSES_WAIT = True  # guesses yield to demand reads (bench/gpu_compare's `guesswait` ablation turns it off)


class ExpertStore:
    """The layer files of one expert format, I/O threads serving demand reads before guesses, and the host
    staging ring."""

    def __init__(self, paths: list[Path], lay: RecordLayout, n_experts: int, layouts: dict[str, RecordLayout], fmt: str,
                 io_threads: int, ring: int, share: list[int] | None = None, host: HostTier | None = None):
        """`share`: the experts this process holds (an expert-parallel rank's, `runtime/ranks.py`); expert j of
        a read is then record share[j] of its layer file, and no other record is ever read. None: all of them.
        `host`: the host tier under a discrete GPU's slots (None: every miss is read from disk)."""
        self.lay, self.n_experts, self.paths = lay, n_experts, list(paths)
        self.share = share
        self.fds: list[int] = []
        self.direct: list[bool] = []
        for p in paths:
            if not p.is_file():
                raise fail(p, "missing expert layer file")
            got = detect_format(p, p.stat().st_size, n_experts, layouts, claimed=fmt)
            if got != fmt:
                raise fail(p, f"holds {got} experts by its size, but {fmt} was asked for")
            fd, direct = open_uncached(p)
            self.fds.append(fd)
            self.direct.append(direct)
        self.ring = max(ring, io_threads)
        self.buf = aligned_buffer(self.ring * lay.stride)
        self.view = memoryview(self.buf)
        self.free = list(range(self.ring))
        self.lock = threading.Lock()  # guards the ring's free list, the queues and the counts below
        self.entry_freed = threading.Condition(self.lock)  # a read waiting for a ring entry
        self.work = threading.Condition(self.lock)  # an idle I/O thread waiting for a read it may start
        self.demand: deque[tuple[Future, int, int]] = deque()
        self.guesses: deque[tuple[Future, int, int]] = deque()
        self.demand_running = 0
        self.closing = False
        self.bytes_read = 0
        self.host, self.host_hits = host, 0  # reads served from the host tier instead of the disk
        # the disk's busy time: seconds with at least one read in progress (bench/gpu_compare: how much of a
        # token the disk worked, and how fast it read while it did)
        self.reading, self.busy_s, self.busy_since = 0, 0.0, 0.0
        self.threads = [threading.Thread(target=self._serve, name=f"streamoe-io-{i}", daemon=True)
                        for i in range(io_threads)]
        for t in self.threads:
            t.start()

    @classmethod
    def open(cls, root: Path, m: Manifest, fmt: str, io_threads: int, ring: int,
             share: list[int] | None = None, host: HostTier | None = None) -> ExpertStore:
        """The layer files of expert format `fmt` of the converted model at `root` (manifest `m`); `share`: the
        experts read, `host`: the host tier (see `__init__`)."""
        f = m.expert_formats()[fmt]
        lay = f.layout
        layouts = record_layouts(lay)
        n_experts = ModelArgs.from_config(m.config, root / "manifest.json").num_experts
        return cls([safe_path(root, x["path"]) for x in f.files], lay, n_experts, layouts, fmt, io_threads, ring, share,
                   host)

    def offset(self, expert: int) -> int:
        """Where expert `expert`'s record starts in its layer file."""
        return (expert if self.share is None else self.share[expert]) * self.lay.stride

    def busy_time(self) -> float:
        """Seconds so far with at least one read in progress (the interval now open included): over a step, the
        share of its time the disk was working."""
        with self.lock:
            return self.busy_s + (time.perf_counter() - self.busy_since if self.reading else 0.0)

    def record(self, entry: int) -> memoryview:
        """The bytes of the record held in entry `entry` (a ring entry, or a host slot from `ring` up)."""
        if entry >= self.ring:
            return self.host.record(entry - self.ring)
        s = self.lay.stride
        return self.view[entry * s: (entry + 1) * s]

    def release(self, entry: int) -> None:
        if entry >= self.ring:
            self.host.release(entry - self.ring)
            return
        with self.lock:
            self.free.append(entry)
            self.entry_freed.notify()

    def _serve(self) -> None:
        """One I/O thread: the oldest demand read, else (no demand read queued or running) the oldest guess."""
        while True:
            with self.lock:
                while not self.closing and not self.demand and (not self.guesses or self.demand_running):
                    self.work.wait()
                if self.demand:
                    job, is_demand = self.demand.popleft(), True
                    self.demand_running += 1
                elif self.guesses:
                    job, is_demand = self.guesses.popleft(), False
                else:
                    return
            fut, layer, expert, slot = job
            try:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(self._read(layer, expert, slot))
                    except BaseException as e:
                        fut.set_exception(e)
            finally:
                if is_demand:
                    with self.lock:
                        self.demand_running -= 1
                        if not self.demand_running and not self.demand and self.guesses:
                            self.work.notify(len(self.guesses))  # guesses may start now

    def _read(self, layer: int, expert: int, slot: int | None) -> int:
        """Read one record into a free ring entry, or into host slot `slot`; returns the entry."""
        with self.lock:
            if slot is None:
                while not self.free:
                    self.entry_freed.wait()
                entry = self.free.pop()
            else:
                entry = self.ring + slot
            if not self.reading:
                self.busy_since = time.perf_counter()
            self.reading += 1
        try:
            off = self.offset(expert)
            try:
                n = os.preadv(self.fds[layer], [self.record(entry)], off)
            finally:
                with self.lock:
                    self.reading -= 1
                    if not self.reading:
                        self.busy_s += time.perf_counter() - self.busy_since
            if not self.direct[layer]:
                drop_cache(self.fds[layer], off, self.lay.stride)
            if n != self.lay.stride:
                raise fail(self.paths[layer], f"short read of expert {off // self.lay.stride}: {n} of {self.lay.stride} bytes "
                                              "(the file changed since it was opened?)")
        except BaseException:
            if slot is None:
                self.release(entry)
            else:
                self.host.forget(slot)
            raise
        if slot is not None:
            self.host.filled(slot)
        return entry

    def read(self, layer: int, expert: int) -> Future:
        """Queue a demand read of one record; the future's result is the ring entry holding it (release it
        after use)."""
        return self._queue(self.demand, [(layer, expert)])[0]

    def read_many(self, keys: list[tuple[int, int]]) -> list[Future]:
        """Demand reads of (layer, expert) records, queued with one lock and one wake-up (a layer's misses)."""
        return self._queue(self.demand, keys)

    def guess(self, layer: int, expert: int) -> Future:
        """Queue a read ahead: it starts only while no demand read is queued or running."""
        return self.guess_many([(layer, expert)])[0]

    def guess_many(self, keys: list[tuple[int, int]]) -> list[Future]:
        return self._queue(self.guesses if GUESSES_WAIT else self.demand, keys)

    def _queue(self, queue: deque, keys: list[tuple[int, int]]) -> list[Future]:
        if not keys:
            return []
        futs: list[Future] = [Future() for _ in keys]
        jobs = []
        if self.host is not None and queue is self.demand:  # off the guesses
            self.host.check(host_memory)
        for f, (layer, e) in zip(futs, keys, strict=True):
            slot, ready = self.host.take((layer, e)) if self.host is not None else (None, False)
            if ready:  # in the host tier: no disk read
                f.set_result(self.ring + slot)
                self.host_hits += 1
                continue
            if slot is not None:  # admitted: read into its host slot, which holds nothing if the read never happens
                f.add_done_callback(lambda f, s=slot: (f.cancelled() or f.exception() is not None) and self.host.forget(s))
            jobs.append((f, layer, e, slot))
        self.bytes_read += self.lay.stride * len(jobs)
        with self.lock:
            queue.extend(jobs)
            self.work.notify(len(jobs))
        return futs

    def promote(self, fut: Future) -> None:
        """A guess that is now needed: if it has not started, it is the next demand read."""
        with self.lock:
            for job in self.guesses:
                if job[0] is fut:
                    self.guesses.remove(job)
                    self.demand.appendleft(job)
                    self.work.notify()
                    return

    def in_host(self, key: tuple[int, int]) -> bool:
        """Whether a read of this record would be served from the host tier (no disk read)."""
        return self.host is not None and self.host.has(key)

    def note_picks(self, layer: int, experts: list[int]) -> None:
        if self.host is not None:
            self.host.note_picks(layer, experts)

    def fill_host(self) -> None:
        """Read every record into the host tier (it holds them all): the run then never waits for the disk. A
        progress bar on a terminal (a full-size model is 18 GB)."""
        from tqdm import tqdm

        n = self.n_experts if self.share is None else len(self.share)
        futs = self.read_many([(li, e) for li in range(len(self.paths)) for e in range(n)])
        # as they complete: a record the tier declines holds a ring entry until released, and a read waiting for
        # an entry must not wait behind one held by a later read
        for f in tqdm(as_completed(futs), total=len(futs), desc="host tier", unit=" records", disable=None, leave=False):
            self.release(f.result())
        self.bytes_read = self.host_hits = 0

    def cancel(self, fut: Future) -> bool:
        """Withdraw a read that has not started (its bytes are then not counted)."""
        if fut.cancel():
            self.bytes_read -= self.lay.stride
            return True
        return False

    def read_bytes(self, layer: int, expert: int) -> bytes:
        """One record through a plain buffered read, bypassing the ring (the verification mode's reference)."""
        with open(self.paths[layer], "rb") as f:
            f.seek(self.offset(expert))
            return f.read(self.lay.raw_size)

    def close(self) -> None:
        """Finish every queued read, stop the I/O threads, close the files."""
        with self.lock:
            self.closing = True
            self.work.notify_all()
        for t in self.threads:
            t.join()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
