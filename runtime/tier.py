"""HotTier: which expert lives in which slot, shared by all layers.

Slots [0, hot) belong to the tier; slots [hot, hot + staging) are the prefill staging area (slot
hot + e stages expert e of the current layer). During decode the staging slots are lent to the tier,
except a small scratch ring that takes misses the tier declines; the next prompt takes them back.

Admission by pick frequency: a miss is admitted when it has been picked more often than a sampled
victim (so one-off experts do not flush the hot set); `policy="lru"` always admits and evicts the least
recently used entry, the measured alternative. Placement never changes the math, only what is read.
"""

from __future__ import annotations

import numpy as np

Key = tuple[int, int]  # (layer, expert)


class HotTier:
    def __init__(self, hot: int, staging: int, n_layers: int, n_experts: int, scratch: int,
                 policy: str = "freq", sample: int = 8, seed: int = 0):
        if policy not in ("freq", "lru"):
            raise ValueError(f"unknown tier policy {policy!r}")
        self.hot, self.staging, self.policy, self.sample = hot, staging, policy, sample
        self.scratch_n = min(scratch, staging)
        self.n_slots = hot + staging
        self.key_of: list[Key | None] = [None] * self.n_slots
        self.slot_of: dict[Key, int] = {}
        self.freq = np.zeros((n_layers, n_experts), np.int64)
        self.last_use = np.zeros(self.n_slots, np.int64)
        self.clock = 0
        self.pinned: set[int] = set()
        self.busy: set[int] = set()  # slots with a read in flight
        self.lent = False
        self.rng = np.random.default_rng(seed)
        self.scratch_next = 0

    # --- which slots the tier may use right now
    def tier_slots(self) -> range | list[int]:
        if not self.lent:
            return range(self.hot)
        return [*range(self.hot), *range(self.hot + self.scratch_n, self.n_slots)]

    def is_staging(self, slot: int) -> bool:
        return slot >= self.hot

    def lend_staging(self) -> None:
        """Decode begins: the staging slots become tier slots (all but the scratch ring)."""
        self.lent = True

    def reclaim_staging(self) -> None:
        """A prompt begins: forget every entry living in a staging slot."""
        for s in range(self.hot, self.n_slots):
            self.evict(s)
        self.lent = False

    # --- bookkeeping
    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def note_picks(self, layer: int, experts) -> None:
        self.clock += 1
        self.freq[layer, np.asarray(experts, dtype=np.int64)] += 1
        for e in experts:
            s = self.slot_of.get((layer, int(e)))
            if s is not None:
                self.last_use[s] = self.clock

    def evict(self, slot: int) -> None:
        k = self.key_of[slot]
        if k is not None:
            del self.slot_of[k]
            self.key_of[slot] = None

    def assign(self, slot: int, key: Key) -> None:
        self.evict(slot)
        old = self.slot_of.pop(key, None)
        if old is not None:
            self.key_of[old] = None
        self.key_of[slot] = key
        self.slot_of[key] = slot
        self.last_use[slot] = self.clock

    def usable(self, slot: int) -> bool:
        return slot not in self.pinned and slot not in self.busy

    # --- placement of a miss
    def victim(self) -> int | None:
        cands = [s for s in self.tier_slots() if self.usable(s)]
        if not cands:
            return None
        free = [s for s in cands if self.key_of[s] is None]
        if free:
            return free[0]
        if self.policy == "lru":
            return min(cands, key=lambda s: self.last_use[s])
        pick = self.rng.choice(len(cands), size=min(self.sample, len(cands)), replace=False)
        return min((cands[i] for i in pick), key=lambda s: (self.freq[self.key_of[s]], self.last_use[s]))

    def scratch_slot(self, key: Key) -> int | None:
        """Where a declined miss goes: prefill stages expert e in slot hot + e; decode uses the scratch ring."""
        if not self.lent:
            s = self.hot + key[1]
            return s if self.usable(s) else None
        for i in range(self.scratch_n):
            s = self.hot + (self.scratch_next + i) % self.scratch_n
            if self.usable(s):
                self.scratch_next = (s - self.hot + 1) % self.scratch_n
                return s
        return None

    def place(self, key: Key, optional: bool = False) -> tuple[int | None, bool]:
        """A slot to read a missing expert into, and whether it was admitted to the tier.

        `optional` (a prefetch guess) gets None rather than forcing an admission when only the scratch ring
        could take it and the ring is busy."""
        v = self.victim()
        if v is not None:
            vk = self.key_of[v]
            if vk is None or self.policy == "lru" or self.freq[key] > self.freq[vk]:
                self.assign(v, key)
                return v, True
        s = self.scratch_slot(key)
        if s is None and optional:
            return None, False
        if s is None:  # everything pinned or in flight: admit over the victim rather than stall
            if v is None:
                raise RuntimeError("no expert slot available: plan too small for top_k + prefetch width")
            self.assign(v, key)
            return v, True
        self.assign(s, key)
        return s, False
