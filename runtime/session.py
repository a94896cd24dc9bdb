"""Save and restore a conversation's state: every layer's cache, the token count and M-RoPE delta, and what
the caller keeps beside them (token history, chat messages, sampler state). A restored engine continues
with bit-identical logits because it holds exactly the bytes the saved one held; the hot tier is not
saved, since logits do not depend on what is resident.

The byte layout is `formats.session`'s; this module maps the engine's `Conversation` onto it (its tensors by
name, `layers.{i}.{field}`), a block at a time, so saving or loading a long context never holds more than one
head's keys beside the cache itself.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..formats.dtypes import COMPUTE, DTYPES
from ..formats.errors import fail
from ..formats.session import SessionReader, header_limit, write_session
from .conversation import Conversation, StateTensor, TensorSpec, from_host, host_view
from .plan import kv_format
from .sampling import Sampler
from .weights import code_of


def fingerprint(eng) -> dict:
    """What a saved state is valid for: the same model (its config and the checksums of the weights this run
    reads, so a retrained model of the same shape does not match), expert format and dtypes."""
    m = eng.manifest
    weights = [m.blob("nonexpert")[0]["checksum"]] + [f["checksum"] for f in m.expert_formats()[eng.opts.experts].files]
    ident = json.dumps([m.config, weights], sort_keys=True).encode()
    return {"model": hashlib.sha256(ident).hexdigest()[:16], "experts": eng.opts.experts,
            "dtype": code_of(eng.dtype), "kv": kv_format(eng.opts)}


def _bytes(a: mx.array) -> np.ndarray:
    return np.ascontiguousarray(host_view(a)).reshape(-1).view(np.uint8)


def _blocks(tensors: list[StateTensor]) -> Iterator[np.ndarray]:
    for t in tensors:
        if t.per_position:  # the tokens held, head by head
            for b in range(t.array.shape[0]):
                for h in range(t.array.shape[1]):
                    yield _bytes(t.array[b, h])
        else:
            yield _bytes(t.array)


def save_session(eng, path: str | Path, extra: dict, locked: bool = False) -> int:
    """Write the engine's conversation state and `extra` (JSON-able) to `path` (`locked`: the caller holds its
    `session_lock`); returns the file size."""
    conv: Conversation = eng.conversation
    tensors = conv.tensors()
    mx.eval([t.array for t in tensors])
    meta = {**fingerprint(eng), "tokens": conv.offset, "rope_delta": conv.rope_delta, "extra": extra}
    return write_session(path, meta, [(t.name, code_of(t.array.dtype), tuple(t.array.shape)) for t in tensors],
                         _blocks(tensors), locked=locked)


def load_session(eng, path: str | Path) -> dict:
    """Replace the engine's state by the saved one (checked against this engine first); returns `extra`."""
    path = Path(path)
    with SessionReader(path, header_limit(eng.opts.ctx)) as r:
        meta = r.meta
        mine = fingerprint(eng)
        for key, what in (("experts", "expert format (--experts)"), ("dtype", "compute dtype (--dtype)"),
                          ("kv", "KV cache format (--kv)"), ("model", "model or weights")):
            if meta.get(key) != mine[key]:
                said = {v: k for k, v in COMPUTE.items()} if key == "dtype" else {}  # as the flag says it: bfloat16
                raise fail(path, f"saved with a different {what}: the session's {said.get(meta.get(key), meta.get(key))}, "
                                 f"this run's {said.get(mine[key], mine[key])}")
        n = int(meta["tokens"])
        if n > eng.opts.ctx:
            raise fail(path, f"the session holds {n} tokens, more than the planned context --ctx {eng.opts.ctx}")
        extra = check_extra(path, meta.get("extra", {}), n, eng.args.vocab_size)
        eng.reset()
        conv: Conversation = eng.conversation
        want = {s.name: s for s in conv.specs(n)}
        if [t.name for t in r.tensors] != list(want):
            raise fail(path, "its tensors are not this model's layer states")
        try:
            for t in r.tensors:
                s = want[t.name]
                if t.shape != s.shape or t.dtype != code_of(s.dtype):
                    raise fail(path, f"tensor {t.name!r} is {t.dtype}{list(t.shape)}, this engine needs "
                                     f"{code_of(s.dtype)}{list(s.shape)}")
                _fill(conv, s, r)
            r.finish()
        except BaseException:
            eng.reset()  # never a half-restored state: an empty conversation instead
            raise
    conv.resume(n, int(meta["rope_delta"]))
    return extra


def check_extra(path: Path, extra: dict, n: int, vocab: int) -> dict:
    """What `streamoe run` keeps beside the state of `n` tokens (raw flag, messages, token history, the answer's
    final token a full context left out of the state, sampler), typed before it is used: a session file is input
    like any other. A history holds no more than the state's tokens and the unfed one (fewer where an image's one
    pad stands for its run of tokens)."""
    for flag in ("raw", "think"):
        if flag in extra and not isinstance(extra[flag], bool):
            raise fail(path, f"session '{flag}' must be true or false")
    msgs = extra.get("messages", [])
    if not isinstance(msgs, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str | list) for m in msgs):
        raise fail(path, "session 'messages' must be a list of {role, content} objects")
    toks, unfed = extra.get("tokens", []), extra.get("unfed", [])
    held = n + bool(unfed)  # the history holds an unfed token beyond what the state holds
    if not isinstance(toks, list) or len(toks) > held or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in toks):
        raise fail(path, f"session 'tokens' must be a list of at most {held} token ids, each below the model's "
                         f"vocabulary of {vocab}")

    if not isinstance(unfed, list) or len(unfed) > 1 or (unfed and toks[-1:] != unfed):
        raise fail(path, "session 'unfed' must be the last of its 'tokens' (an answer's final token its full "
                         "context left out) or nothing")
    if "sampler" in extra and not isinstance(extra["sampler"], dict):
        raise fail(path, "session 'sampler' must be an object {seed, drawn}")
    return extra


def restore_sampler(sampler: Sampler, state: dict, path: Path) -> None:
    """Continue a sampled conversation where it stopped: the seed and the number of tokens drawn."""
    ok = set(state) == {"seed", "drawn"} and all(
        isinstance(state[k], int) and not isinstance(state[k], bool) and 0 <= state[k] < 1 << 64 for k in state)
    if not ok:
        raise fail(path, "session 'sampler' must be {seed, drawn} (two non-negative integers); "
                         "a session saved by an older streamoe cannot continue its draws")
    sampler.restore(state)


def _fill(conv: Conversation, s: TensorSpec, r: SessionReader) -> None:
    """Read the next tensor (checked against `s`) into the conversation: a per-position one head by head."""
    code = code_of(s.dtype)
    np_dtype, item = DTYPES[code].numpy, DTYPES[code].itemsize

    def array(shape) -> mx.array:
        return from_host(np.frombuffer(r.read(int(np.prod(shape)) * item), dtype=np_dtype).reshape(shape), s.dtype)

    if s.per_position:
        for b in range(s.shape[0]):
            for h in range(s.shape[1]):
                conv.restore(s.name, array(s.shape[2:]), at=(b, h))
    else:
        conv.restore(s.name, array(s.shape))
