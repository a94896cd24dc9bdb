"""Prompt cache across requests: snapshots of the engine's conversation state, keyed by the exact prompt prefix
they hold, so a request that repeats a conversation prefills only what is new.

Chat clients resend the whole conversation every turn, and the chat template re-renders it: earlier answers
come back without their thinking, so the state after the last answer is never a prefix of the next prompt,
and a Gated DeltaNet state cannot be rewound to one. What the next rendering does share is everything up to
the header of the assistant turn being answered (`<|im_start|>assistant\\n`), so the server prefills a chat
prompt in segments that end at every assistant header and keeps a snapshot at the last one. The segments are
a function of the prompt alone, so an answer computed from a restored snapshot is bit-identical to one
computed from scratch.

A snapshot is the engine's `Conversation` (`runtime/conversation.py`: its tensors, KV caches cut to the tokens
held, as stored: floats, or a quantized cache's codes, scales and biases; linear-attention conv and recurrent
state; the offset and M-RoPE delta) as host copies, the tensors a session file holds; its bytes are an account
of the memory plan, evicted LRU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..conversation import Conversation, from_host, host_view

# an item of a cache key: a token id, or ("image", sha256) where an image placeholder stands, because every
# image renders to the same placeholder token and only its bytes tell two prompts apart; a salted key's first item
# is ("salt", salt, item), so that no salted key is a prefix of a key salted otherwise or not at all
Item = int | tuple


@dataclass
class Snapshot:
    key: tuple[Item, ...]
    offset: int
    rope_delta: int
    arrays: list[tuple[str, np.ndarray]]  # (name, host copy) in `Conversation.tensors` order

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in self.arrays)


def capture(eng, key: tuple[Item, ...]) -> Snapshot:
    """Copy the engine's conversation state (KV caches cut to the tokens held) to host memory."""
    conv: Conversation = eng.conversation
    arrays = [(t.name, np.array(host_view(t.array), copy=True)) for t in conv.tensors()]
    return Snapshot(key, conv.offset, conv.rope_delta, arrays)


def snapshot_nbytes(eng) -> int:
    """What `capture` would copy now, known before copying, so room is made first."""
    return eng.conversation.nbytes()


def restore(eng, snap: Snapshot) -> None:
    """Put a snapshot's state back into the engine's conversation, in place: KV caches are written up to the
    tokens held (positions past the offset are never read), linear-attention states replaced."""
    conv: Conversation = eng.conversation
    dtypes = {s.name: s.dtype for s in conv.specs(snap.offset)}
    for name, host in snap.arrays:
        conv.restore(name, from_host(host, dtypes[name]))
    conv.resume(snap.offset, snap.rope_delta)


def clear(eng) -> None:
    """An empty conversation without reallocating the KV caches (`Engine.reset` makes new ones before the old
    are freed: twice the KV account for a moment). Equal to a reset: attention reads only up to the offset."""
    eng.conversation.clear()


def key_items(ids: list[int], image_pad: int | None, image_hashes: list[str],
              salt: str | None = None, cut: str | None = None) -> tuple[Item, ...]:
    """The cache key of a prompt: its token ids with each image placeholder replaced by that image's hash; with a
    `salt` (vLLM's `cache_salt`), its first item salted, so the prompt shares snapshots only with the same salt's;
    with `cut`, how its prefill is cut (a chat's at its assistant headers, a completion's at whole steps): a
    snapshot holds the bits of one cutting, so a prompt restores only those of its own kind."""
    out: list[Item] = []
    it = iter(image_hashes)
    for t in ids:
        h = next(it, None) if t == image_pad else None
        out.append(t if h is None else ("image", h))  # a placeholder without an image (raw text) is a token
    if salt is not None and out:
        out[0] = ("salt", salt, out[0])
    if cut is not None and out:
        out[0] = ("cut", cut, out[0])
    return tuple(out)


def boundaries(ids: list[int], header: list[int]) -> list[int]:
    """Where a chat prompt's segments end: just after every assistant header (and nowhere when the header is
    empty, as for raw completions); the worker adds where its system prompt and tools end (`Job.head`)."""
    if not header:
        return []
    h, n = len(header), len(ids)
    return [i + h for i in range(n - h + 1) if ids[i:i + h] == header and i + h < n]


class PromptCache:
    """Snapshots up to `budget` bytes, least recently used evicted first."""

    def __init__(self, budget: int):
        self.budget = budget
        self.snaps: OrderedDict[tuple[Item, ...], Snapshot] = OrderedDict()
        self.hits = self.misses = self.tokens_saved = 0

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.snaps.values())

    def lookup(self, key: tuple[Item, ...], fits: Callable[[int], bool] = lambda n: True) -> Snapshot | None:
        """The snapshot holding the longest prefix of `key` (shorter than `key`: the last token must be fed) whose
        length `fits` (where the prompt's own prefill would cut)."""
        best = None
        for k, s in self.snaps.items():
            if len(k) < len(key) and (best is None or len(k) > len(best.key)) and fits(len(k)) and key[:len(k)] == k:
                best = s
        if best is None:
            self.misses += 1
            return None
        self.snaps.move_to_end(best.key)
        self.hits += 1
        self.tokens_saved += best.offset  # tokens of state not prefilled again (images expanded)
        return best

    def holds(self, key: tuple[Item, ...]) -> bool:
        return key in self.snaps

    def wants(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.budget

    def make_room(self, nbytes: int) -> None:
        """Evict least recently used snapshots until `nbytes` more fit in the budget (before copying them)."""
        while self.snaps and self.nbytes + nbytes > self.budget:
            self.snaps.popitem(last=False)

    def add(self, snap: Snapshot) -> None:
        if not self.wants(snap.nbytes):
            return
        self.snaps.pop(snap.key, None)
        self.make_room(snap.nbytes)
        self.snaps[snap.key] = snap

    def to_json(self) -> dict:
        return {"budget": self.budget, "bytes": self.nbytes, "snapshots": len(self.snaps), "hits": self.hits,
                "misses": self.misses, "tokens_saved": self.tokens_saved}
