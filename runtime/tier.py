"""HotTier: which expert lives in which slot, shared by all layers.

Slots [0, hot) belong to the tier; slots [hot, hot + staging) are the prefill staging area (slot
hot + e stages expert e of the current layer). During decode the staging slots are lent to the tier,
except a small scratch ring that takes misses the tier declines; the next prompt takes them back.

Admission by pick frequency: a miss is admitted when it has been picked more often than a sampled
victim (so one-off experts do not flush the hot set); `policy="lru"` always admits and evicts the least
recently used entry, the measured alternative. Placement never changes the math, only what is read.
Every operation is O(1) or O(sample) in the number of slots: a decode token places hundreds of experts.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from ..formats.errors import StreamoeError

Key = tuple[int, int]  # (layer, expert)


class HotTier:
    def __init__(self, hot: int, staging: int, n_layers: int, n_experts: int, scratch: int,
                 policy: str = "freq", sample: int = 8, seed: int = 0):
        if policy not in ("freq", "lru"):
            raise StreamoeError(f"unknown tier policy {policy!r}")
        self.hot, self.staging, self.policy, self.sample = hot, staging, policy, sample
        self.scratch_n = min(scratch, staging)
        self.n_slots = hot + staging
        self.key_of: list[Key | None] = [None] * self.n_slots
        self.slot_of: dict[Key, int] = {}
        # slot_of as a flat array, layer * E + expert -> slot, for a decode step run on the device's lookups
        # (`StreamingExperts.on_hot`); an entry outlives its eviction, so only keys in slot_of are read from it
        self.E = n_experts
        self.table = np.zeros(n_layers * n_experts, dtype=np.uint32)
        # picks per (layer, expert) as Python ints: a decode step touches a few of them per layer, where a numpy
        # fancy update cost ~150 us (its code paths cold after each layer's kernels) against ~1 us for the loop
        self.freq: list[list[int]] = [[0] * n_experts for _ in range(n_layers)]
        self.recency: OrderedDict[int, None] = OrderedDict()  # occupied tier slots, least recently used first
        self.free: list[int] = list(range(hot - 1, -1, -1))  # unoccupied tier slots (a stack)
        self.pinned: set[int] = set()
        self.lent = False
        self.rng = np.random.default_rng(seed)
        self.u: list[float] = []  # uniforms drawn ahead (_uniforms)
        self.u_next = 0
        self.scratch_next = 0

    # --- which slots belong to the tier right now
    def in_tier(self, slot: int) -> bool:
        return slot < self.hot or (self.lent and slot >= self.hot + self.scratch_n)

    def is_staging(self, slot: int) -> bool:
        return slot >= self.hot

    def lend_staging(self) -> None:
        """Decode begins: the staging slots become tier slots (all but the scratch ring)."""
        if self.lent:
            return
        self.lent = True
        for s in range(self.hot + self.scratch_n, self.n_slots):
            if self.key_of[s] is None:
                self.free.append(s)
            else:
                self.recency[s] = None

    def reclaim_staging(self) -> None:
        """A prompt begins: forget every entry living in a staging slot."""
        for s in range(self.hot, self.n_slots):
            self.evict(s)
        self.lent = False
        self.free = [s for s in self.free if s < self.hot]

    # --- bookkeeping
    def lookup(self, key: Key) -> int | None:
        return self.slot_of.get(key)

    def note_picks(self, layer: int, experts: list[int]) -> None:
        """A step picked these distinct experts of `layer`: one more pick each, and each resident one is used."""
        row = self.freq[layer]
        for e in experts:
            row[e] += 1
            s = self.slot_of.get((layer, e))
            if s is not None and s in self.recency:
                self.recency.move_to_end(s)

    def evict(self, slot: int) -> None:
        k = self.key_of[slot]
        if k is not None:
            del self.slot_of[k]
            self.key_of[slot] = None
            if self.recency.pop(slot, 0) is None and self.in_tier(slot):
                self.free.append(slot)

    def assign(self, slot: int, key: Key) -> None:
        self.evict(slot)
        old = self.slot_of.get(key)
        if old is not None:
            self.evict(old)
        self.key_of[slot] = key
        self.slot_of[key] = slot
        self.table[key[0] * self.E + key[1]] = slot
        if self.in_tier(slot):
            self.recency[slot] = None
            self.recency.move_to_end(slot)

    def picks(self, key: Key) -> int:
        return self.freq[key[0]][key[1]]

    def usable(self, slot: int) -> bool:
        return slot not in self.pinned

    # --- placement of a miss
    def take_free(self) -> int | None:
        """A free tier slot, taken; None if there is none."""
        while self.free:
            s = self.free.pop()
            if self.key_of[s] is None and self.in_tier(s):
                return s
        return None

    def _lru(self) -> int | None:
        for s in self.recency:
            if self.usable(s):
                return s
        return None

    def victim(self) -> tuple[int | None, bool]:
        """(slot, is_free): a free tier slot, else the policy's victim among usable occupied ones."""
        s = self.take_free()
        if s is not None:
            return s, True
        return self.occupied_victim(), False

    def occupied_victim(self) -> int | None:
        """The policy's victim among the usable occupied slots (None: none is usable)."""
        if not self.recency:
            return None
        if self.policy == "lru":
            return self._lru()
        best, fewest = None, 0
        freq, key_of, pinned = self.freq, self.key_of, self.pinned  # locals: this runs for every miss of a decode step
        for s in self._sample_occupied():
            if s not in pinned:
                layer, e = key_of[s]
                if best is None or freq[layer][e] < fewest:
                    best, fewest = s, freq[layer][e]
        return best if best is not None else self._lru()

    def _sample_occupied(self) -> list[int]:
        """Up to `sample` random occupied tier slots, drawn in one call (a draw per slot cost more than the rest
        of a capped CPU decode's tier work): from the occupied ones when they are few, else 4 draws per pick
        over every slot, keeping the occupied ones."""
        if len(self.recency) <= 4 * self.sample:
            occupied = list(self.recency)
            return [occupied[int(u * len(occupied))] for u in self._uniforms(self.sample)]
        n, occupied = self.n_slots, self.recency
        return [s for s in [int(u * n) for u in self._uniforms(4 * self.sample)] if s in occupied][: self.sample]

    def _uniforms(self, n: int) -> list[float]:
        """n uniform numbers in [0, 1) from the seeded generator, drawn 4096 at a time (a generator call costs
        ~10 us: per victim it was 5 % of a capped CPU decode's main thread)."""
        if self.u_next + n > len(self.u):
            self.u, self.u_next = self.rng.random(max(4096, n)).tolist(), 0
        self.u_next += n
        return self.u[self.u_next - n:self.u_next]

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
        v, free = self.victim()
        if v is not None and (free or self.policy == "lru" or self.picks(key) >= self.picks(self.key_of[v])):
            self.assign(v, key)
            return v, True
        s = self.scratch_slot(key)
        if s is None and optional:
            return None, False
        if s is None:  # everything pinned or in flight: admit over the victim rather than stall
            if v is None:
                raise StreamoeError("no expert slot available: plan too small for top_k + prefetch width")
            self.assign(v, key)
            return v, True
        self.assign(s, key)
        return s, False
