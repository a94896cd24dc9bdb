"""Constrained decoding: an answer that must follow a grammar (a JSON schema, any JSON object, a tool call's
arguments), by llguidance.

llguidance (a Rust library with no Python dependencies) keeps the grammar's state on the host and gives, for
each next token, a bitmask of the tokens the grammar allows, in well under a millisecond; the mask goes to
the device and the sampler draws among the allowed tokens (`Sampler(..., allowed=...)`). The grammar can wait
for the reasoning to close: with thinking on, the answer runs free until the template's `</think>` token and
the constraint starts after it, so the JSON lands in the content, as vLLM's reasoning parsers arrange. A
forced tool call is constrained from its prefix to the block's close.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..formats.errors import StreamoeError
from .tool_calls import (
    CALL_CLOSE,
    CALL_OPEN,
    FUNCTION_CLOSE,
    FUNCTION_OPEN,
    H_CHANNEL,
    H_END,
    H_MESSAGE,
    H_START,
    HARMONY_ARGS,
    PARAM_CLOSE,
    PARAM_OPEN,
    xml_raw,
)

BITS = mx.array(np.arange(32, dtype=np.uint32))
# JSON as json.dumps writes it: no whitespace beyond ", " and ": ", so an answer's length is the value's (a
# model cannot pad it with whitespace forever)
COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def closed(schema):
    """A tool's parameters with every object that lists its `properties` and says nothing of others closed to
    them (`additionalProperties: false`), as xgrammar's strict mode (vLLM's default structured-output backend)
    reads a schema: a call's arguments are the keys its tool declares. Left open, the grammar lets a model add
    keys, the same ones again included, until the answer's tokens run out and the call never closes. An object
    that lists no properties stays any object."""
    if isinstance(schema, list):
        return [closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed(v) if k in SUBSCHEMAS else v for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions", "patternProperties"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed(sub) for name, sub in schema[k].items()}
    if isinstance(schema.get("properties"), dict) and "additionalProperties" not in schema \
            and "patternProperties" not in schema:
        out["additionalProperties"] = False
    return out


# the keywords whose value is a schema (or a list of them), which `closed` walks into
SUBSCHEMAS = ("items", "prefixItems", "additionalProperties", "anyOf", "oneOf", "allOf", "not", "if", "then", "else",
              "contains")


# what the added tokens' texts are prefixed with in llguidance's view of the tokenizer (a noncharacter no text holds)
HIDDEN = "\U0010ffff"


def guide_tokenizer(tokenizer, vocab: int, stop_ids: set[int]):
    """llguidance's view of the model's tokenizer (`tokenizers.Tokenizer`), made once per model: ~0.1 s at a
    4K vocabulary, ~1 s at the real one. Its added tokens (`<tool_call>`, `</think>`, `<|im_end|>`) are control
    tokens there, written only where a grammar names one by id (`_literal`); their texts are hidden from its
    tokenizer, which would otherwise spell a grammar's literal "<tool_call>" as the control token, let it through
    the mask, and then refuse it (llguidance 1.9): a schema's text is written in plain tokens, as `encode_plain`
    reads a request's."""
    import llguidance

    spec = json.loads(tokenizer.to_str())
    for added in spec.get("added_tokens") or []:
        added["content"] = HIDDEN + added["content"]
    return llguidance.LLTokenizer(json.dumps(spec), n_vocab=vocab, eos_token=sorted(stop_ids))


def tool_call_grammar(fmt: str, tools: list[dict], name: str | None, tokenizer, free: frozenset[str] = frozenset(),
                      opened: bool = False) -> str:
    """The grammar (Lark, llguidance's dialect) of what the model writes after a forced call's prefix
    (`tool_calls.call_prefix`) up to the end of the block: the arguments of tool `name` (JSON: an object valid
    against its parameters; XML: its `<parameter=KEY>` blocks, the required ones in the schema's order, the
    others optional), or with name None one call of any of the tools, its name included; then the block's
    close. After it only a stop token is allowed: a forced answer is one call.

    For the calls a model opens itself (`opened`: from the newline after its `<tool_call>` token, the grammar of a
    lazy `Constraint`), the tools named in `free` (not strict) take any arguments: any JSON object, or any
    `<parameter=...>` blocks."""
    fns = [t["function"] for t in tools if name is None or t["function"]["name"] == name]

    def params(fn: dict) -> dict:
        p = fn.get("parameters")
        return closed(p) if isinstance(p, dict) and p and fn["name"] not in free else {"type": "object"}

    def js(schema: dict) -> str:
        return "%json" + json.dumps({**schema, "x-guidance": COMPACT}, ensure_ascii=False)

    if fmt == "harmony":  # after `<|message|>` (named) or `to=functions.` (required); <|call|> is a stop token
        if name is not None:
            return f"start: {js(params(fns[0]))}\n"
        args = " ".join(_literal(tokenizer, piece) for piece in re.split(r"(<\|\w+\|>)", HARMONY_ARGS) if piece)
        return "start: " + " | ".join(f"{json.dumps(fn['name'], ensure_ascii=False)} {args} {js(params(fn))}"
                                      for fn in fns) + "\n"
    close = _literal(tokenizer, "\n") + " " + _literal(tokenizer, CALL_CLOSE)
    start = "start: " + (_literal(tokenizer, "\n") + " " if opened else "")
    if fmt == "json":
        if name is not None:
            return f"{start}{js(params(fns[0]))} {_literal(tokenizer, '}')} {close}\n"
        # a tool's schema moved under the calls' `$defs` where its `$ref`s point into it (at its root: `#/$defs/X`),
        # each of them re-pointed there: inside the wrapper, `#` is the wrapper's root
        schemas = [params(fn) for fn in fns]
        moved = {f"tool{i}": rerooted(p, f"#/$defs/tool{i}") for i, p in enumerate(schemas) if refers(p)}
        calls = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": fn["name"]}, "arguments": {"$ref": f"#/$defs/tool{i}"} if f"tool{i}" in moved else p},
            "required": ["name", "arguments"], "additionalProperties": False}
            for i, (fn, p) in enumerate(zip(fns, schemas, strict=True))], **({"$defs": moved} if moved else {})}
        return f"{start}{js(calls)} {close}\n"
    end_param = json.dumps(f"\n{PARAM_CLOSE}\n")
    end_re = r"\n" + PARAM_CLOSE.replace("/", r"\/") + r"\n"  # the same, inside a /regex/
    rules, calls = [f"text[lazy]: /(?s:.*){end_re}/"], []  # a raw string value, up to its close
    key_close = json.dumps(">\n")
    rules.append(f"anyparam: {json.dumps(PARAM_OPEN)} /[^>\\n]+/ {key_close} text")  # a free tool's parameter
    for i, fn in enumerate(fns):
        if fn["name"] in free:
            opening = json.dumps(f"{FUNCTION_OPEN}{fn['name']}>\n", ensure_ascii=False)
            rules.append(f"call{i}: {opening} anyparam* {json.dumps(FUNCTION_CLOSE)} {close}")
            calls.append(f"call{i}")
            continue
        schema = params(fn)
        props, required, parts = schema.get("properties") or {}, set(schema.get("required") or []), []
        defs = {k: schema[k] for k in ("$defs", "definitions") if k in schema}  # what a property's $ref points into
        for j, (key, sub) in enumerate(props.items()):
            head, sub = json.dumps(f"{PARAM_OPEN}{key}>\n", ensure_ascii=False), sub if isinstance(sub, dict) else {}
            raw = xml_raw(sub)
            if raw == "enum":
                words = sub["enum"] if "enum" in sub else [sub["const"]]
                body = f"{head} (" + " | ".join(json.dumps(v, ensure_ascii=False) for v in words) + f") {end_param}"
            elif raw == "text" and isinstance(sub.get("maxLength"), int):
                body = f"{head} /(?s:.{{0,{sub['maxLength']}}}){end_re}/"
            elif raw == "text":  # written raw, as the template writes it
                body = f"{head} text"
            else:  # written as JSON, which `tool_calls.typed` reads back
                body = f"{head} {js({**defs, **sub})} {end_param}"
            rules.append(f"p{i}_{j}: {body}")
            parts.append(f"p{i}_{j}" + ("" if key in required else "?"))
        opening = "" if name is not None else json.dumps(f"{FUNCTION_OPEN}{fn['name']}>\n", ensure_ascii=False) + " "
        rules.append(f"call{i}: {opening}{' '.join(parts)} {json.dumps(FUNCTION_CLOSE)} {close}")
        calls.append(f"call{i}")
    return start + "(" + " | ".join(calls) + ")\n" + "\n".join(rules) + "\n"  # the newline before any call


def think_opener(tokenizer) -> int | None:
    """`<think>`, where the tokenizer has it and `</think>`: the token an answer opens its own reasoning with where
    the template leaves the tag to the model (Qwen3's), which a grammar or a thinking budget then waits on."""
    opener, close = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    return opener if opener is not None and close is not None else None


def refers(schema) -> bool:
    """Whether a schema holds a `$ref` anywhere."""
    if isinstance(schema, dict):
        return "$ref" in schema or any(refers(v) for v in schema.values())
    return isinstance(schema, list) and any(refers(v) for v in schema)


def rerooted(schema, at: str):
    """`schema` with each `$ref` that points into it from its root (`#...`) pointing at the same place under `at`,
    where the schema is moved inside another."""
    if isinstance(schema, list):
        return [rerooted(v, at) for v in schema]
    if not isinstance(schema, dict):
        return schema
    return {k: at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rerooted(v, at)
            for k, v in schema.items()}


def json_or_calls_grammar(fmt: str, tools: list[dict], tokenizer, schema: dict | None, free: frozenset[str],
                          once: bool) -> str:
    """An answer that is either JSON following `schema` (a structured output; None: any object) or the model's tool
    calls (each a `<tool_call>` block as the lazy grammar holds one, `free` tools taking any arguments; one
    with `once`), as OpenAI's API lets a model with a format and tools answer: held to the format, a model given
    tools could never call one (vLLM's form)."""
    json_grammar(schema)  # a schema llguidance cannot compile: the same one line as elsewhere
    call = tool_call_grammar(fmt, tools, None, tokenizer, free=free, opened=True)
    assert call.startswith("start: ")
    value = "%json" + json.dumps({**(schema if schema is not None else {"type": "object"}), "x-guidance": COMPACT},
                                 ensure_ascii=False)
    opened = f"{_literal(tokenizer, CALL_OPEN)} call"
    calls = opened if once else f"{opened} ({_literal(tokenizer, chr(10))} {opened})*"
    return f"start: {value} | calls\ncalls: {calls}\ncall: {call[len('start: '):]}"


def _literal(tokenizer, text: str) -> str:
    """`text` in a Lark grammar: an added token (special or not: llguidance keeps every added token apart from
    the bytes it spells) by its id, else a string."""
    tid = tokenizer.token_to_id(text)
    return f"<[{tid}]>" if tid is not None and tid in tokenizer.get_added_tokens_decoder() else json.dumps(text)


def harmony_json_grammar(schema: dict | None, tokenizer) -> str:
    """A harmony answer (gpt-oss) whose `final` message is JSON following `schema` (None: any object): an
    `analysis` message first if the model writes one (its reasoning runs free), then the final channel's header,
    then the JSON, as vLLM starts a structured output where gpt-oss's reasoning ends."""
    json_grammar(schema)  # a schema llguidance cannot compile: the same one line as elsewhere
    mark = functools.partial(_literal, tokenizer)
    value = "%json" + json.dumps({**(schema if schema is not None else {"type": "object"}), "x-guidance": COMPACT},
                                 ensure_ascii=False)
    return (f"start: analysis? {mark(H_CHANNEL)} \"final\" {mark(H_MESSAGE)} {value}\n"
            f"analysis: {mark(H_CHANNEL)} \"analysis\" {mark(H_MESSAGE)} /(?s:.*)/ {mark(H_END)} {mark(H_START)} "
            "\"assistant\"\n")


def json_answer(tokens, schema: dict | None, tokenizer, vocab: int, thinking: bool, harmony: bool,
                opener: int | None = None) -> Constraint:
    """An answer held to JSON valid against `schema` (None: any object), as `run --json-schema` and `serve`'s
    structured outputs hold it: after the template's `</think>` where the prompt leaves the model thinking; in a
    harmony chat from the first token, the `final` message's text after a free `analysis` (`harmony_json_grammar`)."""
    if harmony:
        return Constraint(tokens, harmony_json_grammar(schema, tokenizer), vocab)
    after = tokenizer.token_to_id("</think>") if thinking or opener is not None else None
    return Constraint(tokens, json_grammar(schema), vocab, after=after, opener=opener)


def guarded(call, *args, **kw):
    """An llguidance call on a request's grammar or schema. A panic in its Rust code (pyo3's `PanicException`, a
    `BaseException`: a client's schema once made it slice text inside a character) is the request's clear error,
    not an exception that escapes a server's handlers."""
    try:
        return call(*args, **kw)
    except BaseException as e:
        if type(e).__name__ != "PanicException":
            raise
        raise StreamoeError(f"the grammar does not compile (llguidance failed on it: {one_line(str(e))[:120]})"
                            ) from None


def one_line(message: str) -> str:
    """llguidance's message in one line: its first, and the `error: ...` lines it prints below a quoted source (a
    regex's "unclosed group"), which the first alone leaves out."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    if not lines:
        return ""
    causes = [ln[len("error:"):].strip() for ln in lines[1:] if ln.startswith("error:")]
    return " ".join([lines[0].rstrip(":") + (":" if causes else ""), *causes])


def json_grammar(schema: dict | None) -> str:
    """The grammar of a JSON value following `schema` (None: any JSON object). A schema llguidance cannot
    compile is the request's fault: StreamoeError with its message."""
    import llguidance

    try:
        return guarded(llguidance.LLMatcher.grammar_from_json_schema,
                       schema if schema is not None else {"type": "object"}, overrides=COMPACT)
    except (ValueError, TypeError, RuntimeError) as e:
        raise StreamoeError(f"the JSON schema does not compile ({one_line(str(e))[:200]})") from None


class Constraint:
    """The grammar an answer follows, from the token after `after` (None: from the first token). With a `trigger`
    the grammar is lazy, as llama.cpp's lazy grammars and vLLM's structural tags apply a strict tool's schema:
    the answer runs free, and from each `trigger` token the model writes (past `after`) to the grammar's end the
    grammar holds (a call block the model opened, `tool_call_grammar(..., opened=True)`), then it runs free again;
    or, `once`, only a stop token may follow the first block (one call: `parallel_tool_calls` false). With an
    `opener` (Qwen3's `<think>`, which its template leaves to the model): an answer whose first token is it reasons
    free until `after`, as vLLM starts a grammar where the reasoning ends; any other first token starts the grammar
    there."""

    def __init__(self, tokens, grammar: str, vocab: int, after: int | None = None, trigger: int | None = None,
                 once: bool = False, opener: int | None = None):
        import llguidance

        err = guarded(llguidance.LLMatcher.validate_grammar, grammar, tokens)
        if err and not err.startswith("WARNING"):
            raise StreamoeError(f"the grammar does not compile ({one_line(err)[:200]})")
        self.matcher = guarded(llguidance.LLMatcher, tokens, grammar, log_level=0)
        self.fresh = self.matcher.deep_copy() if trigger is not None else None  # each block starts from it
        self.vocab, self.after, self.trigger, self.once, self.opener = vocab, after, trigger, once, opener
        self.armed = after is None or opener is not None  # past `after`: the grammar starts here (or at the next trigger)
        self.active = self.armed and trigger is None
        self.first = opener is not None  # the first token, which may open the model's reasoning, is still to come

    @property
    def complete(self) -> bool:
        """Whether the answer so far ends a whole match of the grammar (a JSON value closed): an answer that stops
        anywhere else was cut short, and what it wrote does not parse."""
        return self.armed and self.matcher.is_accepting()

    @property
    def dead_end(self) -> bool:
        """Whether an answer that ended by itself (no limit cut it) stopped inside its grammar's match: llguidance
        let no token continue the value (a schema some of whose values it cannot write, as a `multipleOf` of a
        fraction), so what was written does not parse. In force only: a lazy grammar between its blocks is not."""
        return self.active and not self.matcher.is_accepting()

    def allowed(self) -> mx.array | None:
        """[V] bool of the tokens the grammar allows next; None while the answer runs free."""
        if not self.active:
            return None
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint32)
        bits = ((mx.array(words)[:, None] >> BITS) & 1).reshape(-1)[: self.vocab].astype(mx.bool_)
        return bits | (mx.arange(self.vocab) == self.opener) if self.first else bits

    def advance(self, tok: int) -> None:
        """Feed the token drawn. A token the grammar refuses cannot be drawn from its mask; were one drawn, the
        matcher's error state allows only a stop token: the answer ends at a `dead_end` (a lazy grammar's block
        ends instead, and the answer runs free until the next trigger)."""
        if self.first:
            self.first = False
            if tok == self.opener:  # the model opened its reasoning: the grammar waits for its close
                self.armed = self.active = False
                return
        if not self.active:
            if not self.armed:
                self.armed = tok == self.after
                self.active = self.armed and self.trigger is None
            elif self.trigger is not None:
                self.active = tok == self.trigger
            return
        self.matcher.consume_token(tok)
        if self.once and self.matcher.is_accepting():
            return  # the call is made: the grammar, complete, allows only a stop token
        if self.trigger is not None and (self.matcher.is_error() or self.matcher.is_accepting()):
            self.active = False  # a lazy grammar's block closed (or broke): free until the next trigger
            if self.fresh is not None:  # (llguidance's `reset` keeps a grammar's forced first token consumed)
                self.matcher = self.fresh.deep_copy()


class ThinkingBudget:
    """A cap on the reasoning (Anthropic's `thinking.budget_tokens`): the answer runs as it would until `budget`
    tokens were written without the reasoning's `close` token; the next tokens are then `close`, forced (Qwen's
    `</think>`; in harmony `<|end|>` and the final message's header, `HARMONY_CLOSE`), and the answer goes on from
    there under `then` (the request's own constraint, if any), as Qwen's model card closes a budgeted thought. The
    same interface as `Constraint`, so `Engine.generate` draws a forced token once the previous one is read, like
    any masked one. `header` (harmony's, `reasoning_header`): (the token that ends a message's header, the token
    that starts one, whether a header's tokens open the final message); the tokens up to the first header's end
    are not reasoning and not counted, and a first header that opens the final message (gpt-oss may answer at once)
    ends the budget unforced, however the model spelt it in tokens. `opener` (Qwen3's `<think>`, which its template
    leaves to the model): the reasoning is counted after the answer's first token where that is it; an answer that
    opens with anything else did not reason, and nothing is forced."""

    def __init__(self, close: int | list[int], budget: int, vocab: int, then: Constraint | None = None,
                 header: tuple[int, int, Callable[[list[int]], bool]] | None = None, opener: int | None = None):
        self.close = [close] if isinstance(close, int) else list(close)
        self.budget, self.vocab, self.then, self.header, self.opener = budget, vocab, then, header, opener
        self.written, self.forced, self.closed, self.opening = 0, 0, False, [] if header is not None else None

    @property
    def forcing(self) -> bool:
        return not self.closed and self.opening is None and self.opener is None and self.written >= self.budget

    @property
    def active(self) -> bool:
        return self.forcing or (self.then is not None and self.then.active)

    @property
    def complete(self) -> bool:
        return self.then.complete if self.then is not None else True

    @property
    def dead_end(self) -> bool:
        return self.then is not None and self.then.dead_end

    def allowed(self) -> mx.array | None:
        if self.forcing:
            return mx.arange(self.vocab) == self.close[self.forced]
        return self.then.allowed() if self.then is not None else None

    def advance(self, tok: int) -> None:
        if self.opener is not None:  # the first token: the model opens its reasoning, or there is none to cap
            self.closed, self.opener = tok != self.opener, None
        elif self.forcing:
            self.forced += 1
            self.closed = self.forced == len(self.close)
        elif self.opening is not None and (self.opening or tok == self.header[1]):  # the first message's header
            self.opening.append(tok)
            if tok == self.header[0]:
                self.closed, self.opening = self.header[2](self.opening[:-1]), None
        elif not self.closed:
            self.opening = None  # where the model wrote no header, its reasoning began at once
            self.written += 1
            self.closed = tok == self.close[0]
        if self.then is not None:
            self.then.advance(tok)


class TokenMask:
    """A fixed set of tokens the answer may draw, for its first `count` tokens (None: throughout), under `then`
    (the request's other constraint, if any): vLLM's `min_tokens` (the tokens that would end the answer masked
    out until it has that many: `without`) and `allowed_token_ids` (only those: `only`). The same interface as
    `Constraint`: while it masks, `Engine.generate` draws each token once the previous one is read, like any
    masked one."""

    def __init__(self, keep: np.ndarray, count: int | None, then: Constraint | ThinkingBudget | TokenMask | None = None):
        self.keep, self.then, self.written = mx.array(keep), then, 0
        self.count = float("inf") if count is None else count

    @classmethod
    def without(cls, ids: list[int], count: int, vocab: int, then=None) -> TokenMask:
        keep = np.ones(vocab, dtype=bool)
        keep[[t for t in ids if 0 <= t < vocab]] = False
        return cls(keep, count, then)

    @classmethod
    def only(cls, ids: list[int], vocab: int, then=None) -> TokenMask:
        keep = np.zeros(vocab, dtype=bool)
        keep[[t for t in ids if 0 <= t < vocab]] = True
        return cls(keep, None, then)

    @property
    def active(self) -> bool:
        return self.written < self.count or (self.then is not None and self.then.active)

    @property
    def complete(self) -> bool:
        return self.then.complete if self.then is not None else True

    @property
    def dead_end(self) -> bool:
        return self.then is not None and self.then.dead_end

    def allowed(self) -> mx.array | None:
        inner = self.then.allowed() if self.then is not None else None
        if self.written >= self.count:
            return inner
        return self.keep if inner is None else inner & self.keep

    def advance(self, tok: int) -> None:
        self.written += 1
        if self.then is not None:
            self.then.advance(tok)


HARMONY_CLOSE = f"{H_END}{H_START}assistant{H_CHANNEL}final{H_MESSAGE}"  # an analysis message closed, the answer opened


def reasoning_header(text, harmony: bool) -> tuple[int, int, Callable[[list[int]], bool]] | None:
    """`ThinkingBudget`'s `header` in harmony: `<|message|>`, `<|channel|>`, and whether a header's tokens spell
    `<|channel|>final` (by their text: a grammar's "final" may be written in other tokens than the tokenizer's own);
    None elsewhere (Qwen's template opens the thinking in the prompt)."""
    if not harmony:
        return None
    return text.encode(H_MESSAGE)[0], text.encode(H_CHANNEL)[0], lambda ids: text.decode(ids) == f"{H_CHANNEL}final"


def reasoning_close(text, harmony: bool) -> list[int] | None:
    """The tokens `ThinkingBudget` forces to end a reasoning (`text`: the model's `TextIO`): Qwen's `</think>`, or in
    harmony `HARMONY_CLOSE`; None where the tokenizer has no `</think>`."""
    if harmony:
        return text.encode(HARMONY_CLOSE)
    close = text.tokenizer.token_to_id("</think>")
    return None if close is None else [close]
