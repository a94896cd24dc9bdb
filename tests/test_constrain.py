"""Constrained decoding (llguidance): answers valid against their schema from random weights, sampled or
greedy, at a cap or resident; forced tool calls with schema-valid arguments in both call forms; bad schemas
refused; the reasoning left free until it closes."""

from __future__ import annotations

import json

import jsonschema
import pytest

from streamoe.formats.errors import StreamoeError
from streamoe.runtime.constrain import Constraint, guide_tokenizer, json_grammar, tool_call_grammar
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


def _answer(eng: Engine, grammar: str, sampler: Sampler, **kw) -> str:
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)
    c = Constraint(guide, grammar, eng.args.vocab_size, **kw)
    eng.reset()
    return eng.text.decode([t for t, _ in eng.generate(eng.text.encode("Give me JSON:"), 120, sampler, constraint=c)])


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


def test_constrained_tokens_are_identical_across_caps(tiny_conv):
    outs = []
    for slots in (None, 6):
        eng = _engine(tiny_conv, slots)
        outs.append(_answer(eng, json_grammar(SCHEMA), Sampler(temp=1.0, top_p=0.95, top_k=20, seed=3)))
        eng.close()
    assert outs[0] == outs[1]


@pytest.mark.parametrize("fmt", ["json", "xml"])
@pytest.mark.parametrize("name", ["get_weather", None])
def test_forced_calls_have_schema_valid_arguments(tiny_conv, fmt, name):
    """The constraint covers what follows the call's prefix up to the block's close, then only a stop."""
    from streamoe.runtime.tool_calls import call_prefix, parse_call

    eng = _engine(tiny_conv, None)
    for seed in range(3):
        text = _answer(eng, tool_call_grammar(fmt, TOOLS, name, eng.text.tokenizer),
                       Sampler(temp=1.0, top_k=50, seed=seed))
        assert text.endswith("\n</tool_call>")  # the block closed, then only a stop token
        call = call_prefix(fmt, name)[len("<tool_call>\n"):] + text[: -len("\n</tool_call>")]
        parsed = parse_call(call, fmt, TOOLS)
        assert parsed is not None, call
        assert name is None or parsed["name"] == name
        args = json.loads(parsed["arguments"])
        tool = next(t for t in TOOLS if t["function"]["name"] == parsed["name"])
        jsonschema.validate(args, tool["function"]["parameters"])
    eng.close()


def test_a_schema_that_does_not_compile_is_refused(tiny_conv):
    from tokenizers import Tokenizer

    guide = guide_tokenizer(Tokenizer.from_file(str(tiny_conv / "tokenizer.json")), 576, {1})
    with pytest.raises(StreamoeError, match="does not compile .*no-such-type"):
        Constraint(guide, json_grammar({"type": "no-such-type"}), 576)
