"""The Responses API's stored responses (`store`, true unless a request says false), inside a byte budget.

A client that keeps no history of its own names what it wants continued: `previous_response_id` (the whole chain
of stored responses before it: each one's input items, then its output items) or an `item_reference` (one item of a
stored response, by its id). Each response is kept as its compact JSON text, and so is each item its request gave
(references resolved; the chain before it is its `previous`'s, so a conversation of n turns holds each turn once)
and each item it answered. The texts are handed out as kept, so a request's reader can weigh what it is given before
parsing any of it. What is kept is charged at the texts' lengths plus `ENTRY` and `ITEM` for the objects around them;
past the budget (the plan's `response store` account) the least recently used response goes first. A response
whose chain lost a response to that is answered as never stored: the client sends the conversation again.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

ENTRY = 1024  # what one stored response costs beyond its texts: the entry, its keys, the LRU's links
ITEM = 256  # ... and each item's place in the index of item ids


def _cost(texts: list[bytes], ids: int) -> int:
    """What a stored response costs: its texts, its entry, and its items' places in the index of ids."""
    return sum(map(len, texts)) + ENTRY + ITEM * ids


def _text(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


@dataclass(frozen=True)
class Stored:
    previous: str | None  # the response this one continued
    response: bytes  # the response object, as the client got it
    given: tuple[bytes, ...]  # the input items its request gave, references resolved
    given_ids: tuple[str | None, ...]  # their ids (a page of them is written from the texts, never parsed)
    answered: tuple[bytes, ...]  # its output items
    by_id: dict[str, bytes]  # those of them with an id
    cost: int


class ResponseStore:
    """Stored responses by id, least recently used first; shared by the prepare thread (which reads chains and
    items) and the event loop (which stores a response once it ends), hence the lock."""

    def __init__(self, budget: int):
        self.budget, self.used = budget, 0
        self.entries: OrderedDict[str, Stored] = OrderedDict()
        self.item_of: dict[str, list[str]] = {}  # item id -> the responses holding it, the newest last
        self.lock = threading.Lock()

    def fits(self, items: list[dict]) -> bool:
        """Whether a request's input `items` alone leave room in the budget for its response."""
        return _cost([_text(it) for it in items], len(items)) <= self.budget

    def put(self, response: dict, items: list[dict], previous: str | None) -> bool:
        """Keep `response` (with its request's resolved input `items`); False where it alone exceeds the budget."""
        given, answered = tuple(map(_text, items)), tuple(map(_text, response["output"]))
        by_id = {it["id"]: t for it, t in zip([*items, *response["output"]], given + answered, strict=True)
                 if isinstance(it.get("id"), str)}
        body = _text(response)
        cost = _cost([body, *given, *answered], len(by_id))
        ids = tuple(it["id"] if isinstance(it.get("id"), str) else None for it in items)
        entry = Stored(previous, body, given, ids, answered, by_id, cost)
        if cost > self.budget:
            return False
        with self.lock:
            self._drop(response["id"])
            while self.used + cost > self.budget:
                self._drop(next(iter(self.entries)))
            self.entries[response["id"]] = entry
            self.used += cost
            for i in by_id:
                self.item_of.setdefault(i, []).append(response["id"])
        return True

    def _drop(self, rid: str) -> Stored | None:
        entry = self.entries.pop(rid, None)
        if entry is not None:
            self.used -= entry.cost
            for i in entry.by_id:
                holders = self.item_of[i]
                holders.remove(rid)
                if not holders:
                    del self.item_of[i]
        return entry

    def delete(self, rid: str) -> bool:
        with self.lock:
            return self._drop(rid) is not None

    def _use(self, rid: str) -> Stored | None:
        with self.lock:
            entry = self.entries.get(rid)
            if entry is not None:
                self.entries.move_to_end(rid)
            return entry

    def response(self, rid: str) -> bytes | None:
        """The stored response's JSON text, or None where it is not stored."""
        entry = self._use(rid)
        return None if entry is None else entry.response

    def input_items(self, rid: str) -> list[tuple[str | None, bytes]] | None:
        """The ids and JSON texts of the input items the stored response's request gave, or None where it is not
        stored."""
        entry = self._use(rid)
        return None if entry is None else list(zip(entry.given_ids, entry.given, strict=True))

    def chain(self, rid: str) -> list[bytes] | None:
        """The conversation up to and with response `rid`, as JSON texts: each stored response of its chain, oldest
        first, its input items then its output items; None where any of them is not stored. Each one read counts
        as used."""
        with self.lock:
            got, at = [], rid
            while at is not None:
                entry = self.entries.get(at)
                if entry is None:
                    return None
                got.append((at, entry))
                at = entry.previous
            for at, _ in reversed(got):  # the chain's newest the most recently used
                self.entries.move_to_end(at)
        return [t for _, entry in reversed(got) for t in entry.given + entry.answered]

    def item(self, item_id: str) -> bytes | None:
        """A stored item's JSON text (an input or an output item of a stored response) by its id."""
        with self.lock:
            holders = self.item_of.get(item_id)
            return self.entries[holders[-1]].by_id[item_id] if holders else None
