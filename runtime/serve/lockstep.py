"""`streamoe serve` across ranks (`mlx.launch`): rank 0 serves, every other rank repeats its engine calls.

Rank 0 alone binds the port and runs the server and its worker. Each engine call the worker makes for a job
goes through `Lockstep`, which first tells every other rank the same call (a small JSON command, broadcast by
`ranks.gather_bytes`), and each follower (`follow`) makes it on its own engine: the same prefill segments, the
same decode steps and take-backs, hence the same collectives, over its own share of the experts inside its
own cap. A follower decides nothing; rank 0's worker owns every decision (the prompt cache, stops, cancels):

- `begin`: a job starts: the conversation cleared, or restored from the snapshot rank 0 restores. Each rank
  keeps its own copy of each snapshot rank 0's prompt cache holds (the same conversation state, so the same
  bytes), named by its key's hash; `capture` says which to take, and which rank 0 still holds after evicting.
- `prefill`: one segment of the prompt.
- `generate`: the answer's loop with rank 0's prompt, length, sampler and context. The token drawn is rank 0's
  inside the engine (`ranks.shared_token`); a constrained answer's grammar and mask run on rank 0 alone, and a
  follower takes the same path through `Engine.generate` with a stand-in (`Unseen`). After each token rank 0
  says whether the answer goes on (`ranks.rank0_says`): a stop sequence, a finished tool call, a client gone
  or the server stopping end it there on rank 0, and every rank takes back the step it queued ahead alike.
- `done`: the gather's replies carry each follower's summary of the answer (rank 0's telemetry shows them).
- `stop`: the server stops; every follower closes its engine and exits 0.

Faults: an exception out of an engine call on rank 0 may leave its peers inside a step (mid-collective), so
the server stops (`Lockstep.broken`) and the peers stop on the lost link; a follower stops on any error of
its own, and rank 0 then on the lost link. Images reach rank 0 alone: refused across ranks.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator

import mlx.core as mx

from ...formats.errors import StreamoeError
from .. import ranks
from ..constrain import Constraint
from ..sampling import Sampler
from .prompt_cache import Item, Snapshot, capture, clear, restore


def snapshot_id(key: tuple[Item, ...]) -> str:
    """The name every rank gives the snapshot of this prompt prefix."""
    return hashlib.blake2b(repr(key).encode(), digest_size=12).hexdigest()


class Unseen:
    """A follower's stand-in for rank 0's constraint: the same path through `Engine.generate` (each token drawn
    once the previous one is read), no mask (the token every rank takes is rank 0's)."""

    active = True  # so every token is drawn once the previous one is read, as on rank 0

    def allowed(self) -> None:
        return None

    def advance(self, tok: int) -> None:
        pass


class Lockstep:
    """Rank 0's side: each engine call of a job, told to the other ranks before it is made."""

    def __init__(self, eng):
        self.eng, self.group = eng, eng.group
        self.broken: StreamoeError | None = None  # why the ranks may be out of step: the server stops
        self.lost = False  # the backend said a peer is gone

    def tell(self, op: str, **fields) -> list[bytes]:
        """Send a command; returns the followers' replies (what each had ready: a summary after `generate`). The
        followers wait for it: a peer that never answers (gone while the server idled, which the ring backend may
        not report) is the watchdog's, not a wait for ever."""
        self.eng.watchdog.tick()
        try:
            return ranks.gather_bytes(self.group, json.dumps({"op": op, **fields}).encode())[1:]
        except Exception as e:
            raise self.fail(e) from None

    @contextlib.contextmanager
    def call(self, op: str, **fields):
        """Tell the command, then run the block (the engine call itself) on this rank."""
        self.tell(op, **fields)
        try:
            yield
        except Exception as e:
            self.fail(e)
            raise

    def fail(self, e: Exception) -> StreamoeError:
        """Note an engine call that failed on rank 0: its peers may be waiting inside a step."""
        lost = ranks.lost_peer(e, self.group) if isinstance(e, RuntimeError) else None
        self.lost = self.lost or lost is not None
        self.broken = self.broken or lost or StreamoeError(
            f"{ranks.where(self.group)}: an engine call failed ({type(e).__name__}: {e}); the ranks may be out of "
            "step, so every rank stops")
        return self.broken

    def generate(self, ids: list[int], start: int, max_tokens: int, sampler: Sampler,
                 constraint: Constraint | None, stops: list[int] | None = None) -> Iterator[tuple[int, mx.array]]:
        """`Engine.generate(ids[start:], ...)` on every rank (context: ids); closing it early (a stop, a cancel)
        ends it after the same token on every rank."""
        self.tell("generate", ids=ids, start=start, max_tokens=max_tokens, sampler=sampler.params(),
                  constrained=constraint is not None, stops=stops)
        gen = self.eng.generate(ids[start:], max_tokens, sampler, context=ids, constraint=constraint, stops=stops)
        try:
            while True:
                try:
                    item = next(gen)
                except StopIteration:
                    return
                except Exception as e:
                    self.fail(e)
                    raise
                try:
                    yield item
                except GeneratorExit:
                    self.say(False)
                    raise
                self.say(True)
        finally:
            gen.close()

    def say(self, more: bool) -> None:
        try:
            ranks.rank0_says(self.group, more)
        except Exception as e:
            raise self.fail(e) from None

    def stop(self) -> None:
        """The last command: every follower closes and exits (not sent to peers that may be out of step)."""
        if self.broken is None:
            with contextlib.suppress(RuntimeError):  # a peer already gone: nothing left to stop
                self.tell("stop")


def follow(eng) -> None:
    """A follower's serving: rank 0's commands, one engine call each, until `stop`."""
    group = eng.group
    snaps: dict[str, Snapshot] = {}
    reply = b""
    while True:
        eng.watchdog.idle()  # the next request may come hours later: only a step waits on its peers
        cmd = json.loads(ranks.gather_bytes(group, reply)[0])
        op, reply = cmd["op"], b""
        if op == "stop":
            return
        if op == "begin":
            del eng.steps[:]
            if cmd["restore"] is None:
                clear(eng)
            elif cmd["restore"] in snaps:
                restore(eng, snaps[cmd["restore"]])
            else:
                raise StreamoeError(f"{ranks.where(group)}: rank 0 restored a snapshot this rank never took")
        elif op == "prefill":
            eng.prefill(cmd["ids"])
        elif op == "capture":
            for name in set(snaps) - set(cmd["keep"]):  # what rank 0 evicted goes first: the same LRU order
                del snaps[name]
            if cmd["id"] in cmd["keep"]:
                snaps[cmd["id"]] = capture(eng, ())
        elif op == "generate":
            ids = cmd["ids"]
            gen = eng.generate(ids[cmd["start"]:], cmd["max_tokens"], Sampler(**cmd["sampler"]), context=ids,
                               constraint=Unseen() if cmd["constrained"] else None, stops=cmd["stops"])
            with contextlib.closing(gen):
                for _ in gen:
                    if not ranks.rank0_says(group, False):
                        break
            reply = json.dumps(rank_summary(eng)).encode()


def rank_summary(eng) -> dict:
    """What rank 0's telemetry shows of one rank's answer: its expert reads and hit rate."""
    s = eng.summary(eng.steps)
    return {"rank": eng.opts.rank, "mib_read_token": s["mib_read_token"], "hit_rate": s["hit_rate"],
            "prefill_mib_token": s["prefill_mib_token"], "bytes_read": sum(st.bytes_read for st in eng.steps),
            "peak_gib": s["peak_gib"], "cap_gib": s["cap_gib"]}
