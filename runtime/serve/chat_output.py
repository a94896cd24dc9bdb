"""From generated text to OpenAI's message fields, incrementally: stop strings, thinking (`reasoning_content`)
and tool calls (see `tool_calls`).

Every stage takes text as it is decoded and gives back only what can no longer change, holding back a
suffix that may still become a stop string, `</think>` or `<tool_call>`. A whole answer is parsed by feeding
it at once, so a streamed answer and a non-streamed one are the same by construction.
"""

from __future__ import annotations

import re

from ..tool_calls import (
    H_CHANNEL,
    H_END,
    H_MESSAGE,
    H_START,
    ToolCallStream,
    dumps_exact,
    hold_newlines,
    loads_exact,
    partial_suffix,
)

THINK_START, THINK_END = "<think>", "</think>"

Event = tuple[str, object]  # ("reasoning", str) | ("content", str) | ("tool_call", {"name", "arguments"})


class StopMatcher:
    """Cuts the text at the first of the request's stop strings: after it with `include` (vLLM's
    `include_stop_str_in_output`), else before it (not returned, as OpenAI does)."""

    def __init__(self, stops: list[str], include: bool = False):
        self.stops, self.buf, self.stopped, self.include = [s for s in stops if s], "", False, include
        self.matched: str | None = None  # the stop string that ended the answer
        # vLLM's `min_tokens`: while the answer has no more tokens than it, no stop string is matched (the caller
        # sets `held`); then only one that ends in text fed after (`old`: the characters of `buf` fed while held)
        self.held, self.old = False, 0

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        hits = [] if self.held else [
            (i, s) for i, s in ((self.buf.find(s, max(0, self.old - len(s) + 1)), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.buf, self.stopped = self.buf[:at + len(self.matched) * self.include], "", True
            return out
        keep = partial_suffix(self.buf, self.stops)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        self.old = len(self.buf) if self.held else 0
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


class ChatOutput:
    """The whole pipeline for one answer: thinking, then stop strings on the content, then tool calls (when tools
    were given: the request's tools, or True for calls without schemas to type them, in the template's
    `tool_format`). Stop strings match the content the client is given, not the reasoning nor the template's
    markup around it (`</think>` and the newlines after it): a stop of "\n\n" ends the answer's text, not its
    thinking.

    `thinking` says the prompt left the model inside `<think>`: text up to `</think>` is reasoning (newlines
    around it trimmed), the rest is content (leading newlines trimmed). Otherwise an answer that opens with
    `<think>` itself (Qwen3's template leaves the tag to the model) is reasoning up to `</think>` just the same,
    as vLLM's and mlx-lm's reasoning parsers read it. A completion (`reasons` false) is text alone: no reasoning is
    read from it, whatever it holds (vLLM parses no reasoning on /v1/completions).

    `spans` says which of the text fed became content: (offset, length) in the text fed (text `given` lies before
    it, at negative offsets), one per content event, in order; so the tokens whose text the content holds, and no
    reasoning or markup, are the ones a caller gives logprobs for."""

    def __init__(self, thinking: bool, tools: list[dict] | bool | None, stops: list[str], tool_format: str = "json",
                 include_stop: bool = False, reasons: bool = True):
        self.stop = StopMatcher(stops, include_stop)
        self.phase = "reasoning" if thinking else "content"
        self.tools = ToolCallStream(tool_format, tools if isinstance(tools, list) else None) if tools else None
        self.pending, self.newlines, self.started = "", "", False
        self.opening = reasons and not thinking  # the answer's start may still be the model's own `<think>`
        self.matching = True  # whether content goes through the stop strings (not text `given`)
        self.fed = 0  # characters fed (`feed`): where the next text fed starts
        self.spans: list[tuple[int, int]] = []
        self.pieces: list[tuple[int, int, int]] = []  # (offset in the tool stream's input, offset fed, length)
        self.piped = 0  # characters given to the tool stream

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def _content(self, s: str, at: int, out: list[Event]) -> None:
        if not s:
            return
        if self.tools is None:
            self.spans.append((at, len(s)))
            out.append(("content", s))
            return
        if self.pieces and self.pieces[-1][1] + self.pieces[-1][2] == at:  # it goes on where the last piece ended
            p, a, m = self.pieces[-1]
            self.pieces[-1] = (p, a, m + len(s))
        else:
            self.pieces.append((self.piped, at, len(s)))
        self.piped += len(s)
        seen = len(self.tools.spans)
        out += self.tools.feed(s)
        self._spans_of_tools(seen)

    def _spans_of_tools(self, seen: int) -> None:
        """The tool stream's new content spans (offsets in its input) as offsets in the text fed."""
        for u, n in self.tools.spans[seen:]:
            while len(self.pieces) > 1 and self.pieces[0][0] + self.pieces[0][2] <= u:  # spans come in order
                self.pieces.pop(0)
            for p, at, m in self.pieces:
                lo, hi = max(u, p), min(u + n, p + m)
                if lo < hi:
                    self.spans.append((at + lo - p, hi - lo))

    def _reasoning(self, s: str, out: list[Event]) -> None:
        if not self.started:
            s = s.lstrip("\n")
            if not s:
                return
            self.started = True
        hold_newlines(self, s, "reasoning", out)

    def _open(self, text: str, at: int, out: list[Event]) -> tuple[str, int] | None:
        """The answer's first text while it may still be `<think>` (after whitespace): held; once it is, the
        reasoning starts after it; once it cannot be, the held text is returned as the content's start (with
        where it starts)."""
        self.pending += text
        at += len(text) - len(self.pending)  # where the held text starts
        head = self.pending.lstrip()
        if head.startswith(THINK_START):
            skipped = len(self.pending) - len(head) + len(THINK_START)
            self.pending, self.opening, self.phase = "", False, "reasoning"
            self._split(head[len(THINK_START):], at + skipped, out)
            return None
        if THINK_START.startswith(head):
            return None
        text, self.pending, self.opening = self.pending, "", False
        return text, at

    def _split(self, text: str, at: int, out: list[Event]) -> None:
        """`text`, which starts at offset `at` of the text fed, through the pipeline."""
        if self.opening and text:
            opened = self._open(text, at, out)
            if opened is None:
                return
            text, at = opened
        if self.phase == "content":
            if self.started is None:  # just after </think>: leading newlines are the template's
                n = len(text) - len(text.lstrip("\n"))
                text, at = text[n:], at + n
                if not text:
                    return
                self.started = True
            # a tool call's block is no content: the stop strings match neither it nor what it holds
            inside_call = self.tools is not None and self.tools.in_call and not self.stop.buf
            if self.matching and not inside_call:  # what the stop strings let through starts where their held text did
                at -= len(self.stop.buf)
                text = self.stop.feed(text)
            self._content(text, at, out)
            return
        self.pending += text
        at += len(text) - len(self.pending)  # where the held text starts
        i = self.pending.find(THINK_END)
        if i >= 0:
            self._reasoning(self.pending[:i], out)
            rest, self.pending, self.newlines = self.pending[i + len(THINK_END):], "", ""
            self.phase, self.started = "content", None
            self._split(rest, at + i + len(THINK_END), out)
            return
        keep = partial_suffix(self.pending, [THINK_END])
        self._reasoning(self.pending[:len(self.pending) - keep], out)
        self.pending = self.pending[len(self.pending) - keep:]

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if not self.stop.stopped:
            self._split(text, self.fed, out)
        self.fed += len(text)
        return out

    def given(self, text: str) -> list[Event]:
        """Text the answer starts with that the model did not generate (a forced tool call's opening, written
        into the prompt): content, past the stop strings, which match generated text only; it lies just before
        the text fed (at negative offsets: no token of the answer holds it)."""
        out: list[Event] = []
        self.matching = False
        self._split(text, self.fed - len(text), out)
        self.matching = True
        return out

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if self.opening and self.pending and not self.stop.stopped:  # the answer was a start of `<think>`: content
            text, self.pending, self.opening = self.pending, "", False
            self._content(self.stop.feed(text), self.fed - len(text), out)
        self._content(self.stop.buf, self.fed - len(self.stop.buf), out)
        self.stop.flush()
        if self.phase == "reasoning" and self.pending:
            self._reasoning(self.pending, out)
            self.pending = ""
        if self.tools is not None:
            seen = len(self.tools.spans)
            out += self.tools.flush()
            self._spans_of_tools(seen)
        return out


def collect(events: list[Event]) -> dict:
    """A whole answer's events -> {"content", "reasoning_content", "tool_calls"}; content is None only beside
    tool calls, as OpenAI returns it."""
    content = "".join(str(v) for k, v in events if k == "content")
    reasoning = "".join(str(v) for k, v in events if k == "reasoning")
    calls = [v for k, v in events if k == "tool_call"]
    return {"content": content or (None if calls else ""), "reasoning_content": reasoning or None,
            "tool_calls": calls or None}


# gpt-oss's harmony format: each message a header, then its text; the answer starts inside the first header
# (the prompt ends in `<|start|>assistant`)
H_CLOSES = (H_END, "<|call|>", "<|return|>")  # <|call|> and <|return|> are stop tokens: seldom seen here
RECIPIENT = re.compile(r"\bto=([^\s<]+)")
CHANNEL = re.compile(re.escape(H_CHANNEL) + r"\s*(\w+)")


class HarmonyOutput:
    """`ChatOutput` for a template that writes harmony (gpt-oss): the `analysis` channel is reasoning, `final` the
    content (through the stop strings), a `commentary` message to `functions.NAME` a tool call whose text is its
    JSON arguments, and a `commentary` message to no one (a preamble) content, as vLLM's and llama.cpp's harmony
    parsers read them. Headers are markup, never text the client gets; a header that never reaches its
    `<|message|>` is content verbatim, as a call whose arguments are not a JSON object is."""

    def __init__(self, tools: list[dict] | bool | None, stops: list[str], include_stop: bool = False):
        self.stop = StopMatcher(stops, include_stop)
        self.tools = bool(tools)
        self.buf, self.at, self.fed = "", 0, 0  # held text, where it starts in the text fed, characters fed
        self.in_header = True  # in a message's header (held in `buf` until its <|message|>), else in its text
        self.channel, self.recipient = "", None
        self.call, self.call_at = "", 0  # a call's arguments so far, and where they start
        self.spans: list[tuple[int, int]] = []

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    @property
    def calling(self) -> bool:
        """Whether the open message is a call (to `functions.NAME`), on whatever channel: gpt-oss writes calls on
        `analysis` too, as vLLM's parser takes them."""
        return bool(self.tools and self.recipient and self.recipient.startswith("functions."))

    @property
    def phase(self) -> str:
        return "reasoning" if not self.in_header and self.channel == "analysis" and not self.calling else "content"

    def _content(self, s: str, at: int, out: list[Event], matching: bool = True) -> None:
        if matching:
            at -= len(self.stop.buf)
            s = self.stop.feed(s)
        if s:
            self.spans.append((at, len(s)))
            out.append(("content", s))

    def _text(self, s: str, at: int, out: list[Event]) -> None:
        """Text of the open message."""
        if not s:
            return
        if self.calling:
            self.call_at = self.call_at if self.call else at
            self.call += s
        elif self.channel == "analysis":
            out.append(("reasoning", s))
        else:
            self._content(s, at, out)

    def _close(self, out: list[Event]) -> None:
        """The open message ends: a call's arguments parsed into its event."""
        if self.call:
            name, text = self.recipient[len("functions."):], self.call
            try:
                args = loads_exact(text)
            except ValueError:
                args = None
            if isinstance(args, dict) and name:
                out.append(("tool_call", {"name": name, "arguments": dumps_exact(args)}))
            else:
                self._content(text, self.call_at, out)
        self.call, self.in_header = "", True

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        if self.stop.stopped:
            return out
        self.buf += text
        while self.buf and not self.stop.stopped:
            if self.in_header:  # held up to its <|message|>
                i = self.buf.find(H_MESSAGE)
                if i < 0:
                    break
                head, k = self.buf[:i], self.buf[:i].rfind(H_START)
                if k > 0 and self.buf[:k].strip():  # text before the header's <|start|>: no header's, so text
                    self._content(self.buf[:k], self.at, out)
                head = head[k + len(H_START):] if k >= 0 else head
                m, r = CHANNEL.search(head), RECIPIENT.search(head)
                self.channel, self.recipient, self.in_header = (m.group(1) if m else ""), (r.group(1) if r else None), False
                self.at += i + len(H_MESSAGE)
                self.buf = self.buf[i + len(H_MESSAGE):]
                continue
            ends = [(j, mark) for j, mark in ((self.buf.find(mark), mark) for mark in (*H_CLOSES, H_START)) if j >= 0]
            if not ends:  # all of it is the message's text, but what may be the start of a mark
                keep = partial_suffix(self.buf, [*H_CLOSES, H_START])
                self._text(self.buf[:len(self.buf) - keep], self.at, out)
                self.at += len(self.buf) - keep
                self.buf = self.buf[len(self.buf) - keep:]
                break
            j, mark = min(ends)
            self._text(self.buf[:j], self.at, out)
            self.at += j + len(mark)
            self.buf = self.buf[j + len(mark):]
            self._close(out)
        self.fed += len(text)
        return out

    def given(self, text: str) -> list[Event]:
        """Text the answer starts with that the model did not write (a forced call's header, written into the
        prompt); it lies just before the text fed, at negative offsets."""
        self.at, self.fed = self.at - len(text), self.fed - len(text)
        return self.feed(text)

    def flush(self) -> list[Event]:
        out: list[Event] = []
        if not self.stop.stopped:
            if self.in_header:  # a header cut short (by max_tokens) is markup, dropped; words with no mark are text
                if self.buf.strip() and H_START not in self.buf and H_CHANNEL not in self.buf:
                    self._content(self.buf, self.at, out)
            else:
                self._text(self.buf, self.at, out)
                self.at += len(self.buf)
                self._close(out)
            self.buf = ""
        self._content(self.stop.buf, self.fed - len(self.stop.buf), out, matching=False)
        self.stop.flush()
        return out
