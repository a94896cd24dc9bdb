"""From generated text to OpenAI's message fields, incrementally: stop strings, thinking (`reasoning_content`)
and `<tool_call>` blocks.

Every stage takes text as it is decoded and gives back only what can no longer change, holding back a
suffix that may still become a stop string, `</think>` or `<tool_call>`. A whole answer is parsed by feeding
it at once, so a streamed answer and a non-streamed one are the same by construction.

Tool calls are the form the checkpoint's chat template writes for an assistant message (the Qwen3 template):
`<tool_call>\\n{"name": NAME, "arguments": ARGS}\\n</tool_call>`, separated from the content and from each
other by a newline. A block that does not parse (bad JSON, no name, never closed) stays in the content as it
was written: the client sees what the model said rather than losing it.
"""

from __future__ import annotations

import json

THINK_END = "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

Event = tuple[str, object]  # ("reasoning", str) | ("content", str) | ("tool_call", {"name", "arguments"})


def call_prefix(name: str | None) -> str:
    """The start of a tool call block, written into the prompt to force a call (`tool_choice`): "required"
    (name None) opens a block, a named tool also fills in its name, so the model writes only the arguments."""
    return CALL_OPEN + "\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')


def _partial_suffix(text: str, marks: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `marks`."""
    best = 0
    for m in marks:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


def hold_newlines(owner, s: str, kind: str, out: list) -> None:
    """Emit `s` after the newlines held back from before, holding back its own trailing newlines: text that
    ends a block (before a tool call or the end of thinking) must not end in the newlines the template adds."""
    s = owner.newlines + s
    body = s.rstrip("\n")
    owner.newlines = s[len(body):]
    if body:
        out.append((kind, body))


class StopMatcher:
    """Cuts the text at the first of the request's stop strings (which are not returned, as OpenAI does)."""

    def __init__(self, stops: list[str]):
        self.stops, self.buf, self.stopped = [s for s in stops if s], "", False
        self.matched: str | None = None  # the stop string that ended the answer

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        hits = [(i, s) for i, s in ((self.buf.find(s), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits)
            out, self.buf, self.stopped = self.buf[:at], "", True
            return out
        keep = _partial_suffix(self.buf, self.stops)
        out, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


def parse_call(body: str) -> dict | None:
    """`{"name": ..., "arguments": {...}}` -> {"name", "arguments" (a JSON string)}, or None if malformed."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # a client's own string, rendered back verbatim by the template
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class ToolCallStream:
    """Content text in, content text and parsed tool calls out. Newlines between content and a call, and
    between calls, are the template's separators and are dropped."""

    def __init__(self):
        self.buf, self.newlines, self.in_call, self.after_call = "", "", False, False

    def _text(self, s: str, out: list[Event]) -> None:
        if self.after_call:
            s = s.lstrip("\n")
            if not s:
                return
            self.after_call = False
        hold_newlines(self, s, "content", out)

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    keep = _partial_suffix(self.buf, [CALL_OPEN])
                    self._text(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._text(self.buf[:i], out)
                self.buf, self.in_call = self.buf[i + len(CALL_OPEN):], True
            else:
                j = self.buf.find(CALL_CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CALL_CLOSE):], False
                call = parse_call(body.strip())
                if call is None:
                    self._text(CALL_OPEN + body + CALL_CLOSE, out)
                else:
                    self.newlines, self.after_call = "", True
                    out.append(("tool_call", call))

    def flush(self) -> list[Event]:
        out: list[Event] = []
        rest = (CALL_OPEN if self.in_call else "") + self.buf  # an unclosed block is content
        self.buf, self.in_call = "", False
        if rest:
            self._text(rest, out)
        if self.newlines and not self.after_call:
            out.append(("content", self.newlines))
        self.newlines = ""
        return out


class ChatOutput:
    """The whole pipeline for one answer: stop strings, then thinking, then tool calls (when tools were given).

    `thinking` says the prompt left the model inside `<think>`: text up to `</think>` is reasoning (newlines
    around it trimmed), the rest is content (leading newlines trimmed)."""

    def __init__(self, thinking: bool, tools: bool, stops: list[str]):
        self.stop = StopMatcher(stops)
        self.phase = "reasoning" if thinking else "content"
        self.tools = ToolCallStream() if tools else None
        self.pending, self.newlines, self.started = "", "", False

    @property
    def stopped(self) -> bool:
        return self.stop.stopped

    def _content(self, s: str, out: list[Event]) -> None:
        if not s:
            return
        if self.tools is not None:
            out += self.tools.feed(s)
        else:
            out.append(("content", s))

    def _reasoning(self, s: str, out: list[Event]) -> None:
        if not self.started:
            s = s.lstrip("\n")
            if not s:
                return
            self.started = True
        hold_newlines(self, s, "reasoning", out)

    def _split(self, text: str, out: list[Event]) -> None:
        if self.phase == "content":
            if self.started is None:  # just after </think>: leading newlines are the template's
                text = text.lstrip("\n")
                if not text:
                    return
                self.started = True
            self._content(text, out)
            return
        self.pending += text
        i = self.pending.find(THINK_END)
        if i >= 0:
            self._reasoning(self.pending[:i], out)
            rest, self.pending, self.newlines = self.pending[i + len(THINK_END):], "", ""
            self.phase, self.started = "content", None
            self._split(rest, out)
            return
        keep = _partial_suffix(self.pending, [THINK_END])
        self._reasoning(self.pending[:len(self.pending) - keep], out)
        self.pending = self.pending[len(self.pending) - keep:]

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._split(self.stop.feed(text), out)
        return out

    def given(self, text: str) -> list[Event]:
        """Text the answer starts with that the model did not generate (a forced tool call's opening, written
        into the prompt): content, past the stop strings, which match generated text only."""
        out: list[Event] = []
        self._split(text, out)
        return out

    def flush(self) -> list[Event]:
        out: list[Event] = []
        self._split(self.stop.flush(), out)
        if self.phase == "reasoning" and self.pending:
            self._reasoning(self.pending, out)
            self.pending = ""
        if self.tools is not None:
            out += self.tools.flush()
        return out


def collect(events: list[Event]) -> dict:
    """A whole answer's events -> {"content", "reasoning_content", "tool_calls"}; content is None only beside
    tool calls, as OpenAI returns it."""
    content = "".join(str(v) for k, v in events if k == "content")
    reasoning = "".join(str(v) for k, v in events if k == "reasoning")
    calls = [v for k, v in events if k == "tool_call"]
    return {"content": content or (None if calls else ""), "reasoning_content": reasoning or None,
            "tool_calls": calls or None}
