"""Constrained decoding (llguidance): answers valid against their schema from random weights, sampled or
greedy, at a cap or resident; forced tool calls with schema-valid arguments in both call forms; bad schemas
refused; the reasoning left free until it closes."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import numpy as np
import pytest

from streamoe.formats.errors import StreamoeError
from streamoe.runtime.constrain import (
    Constraint,
    ThinkingBudget,
    closed,
    guide_tokenizer,
    json_grammar,
    json_or_calls_grammar,
    tool_call_grammar,
)
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.plan import plan_for
from streamoe.runtime.sampling import Sampler

from .conftest import RUNTIME

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                         "ok": {"type": "boolean"}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "additionalProperties": False,
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer", "minimum": 1, "maximum": 9},
                   "units": {"enum": ["c", "f"]}}}}},
         {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {},
                                                                          "additionalProperties": False}}}]


def _engine(conv, slots: int | None) -> Engine:
    base = plan_for(conv, Options(cap_gib=64, ctx=512, runtime_bytes=RUNTIME))
    cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
    return Engine(conv, Options(cap_gib=cap, ctx=512, runtime_bytes=RUNTIME))


def _answer(eng: Engine, grammar: str, sampler: Sampler, n: int = 120, **kw) -> str:
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
    c = Constraint(guide, grammar, eng.args.vocab_size, **kw)
    eng.reset()
    return eng.text.decode([t for t, _ in eng.generate(eng.text.encode("Give me JSON:"), n, sampler, constraint=c)])


@pytest.mark.parametrize("slots", [None, 6])
def test_random_weights_always_answer_schema_valid_json(tiny_conv, slots):
    eng = _engine(tiny_conv, slots)
    assert eng.experts.resident == (slots is None)
    texts = [_answer(eng, json_grammar(SCHEMA), Sampler(temp=1.0, top_k=50, seed=s)) for s in range(4)]
    texts.append(_answer(eng, json_grammar(SCHEMA), Sampler()))
    texts.append(_answer(eng, json_grammar(None), Sampler(temp=1.0, seed=9)))  # json_object: any object
    eng.close()
    for t in texts[:-1]:
        jsonschema.validate(json.loads(t), SCHEMA)
        assert t == json.dumps(json.loads(t), ensure_ascii=False)  # compact: no whitespace a model could pad forever
    assert isinstance(json.loads(texts[-1]), dict)
    assert len(set(texts[:4])) > 1  # the draws still choose


def test_a_schemas_text_that_spells_a_control_token_is_written_in_plain_tokens(tiny_conv):
    """A string the schema holds that is a control token's text (`<tool_call>`, `</think>`, `<|im_end|>`) is
    written in plain tokens: the control token, which the chat's reader takes for its markup, is never drawn, and
    the JSON is whole (llguidance would spell it as the control token, then refuse it and leave the rest free)."""
    eng = _engine(tiny_conv, None)
    added = set(eng.text.tokenizer.get_added_tokens_decoder())
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
    for mark in ["<tool_call>", "</think>", "<think>", "<|im_end|>", "a<tool_call>b"]:
        schema = {"type": "object", "properties": {"tag": {"const": mark}}, "required": ["tag"],
                  "additionalProperties": False}
        c = Constraint(guide, json_grammar(schema), eng.args.vocab_size)
        eng.reset()
        out = [t for t, _ in eng.generate(eng.text.encode("Give me JSON:"), 40, Sampler(), constraint=c)]
        drawn = out[:-1] if out[-1] in eng.text.stop_ids else out
        assert not added & set(drawn) and c.complete, eng.text.decode(out)
        assert json.loads(eng.text.decode(drawn)) == {"tag": mark}
    eng.close()


@pytest.mark.parametrize("budget", [1, 7])
def test_a_thinking_budget_closes_the_reasoning_then_its_grammar_holds(tiny_conv, budget):
    """A thinking budget over a JSON grammar that waits for `</think>`: the reasoning is the first `budget` tokens
    the answer would have had, then `</think>` (forced: the random model does not write it so soon), then
    schema-valid JSON; without a grammar the answer after the close runs free."""
    eng = _engine(tiny_conv, None)
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
    close, vocab = eng.text.tokenizer.token_to_id("</think>"), eng.args.vocab_size
    prompt = eng.text.encode("<think>\nWhy?")

    def answer(c) -> list[int]:
        eng.reset()
        return [t for t, _ in eng.generate(prompt, 120, Sampler(temp=1.0, seed=3), constraint=c)]

    free = answer(None)
    assert close not in free[:budget + 1]
    shaped = answer(ThinkingBudget(close, budget, vocab, Constraint(guide, json_grammar(SCHEMA), vocab, after=close)))
    unshaped = answer(ThinkingBudget(close, budget, vocab))
    eng.close()
    assert shaped[:budget] == unshaped[:budget] == free[:budget] and shaped[budget] == unshaped[budget] == close
    jsonschema.validate(json.loads(eng.text.decode(shaped[budget + 1:])), SCHEMA)
    assert unshaped[budget + 1:] != shaped[budget + 1:]


def test_constrained_tokens_are_identical_across_caps(tiny_conv):
    outs = []
    for slots in (None, 6):
        eng = _engine(tiny_conv, slots)
        outs.append(_answer(eng, json_grammar(SCHEMA), Sampler(temp=1.0, top_p=0.95, top_k=20, seed=3)))
        eng.close()
    assert outs[0] == outs[1]


# what JSON Schema asks beyond a plain type per property: a $ref into $defs, a const, a pattern, anyOf, a list of types
RICH = [{"type": "function", "function": {"name": "place", "parameters": {
    "type": "object", "required": ["at", "kind", "code", "id", "note"], "additionalProperties": False,
    "$defs": {"Pt": {"type": "object", "required": ["x", "y"], "additionalProperties": False,
                     "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}}},
    "properties": {"at": {"$ref": "#/$defs/Pt"}, "kind": {"const": "fixed"}, "code": {"type": "string", "pattern": "^[A-Z]{3}$"},
                   "id": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 4}]},
                   "note": {"type": ["string", "null"], "maxLength": 5}}}}}]


@pytest.mark.parametrize("fmt", ["json", "xml"])
@pytest.mark.parametrize("name", ["get_weather", None, "place"])
def test_forced_calls_have_schema_valid_arguments(tiny_conv, fmt, name):
    """The constraint covers what follows the call's prefix up to the block's close, then only a stop; the
    arguments parse back valid against the tool's schema, whatever keywords it uses (`RICH`), in either form, named
    or any of the tools (whose schemas one grammar holds: a `$ref` into a tool's `$defs` still finds them)."""
    from streamoe.runtime.tool_calls import call_prefix, parse_call

    tools = RICH + TOOLS if name in ("place", None) else TOOLS  # any of them: a $ref inside the calls' wrapper
    eng = _engine(tiny_conv, None)
    for seed in range(3):
        text = _answer(eng, tool_call_grammar(fmt, tools, name, eng.text.tokenizer),
                       Sampler(temp=1.0, top_k=50, seed=seed), 300)
        assert text.endswith("\n</tool_call>")  # the block closed, then only a stop token
        call = call_prefix(fmt, name)[len("<tool_call>\n"):] + text[: -len("\n</tool_call>")]
        parsed = parse_call(call, fmt, tools)
        assert parsed is not None, call
        assert name is None or parsed["name"] == name
        args = json.loads(parsed["arguments"])
        tool = next(t for t in tools if t["function"]["name"] == parsed["name"])
        jsonschema.validate(args, tool["function"]["parameters"])
    eng.close()


@pytest.mark.parametrize("name", ["weather", None])
def test_a_forced_calls_arguments_hold_only_the_keys_its_tool_declares(tiny_conv, name):
    """A tool whose parameters say nothing of other keys (most hand-written tools, Anthropic's examples): a forced
    call's arguments close after the declared keys, nested objects too, as vLLM's default backend (xgrammar, strict
    mode) holds them; open, a model wrote keys, the same ones again included, until its tokens ran out."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_conv / "tokenizer.json"))
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string"}, "at": {"type": "object", "properties": {"lat": {"type": "number"}}}}}}}]
    guide = guide_tokenizer(tok, tok.get_vocab_size(), {1})
    c = Constraint(guide, tool_call_grammar("json", tools, name, tok), tok.get_vocab_size())
    head = '{"city": "Oslo", "at": {"lat": 1' if name else '{"name": "weather", "arguments": {"city": "Oslo", "at": {"lat": 1'
    for t in tok.encode(head, add_special_tokens=False).ids:
        c.advance(t)
    assert not _allows(c, tok, ', "') and _allows(c, tok, "}")  # the nested object: no key but lat
    c.advance(tok.encode("}", add_special_tokens=False).ids[0])
    assert not _allows(c, tok, ', "') and _allows(c, tok, "}")  # the arguments: no key but city and at


@pytest.mark.parametrize("fmt", ["json", "xml"])
@pytest.mark.parametrize("once", [True, False])
def test_a_format_beside_tools_takes_the_json_or_the_calls(tiny_conv, fmt, once):
    """A JSON format with tools the model may call (OpenAI's API lets it choose): the answer opens with the JSON or
    with `<tool_call>`, and then is all that; calls follow one another unless parallel calls are off (`once`)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_conv / "tokenizer.json"))
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    guide = guide_tokenizer(tok, tok.get_vocab_size(), {1})
    grammar = json_or_calls_grammar(fmt, TOOLS, tok, SCHEMA, frozenset(), once)
    c = Constraint(guide, grammar, tok.get_vocab_size())
    assert _allows(c, tok, "{") and _allows(c, tok, "<tool_call>") and not _allows(c, tok, "Sure")
    call = {"json": '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            "xml": "<tool_call>\n<function=now>\n</function>\n</tool_call>"}[fmt]
    for t in ids(call):
        c.advance(t)
    assert _allows(c, tok, "\n<tool_call>") != once and not _allows(c, tok, "{")
    c = Constraint(guide, grammar, tok.get_vocab_size())
    for t in ids('{"name": "ab", "age": 3, "tags": [], "ok": true}'):
        c.advance(t)
    assert not _allows(c, tok, "<tool_call>") and not _allows(c, tok, " ")


def test_closed_closes_objects_that_list_their_properties_and_only_those():
    open_ = {"type": "object", "properties": {
        "a": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}},
        "b": {"anyOf": [{"$ref": "#/$defs/P"}, {"type": "null"}]}, "c": {"type": "object"},
        "d": {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}},
        "$defs": {"P": {"type": "object", "properties": {"y": {"type": "string"}}}}}
    out = closed(open_)
    assert out["additionalProperties"] is False
    assert out["properties"]["a"]["items"]["additionalProperties"] is False
    assert out["$defs"]["P"]["additionalProperties"] is False
    assert out["properties"]["c"] == {"type": "object"}  # no properties listed: any object
    assert out["properties"]["d"]["additionalProperties"] == {"type": "string"}  # said: kept
    assert "additionalProperties" not in open_ and "additionalProperties" not in open_["$defs"]["P"]  # a copy


def test_a_lazy_xml_call_of_any_tool_opens_with_the_templates_newline(tiny_conv):
    """After the model's `<tool_call>`, a call of any of the strict tools starts with the newline the template
    writes (the alternatives grouped: the newline had bound to the first tool's only)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_conv / "tokenizer.json"))
    c = _lazy(tok, "xml")
    c.advance(tok.token_to_id("<tool_call>"))
    assert not _allows(c, tok, "<function=now>") and _allows(c, tok, "\n<function=now>")


def test_a_schema_that_does_not_compile_is_refused(tiny_conv):
    from tokenizers import Tokenizer

    guide = guide_tokenizer(Tokenizer.from_file(str(tiny_conv / "tokenizer.json")), 576, {1})
    with pytest.raises(StreamoeError, match="does not compile .*no-such-type"):
        Constraint(guide, json_grammar({"type": "no-such-type"}), 576)


def _lazy(tok, fmt: str, free: frozenset[str] = frozenset(), after: int | None = None, once: bool = False) -> Constraint:
    guide = guide_tokenizer(tok, tok.get_vocab_size(), {1})  # token 1: the stop token here
    grammar = tool_call_grammar(fmt, TOOLS, None, tok, free=free, opened=True)
    return Constraint(guide, grammar, tok.get_vocab_size(), after=after, trigger=tok.token_to_id("<tool_call>"), once=once)


def _allows(c: Constraint, tok, text: str) -> bool:
    """Whether the constraint's mask allows the first token of `text`."""
    m = c.allowed()
    return m is None or bool(m[tok.encode(text, add_special_tokens=False).ids[0]].item())


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_lazy_constraint_holds_each_call_block_the_model_opens_and_nothing_else(tiny_conv, fmt):
    """A strict tool's schema holds from each `<tool_call>` token to its block's close, after the reasoning
    closes; the text before, between and after the blocks runs free (no mask), and a tool not strict takes any
    arguments."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_conv / "tokenizer.json"))
    ids = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    call = {"json": '\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>',
            "xml": "\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
                   "</function>\n</tool_call>"}[fmt]
    c = _lazy(tok, fmt, after=tok.token_to_id("</think>"))
    for t in ids("thinking <tool_call> inside the reasoning is free</think>\n\nLet me look."):
        assert c.allowed() is None
        c.advance(t)
    for block in range(2):  # a second block is held as the first
        c.advance(tok.token_to_id("<tool_call>"))
        for t in ids(call):
            assert c.allowed() is not None and bool(c.allowed()[t].item()), (block, tok.decode([t]))
            c.advance(t)
        assert c.allowed() is None  # closed: free again
        for t in ids(" And the next."):
            c.advance(t)
    c.advance(tok.token_to_id("<tool_call>"))
    for t in ids(call.split("Oslo")[0] + "Oslo" + ('", "days": ' if fmt == "json" else "\n</parameter>\n<parameter=days>\n")):
        c.advance(t)
    assert not _allows(c, tok, "x") and _allows(c, tok, "3")  # "days" is an integer
    free = _lazy(tok, fmt, free=frozenset({"get_weather"}))
    free.advance(tok.token_to_id("<tool_call>"))
    for t in ids(call.split("Oslo")[0] + "Oslo" + ('", "days": ' if fmt == "json" else "\n</parameter>\n<parameter=days>\n")):
        free.advance(t)
    assert _allows(free, tok, '"x' if fmt == "json" else "x")  # not strict: any value
    one = _lazy(tok, fmt, free=frozenset({"get_weather", "now"}), once=True)  # parallel_tool_calls false
    for t in ids("Let me look."):
        assert one.allowed() is None
        one.advance(t)
    for t in [tok.token_to_id("<tool_call>")] + ids(call):
        one.advance(t)
    assert np.flatnonzero(np.array(one.allowed())).tolist() == [1]  # one call made: only a stop may follow


class _OpensACall(Constraint):
    """The lazy constraint, with the model made to open a call block at its third token (the tiny model never opens
    one by itself): a state of the constraint, as the engine's draws ahead assume (`allowed` is None only while
    `active` is off)."""

    seen, forcing = 0, False

    def advance(self, tok: int) -> None:
        self.seen += 1
        if self.forcing:  # the trigger, drawn under the mask below: from here on the lazy grammar's own way
            self.forcing = self.active = False
            return super().advance(tok)
        super().advance(tok)
        if self.seen == 2:
            self.active = self.forcing = True

    def allowed(self):
        if self.forcing:
            return mx.arange(self.vocab) == self.trigger
        return super().allowed()


@pytest.mark.parametrize("fmt", ["json", "xml"])
def test_a_call_the_model_opens_has_schema_valid_arguments_at_every_cap(tiny_conv, fmt):
    from streamoe.runtime.tool_calls import parse_call

    outs = []
    for slots in (None, 6):
        eng = _engine(tiny_conv, slots)
        guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
        tok = eng.text.tokenizer
        for seed in range(2):
            c = _OpensACall(guide, tool_call_grammar(fmt, TOOLS, None, tok, opened=True), eng.args.vocab_size,
                            trigger=tok.token_to_id("<tool_call>"))
            eng.reset()
            toks = [t for t, _ in eng.generate(eng.text.encode("Call a tool:"), 200, Sampler(temp=1.0, top_k=50, seed=seed),
                                               constraint=c)]
            text = eng.text.decode(toks)
            outs.append(text)
            body = text.split("<tool_call>", 1)[1].split("</tool_call>", 1)[0]
            parsed = parse_call(body.strip(), fmt, TOOLS)
            assert parsed is not None, text
            tool = next(t for t in TOOLS if t["function"]["name"] == parsed["name"])
            jsonschema.validate(json.loads(parsed["arguments"]), tool["function"]["parameters"])
        eng.close()
    assert outs[:2] == outs[2:]  # the same tokens resident and at a cap


def test_run_json_schema_cut_by_max_tokens_says_so_and_exits_1(tiny_conv):
    """An answer held to --json-schema that -n cuts before its JSON closes: stdout holds what was written (the
    start of the same seed's whole answer, which does not parse), one stderr line says -n cut it, exit status 1.
    The whole answer: valid JSON, nothing on stderr, exit status 0."""
    from .conftest import cli

    schema = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}
    run = ("run", tiny_conv, "--ctx", "256", "--raw", "--temp", "1", "--seed", "5", "-q", "--runtime-mib", RUNTIME >> 20,
           "-p", "Give JSON:", "--json-schema", json.dumps(schema))
    whole = cli(*run, "-n", "60")
    assert (whole.returncode, whole.stderr) == (0, "")
    jsonschema.validate(json.loads(whole.stdout), schema)
    cut = cli(*run, "-n", "5")
    assert cut.returncode == 1 and "Traceback" not in cut.stderr
    assert cut.stderr == "streamoe: error: the answer was cut by -n 5 before its JSON ended (give a larger -n)\n"
    assert cut.stdout.endswith("\n") and whole.stdout.startswith(cut.stdout[:-1]) and len(cut.stdout) < len(whole.stdout)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut.stdout)


def test_run_json_schema_constrains_each_answer(tiny_conv, tmp_path):
    """`streamoe run --json-schema`, inline or from a file or a pipe: the answer is JSON valid against the schema, sampled from
    random weights, and the same at a cap as resident; in a chat every turn's answer is."""
    from .conftest import cli

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    run = ("run", tiny_conv, "--ctx", "256", "--raw", "--temp", "1", "--seed", "5", "-n", "40", "-q",
           "--runtime-mib", RUNTIME >> 20)
    base = plan_for(tiny_conv, Options(cap_gib=64, ctx=256, runtime_bytes=RUNTIME >> 20 << 20))
    capped = f"{(base.fixed + 6 * base.slot_bytes) / 2**30 + 1e-4:.4f}"  # 6 of the experts in slots
    outs = [cli(*run, "--cap", cap, "-p", "Give JSON:", "--json-schema", given, check=True).stdout.strip()
            for cap, given in (("8", json.dumps(schema)), (capped, str(tmp_path / "s.json")))]
    jsonschema.validate(json.loads(outs[0]), schema)
    assert outs[0] == outs[1]
    piped = cli(*run, "--cap", "8", "-p", "Give JSON:", "--json-schema", "/dev/stdin", input=json.dumps(schema),
                check=True).stdout.strip()  # a schema file that is a pipe (`--json-schema <(jq ...)`)
    assert piped == outs[0]
    chat = cli(*run, "--cap", "8", "--chat", "--json-schema", json.dumps(schema), input="one\ntwo\n", check=True).stdout
    answers = [ln for ln in chat.splitlines() if ln.startswith("{")]
    assert len(answers) == 2
    for a in answers:
        jsonschema.validate(json.loads(a), schema)


def test_run_thinking_budget_closes_the_thought_at_its_tokens(tiny_conv):
    """`streamoe run --thinking-budget N`: on a prompt whose greedy thought runs on, the answer is the first N tokens
    greedy decoding writes, then `</think>` written for the model, then what the model writes after it, as the engine
    continues it; a budget the answer never reaches changes nothing; with --raw or --no-think it is refused in one
    line."""
    from streamoe.runtime.text import Detokenizer

    from .conftest import cli, one_error_line
    from .serve_util import chat_ids, greedy

    budget, n = 24, 40
    eng = Engine(tiny_conv, Options(cap_gib=8, ctx=256, runtime_bytes=RUNTIME))
    on = chat_ids(eng, [{"role": "user", "content": "Why?"}], think=True)
    thought = greedy(eng, on, budget)
    close = eng.text.tokenizer.token_to_id("</think>")
    after = [t for t, _ in eng.generate([close], n - budget - 1, Sampler(), context=on + thought)]
    eng.close()
    assert close not in thought and close is not None and len(after) == n - budget - 1
    detok = Detokenizer(eng.text)
    want = "".join(map(detok.add, thought + [close] + after)) + detok.tail() + "\n"
    run = ("run", tiny_conv, "--cap", "8", "--ctx", "256", "--temp", "0", "-q", "--runtime-mib", RUNTIME >> 20,
           "-p", "Why?", "-n", n)
    assert cli(*run, "--thinking-budget", budget, check=True).stdout == want
    assert cli(*run, "--thinking-budget", n, check=True).stdout == cli(*run, check=True).stdout != want
    for flag in ("--raw", "--no-think"):
        one_error_line(cli(*run, "--thinking-budget", budget, flag), "--thinking-budget", flag)


def test_run_json_schema_writes_the_json_alone_to_stdout(tiny_conv):
    """With the model's thinking on, `run --json-schema` writes the JSON alone to stdout, so that it parses (`> out.json`,
    `| jq`), and the thinking before it to stderr, with the markup between them (`</think>`) in neither."""
    from .conftest import cli

    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False}
    p = cli("run", tiny_conv, "--ctx", "256", "--cap", "8", "--temp", "1", "--seed", "5", "-n", "60", "-q",
            "--thinking-budget", "6", "-p", "Give JSON:", "--json-schema", json.dumps(schema), check=True)
    jsonschema.validate(json.loads(p.stdout), schema)
    assert p.stdout.startswith("{") and p.stderr.strip() and "think>" not in p.stdout + p.stderr, (p.stdout, p.stderr)


def test_run_to_a_stdout_that_is_not_utf8_writes_escapes_and_says_so(tiny_conv):
    """A stdout that cannot hold every character (PYTHONIOENCODING=ascii, a Latin-1 locale): the answer is written
    with backslash escapes for what it cannot hold, not cut by an encoding error, and stderr says so once."""
    import os

    from .conftest import cli

    schema = {"enum": ["café 你好"]}
    run = ("run", tiny_conv, "--ctx", "256", "--cap", "8", "-n", "20", "--no-think", "-p", "Say it:",
           "--json-schema", json.dumps(schema))
    p = cli(*run, env={**os.environ, "PYTHONIOENCODING": "ascii"})
    assert p.returncode == 0 and p.stdout.strip() == '"caf\\xe9 \\u4f60\\u597d"', (p.stdout, p.stderr)
    assert p.stderr.count("stdout is ascii") == 1
    assert cli(*run, check=True).stdout.strip() == '"café 你好"'
