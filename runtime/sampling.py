"""Choosing the next token on the device: penalties, temperature, top-k, top-p, min-p, a seeded draw.

Everything runs as MLX operations on the logits where the model left them, so a decode step can be queued
from a sampled token before the host has seen it, exactly as from a greedy one, and the only transfer per
token is the chosen id. Top-k needs no sort of the vocabulary: the k largest logits lie in the k blocks with
the largest maxima (a logit outside those blocks has k blocks' maxima above it), so the vocabulary is cut in
blocks of `BLOCK`, the k best blocks are kept, and only their `k * BLOCK` logits are partitioned. Only top-p
without top-k sorts the whole vocabulary. A draw with top-k is one compiled function (`_top_k_draw`): on a GPU
each kernel costs the host its encoding, and a decode step's sampler would otherwise add some 40 kernels to a
greedy step's one; without penalties or a bias (a grammar's mask included) the logits stay in the model's dtype
until the k are chosen (a float's widening keeps its order, so the same k are chosen).

Each draw's key comes from the seed and the number of tokens drawn before it (`Sampler.drawn`), so a seed
gives the same tokens at every cap, prefetch width and tier policy (the logits are the same bits), in a
pipelined or a step-by-step loop, and a saved conversation goes on drawing where it stopped.

Order, as vLLM's sampler applies them: OpenAI's `logit_bias` (added to the chosen ids' logits, greedy or not;
-100 bans a token); then the repetition, presence and frequency penalties; then temperature, min-p (against the
most likely token), top-k, and top-p over what min-p and top-k left, renormalised (vLLM's form: the least likely
tokens dropped while their mass, summed from the least likely up, is at most 1 - top_p); then the draw. The
repetition penalty (transformers' form: a positive logit divided by it, a negative one multiplied) counts the
prompt and the answer; the presence and frequency penalties (OpenAI's form) count the answer. Top-k keeps k
tokens, a tie at the k-th broken by position (mlx-lm's form; vLLM keeps every token tied with the k-th).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import mlx.core as mx

from ..formats.errors import StreamoeError

BLOCK = 256
SMALLEST_TEMP = 1 / float.fromhex("0x1.fffffep+127")  # below it 1/temp overflows float32: such a temperature is greedy
MASK = 2**64 - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: neighbouring (seed, draw) pairs give unrelated keys."""
    x = (x + 0x9E3779B97F4A7C15) & MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK
    return x ^ (x >> 31)


@dataclass
class Penalties:
    """What a penalised draw carries on the device from token to token; None where no penalty asks for it."""

    counts: mx.array | None = None  # [V] float32: times each token occurs in the answer so far
    debt: mx.array | None = None  # [V] float32: what presence and frequency take off each logit
    seen: mx.array | None = None  # uint32 ids of the prompt's distinct tokens, then the answer's (repeats allowed)


class Sampler:
    """Greedy when temp == 0 (or below `SMALLEST_TEMP`); else a seeded draw from the filtered distribution."""

    def __init__(self, temp: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                 presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repetition_penalty: float = 1.0,
                 seed: int = 0, logit_bias: dict[int, float] | list | None = None):
        checks = [(temp, temp >= 0, "--temp must be >= 0"), (top_p, 0 < top_p <= 1, "--top-p must be in (0, 1]"),
                  (top_k, top_k >= 0, "--top-k must be >= 0"), (min_p, 0 <= min_p <= 1, "--min-p must be in [0, 1]"),
                  (presence_penalty, -2 <= presence_penalty <= 2, "--presence-penalty must be in [-2, 2]"),
                  (frequency_penalty, -2 <= frequency_penalty <= 2, "--frequency-penalty must be in [-2, 2]"),
                  (repetition_penalty, 0 < repetition_penalty <= 10, "--repetition-penalty must be in (0, 10]")]
        for value, ok, msg in checks:  # nan fails every comparison, so it is refused by its own flag's check
            if not ok or not math.isfinite(value):
                raise StreamoeError(msg)
        self.temp, self.top_p, self.top_k, self.min_p = float(temp), float(top_p), int(top_k), float(min_p)
        self.presence, self.frequency = float(presence_penalty), float(frequency_penalty)
        self.repetition = float(repetition_penalty)
        self.seed, self.drawn = int(seed) & MASK, 0
        self.bias = sorted((int(t), float(b)) for t, b in dict(logit_bias or {}).items())  # OpenAI's logit_bias
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.bias):
            raise StreamoeError("logit_bias: token ids must be >= 0 and biases in [-100, 100]")
        self._bias: tuple[mx.array, mx.array] | None = None
        self._filters: tuple[mx.array, mx.array, mx.array] | None = None

    @property
    def greedy(self) -> bool:
        return self.temp < SMALLEST_TEMP

    @property
    def penalised(self) -> bool:
        return bool(self.presence or self.frequency or self.repetition != 1.0)

    def params(self) -> dict:
        """The arguments that make this sampler anew: what another rank needs to draw as this one does."""
        return {"temp": self.temp, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "presence_penalty": self.presence, "frequency_penalty": self.frequency,
                "repetition_penalty": self.repetition, "seed": self.seed, "logit_bias": [list(p) for p in self.bias]}

    # ---- state a conversation keeps
    def state(self) -> dict:
        return {"seed": self.seed, "drawn": self.drawn}

    def restore(self, state: dict) -> None:
        self.seed, self.drawn = int(state["seed"]) & MASK, int(state["drawn"])

    # ---- one answer
    def start(self, context: list[int], vocab: int) -> Penalties:
        """The penalties' state at the start of an answer whose prompt (all of it, cached or not) is `context`."""
        pen = Penalties()
        if self.presence or self.frequency:
            pen.counts, pen.debt = mx.zeros((vocab,), mx.float32), mx.zeros((vocab,), mx.float32)
        if self.repetition != 1.0:
            pen.seen = mx.array(sorted({t for t in context if 0 <= t < vocab}), mx.uint32)
        return pen

    def __call__(self, logits: mx.array, pen: Penalties, drawn: int,
                 allowed: mx.array | None = None) -> tuple[mx.array, Penalties]:
        """The next token (a lazy uint32 scalar) from logits [V], the `drawn`-th draw of this sampler, among the
        `allowed` tokens ([V] bool, a grammar's; None: all), and the penalties' state with it added. Nothing
        here waits for the device."""
        x = logits
        if self.bias:
            if self._bias is None:
                self._bias = (mx.array([t for t, _ in self.bias], mx.uint32), mx.array([b for _, b in self.bias], mx.float32))
            x = x.astype(mx.float32).at[self._bias[0]].add(self._bias[1])
        x = self._penalise(x, pen)
        if allowed is not None:
            x = mx.where(allowed, x, -math.inf)
        tok = (mx.argmax(x) if self.greedy else self._draw(x, drawn)).astype(mx.uint32)
        nxt = Penalties()
        if pen.counts is not None:
            first = (pen.counts[tok] == 0).astype(mx.float32)
            nxt.debt = pen.debt.at[tok].add(self.frequency + self.presence * first)
            nxt.counts = pen.counts.at[tok].add(1.0)
        if pen.seen is not None:
            nxt.seen = mx.concatenate([pen.seen, tok.reshape(1)])
        return tok, nxt

    def _penalise(self, x: mx.array, pen: Penalties) -> mx.array:
        """Repetition on the ids seen (gathered and scattered back: a repeated id gets the same value), then the
        presence and frequency debt, in float32; a few kernels over the vocabulary at most, none without them."""
        if pen.seen is not None or pen.debt is not None:
            x = x.astype(mx.float32)
        if pen.seen is not None and pen.seen.size:
            g, r = x[pen.seen], self.repetition
            x = (x.at[pen.seen].minimum(mx.minimum(g / r, g * r)) if r > 1
                 else x.at[pen.seen].maximum(mx.maximum(g / r, g * r)))
        if pen.debt is not None:
            x = x - pen.debt
        return x

    def _draw(self, x: mx.array, drawn: int) -> mx.array:
        key = mx.random.key(_mix(self.seed ^ _mix(drawn)))
        if self._filters is None:  # the settings as arrays, so one compiled draw serves every temperature
            self._filters = (mx.array(1.0 / self.temp, mx.float32), mx.array(math.log(self.min_p) if self.min_p else 0.0,
                             mx.float32), mx.array(self.top_p, mx.float32))
        if self.top_k:
            return _top_k_draw(self.top_k, self.min_p > 0, self.top_p < 1)(x, key, *self._filters)
        z = x.astype(mx.float32)
        ids = None
        if self.top_p < 1:  # no top-k: the one case that sorts the vocabulary
            ids = mx.argsort(-z)
            z = z[ids]
        return _filtered_draw(z, key, *self._filters, self.min_p > 0, self.top_p < 1, ids)


def _filtered_draw(z: mx.array, key: mx.array, inv_temp: mx.array, log_min_p: mx.array, top_p: mx.array,
                   min_p: bool, nucleus: bool, ids: mx.array | None) -> mx.array:
    """Temperature, min-p and (z sorted largest first) top-p over what min-p left, on float32 logits z, then the
    seeded draw: an id of z, or of `ids` where z holds the logits of those ids."""
    z = (z - z.max()) * inv_temp  # max first: a tiny temperature sends the rest to -inf, never nan
    keep = z >= log_min_p if min_p else None
    if nucleus:
        p = mx.softmax(z if keep is None else mx.where(keep, z, -math.inf))
        # the tail of mass at most 1 - top_p dropped, summed from its least likely token up as vLLM sums it; the
        # most likely token (z 0) kept whatever the rounding
        inside = (mx.cumsum(p, reverse=True) > 1 - top_p) | (z == 0)
        keep = inside if keep is None else keep & inside
    if keep is not None:
        z = mx.where(keep, z, -math.inf)
    choice = mx.random.categorical(z, key=key)
    return choice if ids is None else ids[choice]


@functools.lru_cache(maxsize=64)
def _top_k_draw(k: int, min_p: bool, nucleus: bool):
    """The draw from the k largest logits as one compiled function of (logits, key, 1/temp, log min-p, top-p):
    the elementwise steps fused, no kernel for what is known when it is traced."""
    def draw(x, key, inv_temp, log_min_p, top_p):
        ids, v = top_k(x, k)
        return _filtered_draw(v.astype(mx.float32), key, inv_temp, log_min_p, top_p, min_p, nucleus, ids)
    return mx.compile(draw)


def top_k(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """(ids, logits) of the k largest of x [V], largest first, partitioning `k * BLOCK` of them at most."""
    V = x.shape[0]
    k = min(k, V)
    if k * BLOCK * 2 > V:
        ids = mx.argpartition(x, V - k)[V - k:]
        v = x[ids]
    else:
        pad = -V % BLOCK  # a pad's id is never drawn: its logit is -inf
        xb = (mx.concatenate([x, mx.full((pad,), -math.inf, x.dtype)]) if pad else x).reshape(-1, BLOCK)
        best = mx.argpartition(xb.max(axis=1), xb.shape[0] - k)[-k:]
        cand = xb[best].reshape(-1)  # the k best blocks' logits, block after block
        at = mx.argpartition(cand, cand.size - k)[-k:]
        v = cand[at]
        ids = best[at // BLOCK] * BLOCK + at % BLOCK
    order = mx.argsort(v)[::-1]
    return ids[order], v[order]
