"""gpt-oss's harmony answers served as OpenAI's fields: the `analysis` channel as `reasoning_content`, `final` as
`content`, a `commentary` message to `functions.NAME` as a tool call, a preamble as content; headers never reach
the client. Parsed incrementally (`chat_output.HarmonyOutput`), so a streamed answer is the whole one."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from streamoe.convert.convert import convert
from streamoe.formats.manifest import load_manifest
from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.sampling import Sampler
from streamoe.runtime.serve.chat_output import ChatOutput, HarmonyOutput, collect
from streamoe.runtime.text import Detokenizer, TextIO

from .serve_util import start_server, stop_server
from .test_gpt_oss import make

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

ANSWER = ("<|channel|>analysis<|message|>The user wants the weather. Call the tool.<|end|>"
          "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|>"
          "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
          '{"city": "Zürich"}<|end|>'
          "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\":\"Bern\"}<|end|>"
          "<|start|>assistant<|channel|>final<|message|>Sunny in both.")


def parse(text: str, tools=TOOLS, stops=(), pieces: int | None = None) -> tuple[dict, HarmonyOutput]:
    """The answer's fields, fed whole (`pieces` None) or in pieces of that many characters."""
    out, events = HarmonyOutput(tools, list(stops)), []
    step = pieces or len(text) or 1
    for i in range(0, len(text), step):
        events += out.feed(text[i:i + step])
    return collect(events + out.flush()), out


def test_channels_become_reasoning_content_and_calls():
    got, out = parse(ANSWER)
    assert got == {"reasoning_content": "The user wants the weather. Call the tool.",
                   "content": "Looking it up.Sunny in both.",
                   "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Zürich"}'},
                                  {"name": "get_weather", "arguments": '{"city": "Bern"}'}]}
    assert [ANSWER[a:a + n] for a, n in out.spans] == ["Looking it up.", "Sunny in both."]  # where logprobs go


def test_a_call_on_the_analysis_channel_is_a_call():
    """gpt-oss writes calls on `analysis` too (`<|channel|>analysis to=functions.NAME`): a call, as vLLM's harmony
    parser takes it, not reasoning; the analysis text around it stays reasoning."""
    text = ('<|channel|>analysis<|message|>Look it up.<|end|><|start|>assistant<|channel|>analysis '
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Bern"}<|call|>')
    for pieces in (None, 1, 5):
        got, _ = parse(text, pieces=pieces)
        assert got == {"reasoning_content": "Look it up.", "content": None,
                       "tool_calls": [{"name": "get_weather", "arguments": '{"city": "Bern"}'}]}, pieces


@pytest.mark.parametrize("pieces", [1, 2, 3, 7])
def test_streamed_in_pieces_is_the_whole_answer(pieces):
    assert parse(ANSWER, pieces=pieces)[0] == parse(ANSWER)[0]


def test_stop_strings_cut_the_final_text_not_the_reasoning():
    text = "<|channel|>analysis<|message|>think STOP here<|end|><|start|>assistant<|channel|>final<|message|>one STOP two"
    for pieces in (None, 1, 4):
        got, out = parse(text, stops=["STOP"], pieces=pieces)
        assert got["reasoning_content"] == "think STOP here" and got["content"] == "one " and out.stopped


def test_what_does_not_parse_stays_text():
    bad_args = "<|channel|>commentary to=functions.get_weather<|message|>not json<|end|>"
    assert parse(bad_args)[0] == {"content": "not json", "reasoning_content": None, "tool_calls": None}
    no_tools = '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Bern"}'
    assert parse(no_tools, tools=None)[0]["content"] == '{"city": "Bern"}'
    assert parse("plain words, no header")[0]["content"] == "plain words, no header"
    headless = "no header<|end|><|start|>assistant<|channel|>final<|message|>then an answer"
    assert parse(headless)[0]["content"] == "no header<|end|>then an answer"
    unfinished = "<|channel|>analysis<|message|>half a thought"
    assert parse(unfinished)[0] == {"content": "", "reasoning_content": "half a thought", "tool_calls": None}
    # a header cut short (max_tokens) is markup, not content; a forced call's header the server wrote too
    for cut in ("<|channel|>analysis<|message|>so<|end|><|start|>as", "<|channel|>commentary to=functions.get <|cons"):
        for pieces in (None, 1):
            assert parse(cut, pieces=pieces)[0]["content"] in (None, ""), (cut, pieces)


def test_the_reasoning_phase_is_the_analysis_text():
    out = HarmonyOutput(None, [])
    out.feed("<|channel|>analysis")
    assert out.phase == "content"  # a header is markup
    out.feed("<|message|>hmm")
    assert out.phase == "reasoning"
    out.feed("<|end|><|start|>assistant<|channel|>final<|message|>ok")
    assert out.phase == "content"


# ------------------------------------------------------------------------------------ served


@pytest.fixture(scope="module")
def conv(tmp_path_factory) -> Path:
    """gpt-oss tiny with its residual projections drawn at 0.02, as every weight (not `residual_std`'s smaller
    spread): its picks collapse and its reasoning runs on without `<|end|>` past 1,040 tokens, so a thinking
    budget, Anthropic's at least 1,024, has reasoning to cut (drawn the usual way it closes on its third token)."""
    from streamoe.formats import export

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(export, "residual_std", lambda a, fan_in: export.INIT_STD)
        ckpt = make(tmp_path_factory.mktemp("go") / "tiny")
    out = tmp_path_factory.mktemp("goconv") / "tiny"
    convert(ckpt, out, progress=False)
    return out


@pytest.fixture(scope="module")
def server(conv, tmp_path_factory):
    s = start_server(conv, tmp_path_factory.mktemp("log") / "serve.log", "--cap", 8, "--ctx", 1536, "--runtime-mib", 64)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def oc(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_template_is_told_apart(conv):
    text = TextIO(conv, load_manifest(conv).config)
    assert text.template.tool_format == "harmony"


def test_a_served_answer_is_the_harmony_parse_of_the_tokens_drawn(conv, oc):
    """Greedy, harmony's marks favoured (`logit_bias`: random weights then write headers, texts and closes in an
    order no model would): the server's fields, whole and streamed, are what HarmonyOutput makes of the text of
    the tokens the engine draws for the same prompt."""
    messages = [{"role": "user", "content": "What is the weather in Bern?"}]
    marks = {519: 3.0, 520: 3.0, 521: 3.0, 522: 3.0}  # <|channel|> <|start|> <|end|> <|message|>
    ask = dict(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=48,
               logit_bias={str(t): b for t, b in marks.items()})
    msg = oc.chat.completions.create(**ask).choices[0].message
    eng = Engine(conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 << 20))
    try:
        ids = eng.text.encode_chat(eng.text.chat_text(messages, tools=TOOLS))
        detok = Detokenizer(eng.text)
        text = "".join(detok.add(t) for t, _ in eng.generate(ids, 48, Sampler(logit_bias=marks)))
    finally:
        eng.close()
    assert "<|message|>" in text  # a header was parsed, not only text
    want = parse(text)[0]
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []] or None
    assert (msg.content, getattr(msg, "reasoning_content", None), calls) == \
        (want["content"], want["reasoning_content"], want["tool_calls"])
    parts = [c.choices[0].delta for c in oc.chat.completions.create(**ask, stream=True) if c.choices]
    assert "".join(d.content or "" for d in parts) == (msg.content or "")
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in parts) == \
        (getattr(msg, "reasoning_content", None) or "")


def test_reasoning_effort_is_the_one_gpt_oss_knows(conv, oc):
    """gpt-oss's template takes low, medium or high: "xhigh" renders as "high" (as Anthropic's route maps it);
    "none" and "minimal", which turn thinking off in templates with that switch, are a 400: gpt-oss always reasons."""
    text = TextIO(conv, load_manifest(conv).config)
    msgs = [{"role": "user", "content": "hi"}]
    for effort, want in (("xhigh", "high"), ("low", "low")):
        r = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, reasoning_effort=effort,
                                       extra_body={"return_token_ids": True})
        assert f"Reasoning: {want}\n" in text.decode(r.prompt_token_ids), text.decode(r.prompt_token_ids)
    for effort in ("none", "minimal"):
        with pytest.raises(openai.BadRequestError) as e:
            oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, reasoning_effort=effort)
        assert "gpt-oss always reasons" in e.value.message and e.value.body["param"] == "reasoning_effort"
    with pytest.raises(openai.BadRequestError) as e:  # the Responses API names its own field
        oc.responses.create(model="tiny", input="hi", max_output_tokens=1, reasoning={"effort": "minimal"})
    assert e.value.body["param"] == "reasoning.effort" and "'reasoning.effort' 'minimal'" in e.value.message


BOUNDED = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_is_one_call_valid_against_its_schema(oc, choice):
    """`tool_choice` writes the call's header (`<|channel|>commentary to=functions.`, and a named tool's name up to
    `<|message|>`) and constrains the rest: random weights still make a call of the tools', its arguments valid."""
    import jsonschema

    r = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Weather or time?"}],
                                   tools=BOUNDED, tool_choice=choice, temperature=0, max_tokens=64)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in BOUNDED}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_a_json_answer_is_the_final_messages_text(oc):
    """`response_format` holds the final message to the schema, after whatever reasoning the model writes
    (`<|end|>` favoured so the random weights end their reasoning): the content is the JSON, valid."""
    import jsonschema

    schema = BOUNDED[0]["function"]["parameters"]
    r = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Which city?"}], temperature=0,
                                   max_tokens=96, logit_bias={"521": 20},
                                   response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_run_holds_the_final_message_to_the_schema(conv):
    """`streamoe run --json-schema` in a harmony chat (`cli_run.json_constraint`, harmony): the grammar lets an
    `analysis` message run free, then wants the final channel's header and JSON valid against the schema; the
    first token can only open a header (JSON straight away is what --raw gets)."""
    from streamoe.runtime.cli_run import json_constraint

    schema = BOUNDED[0]["function"]["parameters"]
    eng = Engine(conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 << 20))
    try:
        made = json_constraint(eng, schema, thinking=True, harmony=True)
        first = made().allowed()
        assert first is not None and [i for i, ok in enumerate(first.tolist()) if ok] == [519]  # <|channel|>
        for text, complete in (('<|channel|>analysis<|message|>so<|end|><|start|>assistant<|channel|>final<|message|>'
                                 '{"city": "Bern"}', True), ('<|channel|>final<|message|>{"city": "Bern"}', True),
                                ('<|channel|>final<|message|>{"city": "Bern', False)):
            c = made()
            for t in eng.text.encode(text):
                assert c.allowed().tolist()[t], (text, t)
                c.advance(t)
            assert c.complete == complete
        raw = json_constraint(eng, schema, thinking=False)().allowed().tolist()
        assert raw[eng.text.encode("{")[0]] and not raw[519]
    finally:
        eng.close()


def test_a_thinking_budget_ends_where_the_answer_opens_without_reasoning(conv):
    """gpt-oss may open its final message at once: `<|channel|>final` ends the budget unforced, so the final message
    is the schema's JSON under the budget as without it (the close was forced into it before). An analysis message
    longer than the budget is still closed into the final message."""
    from streamoe.runtime.cli_run import json_constraint
    from streamoe.runtime.constrain import HARMONY_CLOSE, ThinkingBudget, reasoning_close, reasoning_header

    eng = Engine(conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 << 20))
    try:
        made = json_constraint(eng, BOUNDED[0]["function"]["parameters"], thinking=True, harmony=True)
        close, header = reasoning_close(eng.text, True), reasoning_header(eng.text, True)
        so = "so so so"
        final = eng.text.encode('<|channel|>final<|message|>{"city": "Bern"}')
        # "final" in other tokens than the tokenizer's own, as the grammar lets the model write it
        spelt = [t for piece in ("<|channel|>", "fi", "n", "al", '<|message|>{"city": "Bern"}')
                 for t in eng.text.encode(piece)]
        assert eng.text.decode(spelt) == eng.text.decode(final) and spelt != final
        for ids, budget in ((final, 1), (spelt, 1),
                            (eng.text.encode(f'<|channel|>analysis<|message|>{so}{HARMONY_CLOSE}{{"city": "Bern"}}'),
                             len(eng.text.encode(so)))):
            b = ThinkingBudget(close, budget, eng.args.vocab_size, made(), header)
            text = eng.text.decode(ids)
            for t in ids:
                assert b.allowed().tolist()[t], (text, t)
                b.advance(t)
            assert b.closed and b.complete and b.forced == (len(close) if "analysis" in text else 0)
        bare = ThinkingBudget(close, len(eng.text.encode(so)), eng.args.vocab_size, None, header)
        for t in eng.text.encode(so):  # no header at all: the reasoning counted from its first token
            bare.advance(t)
        assert bare.forcing and bare.allowed().tolist().index(True) == close[0]
    finally:
        eng.close()


def test_a_thinking_budget_forces_a_sequence_then_lets_go():
    """`ThinkingBudget` with a close of several tokens (harmony's): after `budget` tokens each is forced in turn,
    then the answer runs free; a close the model writes itself (its first token) ends the budget unforced."""
    from streamoe.runtime.constrain import ThinkingBudget

    b = ThinkingBudget([7, 8, 9], 3, 16)
    for t in (1, 2, 3):
        assert b.allowed() is None
        b.advance(t)
    for t in (7, 8, 9):
        assert b.allowed().tolist() == [i == t for i in range(16)]
        b.advance(t)
    assert b.allowed() is None and b.closed and b.complete
    natural = ThinkingBudget([7, 8, 9], 3, 16)
    for t in (1, 7, 2, 3, 4):
        natural.advance(t)
    assert natural.allowed() is None and natural.closed


def test_a_budgeted_harmony_answer_closes_its_analysis_into_the_final_message(conv):
    """In harmony the budget forces `<|end|><|start|>assistant<|channel|>final<|message|>` (gpt-oss always reasons,
    whatever `enable_thinking` says): greedy, the first `budget` tokens are the unbudgeted answer's, then the close,
    then the model goes on; `run --thinking-budget` takes it (it needed `</think>` before)."""
    from streamoe.runtime.constrain import HARMONY_CLOSE, ThinkingBudget, reasoning_close

    from .conftest import cli

    messages = [{"role": "user", "content": "Think, then answer."}]
    eng = Engine(conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 << 20))
    try:
        close = reasoning_close(eng.text, harmony=True)
        assert close == eng.text.encode(HARMONY_CLOSE) and close[0] == 521 and close[-1] == 522
        ids = eng.text.encode_chat(eng.text.chat_text(messages))
        free = [t for t, _ in eng.generate(ids, 12, Sampler())]
        eng.reset()
        held = [t for t, _ in eng.generate(ids, 12 + len(close), Sampler(),
                                            constraint=ThinkingBudget(close, 5, eng.args.vocab_size))]
    finally:
        eng.close()
    assert 521 not in free[:5] and held[:5] == free[:5] and held[5:5 + len(close)] == close
    p = cli("run", conv, "--cap", 8, "--ctx", 512, "--temp", 0, "-n", 16, "-q", "--thinking-budget", 3,
            "-p", "Think, then answer.", check=True)
    assert HARMONY_CLOSE in p.stdout


def test_anthropics_thinking_budget_is_honoured_in_harmony(conv, server):
    """Anthropic's `thinking.budget_tokens` on gpt-oss (which reasons whether asked or not): the answer is the
    greedy tokens with the reasoning closed into the final message at the budget, as the engine draws them under
    `ThinkingBudget` (unbudgeted, the random weights write no `<|end|>` in 1,040 tokens); its blocks are what
    HarmonyOutput makes of them."""
    import anthropic

    from streamoe.runtime.constrain import HARMONY_CLOSE, ThinkingBudget, reasoning_close, reasoning_header

    ac = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Think, then answer."}]
    r = ac.messages.create(model="tiny", max_tokens=1040, extra_body={"temperature": 0}, messages=messages,
                           thinking={"type": "enabled", "budget_tokens": 1024})
    eng = Engine(conv, Options(cap_gib=8, ctx=1536, runtime_bytes=64 << 20))
    try:
        ids = eng.text.encode_chat(eng.text.chat_text(messages, enable_thinking=True))
        budget = ThinkingBudget(reasoning_close(eng.text, harmony=True), 1024, eng.args.vocab_size,
                                header=reasoning_header(eng.text, harmony=True))
        detok = Detokenizer(eng.text)
        text = "".join(detok.add(t) for t, _ in eng.generate(ids, 1040, Sampler(), constraint=budget))
    finally:
        eng.close()
    assert budget.closed and r.usage.output_tokens == 1040 and text.count(HARMONY_CLOSE) == 1
    want = parse(text, tools=None)[0]
    got = {b.type: (b.thinking if b.type == "thinking" else b.text) for b in r.content}
    # thinking asked for: a thinking block, an empty one where the answer's analysis was empty
    assert got["thinking"] == (want["reasoning_content"] or "") and got.get("text") == want["content"] != ""


def test_a_completion_is_the_text_as_written(conv, oc):
    """/v1/completions continues a raw prompt: its text, marks and all, is the tokens' text, not parsed."""
    marks = {519: 3.0, 520: 3.0, 521: 3.0, 522: 3.0}
    r = oc.completions.create(model="tiny", prompt="Once upon a time", temperature=0, max_tokens=24,
                              logit_bias={str(t): b for t, b in marks.items()})
    eng = Engine(conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 << 20))
    try:
        detok = Detokenizer(eng.text)
        ids = eng.text.encode_prompt("Once upon a time")
        text = "".join(detok.add(t) for t, _ in eng.generate(ids, 24, Sampler(logit_bias=marks)))
    finally:
        eng.close()
    assert "<|message|>" in text and r.choices[0].text == text


def test_other_templates_keep_their_own_parser():
    out = ChatOutput(False, None, [])
    assert collect(out.feed("<|channel|>final<|message|>x") + out.flush())["content"] == "<|channel|>final<|message|>x"


def test_run_json_schema_writes_the_final_messages_json_alone(conv):
    """`run --json-schema` on gpt-oss: stdout is the final message's JSON alone (it parses), the analysis on stderr,
    the headers in neither; with the budget closing the analysis after two tokens."""
    from .conftest import cli

    p = cli("run", conv, "--cap", 8, "--ctx", 512, "--temp", 0, "-n", 40, "-q", "--thinking-budget", 2,
            "--json-schema", json.dumps(BOUNDED[0]["function"]["parameters"]), "-p", "Where?", check=True)
    assert isinstance(json.loads(p.stdout), dict) and "<|" not in p.stdout + p.stderr, (p.stdout, p.stderr)
