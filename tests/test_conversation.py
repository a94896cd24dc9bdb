"""Caches own their state (`runtime/models/cache.py`) and one `Conversation` holds them: what a cache gives as its
state restores, into a fresh cache of the same shape, to the same bytes and the same next outputs, whole or a
head at a time; a mark rewinds; clear equals a new cache. Real MLX arrays, no model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from streamoe.runtime.conversation import Conversation, from_host, host_view
from streamoe.runtime.models.cache import GDNCache, KVCache, QuantizedKVCache

B, NKV, HD, MAX = 2, 2, 64, 32


def caches(kv: str) -> list:
    """A GDN layer and an attention layer, as a model's make_cache gives them."""
    gdn = GDNCache(B, 4, 48, 4, 16, 8, dtype=mx.bfloat16)
    if kv == "float16":
        att = KVCache(B, NKV, HD, MAX, dtype=mx.float16)
    else:
        att = QuantizedKVCache(B, NKV, HD, MAX, int(kv[1:]), dtype=mx.bfloat16)
    return [gdn, att]


def feed(cs: list, n: int, seed: int) -> list[mx.array]:
    """n tokens into each cache as its layer would write them; returns what attention reads."""
    key = mx.random.key(seed)
    gdn, att = cs
    gdn.conv = mx.random.normal(gdn.conv.shape, key=key).astype(gdn.conv.dtype)
    gdn.state = gdn.state * 0.5 + mx.random.normal(gdn.state.shape, key=key)
    gdn.offset += n
    k, v = (mx.random.normal((B, NKV, n, HD), key=mx.random.split(key)[j]) for j in range(2))
    out = att.update_and_fetch(k, v)
    flat = [a for group in out for a in (group if isinstance(group, tuple) else (group,))]
    mx.eval(flat, gdn.conv, gdn.state)
    return flat


def held(conv: Conversation) -> list[tuple[str, bytes]]:
    return [(t.name, np.array(host_view(t.array)).tobytes()) for t in conv.tensors()]


@pytest.mark.parametrize("kv", ["float16", "q8", "q4"])
@pytest.mark.parametrize("by_head", [False, True])
def test_state_restores_to_the_same_bytes_and_next_outputs(kv, by_head):
    a = Conversation(caches(kv))
    feed(a.caches, 5, 1)
    a.offset, a.rope_delta = 5, -2
    saved = held(a)
    assert [n for n, _ in saved] == ["layers.0.conv", "layers.0.state"] + [f"layers.1.{f}" for f in a.caches[1].fields]
    specs = a.specs(5)
    assert [(s.name, s.per_position) for s in specs] == [(t.name, t.per_position) for t in a.tensors()]
    assert sum(len(b) for _, b in saved) == a.nbytes()
    assert all(s.shape == tuple(t.array.shape) and s.dtype == t.array.dtype for s, t in zip(specs, a.tensors(), strict=True))

    b = Conversation(caches(kv))
    for t in a.tensors():
        host = np.array(host_view(t.array))
        if by_head and t.per_position:
            for i in range(host.shape[0]):
                for h in range(host.shape[1]):
                    b.restore(t.name, from_host(host[i, h], t.array.dtype), at=(i, h))
        else:
            b.restore(t.name, from_host(host, t.array.dtype))
    b.resume(5, -2)
    assert held(b) == saved and (b.offset, b.rope_delta) == (5, -2)
    assert all(c.offset == 5 for c in b.caches)
    nxt_a, nxt_b = feed(a.caches, 3, 2), feed(b.caches, 3, 2)
    assert all(np.array_equal(np.array(host_view(x)), np.array(host_view(y))) for x, y in zip(nxt_a, nxt_b, strict=True))


def test_a_mark_rewinds_and_clear_is_a_new_conversation():
    conv = Conversation(caches("q4"))
    feed(conv.caches, 4, 3)
    conv.offset = 4
    before, mark = held(conv), conv.mark()
    feed(conv.caches, 2, 4)
    conv.offset = 6
    assert held(conv) != before
    conv.rewind(mark)
    assert held(conv) == before and conv.offset == 4 and [c.offset for c in conv.caches] == [4, 4]

    conv.clear()
    fresh = Conversation(caches("q4"))
    assert held(conv) == held(fresh) and (conv.offset, conv.rope_delta) == (0, 0)
    assert [c.offset for c in conv.caches] == [0, 0]
