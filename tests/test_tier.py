"""HotTier on its own: which expert lives in which slot, and which slot a miss is read into.

Slots [0, hot) are the tier's; slots [hot, hot + staging) are the prefill staging area, lent to the tier
during decode except a small scratch ring. The tests use only the tier's public methods; pinning a slot
(a kernel will read it) and marking it busy (a read is in flight) go through `pin` and `busy` below.
"""

from __future__ import annotations

import pytest

from streamoe.formats.errors import StreamoeError
from streamoe.runtime.tier import HotTier


def pin(tier: HotTier, slot: int) -> None:
    tier.pinned.add(slot)


def unpin(tier: HotTier, slot: int) -> None:
    tier.pinned.discard(slot)


def make(hot: int = 3, staging: int = 4, layers: int = 2, experts: int = 4, scratch: int = 2, **kw) -> HotTier:
    return HotTier(hot, staging, layers, experts, scratch, **kw)


def picked(tier: HotTier, key: tuple[int, int], times: int) -> None:
    for _ in range(times):
        tier.note_picks(key[0], [key[1]])


def entries(tier: HotTier) -> dict[tuple[int, int], int]:
    """key -> slot of everything resident, by asking `lookup` for every key."""
    keys = [(layer, e) for layer in range(len(tier.freq)) for e in range(len(tier.freq[0]))]
    return {k: tier.lookup(k) for k in keys if tier.lookup(k) is not None}


def test_unknown_policy_is_a_streamoe_error():
    with pytest.raises(StreamoeError, match="unknown tier policy 'mru'"):
        make(policy="mru")


def test_free_tier_slots_are_taken_first_and_always_admit():
    t = make()
    assert [t.place((0, e)) for e in range(3)] == [(0, True), (1, True), (2, True)]
    assert entries(t) == {(0, 0): 0, (0, 1): 1, (0, 2): 2}
    assert all(t.in_tier(s) and not t.is_staging(s) for s in range(3))
    assert not any(t.in_tier(s) for s in range(3, 7)) and all(t.is_staging(s) for s in range(3, 7))


def test_victim_is_a_free_slot_then_an_occupied_one():
    t = make(hot=2, policy="lru")
    assert t.victim() == (0, True)  # a free slot is handed out (and taken)
    t.assign(0, (0, 0))
    assert t.victim() == (1, True)
    t.assign(1, (0, 1))
    assert t.victim() == (0, False)  # full: the least recently used occupied slot
    t.evict(0)
    assert t.lookup((0, 0)) is None and t.victim() == (0, True)  # an evicted tier slot is free again


def test_a_miss_colder_than_every_victim_is_declined_to_staging():
    t = make(hot=2, staging=4, experts=4, sample=64)
    for e in (0, 1):
        t.place((0, e))
        picked(t, (0, e), 3)
    picked(t, (1, 3), 2)
    # prefill (nothing lent): a declined miss is staged in slot hot + expert
    assert t.place((1, 3)) == (2 + 3, False)
    assert entries(t) == {(0, 0): 0, (0, 1): 1, (1, 3): 5}  # the hot set is untouched
    assert not t.in_tier(5)


def test_a_miss_as_hot_as_the_sampled_victim_replaces_it():
    t = make(hot=2, staging=4, experts=4, sample=64)  # 64 samples of 2 slots: both are seen
    t.place((0, 0))
    t.place((0, 1))
    picked(t, (0, 0), 5)
    picked(t, (0, 1), 2)
    picked(t, (1, 2), 2)
    assert t.place((1, 2)) == (1, True)  # the colder of the two is the victim; ties admit
    assert entries(t) == {(0, 0): 0, (1, 2): 1}


def test_lru_admits_every_miss_over_the_least_recently_used():
    t = make(hot=3, policy="lru")
    for e in range(3):
        t.place((0, e))
    picked(t, (0, 1), 9)  # the hottest by far, but then (0, 2) and (0, 0) are picked after it
    picked(t, (0, 2), 1)
    picked(t, (0, 0), 1)
    assert t.place((1, 0)) == (1, True)  # LRU order: 1, 2, 0 — frequency plays no part
    assert t.place((1, 1)) == (2, True)
    assert t.place((1, 2)) == (0, True)
    assert entries(t) == {(1, 0): 1, (1, 1): 2, (1, 2): 0}


def test_assigning_a_resident_key_moves_it():
    t = make()
    t.assign(0, (0, 1))
    t.assign(2, (0, 1))
    assert entries(t) == {(0, 1): 2}


@pytest.mark.parametrize("policy", ["freq", "lru"])
@pytest.mark.parametrize("mark", [pin])
def test_pinned_or_busy_slots_are_never_handed_out(policy, mark):
    t = make(hot=3, policy=policy, sample=64)
    for e in range(3):
        t.place((0, e))
    mark(t, 0)
    mark(t, 1)
    for i in range(6):
        slot, admitted = t.place((1, i % 4))
        assert slot not in (0, 1), (i, slot)
    assert t.lookup((0, 0)) == 0 and t.lookup((0, 1)) == 1


def test_no_slot_at_all_is_a_streamoe_error_and_a_guess_gets_none():
    t = make(hot=1, staging=2, experts=2)
    t.place((0, 0))
    pin(t, 0)
    pin(t, 1 + 1)  # the staging slot of expert 1
    assert t.place((0, 1), optional=True) == (None, False)
    with pytest.raises(StreamoeError, match="no expert slot available"):
        t.place((0, 1))


def test_a_declined_miss_with_its_staging_slot_pinned_is_admitted_over_the_victim():
    t = make(hot=2, staging=2, experts=2, sample=64)
    for e in (0, 1):
        t.place((0, e))
        picked(t, (0, e), 5)
    pin(t, 2 + 1)  # expert 1's staging slot
    slot, admitted = t.place((1, 1))  # colder than both victims, but nowhere else to go: no stall
    assert admitted and slot in (0, 1) and t.lookup((1, 1)) == slot


def test_staging_is_lent_for_decode_and_reclaimed_for_a_prompt():
    t = make(hot=2, staging=4, experts=4, scratch=1, sample=64)
    for e in (0, 1):
        t.place((0, e))
        picked(t, (0, e), 5)
    assert t.place((1, 2)) == (2 + 2, False)  # prefill stages expert 2 in slot 4
    t.lend_staging()
    # slot 2 is the scratch ring; 3, 4, 5 now belong to the tier, and what slot 4 holds stays resident
    assert [t.in_tier(s) for s in range(6)] == [True, True, False, True, True, True]
    assert all(t.is_staging(s) for s in range(2, 6))
    assert t.lookup((1, 2)) == 4
    assert t.place((1, 0))[1] and t.place((1, 1))[1]  # the lent free slots fill before anything is evicted
    assert {t.lookup((1, 0)), t.lookup((1, 1))} == {3, 5}
    assert set(entries(t)) == {(0, 0), (0, 1), (1, 2), (1, 0), (1, 1)}
    t.lend_staging()  # lending twice changes nothing
    assert t.lookup((1, 2)) == 4
    t.reclaim_staging()
    assert entries(t) == {(0, 0): 0, (0, 1): 1}  # every entry in a staging slot is forgotten
    assert [t.in_tier(s) for s in range(6)] == [True, True, False, False, False, False]
    for _ in range(4):  # and the tier never hands out a staging slot again until the next lend
        slot, admitted = t.place((1, 3))
        assert slot < 2 or (not admitted and slot == 2 + 3)


def test_decode_misses_the_tier_declines_go_round_the_scratch_ring():
    t = make(hot=2, staging=4, experts=4, scratch=2, sample=64)
    t.lend_staging()
    for key in [(0, 0), (0, 1), (0, 2), (0, 3)]:  # fill the tier: slots 0, 1 and the lent 4, 5
        t.place(key)
        picked(t, key, 5)
    assert sorted(entries(t).values()) == [0, 1, 4, 5]
    cold = [(1, 0), (1, 1), (1, 2)]
    assert [t.place(k) for k in cold] == [(2, False), (3, False), (2, False)]  # ring of 2, round robin
    assert t.lookup((1, 0)) is None and t.lookup((1, 1)) == 3 and t.lookup((1, 2)) == 2
    pin(t, 3)
    assert t.place((1, 3)) == (2, False)  # a busy ring slot is skipped
    pin(t, 2)
    assert t.place((1, 0), optional=True) == (None, False)  # a guess never forces an admission
    slot, admitted = t.place((1, 0))  # a needed expert is admitted over a victim rather than stall
    assert admitted and slot in (0, 1, 4, 5)
