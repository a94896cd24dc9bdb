"""`streamoe serve`'s pure parts, without a server: the tool-call parser on exactly what the shipped chat
template renders, thinking and stop strings, streamed and whole answers alike, request checking, and the
prompt cache's keys and segment boundaries."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
from PIL import Image

from streamoe.runtime.serve.chat_output import ChatOutput, StopMatcher, collect
from streamoe.runtime.serve.openai_api import APIError, Limits, parse_chat, parse_completion
from streamoe.runtime.serve.prompt_cache import PromptCache, Snapshot, boundaries, key_items
from streamoe.runtime.serve.worker import assistant_header
from streamoe.runtime.text import TextIO, generation_defaults
from streamoe.runtime.tool_calls import call_prefix, parse_call

from .conftest import REPO

TINY = REPO / "models" / "tiny"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALLS = [{"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
         {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET", "n": [1, 2.5]}}}]


@pytest.fixture(scope="module")
def text() -> TextIO:
    return TextIO(TINY, json.loads((TINY / "config.json").read_text()))


def rendered_answer(text: TextIO, content: str, calls: list[dict]) -> str:
    """What the shipped template writes for an assistant message: the text between its header and <|im_end|>."""
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": content, "tool_calls": calls}]
    s = text.chat_text(msgs, tools=TOOLS, add_generation_prompt=False)
    body = s[s.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):]
    assert body.endswith("<|im_end|>\n")
    return body[: -len("<|im_end|>\n")]


def streamed(text: TextIO, answer: str, **kw) -> list:
    """Feed an answer token by token, as the server decodes it."""
    out = ChatOutput(**kw)
    evs = []
    for t in text.encode(answer):
        evs += out.feed(text.decode([t]))
    return evs + out.flush()


def whole(answer: str, **kw) -> list:
    out = ChatOutput(**kw)
    return out.feed(answer) + out.flush()


@pytest.mark.parametrize("content", ["", "Let me look that up."])
def test_tool_calls_parse_back_from_the_templates_rendering(text, content):
    body = rendered_answer(text, content, CALLS)
    assert body.count("<tool_call>") == 2  # the template's own form, not ours
    for evs in (whole(body, thinking=False, tools=True, stops=[]), streamed(text, body, thinking=False, tools=True, stops=[])):
        got = collect(evs)
        assert got["content"] == (content or None)
        assert [(c["name"], json.loads(c["arguments"])) for c in got["tool_calls"]] == [
            ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET", "n": [1, 2.5]})]


def test_a_parsed_call_renders_back_to_the_same_text(text):
    body = rendered_answer(text, "Sure.", CALLS)
    got = collect(whole(body, thinking=False, tools=True, stops=[]))
    again = [{"id": str(i), "type": "function", "function": c} for i, c in enumerate(got["tool_calls"])]
    assert rendered_answer(text, got["content"], again) == body


@pytest.mark.parametrize("block", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',  # bad JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed
])
def test_malformed_tool_call_blocks_stay_content_verbatim(text, block):
    answer = "Checking.\n" + block
    for evs in (whole(answer, thinking=False, tools=True, stops=[]), streamed(text, answer, thinking=False, tools=True, stops=[])):
        got = collect(evs)
        assert got["tool_calls"] is None and got["content"] == answer


def test_a_malformed_block_beside_a_good_one(text):
    good = rendered_answer(text, "", CALLS[:1])
    answer = good + "\n<tool_call>\nnot json\n</tool_call>"
    got = collect(streamed(text, answer, thinking=False, tools=True, stops=[]))
    assert [c["name"] for c in got["tool_calls"]] == ["get_weather"]
    assert got["content"] == "<tool_call>\nnot json\n</tool_call>"


def test_without_tools_a_tool_call_is_plain_content(text):
    body = rendered_answer(text, "x", CALLS)
    assert collect(whole(body, thinking=False, tools=False, stops=[])) == {"content": body, "reasoning_content": None,
                                                                          "tool_calls": None}


@pytest.mark.parametrize("answer, reasoning, content", [
    ("\n</think>\n\ntriangle", None, "triangle"),  # what the embedded model writes: an empty thought
    ("Two shapes?\nNo, one.\n</think>\n\nstar", "Two shapes?\nNo, one.", "star"),
    ("still thinking\n\n", "still thinking", ""),  # cut by max_tokens inside the thought
])
def test_thinking_becomes_reasoning_content(text, answer, reasoning, content):
    for evs in (whole(answer, thinking=True, tools=False, stops=[]), streamed(text, answer, thinking=True, tools=False, stops=[])):
        got = collect(evs)
        assert (got["reasoning_content"], got["content"]) == (reasoning, content)


@pytest.mark.parametrize("answer, kw", [
    ("Two shapes?\nNo, one.\n</think>\n\nstar\n\n", {"thinking": True}),
    ("  <think>hmm</think>\n\nHello world", {"thinking": False}),  # the model's own <think>
    ("<thin", {"thinking": False}),  # a start of <think> that never was one
    ("Hello\n\nSTOP more", {"thinking": False, "tools": True, "stops": ["STOP"]}),
    ("abcab cabd, then more", {"thinking": False, "stops": ["abcd", "bd"]}),  # a stop inside another's start
    ("I will.\n</think>\n\nSure.\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>\n\nDone\n",
     {"thinking": True, "tools": True}),
    ("x\n<tool_call>\nnot json\n</tool_call>\ny", {"thinking": False, "tools": True}),  # a block kept as content
    ('A\n<tool_call>\n{"name": "f", "arguments": {}}', {"thinking": False, "tools": True}),  # never closed
])
def test_spans_say_which_text_fed_became_content(answer, kw):
    """`ChatOutput.spans` (what logprobs are chosen by): the text fed at each content span joins to the content,
    however the answer is cut into pieces, past the reasoning, markup, tool calls and stop strings."""
    import random

    rng = random.Random(0)
    for _ in range(40):
        cuts = sorted(rng.sample(range(1, len(answer)), rng.randint(0, len(answer) - 1)))
        out = ChatOutput(**{"tools": None, "stops": [], **kw})
        evs = [e for a, b in zip([0, *cuts], [*cuts, len(answer)], strict=True) for e in out.feed(answer[a:b])]
        evs += out.flush()
        content = "".join(v for k, v in evs if k == "content")
        assert "".join(answer[a:a + n] for a, n in out.spans) == content
        assert all(a + n <= b for (a, n), (b, _) in zip(out.spans, out.spans[1:], strict=False))  # in order


def test_spans_of_a_forced_call_lie_before_the_answer():
    out = ChatOutput(thinking=False, tools=True, stops=[])
    evs = out.given('<tool_call>\n{"name": "f", "arguments": ') + out.feed("not json}\n</tool_call>") + out.flush()
    assert collect(evs)["content"] == '<tool_call>\n{"name": "f", "arguments": not json}\n</tool_call>'
    assert out.spans == [(-len('<tool_call>\n{"name": "f", "arguments": '), len(collect(evs)["content"]))]


def test_thinking_then_a_tool_call(text):
    body = rendered_answer(text, "", CALLS[:1])
    got = collect(streamed(text, "I need the weather.\n</think>\n\n" + body, thinking=True, tools=True, stops=[]))
    assert got["reasoning_content"] == "I need the weather." and got["content"] is None
    assert got["tool_calls"][0]["name"] == "get_weather"


def test_a_forced_call_is_parsed_from_its_given_start_and_the_models_rest():
    """tool_choice "required" / named: the call's start is written into the prompt (not generated, so stop
    strings never see it) and the model writes the rest; the answer is parsed as if the model wrote it all."""
    assert parse_chat(chat(tools=TOOLS, tool_choice="auto"), Limits()).force_call is None
    assert parse_chat(chat(tools=TOOLS, tool_choice="required"), Limits()).force_call == ""
    assert call_prefix("json", None) == call_prefix("xml", None) == "<tool_call>\n"
    r = parse_chat(chat(tools=TOOLS + [{"type": "function", "function": {"name": "other"}}],
                        tool_choice={"type": "function", "function": {"name": "get_weather"}}), Limits())
    assert r.tools == TOOLS and r.force_call == "get_weather"
    assert call_prefix("json", r.force_call) == '<tool_call>\n{"name": "get_weather", "arguments": '
    for given, rest, stops in ((call_prefix("json", r.force_call), '{"city": "Paris"}}\n</tool_call>', ["<tool_call>", '"arguments": ']),
                               ("<tool_call>\n", '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
                                ["<tool_call>"])):
        out = ChatOutput(False, True, stops)  # stop strings only the given start holds: they must not match it
        got = collect(out.given(given) + out.feed(rest[:7]) + out.feed(rest[7:]) + out.flush())
        assert got["tool_calls"] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}], got
        assert got["content"] is None


def test_stop_strings_cut_before_the_match_at_any_split():
    answer = "def f(x):\n    return x\n\n\ndef g():"
    for cut in range(len(answer) + 1):
        m = StopMatcher(["\n\n\n", "never"])
        got = m.feed(answer[:cut]) + m.feed(answer[cut:]) + m.flush()
        assert got == "def f(x):\n    return x" and m.stopped


@pytest.mark.parametrize("answer, stops, reasoning, content, stopped", [
    ("\n</think>\n\nstar\n\nmore", ["\n\n"], None, "star", True),  # not the template's newlines after </think>
    ("\n</think>\n\nstar\nmore", ["\n"], None, "star", True),
    ("One.\n\nTwo.\n</think>\n\nstar\n\nmore", ["\n\n"], "One.\n\nTwo.", "star", True),  # nor the reasoning
    ("One.\n\nTwo.\n</think>\n\nstar", ["\n\n"], "One.\n\nTwo.", "star", False),
    ("Hm\n</think>\n\nno.</think>x", ["</think>"], "Hm", "no.", True),
])
def test_stop_strings_match_the_content_not_the_thinking(text, answer, stops, reasoning, content, stopped):
    for evs in (whole(answer, thinking=True, tools=False, stops=stops),
                streamed(text, answer, thinking=True, tools=False, stops=stops)):
        got = collect(evs)
        assert (got["reasoning_content"], got["content"]) == (reasoning, content)
    out = ChatOutput(True, False, stops)
    out.feed(answer)
    assert out.stopped == stopped


def test_parse_call_gives_arguments_as_a_json_string():
    assert parse_call('{"name": "f", "arguments": {"a": "é"}}') == {"name": "f", "arguments": '{"a": "é"}'}
    assert parse_call('{"name": "f"}') == {"name": "f", "arguments": "{}"}
    assert parse_call('{"name": "", "arguments": {}}') is None


# ---- request checking

def png_url(size=(64, 48)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


ASKED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": CALLS[:1]}]


def chat(**kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    (chat(temperature="hot"), "temperature"),
    (chat(temperature=3), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(top_p=1.5), "top_p"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_completion_tokens=2.5), "max_completion_tokens"),
    (chat(n=17), "n"),  # more choices than MAX_N
    (chat(n=0), "n"),
    (chat(stream="yes"), "stream"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(seed="x"), "seed"),
    (chat(logprobs="yes"), "logprobs"),
    (chat(top_logprobs=3), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(response_format={"type": "xml"}), "response_format"),
    (chat(response_format={"type": "json_schema"}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": []}}), "response_format"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}),
     "response_format"),
    (chat(min_p=2), "min_p"),
    (chat(presence_penalty=-3), "presence_penalty"),
    (chat(frequency_penalty="lots"), "frequency_penalty"),
    (chat(repetition_penalty=0), "repetition_penalty"),
    (chat(temperature=float("nan")), "temperature"),
    (chat(tools=[{"type": "function"}]), "tools[0]"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (chat(tools=TOOLS, tool_choice={"type": "function", "function": "get_weather"}), "tool_choice"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{'a': 1}"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "[1, 2]"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": "f"}]}]),
     "messages[1].tool_calls[0]"),
    (chat(messages=[{"role": "assistant", "content": "a", "reasoning_content": 3}]), "messages[0].reasoning_content"),
    (chat(chat_template_kwargs={"add_generation_prompt": False}), "chat_template_kwargs"),
    (chat(stream_options={"include_usage": True}), "stream_options"),  # only beside stream: true
    (chat(logit_bias={"\u00b2": 1}), "logit_bias"),  # a digit to str.isdigit, not to int()
    (chat(logit_bias={"\uff11\uff12": 1}), "logit_bias"),  # full-width digits
    (chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters"),
    (chat(tools=TOOLS + TOOLS), "tools[1].function.name"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [
        {**CALLS[0], "index": 1}]}]), "messages[1].tool_calls[0].index"),
    (chat(chat_template_kwargs={"enable_thinking": "no"}), "chat_template_kwargs"),
    # a field of another role's message, as OpenAI's schema has none there (it would be dropped)
    (chat(messages=[{"role": "user", "content": "hi", "tool_calls": CALLS}]), "messages[0].tool_calls"),
    (chat(messages=[{"role": "user", "content": "hi", "reasoning_content": "secret"}]), "messages[0].reasoning_content"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_call_id": "a"}]),
     "messages[1].tool_call_id"),
    (chat(messages=[{"role": "tool", "content": "4", "tool_call_id": "a", "reasoning": "r"}]), "messages[0].reasoning"),
    (chat(messages=[{"role": "user", "content": []}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text"),
    (chat(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}), "response_format"),
    (chat(metadata={"k" * 65: "v"}), "metadata"),
    (chat(metadata={"k": "v" * 513}), "metadata"),
    # OpenAI's pairing of calls and results (the template renders no ids: a broken pair would go unseen)
    (chat(messages=[*ASKED, {"role": "tool", "content": "x"}]), "messages[2].tool_call_id"),
    (chat(messages=[*ASKED, {"role": "tool", "tool_call_id": "zz", "content": "x"}]), "messages[2].tool_call_id"),
    (chat(messages=[*ASKED, {"role": "tool", "tool_call_id": "a", "content": "x"},
                    {"role": "tool", "tool_call_id": "a", "content": "x"}]), "messages[3].tool_call_id"),
    (chat(messages=[*ASKED, {"role": "user", "content": "and?"}]), "messages[1].tool_calls[0]"),
    (chat(messages=[{"role": "tool", "tool_call_id": "a", "content": "x"}, {"role": "user", "content": "hi"}]),
     "messages[0].tool_call_id"),
    (chat(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [CALLS[0], CALLS[0]]}]),
     "messages[1].tool_calls[1].id"),
])
def test_bad_fields_are_400_naming_the_field(body, param):
    with pytest.raises(APIError) as e:
        parse_chat(body, Limits())
    assert e.value.status == 400 and e.value.param == param
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_calls_without_ids_are_not_paired():
    """Calls sent back without ids (no result can name them) parse, as before the pairing check: no id is given
    twice, and none is left unanswered."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    req = parse_chat(chat(messages=[ASKED[0], {"role": "assistant", "tool_calls": [call, call]},
                                    {"role": "user", "content": "and?"}]), Limits())
    assert [m["role"] for m in req.messages] == ["user", "assistant", "user"]


@pytest.mark.parametrize("url, status, words", [
    ("http://example.com/cat.png", 400, "only data: URLs"),
    ("file:///etc/passwd", 400, "only data: URLs"),
    ("/etc/passwd", 400, "only data: URLs"),
    ("data:image/png,rawbytes", 400, "base64"),
    ("data:image/png;base64,@@@@", 400, "not valid base64"),
    ("data:text/plain;base64,aGVsbG8=", 400, "not an image"),
    ("data:image/png;base64," + base64.b64encode(b"GIF89a" + bytes(40)).decode(), 400, "not an image"),
    ("data:image/png;base64," + "A" * 5000, 413, "at most"),
])
def test_images_only_as_checked_data_urls(url, status, words):
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                      {"type": "text", "text": "?"}]}]}
    with pytest.raises(APIError) as e:
        parse_chat(body, Limits(max_image_bytes=2000))
    assert e.value.status == status and words in e.value.message


def test_an_image_as_clients_write_it_is_read():
    """Base64 wrapped at 76 columns or ending in a line break, the scheme and media type in capitals, and a phone's
    JPEG with a second picture after the first (MPO: read as its first): each is the image, as mlx-vlm reads it."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 10, 10)).save(buf, "PNG")
    png = buf.getvalue()
    mpo = io.BytesIO()
    first = Image.new("RGB", (64, 48), "red")
    first.save(mpo, "MPO", save_all=True, append_images=[Image.new("RGB", (64, 48), "blue")])
    b64 = base64.b64encode(png).decode()
    for url, raw in (("data:image/png;base64," + base64.encodebytes(png).decode(), png),
                     ("DATA:IMAGE/PNG;BASE64," + b64 + "\n", png),
                     ("data:image/jpeg;base64," + base64.b64encode(mpo.getvalue()).decode(), mpo.getvalue())):
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
        assert parse_chat(body, Limits()).images == [raw]
    assert Image.open(io.BytesIO(mpo.getvalue())).format == "MPO"
    from streamoe.runtime.image import PipedImage, load_image

    assert load_image(PipedImage(Path("phone.jpg"), mpo.getvalue())).getpixel((5, 5))[0] > 200  # its first picture: red


def test_a_good_request_normalised():
    body = chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url()}},
                                                       {"type": "text", "text": "shape?"}]},
                          {"role": "assistant", "content": None, "tool_calls": [{**CALLS[0], "index": 0}]},
                          {"role": "tool", "tool_call_id": "a", "content": "18 C"}],
                max_tokens=50, max_completion_tokens=20, stop="\n", top_k=-1, tools=TOOLS, tool_choice="auto",
                chat_template_kwargs={"enable_thinking": False}, stream=True, stream_options={"include_usage": True})
    r = parse_chat(body, Limits())
    assert r.messages[0] == {"role": "system", "content": "be brief"}
    assert r.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "shape?"}]
    assert len(r.images) == 1 and r.images[0].startswith(b"\x89PNG")
    assert r.messages[2] == {"role": "assistant", "content": None, "tool_calls": [  # arguments decoded to an object
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert r.max_tokens == 20 and r.stop == ["\n"] and r.sampling == {"top_k": 0}  # -1 is off; nothing else set
    assert r.tools == TOOLS and r.parse_tools and r.template_kwargs == {"enable_thinking": False}
    assert r.stream and r.include_usage
    assert parse_chat(chat(tools=TOOLS, tool_choice="none"), Limits()).tools is None


def test_too_many_images_and_images_outside_user_messages():
    part = {"type": "image_url", "image_url": {"url": png_url()}}
    with pytest.raises(APIError, match="at most 2 images"):
        parse_chat({"messages": [{"role": "user", "content": [part, part, part]}]}, Limits(max_images=2))
    with pytest.raises(APIError, match="user messages only"):
        parse_chat({"messages": [{"role": "system", "content": [part]}]}, Limits())


def test_completion_prompts():
    assert parse_completion({"prompt": "def f():"}).prompt == "def f():"
    assert parse_completion({"prompt": ["x"]}).prompt == "x"
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["a", "b"], "n": 2}).prompts == ["a", "b"]  # a batch
    assert parse_completion({"prompt": [[1, 2], [3]]}).prompts == [[1, 2], [3]]
    for p in (None, "", [], [1, "a"], {"a": 1}, ["a", ""], [[1], []], [[1], [True]], ["a", 5], [["a"]]):
        with pytest.raises(APIError) as e:
            parse_completion({"prompt": p})
        assert e.value.status == 400 and e.value.param == "prompt"


# ---- prompt cache keys and the template's boundaries

def test_assistant_header_and_boundaries(text):
    header = assistant_header(text)
    assert text.decode(header) == "<|im_start|>assistant\n"
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    ids = text.encode(text.chat_prompt(msgs))
    cuts = boundaries(ids, header)
    assert [text.decode(ids[:c])[-len("assistant\n"):] for c in cuts] == ["assistant\n", "assistant\n"]
    # the first cut is where the first turn's own prompt had its boundary: the next turn shares that prefix
    first = text.encode(text.chat_prompt(msgs[:1]))
    assert boundaries(first, header) == [cuts[0]] and first[:cuts[0]] == ids[:cuts[0]]
    assert boundaries(ids, []) == []


def test_keys_tell_images_apart_and_lookup_takes_the_longest_prefix():
    import numpy as np

    a, b = key_items([1, 9, 9, 2], 9, ["h1", "h2"]), key_items([1, 9, 9, 2], 9, ["h1", "h3"])
    assert a == (1, ("image", "h1"), ("image", "h2"), 2) and a != b
    assert key_items([9, 1], 9, []) == (9, 1)  # a placeholder in raw text, without an image, is a plain token
    salted = key_items([1, 2, 3], None, [], "s")
    assert salted == (("salt", "s", 1), 2, 3) and len(salted) == 3  # positions as unsalted: cuts fall where they did
    pc = PromptCache(budget=1000)
    for k in [(1,), (1, 2), (1, 2, 3), (5, 6)]:
        pc.add(Snapshot(k, len(k), 0, [("x", np.zeros(4, np.uint8))]))
    assert pc.lookup((1, 2, 3)).key == (1, 2)  # a snapshot of the whole prompt is not used: one token must be fed
    assert pc.lookup(salted) is None  # nothing unsalted is a prefix of a salted key
    assert pc.lookup((1, 2, 3, 4)).key == (1, 2, 3)
    assert pc.lookup((7, 8)) is None and pc.lookup((5,)) is None
    assert pc.hits == 2 and pc.misses == 3 and pc.tokens_saved == 5


def test_lru_eviction_keeps_the_budget():
    import numpy as np

    pc = PromptCache(budget=3000)
    snap = lambda k: Snapshot(k, 1, 0, [("layers.0.state", np.zeros(250, np.float32))])  # noqa: E731  1000 B each
    for k in [(1,), (2,), (3,)]:
        pc.add(snap(k))
    pc.lookup((1, 0))  # (1,) is now the most recent
    pc.add(snap((4,)))
    assert list(pc.snaps) == [(3,), (1,), (4,)] and pc.nbytes == 3000
    pc.add(Snapshot((9,), 1, 0, [("x", np.zeros(1000, np.float32))]))  # larger than the budget: not kept
    assert (9,) not in pc.snaps and pc.nbytes <= 3000


def test_sampling_defaults_come_from_generation_config(tmp_path):
    greedy = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
    assert generation_defaults(TINY) == {**greedy, "temp": 1.0, "top_p": 0.95, "top_k": 20}
    (tmp_path / "generation_config.json").write_text('{"do_sample": false, "temperature": 0.6}')
    assert generation_defaults(tmp_path)["temp"] == 0.0
    assert generation_defaults(tmp_path / "none") == greedy  # no file: greedy
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.7, "min_p": 0.1, "repetition_penalty": 1.1}')
    assert generation_defaults(tmp_path) == {**greedy, "temp": 0.7, "min_p": 0.1, "repetition_penalty": 1.1}
    # token ids alone (Mixtral's): no sampling asked for, greedy as transformers reads it (it was temperature 1)
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    assert generation_defaults(tmp_path) == greedy
    (tmp_path / "generation_config.json").write_text('{"do_sample": true}')
    assert generation_defaults(tmp_path) == {**greedy, "temp": 1.0}


def test_run_takes_unset_sampling_from_generation_config():
    from streamoe.cli import generation_defaults_of

    assert generation_defaults_of(TINY) == generation_defaults(TINY)
    assert generation_defaults_of(TINY / "config.json")["temp"] == 0.0  # a bare config: greedy
