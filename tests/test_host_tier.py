"""The host tier under a discrete GPU's slots (runtime/host_tier.py, `--host-cap`): planned as the host's own
accounts, refused on unified memory, and never a change to the math: logits bit-identical at every pair of caps,
with every filled slot checked against the file. The CPU backend plans as if its memory were split where
STREAMOE_SPLIT_MEMORY=1 (the host tier's code runs for real: O_DIRECT reads into host slots, copies into the
pools); on the H200 tests/test_gpu.py runs the same across caps on CUDA."""

from __future__ import annotations

import ctypes
import gc
import json
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
import pytest

import streamoe.runtime.plan as plan_mod
from streamoe.runtime import experts as experts_mod
from streamoe.runtime.copy_engine import CopyEngine
from streamoe.runtime.engine import Engine, Options, plan_for
from streamoe.runtime.host_tier import HostTier
from streamoe.runtime.plan import HOST_GROWTH as MARGIN
from streamoe.runtime.plan import GiB, host_rss, read_ring
from streamoe.runtime.store import ExpertStore

from .conftest import RUNTIME, cli, one_error_line
from .test_runtime import PROMPTS


@pytest.fixture
def split(monkeypatch):
    monkeypatch.setenv("STREAMOE_SPLIT_MEMORY", "1")


def caps_for(conv: Path, hot: int, host: int | None, **opts) -> Options:
    """Options whose device hot tier holds `hot` experts and host tier `host` records (None: no --host-cap). The
    host's runtime allowance is this process's host memory now and room to grow: the tier commits only what the
    measured memory leaves under the host cap (the device's plan does not depend on it). A host tier, not host
    reads, unless `host_reads` is given; prefill chunks of 16 tokens unless `prefill_chunk` is."""
    opts = {"host_reads": False, "prefill_chunk": 16, **opts}
    runtime = host_rss() + (192 << 20)
    base = plan_for(conv, Options(cap_gib=64, ctx=256, runtime_bytes=runtime, **opts))
    cap = (base.fixed + hot * base.slot_bytes + 1) / GiB
    host_cap = None if host is None else (base.host_fixed + host * base.stride + 1) / GiB
    return Options(cap_gib=cap, ctx=256, runtime_bytes=runtime, host_cap_gib=host_cap, **opts)


def logits_of(conv: Path, opts: Options, steps: int = 12) -> tuple[bytes, Engine]:
    eng = Engine(conv, opts)
    out = [np.array(eng.prefill(eng.text.encode(PROMPTS[2])).astype(mx.float32))]
    for _ in range(steps):
        out.append(np.array(eng.forward([int(out[-1].argmax())], "decode").astype(mx.float32)))
    eng.memory_when_open = mx.get_active_memory(), eng.device_memory()  # (MLX's, the device's: servers report it)
    eng.close()
    return np.stack(out).tobytes(), eng


class Run(NamedTuple):
    """A run of `logits_of` as the tests across caps compare it."""

    logits: bytes
    bytes_read: int
    hits_host: int  # picks copied from the host tier
    host_slots: int


def run_at(conv: Path, opts: Options) -> Run:
    """`logits_of`, each layer's every pick counted once: a hit (hot, lent, read ahead, host) or a miss."""
    data, eng = logits_of(conv, opts)
    layers = [ly for s in eng.steps for ly in s.layers]
    for ly in layers:
        assert ly.hits_hot + ly.hits_lent + ly.hits_prefetch + ly.hits_host + ly.misses == ly.picks
    return Run(data, sum(ly.bytes_read for ly in layers), sum(ly.hits_host for ly in layers), eng.plan.host_slots)


@pytest.fixture(scope="module")
def no_tier(small_conv) -> Run:
    """The run planned as a discrete GPU's with neither a device tier nor a host tier (the freq policy over the
    staging slots lent in decode), every filled slot checked against the file: the logits every pair of caps and
    every host tier must give. Made once for the tests that compare with it; none of them changes it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STREAMOE_SPLIT_MEMORY", "1")
        mp.setattr(experts_mod, "VERIFY", True)
        return run_at(small_conv, caps_for(small_conv, 0, None))


def test_the_plan_splits_into_the_devices_and_the_hosts_accounts(small_conv, split):
    cap = caps_for(small_conv, 10, None).cap_gib  # the device's plan: the runtime allowance is the host's
    uncapped = plan_for(small_conv, Options(cap_gib=cap, ctx=256, runtime_bytes=RUNTIME))
    p = plan_for(small_conv, Options(cap_gib=cap, ctx=256, runtime_bytes=RUNTIME, host_cap_gib=1))
    ring = read_ring(Options(), 8, 64) * p.stride
    ahead = 64 * p.stride  # a layer's experts read ahead in prefill (plan.prefill_ahead): host memory
    assert p.split and p.host_accounts == {"runtime": RUNTIME, "read staging": ring + ahead, "upload ring": ring,
                                           "growth": MARGIN}  # the room the host tier leaves the process's growth
    assert "read staging" in uncapped.host_accounts and "read staging" not in uncapped.accounts
    assert "runtime" not in p.accounts and p.accounts["upload ring"] == ring
    assert p.host_slots == 8 * 64  # 1 GiB holds every record beside the host accounts
    # a host cap that leaves room for 100 records holds exactly 100
    q = plan_for(small_conv, caps_for(small_conv, 10, 100))
    assert q.host_slots == 100 and q.hot_slots == 10
    # the device holding every expert needs no host tier
    assert plan_for(small_conv, Options(cap_gib=8, ctx=256, runtime_bytes=RUNTIME, host_cap_gib=8)).host_slots == 0
    # without --host-cap the host's accounts are planned, not capped, and hold no tier
    assert uncapped.split and uncapped.host_cap is None and uncapped.host_slots == 0 and uncapped.host_fits


def test_a_cuda_devices_memory_outside_mlx_is_a_device_account(small_conv, split, monkeypatch):
    """On CUDA the driver counts the context and libraries in the GPU's memory beside MLX's allocations: the plan
    measures what the device's count grew by since streamoe was imported, less MLX's own, adds DRIVER_GROWTH, and
    gives the hot tier that much less. Elsewhere (or unmeasured) there is no such account."""
    base = plan_for(small_conv, Options(cap_gib=64, ctx=256, runtime_bytes=RUNTIME))
    context = 300 << 20
    opts = Options(cap_gib=(base.fixed + context + plan_mod.DRIVER_GROWTH + 100 * base.slot_bytes + 1) / GiB, ctx=256,
                   runtime_bytes=RUNTIME)
    plain = plan_for(small_conv, opts)
    assert "driver" not in plain.accounts and plain.hot_slots == 8 * 64  # the CPU backend: nothing outside MLX's
    monkeypatch.setattr(plan_mod, "own_device_memory", lambda: True)
    monkeypatch.setattr(plan_mod.nvml, "AT_IMPORT", 1 << 30)
    monkeypatch.setattr(plan_mod.nvml, "device_memory_used",
                        lambda: (1 << 30) + context + mx.get_active_memory() + mx.get_cache_memory())
    plan_mod.driver_context.cache_clear()
    try:
        p = plan_for(small_conv, opts)
        assert p.accounts["driver"] == context + plan_mod.DRIVER_GROWTH
        assert "300 MiB measured at open" in p.notes["driver"] and "driver" in p.render()
        assert p.fixed == plain.fixed + p.accounts["driver"]
        assert p.hot_slots == 100
        assert p.to_json()["accounts"]["driver"] == p.accounts["driver"]
        given = plan_for(small_conv, Options(cap_gib=opts.cap_gib, ctx=256, runtime_bytes=RUNTIME, driver_bytes=5 << 20))
        assert given.accounts["driver"] == 5 << 20 and given.notes["driver"] == "as given"
        monkeypatch.setattr(plan_mod.nvml, "AT_IMPORT", None)  # no reading from before MLX's context
        plan_mod.driver_context.cache_clear()
        assert "driver" not in plan_for(small_conv, opts).accounts
    finally:
        plan_mod.driver_context.cache_clear()


def test_host_cap_cli(small_conv, monkeypatch):
    """Refused on unified memory in one line; with a device of its own, printed (JSON too) and checked."""
    refused = cli("plan", str(small_conv), "--cap", "1", "--host-cap", "2")
    assert "--host-cap: this device shares its memory with the host" in one_error_line(refused)
    run = cli("run", str(small_conv), "--cap", "1", "--host-cap", "2", "-p", "hi", "-n", "1")
    assert "--host-cap" in one_error_line(run)
    monkeypatch.setenv("STREAMOE_SPLIT_MEMORY", "1")
    monkeypatch.setenv("STREAMOE_HOST_READS", "0")  # the host tier (host reads: their own test)
    ok = cli("plan", str(small_conv), "--cap", "0.13", "--ctx", "512", "--host-cap", "1", "--runtime-mib", "300", "--json")
    assert ok.returncode == 0, ok.stderr
    host = json.loads(ok.stdout)["host"]
    assert host["cap"] == GiB and host["accounts"]["runtime"] == 300 << 20 and host["tier_slots"] == 512 and host["fits"]
    text = cli("plan", str(small_conv), "--cap", "0.13", "--ctx", "512", "--host-cap", "1", "--runtime-mib", "300").stdout
    assert "host memory: cap 1.00 GiB" in text and "512 expert records of 512" in text
    small = cli("plan", str(small_conv), "--cap", "0.13", "--ctx", "512", "--host-cap", "0.1", "--runtime-mib", "300")
    need = plan_for(small_conv, Options(cap_gib=0.13, ctx=512, runtime_bytes=300 << 20, host_cap_gib=1)).host_fixed
    assert "--host-cap 0.10 GiB is too small" in one_error_line(small)
    assert f"smallest that fits: --host-cap {(need + 0.01 * GiB) / GiB:.2f}" in small.stderr


@pytest.mark.parametrize("direct", [True, False])
def test_a_discrete_gpus_prefill_reads_the_next_layer_ahead_whole(small_conv, split, monkeypatch, direct):
    """With a device of its own, read staging is host memory and holds one layer's experts more, so a long
    chunk's next layer is read ahead whole while this one computes, where the ring alone covered a part: on
    unified memory (no extra staging) the same prefill reads fewer ahead. The logits are the same bits, records
    written straight into the slots or (a discrete GPU's path) through the upload ring."""
    monkeypatch.setattr(experts_mod, "DIRECT_WRITES", direct)
    runtime = host_rss() + (192 << 20)
    ahead = {}
    for name in ("split", "unified"):
        if name == "unified":
            monkeypatch.setenv("STREAMOE_SPLIT_MEMORY", "0")
        base = plan_for(small_conv, Options(cap_gib=64, ctx=256, runtime_bytes=runtime))
        hot = 3 * 64  # the tier holds this layer's experts and the next one's
        eng = Engine(small_conv, Options(cap_gib=(base.fixed + hot * base.slot_bytes + 1) / GiB, ctx=256,
                                         runtime_bytes=runtime))
        assert eng.plan.prefill_chunk >= 100 and eng.plan.split == (name == "split")
        logits = np.array(eng.prefill(eng.text.encode(PROMPTS[2] * 2)).astype(mx.float32))
        layers = eng.steps[-1].layers[1:]
        ahead[name] = (logits.tobytes(), sum(ly.hits_prefetch for ly in layers), sum(ly.picks for ly in layers),
                       eng.experts.store.ring)
        eng.close()
    (s_logits, s_ahead, picks, s_ring), (u_logits, u_ahead, _, u_ring) = ahead["split"], ahead["unified"]
    assert s_ring == u_ring + 64 and s_logits == u_logits
    assert s_ahead >= 0.9 * picks > u_ahead, (s_ahead, u_ahead, picks)


PAIRS = {"freq": [(0, 120), (0, 512), (24, 200)], "lru": [(0, None), (24, 200)]}  # freq's (0, None): `no_tier`


@pytest.mark.parametrize("tier", ["freq", "lru"])
def test_logits_bit_identical_at_every_pair_of_caps(small_conv, split, monkeypatch, no_tier, tier):
    """No host tier, a part of the records, all of them; a device tier of none, or some: the same bits, every slot
    filled with the file's bytes. A host tier that holds everything is filled at open and reads nothing after."""
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    runs = {(0, None): no_tier} if tier == "freq" else {}
    for hot, host in PAIRS[tier]:
        runs[(hot, host)] = run_at(small_conv, caps_for(small_conv, hot, host, tier=tier))
    assert all(r.logits == no_tier.logits for r in runs.values()), {k: v[1:] for k, v in runs.items()}
    assert runs[(0, None)].hits_host == 0 and runs[(24, 200)].hits_host > 0
    if tier == "freq":
        assert runs[(0, 120)].host_slots == 120 and runs[(0, 512)].host_slots == 512
        assert runs[(0, 512)].bytes_read == 0 and runs[(0, 512)].hits_host > 0  # every miss copied from the host, none read
        assert 0 < runs[(0, 120)].hits_host and runs[(0, 120)].bytes_read < runs[(0, None)].bytes_read


@pytest.mark.parametrize("hot,host", [(0, 512), (24, 200)])
def test_guesses_copied_ahead_from_the_host_tier_change_no_bit(small_conv, split, monkeypatch, no_tier, hot, host):
    """Through the upload ring (a discrete GPU's path), the next layer's guesses held in the host tier are copied
    into device slots while a layer computes: right ones are hits there, wrong ones stay as tier entries, each such
    slot holds the file's bytes when its layer lands, and the logits are those of a run without a host tier."""
    monkeypatch.setattr(experts_mod, "VERIFY", True)
    monkeypatch.setattr(experts_mod, "DIRECT_WRITES", False)
    eng = Engine(small_conv, caps_for(small_conv, hot, host))
    assert not eng.experts.pools.direct and eng.plan.host_slots == host
    out = [np.array(eng.prefill(eng.text.encode(PROMPTS[2])).astype(mx.float32))]
    eng.experts.precision = 0.0  # every guess passes: the copies run on every layer
    for _ in range(12):
        out.append(np.array(eng.forward([int(out[-1].argmax())], "decode").astype(mx.float32)))
    eng.close()
    layers = [ly for s in eng.steps if s.phase == "decode" for ly in s.layers]
    for ly in layers:
        assert ly.hits_hot + ly.hits_lent + ly.hits_prefetch + ly.hits_host + ly.misses == ly.picks
    assert sum(ly.hits_prefetch for ly in layers) > 0 and sum(ly.prefetch_wasted for ly in layers) > 0
    if host == 512:  # no disk guesses: every read-ahead hit was copied ahead, declined guesses in scratch slots too
        # (skipping the guesses the device tier declined left 14 of 768 picks copied ahead here, against 337)
        assert sum(ly.hits_prefetch for ly in layers) >= sum(ly.picks for ly in layers) // 4
    assert np.stack(out).tobytes() == no_tier.logits


def test_a_withdrawn_read_leaves_its_host_slot_empty(small_conv):
    """Guesses admitted to host slots and then withdrawn before they started hold nothing: a later read of the same
    record goes to the disk again, and the slots are reused."""
    from streamoe.formats.manifest import load_manifest

    m = load_manifest(small_conv)
    lay = m.expert_formats()["q4"].layout
    host = HostTier(16, lay.stride, 8, 64)
    store = ExpertStore.open(small_conv, m, "q4", io_threads=1, ring=4, host=host)
    try:
        first = store.read(0, 0)
        guesses = store.guess_many([(1, e) for e in range(8)])  # wait behind the demand read (one I/O thread)
        withdrawn = [f for f in guesses if store.cancel(f)]
        assert withdrawn, "no guess was still queued"
        store.release(first.result())
        for f in guesses:
            if f not in withdrawn:
                store.release(f.result())
        for f in withdrawn:
            e = guesses.index(f)
            assert host.tier.lookup((1, e)) is None and not store.in_host((1, e))
        assert store.in_host((0, 0))
        before = store.bytes_read
        again = store.read(1, guesses.index(withdrawn[0]))
        entry = again.result()
        assert store.bytes_read == before + lay.stride and entry >= store.ring  # read from disk, into a host slot
        assert bytes(store.record(entry)[: lay.raw_size]) == store.read_bytes(1, guesses.index(withdrawn[0]))
        store.release(entry)
        hit = store.read(0, 0)
        assert hit.done() and store.bytes_read == before + lay.stride  # served from the host tier: no read
        store.release(hit.result())
        assert not host.pins and not host.tier.pinned
    finally:
        store.close()


def test_pinned_host_slots_are_never_victims():
    """A slot whose bytes are still being taken is never given to another record; with every slot pinned a new
    record is declined (it goes through staging), never read over a pinned one."""
    host = HostTier(2, 4096, 1, 8)
    a, ready_a = host.take((0, 0))
    b, _ = host.take((0, 1))
    assert not ready_a and {a, b} == {0, 1}
    assert host.take((0, 2)) == (None, False)  # both pinned
    host.filled(a)
    host.release(a)
    assert host.take((0, 1)) == (None, False)  # its read is still in flight: neither a hit nor a second read
    s, ready = host.take((0, 0))
    assert (s, ready) == (a, True)
    host.release(a)
    host.note_picks(0, [3, 3])
    c, _ = host.take((0, 3))  # picked more often than the record in slot a: admitted over it
    assert c == a and host.tier.lookup((0, 0)) is None


def test_the_host_cap_is_kept_by_measurement():
    """Slots are committed only while the process's measured host memory leaves room under the cap; over the cap,
    unpinned records are given back to the system (their pages dropped: they read as zeros) until it fits."""
    stride = 4096
    host = HostTier(4, stride, 1, 8, cap=MARGIN + 3 * stride)
    assert host.take((0, 0)) == (None, False)  # nothing measured yet: no room
    host.room(0)  # room for three records
    slots = [host.take((0, e))[0] for e in range(4)]
    assert None not in slots[:3] and slots[3] is None  # the fourth has no room, and every slot is pinned
    for e, s in enumerate(slots[:3]):
        host.record(s)[:] = bytes([e + 1]) * stride
        host.filled(s)
        host.release(s)
    host.room(2 * stride)  # the process grew by two records' worth: the tier fits beside it, nothing to give back
    assert all(host.has((0, e)) for e in range(3))
    host.room(5 * stride)  # two records over the cap: two given back
    kept = [e for e in range(3) if host.has((0, e))]
    assert len(kept) == 1
    for e in set(range(3)) - set(kept):
        assert bytes(host.record(slots[e])) == bytes(stride)  # its pages were dropped
    assert bytes(host.record(slots[kept[0]])) == bytes([kept[0] + 1]) * stride
    host.room(stride)  # room for two more again: the slots given back are committed anew
    assert {host.take((0, e))[0] for e in (5, 6)} == {slots[e] for e in set(range(3)) - set(kept)}


def test_a_transient_between_two_measurements_widens_the_margin():
    """A high-water mark above both of two measurements is a peak the tier did not see (kernels compiled while it was
    full): from then on the tier leaves that much room, giving back records to make it; a peak it saw changes
    nothing, and the first measurement's peak (the process's before the tier: its weights loaded) is no transient."""
    stride = 4096
    host = HostTier(8, stride, 1, 8, cap=MARGIN + 6 * stride)
    host.room(0, MARGIN + 5 * stride)  # opening peaked above what the process holds now, more than the margin
    assert host.margin == MARGIN and host.headroom == 6 * stride
    for e in range(6):
        s, _ = host.take((0, e))
        host.filled(s)
        host.release(s)
    host.room(6 * stride, 6 * stride)  # the tier's own six records: measured, no transient
    assert host.margin == MARGIN and sum(host.has((0, e)) for e in range(6)) == 6
    host.room(6 * stride, 6 * stride + MARGIN + 2 * stride)  # a peak MARGIN + 2 records above: that much given back
    assert host.margin == MARGIN + 2 * stride and sum(host.has((0, e)) for e in range(6)) == 4
    host.room(4 * stride, 6 * stride + MARGIN + 2 * stride)  # the same peak again: nothing new
    assert host.margin == MARGIN + 2 * stride and host.headroom == 0


def test_the_host_memory_is_measured_at_most_every_measure_s(monkeypatch):
    """`check` measures at once, then not again until MEASURE_S has passed; without a cap, never."""
    import streamoe.runtime.host_tier as host_tier_mod

    now = [100.0]
    monkeypatch.setattr(host_tier_mod.time, "monotonic", lambda: now[0])
    measured = []

    def measure() -> tuple[int, None]:
        measured.append(now[0])
        return 0, None

    host = HostTier(4, 4096, 1, 8, cap=MARGIN + 3 * 4096)
    for t in (100.0, 100.001, 100.0049, 100.005, 100.006, 100.02):
        now[0] = t
        host.check(measure)
    assert measured == [100.0, 100.005, 100.02] and host.headroom == 3 * 4096
    HostTier(4, 4096, 1, 8).check(measure)
    assert len(measured) == 3


def test_a_fill_the_tier_cannot_hold_goes_through_the_ring(small_conv):
    """Filling a tier with room for a few records: the rest are read through a ring of 4 entries, released as they
    complete (waiting for them in order could leave a read waiting for an entry a later one holds), and the tier
    keeps what it admitted."""
    from streamoe.formats.manifest import load_manifest

    m = load_manifest(small_conv)
    lay = m.expert_formats()["q4"].layout
    host = HostTier(512, lay.stride, 8, 64, cap=MARGIN + 10 * lay.stride)
    store = ExpertStore.open(small_conv, m, "q4", io_threads=4, ring=4, host=host)
    try:
        host.room = lambda host_bytes, peak=None: HostTier.room(host, 0)  # room for ten, whatever this process holds
        store.fill_host()
        assert sum(store.in_host((li, e)) for li in range(8) for e in range(64)) == 10
        assert not host.pins and sorted(store.free) == [0, 1, 2, 3]
    finally:
        store.close()


@pytest.mark.parametrize("reads", ["0", "1"])
def test_both_caps_hold_in_a_cgroup_of_their_sum(small_conv, tmp_path, monkeypatch, reads):
    """On the CPU both memories are the host's, so a run planned as split (a device tier of about 120 slots, a host
    tier that may hold every record) stays inside a cgroup whose limit is --cap + --host-cap, page cache included,
    with misses copied from the host tier; or, host reads on, every expert in host memory and none copied."""
    from .conftest import run_capped

    monkeypatch.setenv("STREAMOE_SPLIT_MEMORY", "1")
    monkeypatch.setenv("STREAMOE_HOST_READS", reads)
    p = plan_for(small_conv, Options(cap_gib=8, ctx=512, runtime_bytes=160 << 20))
    cap = round((p.fixed + 120 * p.slot_bytes) / GiB, 3)
    host_cap = round((p.host_fixed + 512 * p.stride + (100 << 20)) / GiB, 3)
    stats = tmp_path / "stats.jsonl"
    proc, failcnt, peak = run_capped(["run", small_conv, "--cap", cap, "--host-cap", host_cap, "--runtime-mib", 160,
                                      "--ctx", 512, "-p", "def main():", "-n", 24, "--raw", "--stats", stats], cap + host_cap)
    assert proc.returncode == 0, proc.stderr
    assert failcnt == 0 and peak <= (cap + host_cap) * GiB
    decode = [json.loads(ln) for ln in stats.read_text().splitlines() if '"decode"' in ln]
    assert (sum(ly["hits_host"] for r in decode for ly in r["layers"]) > 0) == (reads == "0")
    assert ("hit rate 100.0%" in proc.stderr) == (reads == "1")  # every pick in memory: nothing copied


class HostCopies(CopyEngine):
    """CUDA's copy engine where there is none: the same bookkeeping (page-locked ranges, copies queued and then
    waited for), each copy a `memmove` into the slot's address, done only at `wait`, so a slot read before its
    copy is waited for holds its old bytes. On the CPU backend a pool's host view is its memory."""

    def __init__(self):
        super().__init__(None)
        self.queued: list[tuple[int, int, int]] = []
        self.copied = self.locks = self.moved = 0
        self.pools = None
        self.reading: set[int] = set()  # the slots kernels queued since the last fence read

    def _register(self, ptr: int, nbytes: int) -> bool:
        self.locks += 1
        return True

    def _unregister(self, ptr: int) -> None:
        pass

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        assert self.slot_of(dst) not in self.reading, "a copy into a slot a queued kernel reads"
        self.queued.append((dst, src, nbytes))

    def slot_of(self, dst: int) -> int:
        pools = self.pools
        return next((dst - base) // n for base, _, n in pools.slot_at if base <= dst < base + pools.n * n)

    def wait(self) -> None:
        for dst, src, nbytes in self.queued:
            ctypes.memmove(dst, src, nbytes)
        self.copied += len(self.queued)
        self.queued.clear()

    def to_device(self, ptr: int, nbytes: int) -> None:
        self.moved += 1


# The copy engine's runs are bfloat16 (its pools hold the records as stored). On the CPU backend a bfloat16 prefill
# step of the small checkpoint costs about the same whatever its tokens: PROMPTS[2] took 11.5 s in 6 chunks of 16
# tokens, 4.8 s in 3 of 32, still a first chunk, a middle one and a last.
BF16 = {"dtype": "bfloat16", "prefill_chunk": 32}


@pytest.fixture(scope="module")
def bf16_logits(small_conv) -> bytes:
    """The logits of a bf16 run with neither a host tier nor a copy engine, planned as a discrete GPU's."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("STREAMOE_SPLIT_MEMORY", "1")
        return logits_of(small_conv, caps_for(small_conv, 0, None, **BF16))[0]


@pytest.mark.parametrize("hot,host", [(0, None), (0, 512), (24, 200)])
def test_records_copied_by_the_copy_engine_change_no_bit(small_conv, split, monkeypatch, bf16_logits, hot, host):
    """With a copy engine (a discrete GPU's fast path; here a stand-in that copies at `wait`), records from the
    page-locked staging ring and host tier are copied straight into their slots, the guesses copied ahead included,
    none through the upload ring: every filled slot holds the file's bytes and the logits are those without a
    host tier or an engine."""
    import streamoe.runtime.engine as engine_mod

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    monkeypatch.setattr(experts_mod, "DIRECT_WRITES", False)
    copies = HostCopies()
    monkeypatch.setattr(engine_mod, "open_copy_engine", lambda: copies)
    eng = Engine(small_conv, caps_for(small_conv, hot, host, **BF16))
    x = eng.experts
    assert x.pools.engine is copies and copies.moved == len(eng.lay.segments)  # each pool moved as it was made
    copies.pools = x.pools
    compute, fence = x._compute, x.fence

    def reads(xs, slots):
        copies.reading.update(np.array(slots).reshape(-1).tolist())
        return compute(xs, slots)

    def fenced(*also):
        fence(*also)
        copies.reading.clear()

    monkeypatch.setattr(x, "_compute", reads)
    monkeypatch.setattr(x, "fence", fenced)
    out = [np.array(eng.prefill(eng.text.encode(PROMPTS[2])).astype(mx.float32))]
    x.precision = 0.0  # every guess passes: copies ahead on every layer
    for _ in range(12):
        out.append(np.array(eng.forward([int(out[-1].argmax())], "decode").astype(mx.float32)))
    ring_rows = x.pools.next
    eng.close()
    layers = [ly for s in eng.steps for ly in s.layers]
    landed = sum(ly.picks - ly.hits_hot - ly.hits_lent for ly in layers)
    assert copies.copied >= landed * len(eng.lay.segments) > 0 and ring_rows == 0
    # the staging ring locked once, and each host slot as it fills (every one where the tier holds every record);
    # all given back at close
    assert copies.ranges == {} and copies.locks >= 1 + (512 if host == 512 else 0)
    if host is not None:
        assert sum(ly.hits_host for ly in layers) > 0
    if host == 512:
        assert sum(ly.hits_prefetch for ly in layers if ly.layer > 0) > 0
    assert np.stack(out).tobytes() == bf16_logits


def test_every_expert_in_host_memory_is_read_in_place_with_the_same_bits(small_conv, split, monkeypatch, no_tier):
    """Where the host cap holds every expert and the device does not (`host_reads`), the pools are host memory with
    every expert in them: the run is resident (no round trip a layer, nothing read after open), the device's hot tier
    and upload ring are gone from its plan, and the logits are those of a run without a host tier, decode reading
    the picks in place or through a gather of their rows, and a prefill chunk of several blocks (each layer's
    experts copied for the chunk; a chunk of one block reads them in place). On by default (STREAMOE_HOST_READS=0:
    off), never where the host cap is short of every expert."""
    from dataclasses import replace

    monkeypatch.setattr(experts_mod, "VERIFY", True)
    want = no_tier.logits
    opts = replace(caps_for(small_conv, 80, 580), host_reads=True)  # 512 slots (float32 scales) of 569 records
    assert plan_for(small_conv, replace(opts, host_reads=None)).host_reads  # the default
    monkeypatch.setenv("STREAMOE_HOST_READS", "0")
    assert not plan_for(small_conv, replace(opts, host_reads=None)).host_reads
    monkeypatch.delenv("STREAMOE_HOST_READS")
    short = plan_for(small_conv, replace(caps_for(small_conv, 80, 400), host_reads=True))
    assert not short.host_reads and short.host_slots == 400 and short.hot_slots == 80
    p = plan_for(small_conv, opts)
    assert p.host_reads and p.hot_slots == 0 and p.expert_slots == 512 and p.host_slots == 0
    assert p.host_accounts["expert pools"] == 512 * p.slot_bytes
    assert "upload ring" not in p.accounts and "upload ring" not in p.host_accounts
    assert p.accounts["prefill staging"] == 2 * 64 * p.slot_bytes and p.fits
    assert p.to_json()["host"]["host_reads"] and "read by the device over the bus" in p.render()
    gc.collect()  # what earlier tests left to the cycle collector would be freed mid-run, under `before`
    mx.reset_peak_memory()
    before = mx.get_active_memory()  # what other tests of this process still hold
    got, eng = logits_of(small_conv, opts)
    assert eng.experts.resident and eng.experts.pools.host_bytes == 512 * p.slot_bytes
    # MLX counts the host's pools as its own, past --cap at its peak here; the device's peak leaves them out
    assert mx.get_peak_memory() - before > p.cap >= eng.summary(eng.steps)["peak_gib"] * GiB - before
    active, device = eng.memory_when_open  # and so does the device's memory now (`/v1/stats`, `/metrics`)
    pools = eng.experts.pools.host_bytes  # more than all else the engine holds (its non-expert weights, caches)
    assert 0 < device - before < pools < active - before and device - before <= p.fixed
    assert sum(ly.bytes_read for s in eng.steps for ly in s.layers) == 0
    assert got == want
    monkeypatch.setattr(experts_mod, "HOST_READ_FORM", "direct")  # the picks read where they are
    assert logits_of(small_conv, opts)[0] == want
    monkeypatch.setattr(experts_mod, "HOST_READ_FORM", "take")
    # a prompt of several blocks in one chunk: each layer's experts copied once for its blocks
    monkeypatch.setattr(plan_mod, "PREFILL_STEP", 8)
    staged = []
    prepare = experts_mod.StreamingExperts.prepare

    def spy(self, i, inds, xs):
        prepare(self, i, inds, xs)
        if self.pools.host_bytes:
            staged.append((i, len(inds), self.staged[0] if self.staged is not None else None))

    monkeypatch.setattr(experts_mod.StreamingExperts, "prepare", spy)
    eng = Engine(small_conv, replace(opts, prefill_chunk="auto"))
    assert eng.plan.host_reads and eng.plan.prefill_step == 8 and eng.plan.prefill_chunk >= 32
    ids = eng.text.encode(PROMPTS[2])
    lg = np.array(eng.prefill(ids).astype(mx.float32))
    eng.close()
    ref = Engine(small_conv, replace(caps_for(small_conv, 0, None), prefill_chunk="auto"))
    assert ref.plan.prefill_step == 8
    assert np.array_equal(lg, np.array(ref.prefill(ids).astype(mx.float32)))
    ref.close()
    assert len(ids) > 8 and {n for _, n, _ in staged} == {-(-len(ids) // 8)} and [i for i, _, _ in staged] == list(range(8))
    assert all(i == j for i, _, j in staged)
