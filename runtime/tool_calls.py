"""Tool calls in the form the checkpoint's chat template writes them, parsed from generated text whole or as it
streams.

Two forms, told apart from the template as mlx-lm chooses its parser (`ChatTemplate.tool_format`):
- "json" (Qwen3): `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`;
- "xml" (Qwen3.5/3.6, Qwen3-Coder): `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n
  </function>\\n</tool_call>`, whose values are text: each is typed from the tool's JSON schema (integer,
  number, boolean, object, array, null parsed; strings, and keys the schema does not type, kept as written),
  as vLLM's and mlx-lm's qwen3_coder parsers do.
A third, "harmony" (gpt-oss: a call is a `commentary` message to `functions.NAME` whose text is its JSON
arguments), is read by channel in `serve.chat_output.HarmonyOutput`; here it has only its forced call's prefix.

Blocks are separated from the content and from each other by newlines, which are the template's and are
dropped. A block that does not parse (bad JSON, no name, never closed) stays in the content as it was
written: the client sees what the model said rather than losing it.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"
# harmony's marks (gpt-oss): a message is `<|start|>ROLE<|channel|>CHANNEL [to=RECIPIENT]<|message|>TEXT<|end|>`
H_START, H_CHANNEL, H_MESSAGE, H_END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
HARMONY_CALL = f"{H_CHANNEL}commentary to=functions."  # a harmony call's header up to its tool's name
HARMONY_ARGS = f" <|constrain|>json{H_MESSAGE}"  # and after it, up to the arguments


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def loads_exact(text: str):
    """JSON as the model wrote it: a number with a fraction or an exponent kept as a `Decimal` (a float rounds
    0.1000000000000000055 to 0.1 and turns 1E999 into infinity, which JSON cannot hold); NaN and Infinity,
    which are not JSON, refused (ValueError)."""
    return json.loads(text, parse_float=Decimal, parse_constant=_no_constant)


def dumps_exact(obj, **kw) -> str:
    """`json.dumps` of what `loads_exact` read, each `Decimal` written as its own digits (what holds none is
    written as `json.dumps` writes it, nothing copied)."""
    numbers: list[Decimal] = []

    def number(o):
        if not isinstance(o, Decimal):
            raise TypeError(f"{type(o).__name__} is not JSON serializable")
        numbers.append(o)
        return f"\x00streamoe-number-{len(numbers) - 1}\x00"

    text = json.dumps(obj, ensure_ascii=False, default=number, **kw)
    if not numbers:
        return text
    return re.sub(r'"\\u0000streamoe-number-(\d+)\\u0000"', lambda m: str(numbers[int(m.group(1))]), text)


def call_prefix(fmt: str, name: str | None) -> str:
    """The start of a tool call block, written into the prompt to force a call (`tool_choice`): "required"
    (name None) opens a block, a named tool also fills in its name, so the model writes only the arguments.
    In harmony (gpt-oss) the block is a `commentary` message to `functions.NAME`."""
    if fmt == "harmony":
        return HARMONY_CALL + ("" if name is None else name + HARMONY_ARGS)
    if name is None:
        return CALL_OPEN + "\n"
    if fmt == "xml":
        return f"{CALL_OPEN}\n{FUNCTION_OPEN}{name}>\n"
    return CALL_OPEN + "\n" + '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '


def parse_call(body: str, fmt: str = "json", tools: list[dict] | None = None) -> dict | None:
    """The text between `<tool_call>` and `</tool_call>` -> {"name", "arguments" (a JSON string)}, or None if
    it is not a call of the form `fmt`."""
    if fmt == "xml":
        return _parse_xml(body, tools or [])
    try:
        obj = loads_exact(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # arguments double-encoded as a JSON string
        try:
            args = loads_exact(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": obj["name"], "arguments": dumps_exact(args)}


def _name(text: str, start: int) -> tuple[str, int] | None:
    """The NAME of `<function=NAME>` / `<parameter=NAME>` starting at `start` (just after the `=`), and the
    position after its `>`; None when the name is empty or runs over a line."""
    end = text.find(">", start)
    if end < 0:
        return None
    raw = text[start:end]
    name = raw.strip()
    if not name or "\n" in raw or "<" in raw:
        return None
    return name, end + 1


def _parse_xml(body: str, tools: list[dict]) -> dict | None:
    text = body.strip()
    if not text.startswith(FUNCTION_OPEN) or not text.endswith(FUNCTION_CLOSE):
        return None
    got = _name(text, len(FUNCTION_OPEN))
    if got is None:
        return None
    name, pos = got
    end = len(text) - len(FUNCTION_CLOSE)
    props = _properties(tools, name)
    args = {}
    while True:
        while pos < end and text[pos].isspace():
            pos += 1
        if pos == end:
            break
        if not text.startswith(PARAM_OPEN, pos):
            return None  # text between the parameters: not a call
        got = _name(text, pos + len(PARAM_OPEN))
        if got is None:
            return None
        key, pos = got
        close = text.find(PARAM_CLOSE, pos)
        if close < 0 or close > end:
            return None
        value = text[pos:close]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        args[key] = typed(value, props.get(key))
        pos = close + len(PARAM_CLOSE)
    return {"name": name, "arguments": dumps_exact(args)}


def _properties(tools: list[dict], name: str) -> dict:
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name:
            params = fn.get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            return props if isinstance(props, dict) else {}
    return {}


_KINDS = {"boolean": bool, "object": dict, "array": list, "integer": int, "number": int | Decimal}


def _matches(v, kind: str) -> bool:
    if kind == "null":
        return v is None
    if isinstance(v, bool) and kind != "boolean":  # a bool is an int to Python, not to JSON Schema
        return False
    return kind in _KINDS and isinstance(v, _KINDS[kind])


RAW_STRING_KEYS = frozenset({"type", "description", "title", "maxLength", "default", "examples"})


def xml_raw(schema) -> str | None:
    """How an XML parameter of this schema is written under a strict grammar (`constrain.tool_call_grammar`) and
    read back (`typed`): "enum" (one of its strings, raw: an enum or const of strings), "text" (a plain string, raw,
    as the template writes it; a `maxLength` the only bound), or None: as JSON, so that every other keyword
    (pattern, anyOf, a list of types, $ref...) holds, and `typed` reads the JSON back."""
    if not isinstance(schema, dict):
        return None
    words = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if isinstance(words, list) and words and all(isinstance(v, str) for v in words):
        return "enum"
    kinds = schema.get("type")
    if (kinds == "string" or isinstance(kinds, list) and "string" in kinds) and set(schema) <= RAW_STRING_KEYS:
        return "text"  # a list of types with "string": raw too, as `typed` reads it (vLLM's and mlx-lm's parsers)
    return None


def typed(value: str, schema) -> object:
    """An XML parameter's text as the value its schema's `type` says (a list of types: the first that fits):
    JSON for numbers, objects, arrays and null; `true`/`false` in any case for booleans (templates render
    Python's `True`); `None` or `null` as null. Strings, untyped keys and text that fits no type stay text."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if isinstance(schema, dict) and schema and xml_raw(schema) is None and (not kinds or "string" in kinds):
        try:  # a value a strict grammar wrote as JSON: untyped (a const, anyOf, $ref...), or a bounded string
            v = loads_exact(value.strip())
            if not kinds or isinstance(v, str):
                return v
        except ValueError:
            pass
    if not kinds or "string" in kinds:
        return value
    s = value.strip()
    if s in ("null", "None", "NULL"):
        return None
    try:
        v = loads_exact(s)
    except ValueError:
        v = {"true": True, "false": False}.get(s.lower(), value)
    for kind in kinds:
        if kind == "integer" and isinstance(v, Decimal) and v.is_finite() and v == v.to_integral_value():
            return int(v)
        if _matches(v, kind):
            return v
    return value


def hold_newlines(owner, s: str, kind: str, out: list) -> None:
    """Emit `s` after the newlines held back from before, holding back its own trailing newlines: text that
    ends a block (before a tool call or the end of thinking) must not end in the newlines the template adds."""
    s = owner.newlines + s
    body = s.rstrip("\n")
    owner.newlines = s[len(body):]
    if body:
        out.append((kind, body))


def partial_suffix(text: str, marks: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `marks`."""
    best = 0
    for m in marks:
        for n in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:n]):
                best = n
                break
    return best


class ToolCallStream:
    """Content text in, content text and parsed tool calls out, for the tools of one request (their schemas
    type the XML form's values). `spans` says where each content event's text lies in the text fed (offset,
    length), so a caller can tell which of its tokens the content holds (logprobs cover those alone)."""

    def __init__(self, fmt: str = "json", tools: list[dict] | None = None):
        self.fmt, self.tools = fmt, tools or []
        self.buf, self.newlines, self.in_call, self.after_call = "", "", False, False
        self.at = 0  # where buf starts in the text fed
        self.call_at = 0  # where the open call block's CALL_OPEN starts
        self.held_at = 0  # where the newlines held back start
        self.spans: list[tuple[int, int]] = []

    def _text(self, s: str, at: int, out: list) -> None:
        if self.after_call:
            n = len(s) - len(s.lstrip("\n"))
            s, at = s[n:], at + n
            if not s:
                return
            self.after_call = False
        start, events = at - len(self.newlines), len(out)  # the held newlines come first
        hold_newlines(self, s, "content", out)
        if len(out) > events:
            self.spans.append((start, len(out[-1][1])))
        self.held_at = at + len(s) - len(self.newlines)

    def feed(self, text: str) -> list:
        out: list = []
        self.buf += text
        while True:
            if not self.in_call:
                i = self.buf.find(CALL_OPEN)
                if i < 0:
                    keep = partial_suffix(self.buf, [CALL_OPEN])
                    self._text(self.buf[:len(self.buf) - keep], self.at, out)
                    self.buf, self.at = self.buf[len(self.buf) - keep:], self.at + len(self.buf) - keep
                    return out
                self._text(self.buf[:i], self.at, out)
                self.call_at = self.at + i
                self.buf, self.at, self.in_call = self.buf[i + len(CALL_OPEN):], self.at + i + len(CALL_OPEN), True
            else:
                j = self.buf.find(CALL_CLOSE)
                if j < 0:
                    return out
                body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(CALL_CLOSE):], False
                self.at += j + len(CALL_CLOSE)
                call = parse_call(body.strip(), self.fmt, self.tools)
                if call is None:
                    self._text(CALL_OPEN + body + CALL_CLOSE, self.call_at, out)
                else:
                    self.newlines, self.after_call = "", True
                    out.append(("tool_call", call))

    def flush(self) -> list:
        out: list = []
        rest = (CALL_OPEN if self.in_call else "") + self.buf  # an unclosed block is content
        at = self.call_at if self.in_call else self.at
        self.buf, self.in_call, self.at = "", False, at + len(rest)
        if rest:
            self._text(rest, at, out)
        if self.newlines and not self.after_call:
            self.spans.append((self.held_at, len(self.newlines)))
            out.append(("content", self.newlines))
        self.newlines = ""
        return out
