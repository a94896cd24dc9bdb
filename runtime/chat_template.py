"""A checkpoint's chat template, rendered as transformers' `apply_chat_template` renders it (what mlx-lm and
mlx-vlm use), with the request's own text kept apart from the template's markup.

The environment is the one transformers builds: jinja's immutable sandbox (a template is code that came with
the weights: it may not reach Python internals or change the values it is given), blocks trimmed, loop
controls, `{% generation %}`, and the globals and `tojson` filter templates are written against (insertion
order, raw non-ASCII, no HTML escaping), so a prompt with tools is the model's prompt, byte for byte.

Message text is text: every string a request supplies reaches the template with its control tokens wrapped in
private-use marks, and `pieces` cuts the rendering there, so the tokenizer encodes a marked token as plain
text while the template's own markup stays control tokens (transformers' `sanitize_control_tokens=True`).
Control tokens are the special added tokens and the other added tokens the template itself writes
(`<think>`, `<tool_call>`...). Dict keys are marked too (transformers leaves them), so no key a client sends
(a tool-call argument's name) can open a turn either.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..formats.errors import StreamoeError
from .tool_calls import H_CHANNEL

MARK_OPEN, MARK_CLOSE = "\U000f0000", "\U000f0001"
XML_CALL_MARK = "<tool_call>\n<function="  # what mlx-lm looks for to pick its qwen3_coder parser
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
RENDER_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                 ZeroDivisionError, OverflowError, RecursionError)


class TemplateFailure(StreamoeError):
    """The template refused to render (its own `raise_exception`, a sandbox violation, a bad expression)."""

    def __init__(self, path: Path, reason: str):
        super().__init__(f"{path}: chat template fails to render ({reason})")
        self.path, self.reason = path, reason


def tojson(x, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """JSON as the model was trained on it: keys in the order given, characters as they are, nothing escaped
    for HTML (jinja's own filter sorts keys and escapes `< > & '`)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def raise_exception(message: str):
    raise jinja2.TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Dict:
    """The template's `dict`: builds dictionaries and nothing more (the builtin's attributes stay out of reach)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _check_name(name) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"a namespace may not hold the underscore-prefixed name {name!r}")


class _Namespace(jinja2.utils.Namespace):
    """jinja's `namespace()`, refusing underscore names (they would reach the object's internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's signature: `namespace(self=...)` must still work)
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks the assistant's tokens for training): its body, as is."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=_Dict(), namespace=_Namespace)
    return env


def mark(obj, tokens: re.Pattern):
    """`obj` (a request's messages, tools, template arguments) with every control token in its strings wrapped
    in the marks; marks already there are dropped first, so none can be forged."""
    if isinstance(obj, str):
        obj = obj.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")
        return tokens.sub(lambda m: MARK_OPEN + m.group(0) + MARK_CLOSE, obj)
    if isinstance(obj, dict):
        return {mark(k, tokens): mark(v, tokens) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [mark(v, tokens) for v in obj]
    return obj


def unmark(text: str) -> str:
    """A marked rendering as plain text (for showing it; never for encoding it)."""
    return text.replace(MARK_OPEN, "").replace(MARK_CLOSE, "")


def _as_messages(messages: list[dict]) -> list[dict]:
    """Messages as transformers hands them to a template: keys whose value is None left out (templates test
    for a missing key, not for None), and the reasoning under each of the names templates read."""
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in REASONING_FIELDS if k in m), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One compiled template, the control tokens of its tokenizer, and the tokenizer's named special tokens
    (`eos_token`, `image_token`...; transformers passes them to every rendering)."""

    def __init__(self, source: str, path: Path, added_tokens: list[tuple[str, bool]], named_tokens: dict[str, str]):
        self.source, self.path, self.named_tokens = source, path, named_tokens
        env = environment()
        try:
            ast = env.parse(source)
            self.compiled = env.from_string(ast)
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise StreamoeError(f"{path}: chat template does not parse ({first_line(e)})") from None
        literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
        literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
        written = "\0".join(literals)
        self.control = [t for t, special in added_tokens if special or (t in written and not t.isspace())]
        longest = sorted(self.control, key=len, reverse=True)
        self.tokens = re.compile("|".join(map(re.escape, longest)) or "(?!)")
        self.split = re.compile(f"{MARK_OPEN}({self.tokens.pattern}){MARK_CLOSE}|[{MARK_OPEN}{MARK_CLOSE}]")

    @property
    def tool_format(self) -> str:
        """"xml" (`<tool_call>\\n<function=NAME>\\n<parameter=KEY>...`, the Qwen3.5/3.6 and Qwen3-Coder
        templates) when the template writes that form, "harmony" (gpt-oss: channels, a call a `commentary`
        message to `functions.NAME`) when it writes harmony's channels, else "json" (`<tool_call>\\n{"name": ...}`)."""
        if H_CHANNEL in self.source:  # what only a harmony template writes
            return "harmony"
        return "xml" if XML_CALL_MARK in self.source or XML_CALL_MARK.replace("\n", "\\n") in self.source else "json"

    @functools.cached_property
    def takes_tools(self) -> bool:
        """Whether the template shows a request's tools to the model: a probe tool's name appears in its rendering.
        One that never reads `tools` (Mixtral-Instruct's) would leave them unseen, so a server refuses them there."""
        probe = "streamoe_probe_tool"
        tool = {"type": "function", "function": {"name": probe, "description": "a probe",
                                                 "parameters": {"type": "object", "properties": {}}}}
        try:
            return probe in self.render([{"role": "user", "content": "."}], tools=[tool])
        except TemplateFailure:  # it refuses the probe's messages: the request's own rendering then decides
            return True

    def mark_text(self, s: str) -> str:
        return mark(s, self.tokens)

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        """The marked rendering (encode it with `TextIO.encode_chat`); the template's failures are one
        `TemplateFailure` naming the file."""
        try:
            return self.compiled.render({**self.named_tokens, **mark(kwargs, self.tokens),
                                         "messages": mark(_as_messages(messages), self.tokens),
                                         "tools": mark(tools, self.tokens), "documents": None,
                                         "add_generation_prompt": add_generation_prompt})
        except RENDER_ERRORS as e:
            raise TemplateFailure(self.path, first_line(e)) from None

    def pieces(self, rendered: str) -> list[tuple[str, bool]]:
        """A marked rendering cut at the marks: (text, whether it is a marked token to encode as plain text).
        The first piece is the rendering's start (maybe empty). A lone mark (a template's `split` can part a
        token from its marks) is dropped but still cuts, so the text either side cannot join into a token."""
        parts = self.split.split(rendered)
        out = [(parts[0], False)]
        for i, p in enumerate(parts[1:], start=1):
            if p:
                out.append((p, i % 2 == 1))
        return out


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]
