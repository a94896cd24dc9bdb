"""Expert parallelism across ranks (`mx.distributed`, started by `mlx.launch`): each rank holds a share of every
layer's routed experts inside its own cap, and every rank runs the dense trunk.

The share: rank r of N holds experts e with e % N == r (`plan.share_of`). Strided, not contiguous blocks: the
owner and the local index of a pick are one modulo and one division on the device, for any E and N, and the
shares differ by at most one expert. Which experts a router favours has nothing to do with their ids, so a
block split balances no better. Locally the share is experts 0..E_r-1 (local j is expert r + j N): the rank's
`StreamingExperts` plans, reads (only its records of each layer file: `ExpertStore(share=...)`), caches and
prefetches over them exactly as a single host does over all of them.

Per MoE layer (`RankExperts`, the provider the model calls): each rank computes the picks it owns into a
[tokens, k, H] buffer in router-rank order, one `all_gather` gives every rank every buffer, and each (token,
pick) takes its row from its owner's buffer (a select, never a sum), so every rank holds the very rows one
host would have computed and combines them as one host does: the logits are bit-identical to a single host at
any caps. Rank 0's sampled token is shared (`shared_token`), so every rank feeds the same tokens. Every rank
must compute the same trunk bit for bit (the same MLX, backend and dtype), since each routes on its own.

Faults: a rank that cannot open makes every rank stop at open with one line naming it (`open_together`, a
collective before the first step); a peer that is lost mid-run is a RuntimeError from the backend
(`lost_peer`), and a peer that hangs trips the watchdog (`Watchdog`) after `STREAMOE_RANK_TIMEOUT` seconds
without a layer's exchange.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable

import mlx.core as mx
import numpy as np

from ..formats.errors import StreamoeError

Group = mx.distributed.Group
RANK_TIMEOUT = float(os.environ.get("STREAMOE_RANK_TIMEOUT", "300"))  # seconds a step may wait on its peers


@functools.cache
def find_group() -> Group | None:
    """The group `mlx.launch` started this process in; None when it runs alone (a group of one is the
    single-host engine, unchanged). One per process: the command's checks and its engine ask the same."""
    g = mx.distributed.init()
    return g if g.size() > 1 else None


def _stream():
    """Where a collective runs: the CPU stream on Metal (ring and jaccl move host memory, and MLX's Metal
    backend may have no GPU form of them), the default stream elsewhere (nccl runs on the CUDA stream)."""
    return mx.cpu if mx.metal.is_available() else None


def gather_bytes(group: Group, data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (two all_gathers: the lengths, then the padded bytes)."""
    s = _stream()
    lengths = mx.distributed.all_gather(mx.array([len(data)], dtype=mx.int32), group=group, stream=s).tolist()
    buf = np.zeros(max(1, max(lengths)), dtype=np.uint8)
    buf[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    got = np.array(mx.distributed.all_gather(mx.array(buf)[None], group=group, stream=s))
    return [got[r, :n].tobytes() for r, n in enumerate(lengths)]


def from_rank0(group: Group, text: str | None) -> str | None:
    """Rank 0's `text` (a chat turn; None: the chat ends) on every rank; the others pass anything."""
    sent = gather_bytes(group, json.dumps({"text": text}).encode() if group.rank() == 0 else b"")[0]
    return json.loads(sent)["text"]


def where(group: Group) -> str:
    return f"rank {group.rank()} of {group.size()} on {socket.gethostname()}"


def open_together(group: Group, open_: Callable[[], None], close: Callable[[], None]) -> None:
    """Open on every rank, then agree: if any rank failed, every rank stops here (rank 0 says which rank, on
    which host, and why, in one line; the others exit 2 silently), before any step could wait on it."""
    error = ""
    try:
        open_()
    except StreamoeError as e:
        error = str(e)
    except OSError as e:
        from ..formats.files import os_fail

        error = str(os_fail("(unknown path)", e))
    told = [json.loads(b) for b in gather_bytes(group, json.dumps({"where": where(group), "error": error}).encode())]
    failed = [t for t in told if t["error"]]
    if not failed:
        return
    if not error:
        close()
    if group.rank() != 0:
        raise SystemExit(2)
    first = failed[0]
    more = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
    raise StreamoeError(f"{first['where']} could not open: {first['error']}{more}")


def same_work(group: Group, work: dict[str, object]) -> None:
    """Stop every rank where one was started with other settings or work than rank 0 (`work`, by the option that
    sets each: the model, --kv, --dtype and --ctx at open; -n, the prompt... before an answer). Every rank computes
    the trunk and ends an answer by itself, so a rank that differs gives other rows without a word, or stops
    exchanging while the others wait, or pairs an exchange of theirs with one of another shape: garbage, not an
    error. Rank 0 says which rank and what differs, in one line; the others exit 2 silently."""
    told = [json.loads(b) for b in gather_bytes(group, json.dumps({"where": where(group), "work": work}).encode())]
    rank0 = told[0]["work"]
    odd = next((t for t in told if t["work"] != rank0), None)
    if odd is None:
        return
    if group.rank() != 0:
        raise SystemExit(2)
    theirs = odd["work"]
    what = "; ".join(f"{k} {theirs.get(k)}, not {rank0.get(k)}" for k in sorted(rank0.keys() | theirs.keys())
                     if theirs.get(k) != rank0.get(k))
    raise StreamoeError(f"{odd['where']} differs from rank 0 ({what}): start every rank with the same command "
                        "(mlx.launch does)")


def all_agree(group: Group, flag: bool) -> bool:
    """Whether `flag` holds on every rank (e.g. every share resident, so every rank pipelines its steps alike)."""
    n = mx.distributed.all_sum(mx.array(int(flag), dtype=mx.int32), group=group, stream=_stream()).item()
    return n == group.size()


def smallest(group: Group, n: int) -> int:
    """The smallest `n` of every rank (e.g. the prefill chunk: every rank must cut a prompt alike)."""
    return int(mx.distributed.all_min(mx.array(n, dtype=mx.int32), group=group, stream=_stream()).item())


def rank0_says(group: Group, flag: bool) -> bool:
    """Rank 0's `flag` on every rank (the others pass anything): e.g. whether an answer goes on after a token."""
    mine = int(flag) if group.rank() == 0 else 0
    return mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group, stream=_stream()).item() > 0


def shared_token(token: mx.array, group: Group) -> mx.array:
    """Rank 0's token on every rank (lazy: the pipelined loop queues the next step from it)."""
    mine = mx.where(mx.array(group.rank() == 0), token, mx.zeros_like(token))
    return mx.distributed.all_sum(mine, group=group, stream=_stream())


def lost_peer(e: RuntimeError, group: Group) -> StreamoeError | None:
    """The one line for a backend error that says a peer is gone; None for any other RuntimeError."""
    text = str(e)
    if "[ring]" in text or "[jaccl]" in text or "NCCL" in text or "MPI" in text:
        return StreamoeError(f"{where(group)}: lost its peer ranks ({text.strip()}); every rank stops")
    return None


class Watchdog:
    """Ends the process with one line when a step waits on its peers longer than `timeout` seconds (a peer
    that hangs, or a link that stalls without closing): `tick()` at every exchange, `idle()` between answers."""

    def __init__(self, group: Group, timeout: float = RANK_TIMEOUT):
        self.group, self.timeout, self.last, self.armed = group, timeout, time.monotonic(), False
        self.stop = threading.Event()
        threading.Thread(target=self._watch, name="streamoe-rank-watchdog", daemon=True).start()

    def tick(self) -> None:
        self.last, self.armed = time.monotonic(), True

    def idle(self) -> None:
        self.armed = False

    def _watch(self) -> None:
        while not self.stop.wait(min(1.0, self.timeout / 4)):
            if self.armed and time.monotonic() - self.last > self.timeout:
                print(f"streamoe: error: {where(self.group)}: no exchange with its peer ranks for {self.timeout:.0f} s "
                      "(a rank hung or its link stalled; STREAMOE_RANK_TIMEOUT sets the limit); every rank stops",
                      file=sys.stderr, flush=True)
                os._exit(2)

    def close(self) -> None:
        self.stop.set()


def local_router(router_logits: Callable[[int, mx.array], mx.array], share: list[int]) -> Callable:
    """Layer i's router logits over this rank's share alone (local expert j is share[j]): what the provider's
    cross-layer guesses rank, so a rank only ever reads ahead its own experts."""
    ids = mx.array(share, dtype=mx.uint32)

    def logits(i: int, x: mx.array) -> mx.array:
        return mx.take(router_logits(i, x), ids, axis=-1)

    return logits


class RankExperts:
    """The experts provider across ranks: `experts(i, x, inds)` -> layer i's picks' outputs [..., k, H], every
    pick's row computed by the rank that owns it (`inner`, a `StreamingExperts` over this rank's share) and
    gathered. One `all_gather` per MoE layer and kernel call."""

    def __init__(self, inner, group: Group, n_experts: int, watchdog: Watchdog | None = None):
        self.inner, self.group, self.watchdog = inner, group, watchdog
        self.rank, self.size = group.rank(), group.size()
        self.n_local = len(range(self.rank, n_experts, self.size))
        self.blocks: list[mx.array | None] = []  # prefill: each block's local picks, in block order (`prepare`)

    def _local(self, rows: list[list[int]], fill: int) -> mx.array:
        """Local indices of picks in rows (global ids); another rank's pick takes `fill`, an expert this layer
        lands anyway: its row is computed and never taken."""
        n, r = self.size, self.rank
        return mx.array([[e // n if e % n == r else fill for e in row] for row in rows], dtype=mx.uint32)

    def prepare(self, i: int, inds: list[mx.array], xs: Iterable[mx.array]) -> None:
        """Prefill: every block's picks of layer i; this rank lands its own (once for all the blocks)."""
        if self.inner.resident:
            return
        mx.eval(inds)
        rows = [a.reshape(-1, a.shape[-1]).tolist() for a in inds]
        mine = sorted({e // self.size for b in rows for row in b for e in row if e % self.size == self.rank})
        if not mine:
            self.inner.skip(i)
            self.blocks = [None] * len(inds)
            return
        self.blocks = [self._local(b, mine[0]) for b in rows]
        self.inner.prepare(i, self.blocks, xs)

    def __call__(self, i: int, x: mx.array, inds: mx.array) -> mx.array:
        shape, k = x.shape, inds.shape[-1]
        xf, g = x.reshape(-1, shape[-1]), inds.reshape(-1, k)
        if self.inner.resident:  # every local expert is in a slot: another rank's pick computes a row never taken
            y = self.inner(i, xf, mx.minimum(g // self.size, self.n_local - 1).astype(mx.uint32))
        elif self.blocks:
            local = self.blocks.pop(0)
            y = mx.zeros((*g.shape, shape[-1]), dtype=x.dtype) if local is None else self.inner(i, xf, local)
        else:
            y = self._owned(i, xf, g)
        if self.watchdog is not None:
            self.watchdog.tick()
        gathered = mx.distributed.all_gather(y[None], group=self.group, stream=_stream())  # [ranks, N, k, H]
        owner = (g % self.size)[..., None]
        out = gathered[0]
        for r in range(1, self.size):
            out = mx.where(owner == r, gathered[r], out)
        return out.reshape(*shape[:-1], k, shape[-1])

    def _owned(self, i: int, x: mx.array, g: mx.array) -> mx.array:
        """A decode step's [N, k, H]: this rank's picks computed (a single token: only those), zeros elsewhere."""
        mx.eval(g)  # the picks: the provider's own fence would wait for them too
        rows = g.tolist()
        N, k, H = len(rows), len(rows[0]), x.shape[-1]
        cols = [j for j, e in enumerate(rows[0]) if e % self.size == self.rank] if N == 1 else None
        if cols is not None and len(cols) < k:
            if not cols:
                self.inner.skip(i)
                return mx.zeros((N, k, H), dtype=x.dtype)
            y = self.inner(i, x, mx.array([[rows[0][j] // self.size for j in cols]], dtype=mx.uint32))
            back = [cols.index(j) if j in cols else len(cols) for j in range(k)]  # a zero row for the others'
            return mx.concatenate([y, mx.zeros((1, 1, H), dtype=y.dtype)], axis=1)[:, mx.array(back)]
        mine = sorted({e // self.size for row in rows for e in row if e % self.size == self.rank})
        if not mine:
            self.inner.skip(i)
            return mx.zeros((N, k, H), dtype=x.dtype)
        return self.inner(i, x, self._local(rows, mine[0]))


def rank_summaries(group: Group, summary: dict) -> list[dict]:
    """Every rank's answer summary (`telemetry.summarize`), in rank order."""
    return [json.loads(b) for b in gather_bytes(group, json.dumps(summary).encode())]


def ranks_line(summaries: list[dict]) -> str:
    """What rank 0's summary line adds: each rank's expert reads and hit rate."""
    return "ranks: " + ", ".join(f"{r}: {s['mib_read_token']:.2f} MiB read/token, hit rate {100 * s['hit_rate']:.1f}%"
                                 for r, s in enumerate(summaries))


def gather_steps(group: Group, records: list[dict]) -> list[dict]:
    """Every rank's step records (each carrying its `rank`), rank 0's first: what rank 0's --stats file holds."""
    lines = gather_bytes(group, "\n".join(json.dumps(r) for r in records).encode())
    return [json.loads(ln) for b in lines for ln in b.decode().splitlines() if ln]
