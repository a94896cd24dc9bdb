"""A conversation's state: every layer's cache, the tokens they hold (`offset`) and the M-RoPE delta.

It is what a session file (`session.py`) and a prompt-cache snapshot (`prompt_cache.py`) save and restore, what
the engine advances, marks and rewinds (a step queued ahead for a token that ends the answer is taken back),
and what the server reads (how many tokens are in context). Each cache owns its own state
(`runtime/models/cache.py`: `state_tensors`, `state_specs`, `restore`, `mark`/`rewind`, `clear`); this object
names the tensors `layers.{i}.{field}`, the names a session file holds.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import numpy as np


class StateTensor(NamedTuple):
    name: str  # layers.{i}.{field}
    array: mx.array  # as held, a position-major one cut to the offset
    per_position: bool  # [B, heads, positions, d]: saved and restored a head at a time


class TensorSpec(NamedTuple):
    name: str
    dtype: mx.Dtype
    shape: tuple[int, ...]
    per_position: bool


class Mark(NamedTuple):
    offset: int
    caches: list


class Conversation:
    """The per-layer caches of one conversation, its token count and M-RoPE delta (position minus offset:
    images advance positions by less than their tokens)."""

    def __init__(self, caches: list):
        self.caches = caches
        self.offset = 0
        self.rope_delta = 0

    def tensors(self) -> list[StateTensor]:
        """Every state tensor the conversation holds now, in layer order, then each cache's field order."""
        return [StateTensor(f"layers.{i}.{f}", a, c.per_position)
                for i, c in enumerate(self.caches) for f, a in c.state_tensors()]

    def specs(self, n: int) -> list[TensorSpec]:
        """What `tensors()` holds when the conversation has n tokens, tensor by tensor."""
        return [TensorSpec(f"layers.{i}.{f}", dtype, shape, c.per_position)
                for i, c in enumerate(self.caches) for f, dtype, shape in c.state_specs(n)]

    def nbytes(self) -> int:
        """The bytes of `tensors()` now, known without evaluating them."""
        return sum(int(np.prod(s.shape)) * s.dtype.size for s in self.specs(self.offset))

    def restore(self, name: str, value: mx.array, at: tuple[int, ...] = ()) -> None:
        """Put tensor `name` back (whole, or the head `at` of a per-position one); `resume` once all are back."""
        _, layer, field = name.split(".")
        self.caches[int(layer)].restore(field, value, at)

    def resume(self, offset: int, rope_delta: int) -> None:
        """After every tensor is restored: the conversation holds `offset` tokens."""
        for c in self.caches:
            c.offset = offset
        self.offset, self.rope_delta = offset, rope_delta

    def mark(self) -> Mark:
        return Mark(self.offset, [c.mark() for c in self.caches])

    def rewind(self, mark: Mark) -> None:
        """Back to `mark()`: what was fed since is forgotten."""
        self.offset = mark.offset
        for c, m in zip(self.caches, mark.caches, strict=True):
            c.rewind(m)

    def clear(self) -> None:
        """An empty conversation in the same caches (no reallocation: a KV cache is only rewound)."""
        for c in self.caches:
            c.clear()
        self.offset, self.rope_delta = 0, 0


def host_view(a: mx.array) -> np.ndarray:
    """A numpy view of an evaluated MLX array (bf16 through its bits, which numpy has no type for)."""
    return np.asarray(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)


def from_host(host: np.ndarray, dtype: mx.Dtype) -> mx.array:
    """The MLX array of `host_view`'s bytes, as `dtype`."""
    a = mx.array(host)
    return a.view(mx.bfloat16) if dtype == mx.bfloat16 else a
