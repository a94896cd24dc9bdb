"""Log-probabilities of the generated tokens, for `logprobs`/`top_logprobs`: computed on the device with MLX
from the float32 logits the engine yields for each token (the same logits the sampler saw, before any
temperature), and only when a request asks for them. One entry per token, in OpenAI's chat shape
(`{"token", "logprob", "bytes", "top_logprobs": [...]}`); the other APIs reshape it."""

from __future__ import annotations

import json
from collections import deque
from functools import lru_cache

import mlx.core as mx
import mlx.nn as nn

from ..text import byte_decoder


def log_softmax(logits) -> mx.array:
    """float32 [V] logits -> log-probabilities, on the device."""
    lg = mx.array(logits) if not isinstance(logits, mx.array) else logits
    return nn.log_softmax(lg.astype(mx.float32).reshape(-1))  # shifted by the max first, as mlx-lm's


def token_logprobs(logits, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(the token's log-probability, the `k` most likely tokens as (id, log-probability), most likely first,
    ties broken by the lower id). Only k + 1 numbers leave the device."""
    lp = log_softmax(logits)
    if k:
        top = mx.argpartition(-lp, k - 1)[:k]
        vals = lp[top]
        mx.eval(lp, top, vals)
        pairs = sorted(zip(top.tolist(), vals.tolist(), strict=True), key=lambda p: (-p[1], p[0]))
    else:
        pairs = []
    return lp[token].item(), pairs


SCORE_ROWS = 16  # prompt positions a head call scores: 16 rows of logits (16 MB in float32 at the real vocabulary)


class PromptScores:
    """Each prompt token's log-probability given the tokens before it, and the `k` likeliest tokens there (the
    prompt logprobs of `echo` with `logprobs`, which lm-evaluation-harness scores with), read off each prefill
    step's hidden states as the engine computes them (`Engine.scorer`), once the step's layers are done (so
    inside its activations account). The head runs over `SCORE_ROWS` positions a call, a short block padded to
    that many rows: every row is computed by the same kernel shape wherever the chunks fall, so the scores are
    the same bits at every cap and prefill chunk, and a chunk's full logits are never held. The first token's
    score stays None (nothing comes before it); the prompt's last position predicts the answer, whose logprobs
    come as a generated token's."""

    def __init__(self, ids: list[int], k: int):
        self.ids, self.k = ids, k
        self.scores: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(ids)

    def __call__(self, model, hs: mx.array, offset: int) -> None:
        n = min(hs.shape[1], len(self.ids) - 1 - offset)
        for a in range(0, max(n, 0), SCORE_ROWS):
            rows = min(n - a, SCORE_ROWS)
            x = hs[0, a:a + rows]
            if rows < SCORE_ROWS:
                x = mx.concatenate([x, mx.zeros((SCORE_ROWS - rows, x.shape[-1]), x.dtype)])
            lp = nn.log_softmax(model.head(x).astype(mx.float32), axis=-1)[:rows]
            nxt = mx.array(self.ids[offset + a + 1:offset + a + 1 + rows])[:, None]
            chosen = mx.take_along_axis(lp, nxt, axis=-1)[:, 0]
            top = mx.argpartition(-lp, self.k - 1, axis=-1)[:, :self.k] if self.k else mx.zeros((rows, 0), mx.int32)
            vals = mx.take_along_axis(lp, top, axis=-1)
            mx.eval(chosen, top, vals)
            for i, (c, t, v) in enumerate(zip(chosen.tolist(), top.tolist(), vals.tolist(), strict=True)):
                self.scores[offset + a + 1 + i] = (c, sorted(zip(t, v, strict=True), key=lambda p: (-p[1], p[0])))


TOKEN_CACHE = 8192  # token ids whose text and bytes are kept


class TokenText:
    """A token id -> (its text, its bytes). Byte-level BPE pieces map back to their raw bytes (a token may
    hold part of a UTF-8 character); special tokens and other vocabularies give their decoded text's bytes."""

    def __init__(self, text):
        self.text = text
        decoder = json.loads(text.tokenizer.to_str()).get("decoder") or {}
        self.byte_level = decoder.get("type") == "ByteLevel"
        self.added = set(text.tokenizer.get_added_tokens_decoder())
        self.cached = lru_cache(maxsize=TOKEN_CACHE)(self.piece)  # bounded: a whole vocabulary would be ~80 MB

    def __call__(self, tok: int) -> tuple[str, list[int]]:
        return self.cached(tok)

    def piece(self, tok: int) -> tuple[str, list[int]]:
        piece = self.text.tokenizer.id_to_token(tok) or ""
        table = byte_decoder()
        if self.byte_level and piece and tok not in self.added and all(c in table for c in piece):
            raw = bytes(table[c] for c in piece)
        else:
            raw = self.text.decode([tok]).encode()
        return raw.decode("utf-8", errors="replace"), list(raw)

    def entry(self, logits, token: int, k: int) -> dict:
        """The OpenAI chat logprobs entry of one generated token."""
        return self.scored(token, token_logprobs(logits, token, k))

    def scored(self, token: int, score: tuple[float, list[tuple[int, float]]] | None) -> dict:
        """The entry of a token with its (log-probability, top pairs); None (a prompt's first token): both null."""
        text, raw = self(token)
        if score is None:
            return {"token": text, "logprob": None, "bytes": raw, "top_logprobs": None}
        lp, top = score
        return {"token": text, "logprob": lp, "bytes": raw,
                "top_logprobs": [{"token": self(t)[0], "logprob": v, "bytes": self(t)[1]} for t, v in top]}


class ContentTokens:
    """Which generated tokens an answer's content holds, so that logprobs cover them alone, as OpenAI's
    `choices[].logprobs.content` covers the tokens of `message.content`: not the reasoning, nor `</think>` and the
    newlines the template writes after it, nor a tool call's block, nor text past a stop string. Each token's text
    lies at a known place in the text fed to `ChatOutput`, which reports where its content came from (`spans`): a
    token is the content's if any of its text is (so the entries' text joins to the content wherever the tokens
    fall on its edges), and one whose text is still held back (part of a character) goes with the next."""

    def __init__(self):
        self.queue: deque = deque()  # (entry, start, end) of tokens not yet placed, in order
        self.at = 0  # characters of text the tokens gave so far
        self.seen = 0  # spans already read
        self.end = 0  # where the last of them ends

    def add(self, entry: dict, text: str) -> None:
        """A generated token's entry, and the text it gave (as fed to the output)."""
        self.queue.append((entry, self.at, self.at + len(text)))
        self.at += len(text)

    def place(self, spans: list[tuple[int, int]], settled: bool = False) -> list[dict]:
        """The entries of the tokens the new content `spans` hold, in order; tokens before them are dropped.
        `settled`: none of the tokens added so far can become content any more (the answer is in its reasoning,
        or over): they are dropped too."""
        out = []
        for a, n in spans[self.seen:]:
            b = a + n
            while self.queue:
                entry, s, t = self.queue[0]
                if (t <= a) if t > s else (s < a):  # wholly before the span (held text: before its start)
                    self.queue.popleft()
                elif s < b:
                    out.append(self.queue.popleft()[0])
                else:
                    break
            self.end = b
        self.seen = len(spans)
        if settled:
            self.queue.clear()
        return out

    def finish(self, spans: list[tuple[int, int]], content_open: bool) -> list[dict]:
        """`place` at the answer's end, with the tokens whose text never came (bytes that form no character, held
        back to the end) going with the content where it runs to the end of the text (`content_open`: the answer
        ended in its content): each of the content's tokens has its entry, as OpenAI and vLLM give one a token,
        though the text leaves out what forms no character, as vLLM's does."""
        out = self.place(spans)
        if content_open and self.end == self.at:
            out += [entry for entry, s, t in self.queue if s == t == self.at]
        self.queue.clear()
        return out
