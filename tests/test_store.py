"""ExpertStore: real O_DIRECT reads of a converted tiny model's layer files into the host ring, demand reads
served before guesses. A read whose ring entry is held cannot finish, which is how these tests hold reads
in place while they look at what runs next."""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, wait

import pytest

from streamoe.formats.manifest import load_manifest
from streamoe.runtime.store import ExpertStore


def open_store(conv, io_threads: int, ring: int) -> ExpertStore:
    return ExpertStore.open(conv, load_manifest(conv), "q4", io_threads, ring)


def wait_until(cond, what: str) -> None:
    end = time.monotonic() + 10
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.002)


def settle() -> None:
    time.sleep(0.1)  # long enough for an idle I/O thread to pick up work it is allowed to take


def test_reads_land_the_file_bytes(tiny_conv):
    store = open_store(tiny_conv, io_threads=2, ring=2)
    try:
        for layer, expert in [(0, 0), (1, 3), (0, 1)]:
            for f in (store.read(layer, expert), store.guess(layer, expert)):
                entry = f.result()
                assert bytes(store.record(entry)[:store.lay.raw_size]) == store.read_bytes(layer, expert)
                store.release(entry)
    finally:
        store.close()


def test_reads_queued_together_land_each_its_own_record_in_order(tiny_conv):
    store = open_store(tiny_conv, io_threads=3, ring=3)
    try:
        keys = [(1, 2), (0, 0), (1, 3)]
        for queue in (store.read_many, store.guess_many):
            futs = queue(keys)
            assert len(futs) == len(keys)
            for (layer, expert), f in zip(keys, futs, strict=True):
                entry = f.result(timeout=10)
                assert bytes(store.record(entry)[:store.lay.raw_size]) == store.read_bytes(layer, expert)
                store.release(entry)
        assert store.read_many([]) == [] and store.bytes_read == 6 * store.lay.stride
    finally:
        store.close()


def test_a_guess_waits_while_a_demand_read_is_queued_or_running(tiny_conv):
    store = open_store(tiny_conv, io_threads=2, ring=2)
    try:
        held = [store.read(0, 0).result(), store.read(0, 2).result()]  # the whole ring: later reads block
        d1 = store.read(0, 1)
        wait_until(d1.running, "the demand read to start")
        g1 = store.guess(1, 0)
        settle()
        assert not g1.running(), "a guess started while a demand read was running (one thread was idle)"
        d2 = store.read(1, 1)
        wait_until(d2.running, "the second demand read to start")
        d3 = store.read(1, 2)  # both threads busy: d3 and g1 wait in their queues
        store.release(held.pop())
        done, _ = wait([d1, d2], timeout=10, return_when=FIRST_COMPLETED)
        first = done.pop()
        e = first.result()
        wait_until(d3.running, "the queued demand read to start")
        settle()
        assert not g1.running(), "a guess started before a queued demand read"
        store.release(e)
        store.release(held.pop())
        for f in (d1, d2, d3):
            if f is not first:
                store.release(f.result(timeout=10))
        entry = g1.result(timeout=10)
        assert bytes(store.record(entry)[:store.lay.raw_size]) == store.read_bytes(1, 0)
    finally:
        store.close()


def test_a_promoted_guess_goes_before_other_guesses_and_a_withdrawn_one_is_not_read(tiny_conv):
    store = open_store(tiny_conv, io_threads=1, ring=1)
    try:
        held = store.read(0, 0).result()
        d1 = store.read(0, 1)
        wait_until(d1.running, "the demand read to start")
        g1, g2, g3 = store.guess(1, 0), store.guess(1, 1), store.guess(1, 2)
        read0 = store.bytes_read
        assert store.cancel(g1)
        assert store.bytes_read == read0 - store.lay.stride
        store.promote(g3)
        store.release(held)
        store.release(d1.result(timeout=10))
        wait_until(g3.running, "the promoted guess to start")
        assert not g2.running()
        store.release(g3.result(timeout=10))
        store.release(g2.result(timeout=10))
        assert g1.cancelled()
    finally:
        store.close()


def test_close_finishes_what_was_queued(tiny_conv):
    store = open_store(tiny_conv, io_threads=2, ring=4)
    fs = [store.read(0, e) for e in range(2)] + [store.guess(1, e) for e in range(2)]
    store.close()
    assert all(f.done() and f.exception() is None for f in fs)


@pytest.mark.parametrize("io_threads", [1, 3])
def test_many_reads_through_a_small_ring(tiny_conv, io_threads):
    """More reads than ring entries, guesses mixed in, taken as they complete (as the engine does: it never
    waits on a guess it has not promoted): each lands intact once an entry is released."""
    store = open_store(tiny_conv, io_threads=io_threads, ring=2)
    n_layers = len(store.fds)
    try:
        keys = [(i % n_layers, i % store.n_experts) for i in range(24)]
        pending = {(store.guess if i % 3 else store.read)(*k): k for i, k in enumerate(keys)}
        while pending:
            done, _ = wait(pending, timeout=10, return_when=FIRST_COMPLETED)
            assert done, "no read completed"
            for f in done:
                k, entry = pending.pop(f), f.result()
                assert bytes(store.record(entry)[:store.lay.raw_size]) == store.read_bytes(*k)
                store.release(entry)
    finally:
        store.close()
