"""Streaming experts: the experts provider that keeps a layer's routed experts in slot pools inside the plan.

`SlotPools` holds, for each array of an expert record (weights, scales, biases of gate/up/down; MXFP4's
weights, uint8 scales and the experts' own biases), one MLX array stacked over slots, so a layer's routed experts are three `gather_qmm`
calls over slot indices for all its tokens (`switch_glu`). `StreamingExperts` owns everything around
them: the store and its reads in flight, the hot tier (which expert lives in which slot, pins), the
cross-layer prefetch, and the per-layer telemetry.

Where every expert fits, every slot is filled at open (slot = layer * E + expert) and each layer's
kernels read a view of its own E slots: no host round trip at all, the same kernels as a capped run.
Otherwise each layer costs one small transfer (its top-k) and this sequence:

1. The fence: `mx.eval` of this layer's picks and of the output of every kernel that read the pools
   since the last fence. Each of those kernels has then completed, on every backend and stream, so a
   refill cannot race a reader.
2. Hits are looked up, misses placed by the tier and read from disk into host staging (demand reads
   go first: guesses not yet started are withdrawn). Until the kernels launch the device waits on this
   thread, so this is plain Python over a few ints.
3. Each record is written from staging toward its slot (`SlotPools.stage`): straight into the pool where
   the pools are host memory (the CPU backend, Metal's unified memory; the hits' kernels already run
   meanwhile); else (CUDA), from page-locked host memory (the staging ring, the host tier), by the GPU's copy
   engine straight into the slot, waited for before the layer's kernels are queued (`runtime/copy_engine.py`);
   else through an upload ring and one scatter per segment queued on the stream, so it lands in device
   memory in stream order, before the layer's `gather_qmm` reads it. The scatter must update the pool in
   place (a copy would be a whole pool's bytes outside the plan), so it is queued only once MLX has let go of
   every earlier kernel's inputs (`release_pool_readers`).
4. The next layer's experts are guessed from its router on this layer's input and read ahead into
   staging (never into a slot: a wrong guess costs a read, never a slot or a copy), at a lower priority
   than demand reads: they take the disk while this layer lands and computes (`ExpertStore.guess_many`).

Which slot an expert sits in never enters the math (the kernels read slot s as they would read expert
e), so logits are bit-identical at every cap, tier policy and prefetch width.
"""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import mlx.core as mx
import numpy as np

from ..formats.quant import f32_high_halves
from ..formats.record import ExpertWeights, RecordLayout
from .copy_engine import CopyEngine
from .managed import host_pool, keep_on_host
from .models.cache import clear_for_in_place
from .models.kernels import ExpertKernel, Streams, compiled, compiles, switch_glu
from .store import ExpertStore
from .telemetry import LayerStats
from .tier import HotTier
from .weights import mx_dtype

Key = tuple[int, int]  # (layer, expert)
# A guess's rank is read ahead while it has been right at least `precision` of the time (StreamingExperts.rank_seen);
# `precision` starts at 0.8 and follows the waste of the last few hundred reads, down while the wrong guesses are
# under 90 % of the waste budget (more guesses), up while over (it hovers around that, so a run's waste stays
# under the budget), within PRECISION_RANGE: the budget goes to the most likely guesses.
PRECISION_RANGE = (0.5, 0.95)
VERIFY = os.environ.get("STREAMOE_VERIFY_SLOTS", "") not in ("", "0")  # check every filled slot against the file
DIRECT_WRITES = True  # where the pools are host memory, records are written straight into their slots (tests turn it off)
GPU_ALLOC_PAGE = 16384  # MLX's GPU allocators (CUDA, Metal) count a buffer of more than 8 bytes in whole pages of this size
# the backends on which a streamed decode step queues each layer's mixer as soon as it is built. On the CPU measured
# 0.824 against 0.798 of mlx-lm's token time, medians of 4 paired runs on the small model at a quarter cap
# (`bench.gpu_compare --paired`): the mixer computes while the host builds the routing and the experts' bookkeeping.
# On an H100 (qwen3_moe full-size synthetic, --cap 4, 98.5 % of picks held, layers run ahead where they seldom miss):
# 23.6 and 23.9 against 27.5 and 26.7 ms a token, 2 interleaved pairs (`bench.gpu_compare --ablate eagermixer@CAP`);
# where picks miss (17.8 % held) the disk sets the token either way: 418 and 441 against 426 and 401 ms
EAGER_MIXER: tuple[str, ...] = ("cpu", "gpu")
# the backends on which a streamed decode step queues a layer's routed experts on their own, before the next layer's
# mixer is built; elsewhere they are queued with that mixer and router, in the next layer's fence: one launch a layer,
# not two, where each launch costs the host more than the experts' kernels take (`--ablate queueoutput@CAP` measures it)
QUEUE_OUTPUT: tuple[str, ...] = ("cpu", "gpu")
# measured 0.843 against 0.813 of mlx-lm's token time, medians of 4 paired runs (small model, quarter cap, CPU)
LAND_IN_READERS = True  # with direct writes, the I/O thread that read a record copies it into its slot (_land_in_readers)
HITS_FIRST = True  # with direct writes, a decode step's hits compute while its misses are read (StreamingExperts._streamed)
PREFILL_AHEAD = True  # prefill reads the next layer's likely experts while this one computes (StreamingExperts.prepare)
# the backends on which a capped decode step runs several layers on the hot tier's slots before it reads their picks,
# where a layer seldom misses (`StreamingExperts.layers_ahead`): one wait for several layers, not one each. On an H100
# (qwen3_moe full-size synthetic, --cap 4, 98.5 % of picks held): 28.7-37.7 against 40.0-48.7 ms a token waiting for
# each layer, 4 interleaved pairs. Not on the CPU, where a wait costs little and a thrown-away layer its whole compute:
# 15.6-15.8 against 14.6-15.0 ms (qwen3_moe small synthetic, 200 of 512 experts held, 3 interleaved pairs).
# Where most picks miss (Qwen3.6 at --cap 4; qwen3_moe full size drawn to spread its picks, 17.8 % held) no layer runs
# ahead, so it costs nothing there. `bench.gpu_compare --ablate decodeahead@CAP` runs the other setting
# (docs/performance.md)
DECODE_AHEAD: tuple[str, ...] = ("gpu",)
# Where the pools are host memory (the plan's `host_reads`), how a decode step's kernels reach its picks: "take", one
# gather a segment copies the picks' rows into device memory (a plain copy kernel, many loads in flight) and the
# matmuls read them there; "direct", the expert matmuls read them in place over the bus. The same bytes either way,
# so the same bits. On the H200 (full size, q4, `--cap 4 --host-cap 24`): 47.5 tok/s by take, 33.7 direct
# (bench/results/host-tier-h200-code-efce39e.json).
HOST_READ_FORM = os.environ.get("STREAMOE_HOST_READS_FORM", "take")


# stored dtype -> compute dtype conversions numpy does exactly as MLX's astype does (widening), for direct writes
_WIDEN = {(mx.bfloat16, mx.float32), (mx.float16, mx.float32)}


def pools_in_host_memory() -> bool:
    """The CPU backend's arrays are plain host memory, and so are Metal's (unified memory: MLX allocates shared
    storage, which the host writes in place and the GPU reads coherently in any later command buffer). CUDA's
    are device memory, reached only through MLX operations."""
    return mx.default_device() == mx.cpu or mx.metal.is_available()


def release_pool_readers(streams: Streams = ()) -> None:
    """Return once MLX holds no earlier kernel's inputs any more, so a pool has no holder but its own array and
    MLX's scatter into it is done in place (donated), not as a copy of the whole pool.

    A GPU backend keeps every kernel's inputs alive until its completion handler has run on a worker thread
    (MLX: `CommandEncoder::add_temporary` on CUDA, `addCompletedHandler` on Metal), which can be after `mx.eval`
    of the kernel's output has returned: the fence proves the readers are done, not that they let go. A scatter
    encoded before then finds the pool still held and copies it (seen on the H200: a `--cap 4` run peaking at
    4.3 GiB against a 4.0 GiB plan, two 0.5 GiB weight pools copied). `mx.synchronize` on CUDA queues a handler
    behind every earlier one and waits for it to run (`CommandEncoder::synchronize`), the CPU backend runs a
    stream's tasks in order, so after it nothing earlier holds a pool. Only the upload-ring path needs this:
    direct writes change no MLX array. (Donation also needs the pool's buffer to fit it within a page: see
    `cache.clear_for_in_place`, which may have been those runs' cause as well.)"""
    mx.synchronize()
    for s in streams:  # the CPU backend's extra streams (kernels.cpu_streams) may have read the pools too
        mx.synchronize(s)


def _segment_writer(host: np.ndarray, stored: mx.Dtype, dtype: mx.Dtype, direct: bool) -> tuple[np.ndarray, type]:
    """(destination, source dtype): `destination[row] = segment.view(source dtype)` lands a stored segment's values
    at the pool's dtype. As stored: bytes to bytes. bf16 -> float32: a bf16 is the high half of its float32, so
    only the high halves are written; the low halves are zero from the pool's allocation and nothing else writes
    a directly written pool. f16 -> float32: numpy's cast, exact as MLX's."""
    if not direct or stored == dtype:
        return host, np.uint8
    if stored == mx.bfloat16:
        return f32_high_halves(host), np.uint16
    return host.view(np.float32), np.float16


class SlotPools:
    """One MLX array per record segment, [slots, *segment shape], in the compute device's memory. Packed
    weights stay as stored; scales and biases are held at the compute dtype, cast once as a record lands
    (`gather_qmm` takes them in the activations' dtype: stored bf16 under float32 activations, every call
    would cast the whole pool). `plan.slot_bytes` counts exactly this.

    A record lands in two ways. Every write happens after the layer's fence (no kernel reads a slot any
    more), and before the next evaluation (which queues the kernels that read it):
    - Where the pools are host memory (`pools_in_host_memory`: the CPU backend, Metal): `stage` writes the
      record's segments straight into the slot (`direct`), no MLX operation at all.
    - Elsewhere (CUDA), through an upload ring (the plan's "copies in flight"): one MLX array per segment,
      [uploads, segment bytes], allocated once. `stage` copies the segments into the next row; `flush`
      queues, per segment, one scatter of every row staged since the last flush into its slots, in stream
      order, so a layer's misses land with nine MLX operations, each in place (`release_pool_readers`).
      Before the ring wraps, every queued scatter is evaluated, so no row is rewritten while an update that
      reads it is pending."""

    def __init__(self, n_slots: int, lay: RecordLayout, dtype: mx.Dtype, uploads: int, direct: bool | None = None,
                 streams: Streams = (), engine: CopyEngine | None = None, host_memory: bool = False):
        """`engine`: CUDA's copy engine, which moves records held in page-locked host memory straight into their
        slots (`runtime/copy_engine.py`); it cannot convert, so only where every segment is pooled as stored.
        `host_memory`: the pools are host memory whatever the device (`managed.host_pool`), written directly."""
        self.lay, self.n, self.streams = lay, n_slots, streams
        self.stored = [mx_dtype(s.dtype) for s in lay.segments]
        self.dtypes = [dtype if s.is_float else st for s, st in zip(lay.segments, self.stored, strict=True)]
        clear_for_in_place()
        if direct is None:
            direct = DIRECT_WRITES and (pools_in_host_memory() or host_memory)
        self.direct = direct and all(st == dt or (st, dt) in _WIDEN for st, dt in zip(self.stored, self.dtypes, strict=True))
        self.engine = engine if engine is not None and not self.direct and self.stored == self.dtypes else None
        shapes = [(n_slots, *s.shape) for s in lay.segments]
        make = self.engine.device_pool if self.engine is not None else host_pool if host_memory else mx.zeros
        self.arrays = [make(sh, dt) for sh, dt in zip(shapes, self.dtypes, strict=True)]
        # MLX counts the pools as its own, though on a discrete GPU they are then the host's memory
        self.host_bytes = sum(a.nbytes for a in self.arrays) if host_memory else 0
        self.uploads = 0 if self.direct else uploads
        self.rings = [mx.zeros((self.uploads, s.nbytes), dtype=mx.uint8) for s in lay.segments]
        mx.eval(self.arrays, self.rings)
        self.fields = lay.weights(self.arrays)
        # writable host views: of the pools themselves (direct), else of the ring
        self.hosts = [np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8).reshape(len(a), -1)
                      for a in (self.arrays if self.direct else self.rings)]
        self.host_mapped = not self.direct and keep_on_host(self.hosts)  # CUDA: the ring stays on the host
        # per segment: (start, end) in a record, where its row goes and as what; the ring holds segments as stored
        self.writes = [(sg.offset, sg.offset + sg.nbytes, *_segment_writer(h, st, dt, self.direct))
                       for sg, h, st, dt in zip(lay.segments, self.hosts, self.stored, self.dtypes, strict=True)]
        self.start = self.next = 0  # ring rows [start, next) are staged, not yet flushed
        self.pending: list[int] = []  # their slots
        self.copy_threads = min(4, os.cpu_count() or 1)
        self.copier = None if self.direct else ThreadPoolExecutor(max_workers=self.copy_threads,
                                                                  thread_name_prefix="streamoe-copy")
        self.copies: list[Future] = []
        self.copy_wait_s = self.sync_s = 0.0  # the host's waits in `flush`, summed (telemetry takes differences)
        self.engine_done: list[Callable[[], None]] = []  # the `done` of each record the engine is copying
        if self.engine is not None:
            views = [np.frombuffer(memoryview(a).cast("B"), dtype=np.uint8) for a in self.arrays]
            # per segment: (the pool's address, where the segment starts in a record, its bytes)
            self.slot_at = [(v.ctypes.data, sg.offset, sg.nbytes) for v, sg in zip(views, lay.segments, strict=True)]
            self.slot_bases, self.seg_offsets, self.seg_bytes = (np.array(c, dtype=np.uint64) for c in zip(*self.slot_at, strict=True))

    def weights(self) -> ExpertWeights:
        """The pools as one record's fields. Made once: a scatter into a pool (`flush`) updates its array object in
        place, so these stay the pools' current arrays."""
        return self.fields

    def stage(self, slot: int, record: memoryview, done: Callable[[], None]) -> None:
        """Copy one record (host bytes) toward `slot` (`stage_many` of one)."""
        self.stage_many([(slot, record, done)])

    @property
    def unsettled(self) -> bool:
        """Records staged whose landing `flush` has not yet completed or queued."""
        return bool(self.pending or self.copies or self.engine_done)

    def stage_many(self, records: list[tuple[int, memoryview, Callable[[], None]]], settle: bool = True) -> None:
        """Copy records (slot, host bytes, done) toward their slots; each `done()` is called once its bytes are
        taken, so the staging entry they came from can be reused. Ring copies run on copy threads (numpy releases
        the GIL: a layer's records are copied side by side, off the thread that waits for the disk), at most one
        task per thread for all of `records` (a task per record cost this thread 0.16 ms a record on the H200, under
        cProfile: about the copy's own time). Direct writes run here (on the CPU backend the cores are busy
        computing, and a thread hop costs more than a small copy). Where there is a copy engine every record goes by
        it, straight into its slot (from page-locked memory asynchronously, from pageable memory through the driver's
        own staging), so no MLX operation ever replaces a pool and the slots' addresses stay those taken at open; with
        `settle` this waits for them before returning (their `done` frees staging entries a later read may be
        waiting for), else `flush` does."""
        raws = [(slot, np.frombuffer(record, dtype=np.uint8, count=self.lay.raw_size), done)
                for slot, record, done in records]
        if self.engine is not None:
            self._copy_by_engine(raws)
            if settle:
                self._settle_engine()
            return
        if self.direct:
            for slot, raw, done in raws:
                self._copy(slot, raw, done)
            return
        while raws:
            if self.next == self.uploads:
                self.flush()
                mx.eval(self.arrays)  # the fence of the ring: every update that reads a row has run
                self.start = self.next = 0
            now, raws = raws[: self.uploads - self.next], raws[self.uploads - self.next:]
            rows = [(self.next + j, raw, done) for j, (_, raw, done) in enumerate(now)]
            tasks = min(len(rows), self.copy_threads)
            for t in range(tasks):
                self.copies.append(self.copier.submit(self._copy_rows, rows[t::tasks]))
            self.pending.extend(slot for slot, _, _ in now)
            self.next += len(now)

    def _copy_rows(self, rows: list[tuple[int, np.ndarray, Callable[[], None]]]) -> None:
        error = None
        for row, raw, done in rows:  # every record's done() is called, whatever one copy raised
            try:
                self._copy(row, raw, done)
            except BaseException as e:  # noqa: BLE001 - raised again once the others are done
                error = error or e
        if error is not None:
            raise error

    def _copy(self, row: int, raw: np.ndarray, done: Callable[[], None]) -> None:
        try:
            for a, b, dst, src_dtype in self.writes:
                dst[row] = raw[a:b].view(src_dtype)
        finally:
            done()

    def _copy_by_engine(self, raws: list[tuple[int, np.ndarray, Callable[[], None]]]) -> None:
        """Queue each record's segments on the copy engine, host bytes straight to the slot's address. Only after the
        fence or into a pinned slot (`stage_many`'s callers), so no queued kernel reads a slot written here."""
        if not raws:
            return
        slots = np.array([slot for slot, _, _ in raws], dtype=np.uint64)[:, None]
        srcs = np.array([raw.ctypes.data for _, raw, _ in raws], dtype=np.uint64)[:, None]
        self.engine.copy_many((self.slot_bases + slots * self.seg_bytes).ravel(), (srcs + self.seg_offsets).ravel(),
                              np.broadcast_to(self.seg_bytes, (len(raws), len(self.seg_bytes))).ravel())
        self.engine_done.extend(done for _, _, done in raws)

    def _settle_engine(self) -> None:
        """Wait for the copy engine's copies (so the kernels queued next read their slots' new bytes), then free
        the records they came from."""
        if not self.engine_done:
            return
        t = time.perf_counter()
        try:
            self.engine.wait()
        finally:
            for done in self.engine_done:
                done()
            self.engine_done.clear()
            self.copy_wait_s += time.perf_counter() - t

    def flush(self) -> None:
        """Wait for the staged copies; on the ring, queue their rows' copies into their slots, in stream order
        (before any later kernel reads them)."""
        self._settle_engine()
        if self.copies:
            t = time.perf_counter()
            for f in self.copies:
                f.result()
            self.copies.clear()
            self.copy_wait_s += time.perf_counter() - t
        if not self.pending:
            return
        idx = mx.array(self.pending, dtype=mx.uint32)  # distinct: the tier gives each landing key its own slot
        m, a, b = len(self.pending), self.start, self.next
        t = time.perf_counter()
        release_pool_readers(self.streams)
        self.sync_s += time.perf_counter() - t
        for j, (s, st) in enumerate(zip(self.lay.segments, self.stored, strict=True)):
            self.arrays[j][idx] = self.rings[j][a:b].view(st).reshape(m, *s.shape).astype(self.dtypes[j])
            if VERIFY:
                self._check_in_place(j, m if st != self.dtypes[j] else 0)
        self.pending.clear()
        self.start = self.next

    def _check_in_place(self, j: int, cast_rows: int) -> None:
        """Evaluate pool j's update and fail if MLX copied the pool (its peak grew by the pool's size beyond the
        update's own temporary: the `cast_rows` rows cast to the pool's dtype, in the allocator's whole pages on a
        GPU) instead of writing it in place: a copy is memory outside the plan. Resets MLX's peak counter: a
        verification run measures no peak."""
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(self.arrays[j])
        grew = mx.get_peak_memory() - before
        temporary = cast_rows * (self.arrays[j].nbytes // self.n)
        if temporary and mx.default_device() == mx.gpu:
            temporary = -(-temporary // GPU_ALLOC_PAGE) * GPU_ALLOC_PAGE
        if grew >= self.arrays[j].nbytes + temporary:
            raise AssertionError(f"pool {j} ({self.arrays[j].nbytes} bytes) was copied, not updated in place "
                                 f"(peak +{grew} bytes)")

    def close(self) -> None:
        self._settle_engine()
        if self.copier is not None:
            self.copier.shutdown(wait=True)

    def bytes_at(self, slots: list[int]) -> list[bytes]:
        """The record bytes each of `slots` holds now, scales and biases cast back to their stored dtype (exact from
        a wider float; gathered copies: the pools themselves stay where they are). One gather and one transfer per
        segment for all the slots: on a GPU each transfer is a round trip, so a layer's landing costs nine, not
        nine per record."""
        idx = mx.array(slots, dtype=mx.uint32)
        parts = []
        for a, st in zip(self.arrays, self.stored, strict=True):
            c = mx.take(a, idx, axis=0).astype(st)
            parts.append(np.array(c.view(mx.uint16) if c.dtype == mx.bfloat16 else c).reshape(len(slots), -1))
        return [b"".join(p[r].tobytes() for p in parts) for r in range(len(slots))]


class StreamingExperts:
    """The experts provider of a streamed model: `experts(i, x, inds)` -> layer i's picks' outputs [..., k, H]."""

    def __init__(self, store: ExpertStore, lay: RecordLayout, n_layers: int, n_experts: int, top_k: int,
                 hot_slots: int, tier: str, prefetch_width: int, guess: Callable[[int, mx.array], mx.array],
                 dtype: mx.Dtype = mx.float32, waste_budget: float = 0.05, streams: Streams = (),
                 kernel: ExpertKernel | None = None, uploads: int | None = None, engine: CopyEngine | None = None,
                 host_pools: bool = False):
        """`guess(i, x)`: layer i's router logits on x (the model's `router_logits`); `streams`: the CPU streams the
        picks' matmuls split over (the model's); `kernel`: how the experts compute (`kernels.expert_kernel`; default:
        `lay`'s codes with SwiGLU); `uploads`: rows of the upload ring (default: as many as the store's ring);
        `engine`: CUDA's copy engine (`runtime/copy_engine.py`), which then lands records from page-locked host
        memory (the staging ring is locked here, the host tier's slots as they fill); `host_pools`: every expert in
        host memory the device reads in place (the plan's `host_reads`; `hot_slots` then holds them all)."""
        self.store, self.lay, self.guess, self.waste_budget = store, lay, guess, waste_budget
        self.engine = engine  # closed with the rest: the host tier's slots are page-locked through it too
        self.streams = streams
        self.kernel = kernel or ExpertKernel(lay.bits, lay.group_size, lay.mode)
        self.L, self.E, self.k, self.width = n_layers, n_experts, top_k, prefetch_width
        self.resident = hot_slots >= n_layers * n_experts
        # a streamed step on the CPU queues each layer's mixer as soon as it is built (`kernels.run_layers`)
        self.backend = backend = "cpu" if mx.default_device() == mx.cpu else "gpu"
        # (a flag, not the bound method: that kept on self would make a cycle, and a closed engine's pools would
        # outlive it until Python's cycle collector ran)
        self.eager_mixer = backend in EAGER_MIXER and not self.resident
        self.queue_output = backend in QUEUE_OUTPUT
        staging = 0 if self.resident else n_experts
        # resident, the engine would only speed up open, and its host views make the pools managed memory
        self.pools = SlotPools(hot_slots + staging, lay, dtype, uploads or store.ring, streams=streams,
                               engine=None if self.resident else engine, host_memory=host_pools)
        # host_pools: a prefill chunk's layer (its index, its experts copied into device memory), see `prepare`
        self.staged: tuple[int, ExpertWeights] | None = None
        self.take_rows: dict[tuple[int, ...], mx.array] = {}  # host pools, "take": the gathered picks' rows by shape
        if self.pools.engine is not None:  # records read from disk land from the staging ring by the engine too
            self.pools.engine.lock(np.frombuffer(store.view, dtype=np.uint8).ctypes.data, len(store.view))
        self.tier = HotTier(hot_slots, staging, n_layers, n_experts, scratch=2 * top_k + prefetch_width, policy=tier)
        self.ahead: dict[Key, Future] = {}  # guesses read ahead into staging, not yet picked
        # a discrete GPU's host tier: the next layer's guesses held there, copied into device slots while this
        # layer computes (`_copy_ahead`): (layer, keys) to copy, then key -> slot until their layer
        self.copy_next: tuple[int, list[Key]] | None = None
        self.copied: dict[Key, int] = {}
        # how often the router's r-th guess for the next layer was then picked, issued or not (its precision)
        self.rank_seen, self.rank_right = [0] * max(1, prefetch_width), [0] * max(1, prefetch_width)
        self.candidates: dict[int, list[int]] = {}
        self.precision = 0.8
        self.miss_rate = 0.5  # the share of recent decode layers that missed a pick (decaying): `layers_ahead`
        self.reads_recent, self.wrong_recent = 0.0, 0.0  # records read in decode, wrong guesses among them (decaying)
        self.stats: list[LayerStats] | None = None  # the current step's per-layer records (set by the engine)
        self.readers: list[mx.array] = []  # outputs of kernels that read the pools, not yet waited for (fence)
        self.prepared: tuple[int, mx.array] | None = None  # prefill: (layer, its expert -> slot table), see prepare
        if self.resident:
            self._preload()
            # layer i's experts as views of its E slots, made once: expert e is then row e, and each gather_qmm
            # reads one layer's matrices, as mlx-lm's SwitchGLU does. MLX 0.32's CUDA backend counts every input's
            # bytes toward a graph's limit (1000 MB on an H200) and launches the graph once it is passed: inputs
            # of the whole model's pools (GBs) would launch one graph per expert matmul, 120 per token.
            E = n_experts
            self.layer_views = [[a[i * E:(i + 1) * E] for a in self.pools.arrays] for i in range(n_layers)]
            self.layer_weights = [lay.weights(views) for views in self.layer_views]
            mx.eval(self.layer_weights)

    # ---- reading and filling
    def _preload(self) -> None:
        """Every expert into slot layer * E + expert (the cap holds them all): the run is then resident."""
        keys = [(li, e) for li in range(self.L) for e in range(self.E)]
        for key in keys:
            self.tier.assign(key[0] * self.E + key[1], key)
        self._land({key: key[0] * self.E + key[1] for key in keys}, {})
        mx.eval(self.pools.arrays)
        self.store.bytes_read = 0

    def _land(self, slots: dict[Key, int], reads: dict[Key, Future], st: LayerStats | None = None) -> None:
        """Read every key of `slots` not in `reads` yet, copy each record into its slot as it arrives; the time
        spent waiting for the disk and landing beyond it go to `st`. The staging ring bounds the bytes in flight."""
        missing = [key for key in slots if key not in reads]
        if missing:
            reads.update(zip(missing, self.store.read_many(missing), strict=True))
        copy0, sync0 = self.pools.copy_wait_s, self.pools.sync_s
        start = time.perf_counter()
        if not reads:  # every pick in memory (most layers, where the hot tier holds what the router likes)
            waited = 0.0
        elif self.pools.direct and LAND_IN_READERS:
            waited = self._land_in_readers(slots, reads)
        else:
            waited, t = 0.0, start
            key_of = {f: key for key, f in reads.items()}
            left = set(key_of)
            while left:  # the records read by now staged together (host-tier hits and reads ahead: at once)
                done, left = wait(left, return_when=FIRST_COMPLETED)
                waited += time.perf_counter() - t
                entries = [(slots[key_of[f]], f.result()) for f in done]
                self.pools.stage_many([(slot, self.store.record(e), functools.partial(self.store.release, e))
                                       for slot, e in entries])
                t = time.perf_counter()
        self.pools.flush()
        if st is not None:
            st.io_wait_ms += 1000 * waited
            st.landing_ms += 1000 * (time.perf_counter() - start - waited)
            st.copy_wait_ms += 1000 * (self.pools.copy_wait_s - copy0)
            st.sync_ms += 1000 * (self.pools.sync_s - sync0)
        if VERIFY and slots:
            self._verify(slots)

    def _land_in_readers(self, slots: dict[Key, int], reads: dict[Key, Future]) -> float:
        """Direct writes: each record is copied into its slot by the I/O thread that read it, as the read ends, while
        this thread waits for the last of them (on two cores the copies then overlap other reads instead of
        following them on the thread that launches the kernels). Every slot written here was placed after the
        layer's fence, so no kernel reads it. Returns the seconds spent waiting. A failed read raises here."""
        landed, errors = threading.Semaphore(0), []

        def land(slot: int, f: Future) -> None:
            try:
                if f.exception() is None:
                    entry = f.result()
                    self.pools.stage(slot, self.store.record(entry), lambda: self.store.release(entry))
            except BaseException as e:  # noqa: BLE001 - raised again on the waiting thread
                errors.append(e)
            finally:
                landed.release()

        for key, f in reads.items():
            f.add_done_callback(functools.partial(land, slots[key]))
        t = time.perf_counter()
        for _ in reads:
            landed.acquire()
        waited = time.perf_counter() - t
        for f in reads.values():
            f.result()
        if errors:
            raise errors[0]
        return waited

    def _verify(self, slots: dict[Key, int]) -> None:
        mx.eval(self.pools.arrays)
        held = self.pools.bytes_at(list(slots.values()))
        for (key, slot), got in zip(slots.items(), held, strict=True):
            want = self.store.read_bytes(*key)
            if got != want:
                bad = next(i for i in range(len(want)) if got[i] != want[i])
                raise AssertionError(f"slot {slot} holds wrong bytes for layer {key[0]} expert {key[1]} "
                                     f"(first difference at byte {bad})")

    def fence(self, *also: mx.array) -> None:
        """Wait until every kernel that read a slot has completed (and `also` is computed): `mx.eval` of their
        outputs returns once each is, on every backend and stream, so no slot is refilled under a reader. An
        output already computed costs nothing to wait for, unlike a round trip through every stream. A layer's
        slots stay pinned until here, so `_copy_ahead` places no guess in a slot its kernels still read."""
        mx.eval(*also, *self.readers)
        self.readers.clear()
        self.tier.pinned.clear()

    # ---- the provider
    def __call__(self, i: int, x: mx.array, inds: mx.array) -> mx.array:
        """Layer i's picks' outputs [..., k, H] for x [..., H] and inds [..., k] (the model combines them)."""
        shape, k = x.shape, inds.shape[-1]
        xf, inds = x.reshape(-1, shape[-1]), inds.reshape(-1, k)
        if self.resident:  # on the device: no round trip
            if self.staged is not None and self.staged[0] == i:  # a prefill chunk's layer, copied for its blocks
                y = switch_glu(xf, self.staged[1], inds, self.kernel, self.streams)
            elif self.pools.host_bytes and HOST_READ_FORM == "take":
                rows = self.take_rows.get(inds.shape)
                if rows is None:  # made once a shape: not a kernel a layer
                    rows = self.take_rows[inds.shape] = mx.arange(inds.size, dtype=mx.uint32).reshape(inds.shape)
                picked = [mx.take(a, inds.reshape(-1), axis=0) for a in self.layer_views[i]]
                y = switch_glu(xf, self.lay.weights(picked), rows, self.kernel, self.streams)
            elif compiles(x):  # one compiled function for every layer: its views are inputs
                y = compiled(self.resident_experts)(xf, inds, *self.layer_views[i])
            else:
                y = switch_glu(xf, self.layer_weights[i], inds, self.kernel, self.streams)
        elif self.prepared is not None and self.prepared[0] == i:  # a prefill block: its experts already landed
            y = switch_glu(xf, self.pools.weights(), mx.take(self.prepared[1], inds), self.kernel, self.streams)
            # the fence waits for one value computed from y, not for y itself: a chunk's blocks' outputs (top-k rows
            # per token) are freed as each block is combined, not held to the next layer
            self.readers.append(y[-1:, -1, :1] * 1)
            mx.async_eval(y, self.readers[-1])
        else:
            y = self._streamed(i, xf, inds)
            if self.queue_output:
                mx.async_eval(y)  # the device copies and computes while the host builds the next layer
            self._copy_ahead()
        return y.reshape(*shape[:-1], k, shape[-1])

    def resident_experts(self, x: mx.array, inds: mx.array, *views: mx.array) -> mx.array:
        return switch_glu(x, self.lay.weights(list(views)), inds, self.kernel, self.streams)

    def queue(self, i: int, x: mx.array) -> None:
        """Queue layer i's MoE input (its mixer) as soon as it is built, or its output in a run ahead. On the CPU
        `mx.async_eval` of small kernels holds the calling thread for about their compute, so that time is the
        layer's compute; on a GPU it is the host's, encoding the kernels (the wait for them is the next fence's)."""
        t = time.perf_counter()
        mx.async_eval(x)
        if self.stats is not None and self.backend == "cpu":
            self.stats[i].compute_ms += 1000 * (time.perf_counter() - t)

    def _compute(self, x: mx.array, slots: mx.array) -> mx.array:
        y = switch_glu(x, self.pools.weights(), slots, self.kernel, self.streams)
        self.readers.append(y)  # computed only by kernels that read the pools: the next fence waits for it
        return y

    def _streamed(self, i: int, x: mx.array, inds: mx.array) -> mx.array:
        """Layer i's routed outputs [T, k, H]: picks looked up or placed, misses read and landed in their slots.

        Where records are written straight into the pools (host memory), a decode step's hits start
        computing while the misses are read: the hits' kernels read only hit slots, no miss slot is written
        before the fence, and each (token, pick) row is the same kernel's output whichever call computes it,
        so the result is bit for bit the one call's."""
        st = self.stats[i] if self.stats is not None else LayerStats(layer=i)
        order = None  # the next layer's experts its router likes best, best first: ordered on the device
        if self.width > 0 and i + 1 < self.L and x.shape[0] == 1:
            order = mx.argsort(-self.guess(i + 1, x).reshape(-1).astype(mx.float32))[: self.width]
        t = time.perf_counter()
        self.fence(inds, *([order] if order is not None else []))
        st.compute_ms += 1000 * (time.perf_counter() - t)
        if self.pools.unsettled:  # the copies `_copy_ahead` started while the previous layer computed land first
            self._land_copied(i, st)
        # From here to the kernels' launch the device waits on this thread: the bookkeeping is plain Python over a
        # few ints (a numpy call here costs 5-150 us, its code cold after the layer's kernels, a Python step ~0.1 us).
        rows: list[list[int]] = inds.tolist()
        experts = self._note_picks(i, rows, st)
        read0 = self.store.bytes_read
        slot_of, land, reads = self._gather(i, experts, st)
        if len(rows) == 1:
            self.miss_rate = 0.98 * self.miss_rate + 0.02 * bool(land)
        slots = [[slot_of[e] for e in row] for row in rows]
        split = HITS_FIRST and self.pools.direct and 0 < len(land) < len(experts) and len(rows) == 1
        if split:
            hit = [r for r, e in enumerate(rows[0]) if (i, e) not in land]
            miss = [r for r, e in enumerate(rows[0]) if (i, e) in land]
            early = self._compute(x, mx.array([[slots[0][r] for r in hit]], dtype=mx.uint32))
            mx.async_eval(early)
        # what nothing above waits for, while the hits compute and the misses are read
        if x.shape[0] == 1:
            self._follow_waste(st.misses + st.hits_prefetch + st.prefetch_wasted, st.prefetch_wasted)
        if order is not None:  # guesses start once no demand read waits: while this layer lands and computes
            self._prefetch(i + 1, order.tolist())
        self._land(land, reads, st)
        st.bytes_read += self.store.bytes_read - read0
        if not split:
            return self._compute(x, mx.array(slots, dtype=mx.uint32))
        late = self._compute(x, mx.array([[slots[0][r] for r in miss]], dtype=mx.uint32))
        back = [0] * len(rows[0])  # rank order again: pick r sits at back[r] of [hits..., misses...]
        for j, r in enumerate(hit + miss):
            back[r] = j
        return mx.concatenate([early, late], axis=1)[:, mx.array(back)]

    def _note_picks(self, i: int, rows: list[list[int]], st: LayerStats) -> list[int]:
        """Layer i's picks `rows` into the guesses' precision and the tier; its guesses not picked withdrawn. Returns
        the distinct experts picked, sorted."""
        picked = {e for row in rows for e in row}
        experts = sorted(picked)
        for r, e in enumerate(self.candidates.pop(i, [])):
            self.rank_seen[r] += 1
            self.rank_right[r] += e in picked
        self._withdraw(i, experts, picked, st)
        return experts

    # ---- a decode step's layers run ahead of their picks
    def layers_ahead(self, i: int, h: mx.array) -> int:
        """How many layers from layer i a decode step over h runs on the experts the hot tier holds (`on_hot`) before
        reading their picks (`check_ahead`); 0 or 1: layer i alone, the usual way. A layer that misses a pick throws
        the rest of the run away, so the run is long where misses are rare: sqrt(2 / miss rate) layers keeps the waits
        saved ahead of the layers computed twice (one wait a run against, per miss, half a run recomputed), and
        nothing runs ahead above a miss rate of 2/9. Never while records are still landing in slots."""
        if self.backend not in DECODE_AHEAD or self.resident or h.shape[1] != 1 or self.miss_rate > 2 / 9:
            return 0
        if self.pools.unsettled or self.copy_next is not None:
            return 0
        return min(int((2 / max(self.miss_rate, 1e-3)) ** 0.5), self.L - i)

    def on_hot(self) -> Callable[[int, mx.array, mx.array], mx.array]:
        """The provider of a run ahead: layer i's picks each computed from the slot the hot tier's table gives it on
        the device, no wait. A pick the tier holds is computed by the same kernel over the same slot as the usual way,
        so bit for bit the same; any other pick reads whatever slot its stale entry names, and `check_ahead` throws
        its layer away. No slot is written until then (nothing lands in a run), so no reader races a refill."""
        table = mx.array(self.tier.table)

        def call(i: int, x: mx.array, inds: mx.array) -> mx.array:
            shape, k = x.shape, inds.shape[-1]
            slots = mx.take(table[i * self.E:(i + 1) * self.E], inds.reshape(-1, k))  # a view: one kernel, the take
            return self._compute(x.reshape(-1, shape[-1]), slots).reshape(*shape[:-1], k, shape[-1])

        return call

    def check_ahead(self, start: int, inds: list[mx.array], h: mx.array) -> int | None:
        """The picks of a run ahead from layer `start` (`inds`, a layer each; h its output), waited for at once: each
        layer whose every pick the tier held is counted as the usual way would; returns the first that missed one
        (from there the run is thrown away), or None."""
        t = time.perf_counter()
        self.fence(h, *inds)
        end = start + len(inds) - 1
        if self.stats is not None:
            self.stats[end].compute_ms += 1000 * (time.perf_counter() - t)
        run = self.stats[start:end + 1] if self.stats is not None else []
        for st in run:
            st.ran_ahead += 1
        held = self.tier.slot_of
        for i, a in enumerate(inds, start):
            st = self.stats[i] if self.stats is not None else LayerStats(layer=i)
            rows: list[list[int]] = a.reshape(-1, a.shape[-1]).tolist()
            if any((i, e) not in held for row in rows for e in row):
                for later in run[i - start:]:
                    later.thrown += 1
                return i
            self._gather(i, self._note_picks(i, rows, st), st)
            self._follow_waste(st.hits_prefetch + st.prefetch_wasted, st.prefetch_wasted)
            self.miss_rate *= 0.98
        self.tier.pinned.clear()
        return None

    def _withdraw(self, i: int, experts: list[int], picked: set[int], st: LayerStats) -> None:
        """Layer i picked `experts` (sorted; `picked` as a set): count the picks, withdraw the layer's guesses
        that were not picked."""
        st.picks, st.experts = len(experts), experts
        self.tier.note_picks(i, experts)  # this pick counts toward the admission of a miss
        self.store.note_picks(i, experts)  # and of a read into the host tier
        for key in [key for key in self.copied if key[0] == i and key[1] not in picked]:
            del self.copied[key]  # copied from the host tier ahead, not picked: it stays in its slot, a tier entry
            st.prefetch_wasted += 1
        # withdraw guesses for this layer that were not picked; started ones are waste
        for key in [key for key in self.ahead if key[0] == i and key[1] not in picked]:
            f = self.ahead.pop(key)
            if self.store.cancel(f):
                st.prefetch_issued -= 1
                if i > 0 and self.stats is not None:
                    self.stats[i - 1].bytes_read -= self.lay.stride
            else:
                st.prefetch_wasted += 1
                f.add_done_callback(lambda f: f.exception() is None and self.store.release(f.result()))

    def skip(self, i: int) -> None:
        """Layer i picked none of this provider's experts (across ranks, others own every pick): its guesses
        are withdrawn as after any layer, so none holds a staging entry past it."""
        self.candidates.pop(i, None)
        self._withdraw(i, [], set(), self.stats[i] if self.stats is not None else LayerStats(layer=i))

    def _gather(self, i: int, experts: list[int], st: LayerStats) -> tuple[dict[int, int], dict[Key, int], dict[Key, Future]]:
        """Slots for layer i's distinct picks: hits pinned, misses placed and their reads queued (guessed ones
        promoted). Returns (expert -> slot, the slots to land, the reads to land them from)."""
        slot_of: dict[int, int] = {}
        lookup = self.tier.slot_of.get  # HotTier.lookup, without a method call per pick
        for e in experts:  # pin every hit first, so placing a miss cannot evict one
            s = lookup((i, e))
            if s is not None:
                slot_of[e] = s
                self.tier.pinned.add(s)
                if self.copied.pop((i, e), None) is not None:
                    st.hits_prefetch += 1
                elif self.tier.is_staging(s):
                    st.hits_lent += 1
                else:
                    st.hits_hot += 1
        land: dict[Key, int] = {}
        reads: dict[Key, Future] = {}
        for e in experts:
            if e in slot_of:
                continue
            key = (i, e)
            s, _ = self.tier.place(key)
            slot_of[e] = land[key] = s
            self.tier.pinned.add(s)
            if key in self.ahead:
                reads[key] = self.ahead.pop(key)
                self.store.promote(reads[key])
                st.hits_prefetch += 1
        cold = [key for key in land if key not in reads]
        host0 = self.store.host_hits
        if cold:
            reads.update(zip(cold, self.store.read_many(cold), strict=True))
        host = self.store.host_hits - host0  # copied from the host tier, not read
        st.hits_host += host
        st.bytes_host += host * self.lay.stride
        st.misses += len(cold) - host
        return slot_of, land, reads

    def prepare(self, i: int, inds: list[mx.array], xs: Iterable[mx.array]) -> None:
        """Prefill: layer i's picks for every block of a chunk (`inds`, the blocks' MoE inputs `xs`), before any
        block's experts run. One fence, and each distinct expert lands in a slot once for all the blocks (the
        blocks' calls then only map experts to slots, on the device). Right after this layer's reads are queued,
        the next layer's likely experts are queued as guesses, most likely first (its router on this layer's
        input: how many of the chunk's tokens would pick each), so the disk reads them while this layer lands
        and computes; those the next layer does not pick are withdrawn if not started (`_gather`).

        Where the pools are host memory on a discrete GPU (`host_pools`), nothing is read: a chunk of several blocks
        has the layer's experts copied into device memory once, so its blocks' kernels read them there, not each
        over the bus (a chunk of one block reads what it picks in place, as decode does: no more than a copy would)."""
        if self.resident:
            self.staged = None  # the layer before's copy is let go of once its kernels are done
            if self.pools.host_bytes and len(inds) > 1:
                idx = mx.arange(self.E, dtype=mx.uint32)
                self.staged = (i, self.lay.weights([mx.take(a, idx, axis=0) for a in self.layer_views[i]]))
            return
        st = self.stats[i] if self.stats is not None else LayerStats(layer=i)
        likely = self._likely(i + 1, xs) if PREFILL_AHEAD and self.width > 0 and i + 1 < self.L else ()
        t = time.perf_counter()
        self.fence(*inds, *likely)
        st.compute_ms += 1000 * (time.perf_counter() - t)
        picked = {e for a in inds for row in a.reshape(-1, a.shape[-1]).tolist() for e in row}
        experts = sorted(picked)
        self._withdraw(i, experts, picked, st)
        read0 = self.store.bytes_read
        slot_of, land, reads = self._gather(i, experts, st)
        if likely:
            order, counts = (a.tolist() for a in likely)
            keys = [(i + 1, e) for e, n in zip(order, counts, strict=True)
                    if n > 0 and (i + 1, e) not in self.ahead and self.tier.lookup((i + 1, e)) is None
                    and not self.store.in_host((i + 1, e))]
            # A read ahead holds its staging entry until its layer lands: at most the ring less one entry per I/O
            # thread, so this layer's own reads always find entries (more would fill the ring and wait forever).
            keys = keys[: max(0, self.store.ring - len(self.store.threads))]
            self.ahead.update(zip(keys, self.store.guess_many(keys), strict=True))
            if self.stats is not None:
                self.stats[i + 1].prefetch_issued += len(keys)
        self._land(land, reads, st)
        self.tier.pinned.clear()
        st.bytes_read += self.store.bytes_read - read0
        table = [0] * self.E
        for e, s in slot_of.items():
            table[e] = s
        self.prepared = (i, mx.array(table, dtype=mx.uint32))

    def _likely(self, layer: int, xs: Iterable[mx.array]) -> tuple[mx.array, mx.array]:
        """(experts of `layer` by how many tokens of xs its router would send to each, most first; those counts),
        queued on the device."""
        counts = mx.zeros((self.E,), dtype=mx.int32)
        ones = None
        for x in xs:
            g = self.guess(layer, x.reshape(-1, x.shape[-1])).astype(mx.float32)
            top = mx.argpartition(g, kth=-self.k, axis=-1)[:, -self.k:].reshape(-1)
            ones = ones if ones is not None and ones.size == top.size else mx.ones(top.shape, dtype=mx.int32)
            counts = counts.at[top].add(ones)
            mx.async_eval(counts)  # block by block: each block's router logits are freed once counted
        order = mx.argsort(-counts)
        return order, counts[order]

    def _prefetch(self, layer: int, order: list[int]) -> None:
        """Read ahead into staging the experts layer `layer`'s router likes best for this hidden state (`order`:
        its `width` best, best first): each while its rank's precision and the waste budget allow."""
        st = self.stats[layer] if self.stats is not None else None
        self.candidates[layer] = order
        lookup, right, seen, precision = self.tier.slot_of.get, self.rank_right, self.rank_seen, self.precision
        keys = [(layer, e) for r, e in enumerate(order)
                if (right[r] + 1) / (seen[r] + 2) >= precision and (layer, e) not in self.ahead
                and lookup((layer, e)) is None]
        host = [key for key in keys if self.store.in_host(key)]
        if host and not self.pools.direct:
            self.copy_next = (layer, host)
        keys = [key for key in keys if key not in host]  # a disk guess reads into staging; the host tier needs none
        if keys:
            self.ahead.update(zip(keys, self.store.guess_many(keys), strict=True))
        if st is not None:
            st.prefetch_issued += len(keys)

    def _copy_ahead(self) -> None:
        """A discrete GPU with a host tier: the next layer's guesses found there are placed in device slots (a
        scratch slot where the tier declines one) and their copies started while this layer's kernels run: by the
        copy engine straight into the slots, else into the upload ring; the next layer settles them first
        (`_land_copied`), so a right guess is a hit there and the copies overlap the device's compute. Never a
        direct write: this layer's kernels are in flight. They read only this layer's slots, which stay pinned
        until the next fence, so no slot placed here is one they read."""
        if self.copy_next is None:
            return
        layer, keys = self.copy_next
        self.copy_next = None
        st = self.stats[layer] if self.stats is not None else None
        placed: list[tuple[Key, int]] = []
        for key in keys:
            if self.tier.lookup(key) is not None or key in self.ahead or not self.store.in_host(key):
                continue
            s, _ = self.tier.place(key, optional=True)  # declined by the tier: a scratch slot, as a miss would get
            if s is None:
                break
            self.tier.pinned.add(s)  # no later guess of this batch takes it; the next layer clears the pins
            placed.append((key, s))
        copies = []
        for (key, s), f in zip(placed, self.store.guess_many([key for key, _ in placed]), strict=True):
            if st is not None:
                st.prefetch_issued += 1
            if not f.done():  # it left the host tier meanwhile: an ordinary guess, read from disk into staging
                self.tier.evict(s)
                self.ahead[key] = f
                continue
            entry = f.result()
            copies.append((s, self.store.record(entry), functools.partial(self.store.release, entry)))
            self.copied[key] = s
            if st is not None:
                st.bytes_host += self.lay.stride
        self.pools.stage_many(copies, settle=False)  # waited for when the next layer lands them

    def _land_copied(self, i: int, st: LayerStats) -> None:
        """Queue the moves of the records `_copy_ahead` staged into their slots (before any slot is placed): a
        landing with nothing more to read."""
        self._land({}, {}, st)
        if VERIFY:
            self._verify({key: s for key, s in self.copied.items() if key[0] == i})

    def _follow_waste(self, reads: int, wrong: int) -> None:
        """One decode layer's reads and wrong guesses into the recent account; the precision a guess needs
        moves a step toward spending the waste budget."""
        self.reads_recent = 0.995 * self.reads_recent + reads
        self.wrong_recent = 0.995 * self.wrong_recent + wrong
        if self.reads_recent >= 50:
            step = 0.002 if self.wrong_recent > 0.9 * self.waste_budget * self.reads_recent else -0.002
            self.precision = min(max(self.precision + step, PRECISION_RANGE[0]), PRECISION_RANGE[1])

    # ---- prompts and lifetime
    def begin_prompt(self) -> None:
        """A prompt takes the staging slots back from the tier (prefill streams each expert through them)."""
        self.prepared = self.staged = None
        self.drop_guesses()
        self.tier.reclaim_staging()

    def end_prompt(self) -> None:
        """Decode begins: the idle staging slots are lent to the tier."""
        self.prepared = self.staged = None
        self.drop_guesses()
        self.tier.lend_staging()

    def drop_guesses(self) -> None:
        self.candidates.clear()
        self.pools.flush()  # records copied ahead land: their slots are tier entries like any other
        self.copy_next = None
        self.copied.clear()
        for f in self.ahead.values():
            if not self.store.cancel(f):
                f.add_done_callback(lambda f: f.exception() is None and self.store.release(f.result()))
        self.ahead.clear()

    def close(self) -> None:
        self.drop_guesses()
        self.pools.close()
        self.store.close()
        if self.engine is not None:
            self.engine.close()
