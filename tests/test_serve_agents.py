"""The surface agents speak, against a live `streamoe serve` on the trained tiny model: OpenAI's Responses API
(the `openai` client and the default openai-agents SDK agent), Anthropic's Messages API (the `anthropic`
client), logprobs, `/v1/models/{id}` and `/metrics`. Answers are checked token for token against the
engine on the same conversion, logprobs against log_softmax of the engine's own logits, and every payload
against the official SDKs' strict types. The translation layers' handling of tool calls and reasoning is
checked on the template's own rendering (the tiny model never writes a valid call by itself)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import typing
from pathlib import Path

import anthropic
import jsonschema
import mlx.core as mx
import mlx.nn
import numpy as np
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from openai.types.chat import ChatCompletion
from openai.types.responses import Response, ResponseStreamEvent
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from streamoe.runtime.engine import Engine, Options
from streamoe.runtime.plan import MiB
from streamoe.runtime.sampling import Sampler
from streamoe.runtime.serve import anthropic_api, responses_api
from streamoe.runtime.serve.chat_output import ChatOutput
from streamoe.runtime.serve.openai_api import APIError, GenRequest, Limits, parse_chat, parse_completion
from streamoe.runtime.serve.server import OpenAIOutput
from streamoe.runtime.serve.worker import Choice, EngineWorker, Job, ServeOptions, open_engine
from streamoe.runtime.text import Detokenizer, TextIO

from . import serve_util
from .conftest import cli, one_error_line
from .serve_util import TINY, chat_ids, fetch, greedy, start_server, stop_server, triangle_png

CTX = 1024
RUNTIME_MIB = 256
ALIASES = ["claude-sonnet-4-5", "claude-haiku-4-5"]  # the names Claude Code asks for
SERVE = ["--ctx", CTX, "--runtime-mib", RUNTIME_MIB, "--prompt-cache-mib", 8, "--max-body-mib", 0.5, "--max-image-mib", 0.1,
         *(x for a in ALIASES for x in ("--served-model-name", a))]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                                "parameters": WEATHER}}]
RESP_TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": WEATHER}]
ANTH_TOOLS = [{"name": "get_weather", "description": "The weather in a city", "input_schema": WEATHER}]
CONVO = [{"role": "user", "content": "What is the weather in Paris?"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
         {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]


def by_type(union) -> dict[str, type]:
    """An SDK's stream event union -> {event type: its strict pydantic model}."""
    classes = typing.get_args(typing.get_args(union)[0]) if typing.get_origin(union) is typing.Annotated else \
        typing.get_args(union)
    return {typing.get_args(c.model_fields["type"].annotation)[0]: c for c in classes}


RESPONSE_EVENTS, MESSAGE_EVENTS = by_type(ResponseStreamEvent), by_type(RawMessageStreamEvent)


def validate(kinds: dict[str, type], ev: dict) -> None:
    if ev != {"type": "ping"}:  # Anthropic's stream has pings, which its SDK reads past
        kinds[ev["type"]].model_validate(ev)


@pytest.fixture(scope="module")
def conv(trained_conv) -> Path:
    return trained_conv


@pytest.fixture(scope="module")
def server(conv, tmp_path_factory):
    cap = serve_util.quarter_cap(conv, CTX, RUNTIME_MIB, cache_mib=8, body_mib=0.5)
    s = start_server(conv, tmp_path_factory.mktemp("log") / "serve.log", "--cap", cap, *SERVE)
    yield s
    stop_server(s)


@pytest.fixture(scope="module")
def oc(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ac(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(conv):
    eng = Engine(conv, Options(cap_gib=8, ctx=CTX, images=True, runtime_bytes=RUNTIME_MIB * MiB))
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def triangle(tmp_path_factory) -> Path:
    return triangle_png(tmp_path_factory.mktemp("img") / "triangle.png")


def events(lines: list[str]) -> list[dict]:
    """The JSON payloads of an event stream's data lines, each after its `event:` line of the same type."""
    out, named = [], None
    for ln in lines:
        if ln.startswith("event: "):
            named = ln[7:]
        elif ln.startswith("data: "):
            obj = json.loads(ln[6:])
            assert obj["type"] == named
            out.append(obj)
    return out


# ---- the translation layers, on the template's own rendering of a call (no server)

@pytest.fixture(scope="module")
def text() -> TextIO:
    return TextIO(TINY, json.loads((TINY / "config.json").read_text()))


def answer_events(text: TextIO, answer: str) -> list[tuple]:
    """An answer fed token by token through the real ChatOutput, as the worker does, as job events."""
    out, evs = ChatOutput(thinking=True, tools=True, stops=[]), []
    for t in text.encode(answer):
        if got := out.feed(text.decode([t])):
            evs.append(("delta", got))
    if got := out.flush():
        evs.append(("delta", got))
    usage = {"prompt_tokens": 30, "completion_tokens": 20, "total_tokens": 50,
             "prompt_tokens_details": {"cached_tokens": 10}, "completion_tokens_details": {"reasoning_tokens": 5}}
    return evs + [("done", {"finish_reason": "stop", "usage": usage, "stop_sequence": None})]


def rendered(text: TextIO, thought: str, content: str, n_calls: int) -> str:
    """What the shipped template writes for an assistant turn with these calls, after a thought."""
    calls = [{"id": str(i), "type": "function", "function": {"name": "get_weather", "arguments": {"city": c}}}
             for i, c in enumerate(["Paris", "Oslo"][:n_calls])]
    msgs = [{"role": "user", "content": "?"}, {"role": "assistant", "content": content, "tool_calls": calls}]
    s = text.template.render(messages=msgs, tools=CHAT_TOOLS, add_generation_prompt=False, bos_token="", eos_token="")
    body = s[s.rindex("<|im_start|>assistant\n") + len("<|im_start|>assistant\n"):-len("<|im_end|>\n")]
    return thought + "\n</think>\n\n" + body


def job_for(req: GenRequest) -> Job:
    return Job(req, [Choice(Sampler(), [1, 2, 3], 64, None)], thinking=True,
               started={"prompt_tokens": 3, "cached_tokens": 0})  # as the worker has looked it up


def test_responses_stream_items_reasoning_text_and_calls(text):
    so = ServeOptions("m")
    req = responses_api.parse({"input": "?", "tools": RESP_TOOLS, "stream": True}, so)
    out = responses_api.Output(job_for(req), "m")
    evs = [json.loads(s.split("data: ", 1)[1]) for s in out.start()]
    for ev in answer_events(text, rendered(text, "Paris is in France.", "Let me look.", 2)):
        evs += [json.loads(s.split("data: ", 1)[1]) for s in out.feed(ev)]
    for e in evs:
        validate(RESPONSE_EVENTS, e)
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    kinds = [e["type"] for e in evs]
    n_reason = kinds.count("response.reasoning_text.delta")
    n_text = kinds.count("response.output_text.delta")
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.reasoning_text.delta"] * n_reason, "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * n_text, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     *["response.output_item.added", "response.function_call_arguments.delta",
                       "response.function_call_arguments.done", "response.output_item.done"] * 2,
                     "response.completed"]
    final = Response.model_validate(evs[-1]["response"])
    assert Response.model_validate(out.result()) == final
    reasoning, msg, c1, c2 = final.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == "Paris is in France."
    assert msg.type == "message" and msg.content[0].text == "Let me look." == final.output_text
    assert [(c.name, json.loads(c.arguments)) for c in (c1, c2)] == [("get_weather", {"city": "Paris"}),
                                                                   ("get_weather", {"city": "Oslo"})]
    assert c1.call_id != c2.call_id
    assert final.usage.input_tokens == 30 and final.usage.input_tokens_details.cached_tokens == 10
    assert final.usage.output_tokens == 20 and final.usage.output_tokens_details.reasoning_tokens == 5


def test_responses_parallel_calls_off_and_strict_schemas(text):
    so = ServeOptions("m")
    strict = [{**RESP_TOOLS[0], "strict": True, "parameters": {**WEATHER, "properties": {"city": {"type": "integer"}}}}]
    for body, want in (({"parallel_tool_calls": False, "tools": RESP_TOOLS}, ["function_call"]),
                       ({"tools": strict}, ["message"])):  # "Paris" is no integer: the call stays text
        out = responses_api.Output(job_for(responses_api.parse({"input": "?", **body}, so)), "m")
        for ev in answer_events(text, rendered(text, "", "", 2)):
            out.feed(ev)
        got = Response.model_validate(out.result())
        assert [i.type for i in got.output] == want
    assert '"name": "get_weather"' in got.output_text


def test_chat_parallel_calls_off_and_strict_schemas(text):
    """Chat Completions' `parallel_tool_calls: false` keeps the first call, and a `strict` tool's call whose
    arguments break its schema comes back as text, as the Responses and Anthropic layers answer them."""
    strict = [{"type": "function", "function": {**CHAT_TOOLS[0]["function"], "strict": True,
                                                 "parameters": {**WEATHER, "properties": {"city": {"type": "integer"}}}}}]
    for body, want_calls in (({"tools": CHAT_TOOLS}, ["Paris", "Oslo"]),
                             ({"tools": CHAT_TOOLS, "parallel_tool_calls": False}, ["Paris"]),
                             ({"tools": strict}, [])):  # "Paris" is no integer: both calls stay text
        out = OpenAIOutput(job_for(parse_chat({"messages": [{"role": "user", "content": "?"}], **body}, Limits())), "m")
        for ev in answer_events(text, rendered(text, "", "", 2)):
            out.feed(ev)
        msg = ChatCompletion.model_validate(out.result()).choices[0].message
        assert [json.loads(c.function.arguments)["city"] for c in msg.tool_calls or []] == want_calls
        assert (msg.content or "").count('"name": "get_weather"') == (2 if body["tools"] is strict else 0)


def test_calls_of_an_answer_cut_by_max_tokens_finish_by_length(text):
    """Calls made, then the answer cut by its token limit (one more call perhaps cut short): "length", and
    Anthropic's "max_tokens", not "tool_calls": a client must not run the calls of an answer that did not end."""
    evs = answer_events(text, rendered(text, "", "", 2))
    cut = evs[:-1] + [("done", {**evs[-1][1], "finish_reason": "length"})]
    for stream in (False, True):
        body = {"messages": [{"role": "user", "content": "?"}], "tools": CHAT_TOOLS, "stream": stream}
        for got, want in ((evs, "tool_calls"), (cut, "length")):
            out = OpenAIOutput(job_for(parse_chat(body, Limits())), "m")
            sent = [s for ev in got for s in out.feed(ev)]
            if stream:
                finishes = [c["finish_reason"] for s in sent if s.startswith("data: {")
                            for c in json.loads(s[6:])["choices"] if c.get("finish_reason")]
                assert finishes == [want], sent
            else:
                assert out.result()["choices"][0]["finish_reason"] == want
    so = ServeOptions("m")
    full = cut[:-1] + [("done", {**cut[-1][1], "context_full": True})]  # the context ended it, before max_tokens
    for got, want in ((evs, "tool_use"), (cut, "max_tokens"), (full, "model_context_window_exceeded")):
        out = anthropic_api.Output(job_for(anthropic_api.parse(
            {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "?"}],
             "tools": [{"name": "get_weather", "input_schema": CHAT_TOOLS[0]["function"]["parameters"]}]}, so)), "m")
        for ev in got:
            out.feed(ev)
        assert out.result()["stop_reason"] == want


def chat(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **kw}


PREFILLED = [{"role": "user", "content": "Write a Python function that adds two numbers."},
             {"role": "assistant", "content": "def add(a, b):"}]  # the answer's start, for the model to continue


@pytest.mark.parametrize("body, param", [
    (chat(foo=1), "foo"),
    (chat(store=True), "store"),
    (chat(service_tier="flex"), "service_tier"),
    (chat(prompt_cache_retention="24h"), "prompt_cache_retention"),
    (chat(modalities=["text", "audio"]), "modalities"),
    (chat(audio={"voice": "alloy", "format": "mp3"}), "audio"),
    (chat(prediction={"type": "content", "content": "x"}), "prediction"),
    (chat(verbosity="low"), "verbosity"),
    (chat(web_search_options={}), "web_search_options"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(function_call="auto"), "function_call"),
    (chat(metadata={"a": 1}), "metadata"),
    (chat(user=7), "user"),
    (chat(parallel_tool_calls="no"), "parallel_tool_calls"),
    (chat(reasoning_effort="huge"), "reasoning_effort"),
    (chat(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False}), "reasoning_effort"),
    (chat(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
    (chat(stream_options={"include_usage": True, "extra": 1}), "stream_options.extra"),
    (chat(messages=[{"role": "user", "content": "hi", "foo": 1}]), "messages[0].foo"),
    (chat(messages=[{"role": "user", "content": "hi", "name": 3}]), "messages[0].name"),
    (chat(messages=[{"role": "assistant", "content": None, "refusal": "no"}]), "messages[0].refusal"),
    (chat(messages=[{"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]),
     "messages[0].function_call"),
    (chat(messages=[{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}, "x": 1}]}]),
     "messages[0].tool_calls[0].x"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "paramters": {}}}]), "tools[0].function.paramters"),
    (chat(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "a>b"}}]), "tools[0].function.name"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "strict": "false"}}]), "tools[0].function.strict"),
    (chat(tools=[{"type": "function", "function": {"name": "f", "description": 5}}]), "tools[0].function.description"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {}, "strict": "no"}}),
     "response_format.json_schema.strict"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]),
     "messages[0].content[0].cache_control"),
    (chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {}}]}]),
     "messages[0].content[0].prompt_cache_breakpoint"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}}]}]),
     "messages[0].content[0].image_url.detail"),
    (chat(tools=[{"type": "function", "function": {"name": "f"}, "cache_control": {}}]), "tools[0].cache_control"),
    (chat(logit_bias={"x": 1}), "logit_bias"),
    (chat(logit_bias={"5": 101}), "logit_bias"),
    (chat(logit_bias={"5": True}), "logit_bias"),
    (chat(logit_bias=[5]), "logit_bias"),
    (chat(continue_final_message=True), "continue_final_message"),  # the last message is the user's
    (chat(messages=PREFILLED, continue_final_message=True, add_generation_prompt=True), "add_generation_prompt"),
    (chat(messages=PREFILLED, add_generation_prompt=False), "add_generation_prompt"),  # alone: not supported
    (chat(messages=PREFILLED, continue_final_message=True, add_generation_prompt="no"), "add_generation_prompt"),
    (chat(messages=PREFILLED, continue_final_message=True, response_format={"type": "json_object"}), "response_format"),
    (chat(messages=PREFILLED, continue_final_message=True, structured_outputs={"choice": ["a"]}),
     "structured_outputs.choice"),
    (chat(messages=PREFILLED, continue_final_message=True, tools=CHAT_TOOLS, tool_choice="required"), "tool_choice"),
    (chat(messages=[*PREFILLED[:1], {"role": "assistant", "content": " "}], continue_final_message=True),
     "continue_final_message"),
    (chat(messages=PREFILLED, echo=True), "echo"),  # an assistant's message echoed only where it is continued
])
def test_chat_fields_refused_with_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        parse_chat(body, Limits())
    assert e.value.status == 400 and e.value.param == param, e.value.message


@pytest.mark.parametrize("body, param", [({"prompt": "x", "foo": 1}, "foo"), ({"prompt": "x", "messages": []}, "messages"),
                                         ({"prompt": "x", "user": 7}, "user"),
                                         ({"prompt": "x", "top_logprobs": 2}, "top_logprobs"),
                                         ({"prompt": "x", "stream_options": {"x": 1}}, "stream_options.x")])
def test_completion_fields_refused_with_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        parse_completion(body)
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_chat_fields_honoured():
    """What the Chat Completions fields this server takes do to the request: the reasoning effort is the
    template's thinking switch (and the effort itself, for templates that read it), a message's name reaches
    the template, and the fields that only label a request are accepted as they are."""
    r = parse_chat(chat(reasoning_effort="minimal"), Limits())
    assert r.template_kwargs == {"enable_thinking": False, "reasoning_effort": "minimal"}
    r = parse_chat(chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": True}), Limits())
    assert r.template_kwargs == {"enable_thinking": True, "reasoning_effort": "low"}
    r = parse_chat(chat(messages=[{"role": "user", "content": "hi", "name": "bob"}], store=False, metadata={"k": "v"},
                        user="u", safety_identifier="s", prompt_cache_key="p", prompt_cache_retention="in_memory",
                        service_tier="auto", modalities=["text"], parallel_tool_calls=True, logit_bias={},
                        stream=True, stream_options={"include_usage": True, "include_obfuscation": False}), Limits())
    assert r.messages == [{"role": "user", "content": "hi", "name": "bob"}] and r.include_usage
    assert r.api == {"strict": {}, "parallel": True}
    strict = {"type": "function", "function": {"name": "f", "strict": True}}
    assert parse_chat(chat(tools=[strict]), Limits()).api["strict"] == {"f": {"type": "object", "properties": {}}}


def test_anthropic_stream_blocks_thinking_text_and_tool_use(text):
    so = ServeOptions("m")
    req = anthropic_api.parse({"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "?"}],
                               "tools": ANTH_TOOLS, "stream": True, "thinking": {"type": "adaptive"}}, so)
    out = anthropic_api.Output(job_for(req), "m")
    evs = [json.loads(s.split("data: ", 1)[1]) for s in out.start()]
    for ev in answer_events(text, rendered(text, "Paris is in France.", "Let me look.", 1)):
        evs += [json.loads(s.split("data: ", 1)[1]) for s in out.feed(ev)]
    for e in evs:
        validate(MESSAGE_EVENTS, e)
    kinds = [(e["type"], e.get("delta", e.get("content_block", {})).get("type")) for e in evs]
    deltas = [k for k in kinds if k[0] == "content_block_delta"]
    assert kinds[:2] == [("message_start", None), ("ping", None)]
    assert kinds[-2:] == [("message_delta", None), ("message_stop", None)]
    assert [k for k in kinds if k[0] == "content_block_start"] == [
        ("content_block_start", "thinking"), ("content_block_start", "text"), ("content_block_start", "tool_use")]
    assert {d[1] for d in deltas} == {"thinking_delta", "text_delta", "input_json_delta"}
    msg = Message.model_validate(out.result())
    thinking, said, use = msg.content
    assert thinking.thinking == "Paris is in France." and said.text == "Let me look."
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"}) and use.id.startswith("toolu_")
    assert msg.stop_reason == "tool_use" == evs[-2]["delta"]["stop_reason"]
    assert msg.usage.input_tokens == 20 and msg.usage.cache_read_input_tokens == 10 and msg.usage.output_tokens == 20


def test_an_error_mid_answer_ends_each_stream_in_its_own_shape():
    so, err = ServeOptions("m"), APIError(500, "internal error: RuntimeError")
    out = responses_api.Output(job_for(responses_api.parse({"input": "?"}, so)), "m")
    evs = [json.loads(t.split("data: ", 1)[1]) for t in out.start() + out.feed(("delta", [("content", "Hi")]))
           + out.feed(("error", err))]
    for e in evs:
        validate(RESPONSE_EVENTS, e)
    assert [e["type"] for e in evs[-5:]] == ["response.output_text.done", "response.content_part.done",
                                             "response.output_item.done", "error", "response.failed"]
    assert evs[-1]["response"]["status"] == "failed" and evs[-2]["message"] == err.message
    out = anthropic_api.Output(job_for(anthropic_api.parse(am(), so)), "m")
    texts = out.start() + out.feed(("delta", [("content", "Hi")])) + out.feed(("error", err))
    assert texts[-2:] == ["event: content_block_stop\ndata: {\"type\": \"content_block_stop\", \"index\": 0}\n\n",
                          'event: error\ndata: {"type": "error", "error": {"type": "api_error", '
                          '"message": "internal error: RuntimeError"}}\n\n']


def test_responses_input_items_become_the_chat_messages():
    so = ServeOptions("m")
    req = responses_api.parse({"instructions": "Be brief.", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"}]}, so)
    assert req.messages == [{"role": "system", "content": "Be brief."}, CONVO[0],
                            {**CONVO[1], "reasoning_content": "Use the tool.",
                             "tool_calls": [{**CONVO[1]["tool_calls"][0],
                                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                            CONVO[2]]


def test_anthropic_blocks_become_the_chat_messages():
    so = ServeOptions("m")
    req = anthropic_api.parse({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}],
                               "messages": [
                                   {"role": "user", "content": "What is the weather in Paris?"},
                                   {"role": "assistant", "content": [
                                       {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]},
                                   {"role": "user", "content": [
                                       {"type": "tool_result", "tool_use_id": "call_1", "content": "18 degrees, sunny"},
                                       {"type": "text", "text": "Thanks"}]}]}, so)
    assert req.messages == [{"role": "system", "content": "Be brief."}, CONVO[0],
                            {**CONVO[1], "tool_calls": [{**CONVO[1]["tool_calls"][0],
                                                         "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                            CONVO[2], {"role": "user", "content": "Thanks"}]


def test_anthropic_turns_of_one_role_combine_and_an_empty_final_turn_is_no_prefill():
    """As Anthropic's API: consecutive messages of one role are one turn (two user messages, then a tool call's
    result beside a second user message), and an empty final assistant message leaves the answer unstarted."""
    so = ServeOptions("m")
    req = anthropic_api.parse(am(messages=[
        {"role": "user", "content": "What is the weather"}, {"role": "user", "content": [{"type": "text", "text": " in Paris?"}]},
        {"role": "assistant", "content": [TOOL_USE]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 degrees, sunny"}]},
        {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": ""}], tools=ANTH_TOOLS), so)
    assert req.messages == [{"role": "user", "content": "What is the weather in Paris?"},
                            {"role": "assistant", "content": "", "tool_calls": [
                                {"id": "t1", "type": "function", "function": {"name": "get_weather",
                                                                              "arguments": {"city": "Paris"}}}]},
                            {"role": "tool", "tool_call_id": "t1", "content": "18 degrees, sunny"},
                            {"role": "user", "content": "Thanks"}]
    assert not req.continue_final


THOUGHT_LOOP = [  # a tool loop after the user's question, each call after a thought
    {"role": "user", "content": "What is the weather in Paris and in Oslo?"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Paris first: call the tool.", "signature": "s"},
                                      {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "18 degrees, sunny"}]},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Now Oslo.", "signature": "s"},
                                      {"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": "4 degrees, rain"}]}]


def test_anthropic_context_management_clears_older_thinking(tiny_conv):
    """`context_management`'s `clear_thinking_20251015` (Claude Code sends it, `keep` "all"): "all" keeps every
    turn's thinking; `thinking_turns` 1 takes the first turn's out of the prompt, which is then the prompt of the
    same conversation with that thinking block left out, and the tokens it cleared (counted on a template that
    renders a tool loop's thinking) are reported with the edit; `output_config.effort` reaches the template."""
    so = ServeOptions("m", prompt_cache_bytes=0)
    w = EngineWorker(open_engine(tiny_conv, Options(cap_gib=8, ctx=CTX, runtime_bytes=RUNTIME_MIB * MiB), so), so)
    try:
        def body(messages: list, edit: dict | None) -> dict:
            cm = {"context_management": {"edits": [edit]}} if edit else {}
            return {"model": "m", "max_tokens": 64, "messages": messages, "tools": ANTH_TOOLS,
                    "thinking": {"type": "adaptive"}, "output_config": {"effort": "xhigh"}, **cm}

        def prepared(messages: list, edit: dict | None):
            req = anthropic_api.parse(body(messages, edit), so)
            return req, w.prepare(req).ids

        req, all_kept = prepared(THOUGHT_LOOP, {"type": "clear_thinking_20251015", "keep": "all"})
        assert anthropic_api.applied_edits(req) == [] and all_kept == prepared(THOUGHT_LOOP, None)[1]
        assert req.template_kwargs["reasoning_effort"] == "high"
        req, kept_one = prepared(THOUGHT_LOOP, {"type": "clear_thinking_20251015",
                                                "keep": {"type": "thinking_turns", "value": 1}})
        by_hand = [THOUGHT_LOOP[0], {**THOUGHT_LOOP[1], "content": THOUGHT_LOOP[1]["content"][1:]}, *THOUGHT_LOOP[2:]]
        assert kept_one == prepared(by_hand, None)[1] and len(kept_one) < len(all_kept)
        assert anthropic_api.applied_edits(req) == [{"type": "clear_thinking_20251015", "cleared_thinking_turns": 1,
                                                      "cleared_input_tokens": len(all_kept) - len(kept_one)}]
    finally:
        w.eng.close()


def test_a_claude_code_shaped_request_is_answered(server, ac):
    """The body Claude Code sends for a model that thinks adaptively (`thinking` adaptive, `output_config.effort`,
    `context_management` keeping all thinking, a system prompt with cache markers, tools, `metadata.user_id`),
    streamed by the `anthropic` client to its end, every event of the SDK's types, the edits reported on the
    message (none applied); `count_tokens` reports the count before the edits too."""
    kw = {"model": "claude-sonnet-4-5", "max_tokens": 16, "system": [
              {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "List the files here."}]}],
          "tools": ANTH_TOOLS, "metadata": {"user_id": "user_abc_session_1"}, "thinking": {"type": "adaptive"},
          "extra_body": {"output_config": {"effort": "medium"},
                         "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}}
    with ac.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    body = {**{k: v for k, v in kw.items() if k != "extra_body"}, **kw["extra_body"], "stream": True}
    _, lines = serve_util.sse_lines(server.url + "/v1/messages", body)
    evs = events(lines)
    for e in evs:
        validate(MESSAGE_EVENTS, e)
    assert [e for e in evs if e["type"] == "message_delta"][0]["context_management"] == {"applied_edits": []}
    counted = fetch(server.url + "/v1/messages/count_tokens", "POST", {
        k: v for k, v in body.items() if k not in ("max_tokens", "stream", "metadata")}).json()
    assert counted["context_management"] == {"original_input_tokens": counted["input_tokens"]}


def rq(**kw) -> dict:
    return {"model": "tiny", "input": "hi", **kw}


@pytest.mark.parametrize("body, param", [
    (rq(store=True), "store"),
    (rq(previous_response_id="resp_1"), "previous_response_id"),
    (rq(conversation="conv_1"), "conversation"),
    (rq(background=True), "background"),
    (rq(prompt={"id": "p"}), "prompt"),
    (rq(max_tool_calls=2), "max_tool_calls"),
    (rq(truncation="auto"), "truncation"),
    (rq(service_tier="flex"), "service_tier"),
    (rq(context_management=[{"type": "compaction"}]), "context_management"),
    (rq(prompt_cache_retention="24h"), "prompt_cache_retention"),
    (rq(include=["reasoning.encrypted_content", "file_search_call.results"]), "include[1]"),
    (rq(top_logprobs=2), "top_logprobs"),
    (rq(text={"format": {"type": "xml"}}), "text.format"),
    (rq(text={"format": {"type": "json_schema", "name": "x"}}), "text.format"),
    (rq(text={"verbosity": "low"}), "text.verbosity"),
    (rq(reasoning={"summary": "short"}), "reasoning.summary"),
    (rq(reasoning={"summary": "auto", "generate_summary": "concise"}), "reasoning.generate_summary"),
    (rq(reasoning={"context": "all"}), "reasoning.context"),
    (rq(reasoning={"effort": "huge"}), "reasoning.effort"),
    (rq(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
    (rq(max_output_tokens=0), "max_output_tokens"),
    (rq(temperature=2.5), "temperature"),
    (rq(frequency_penalty=1), "frequency_penalty"),  # a chat field, not the Responses API's
    (rq(tools=[{"type": "web_search"}]), "tools[0].type"),
    (rq(tools=[{**RESP_TOOLS[0], "defer_loading": True}]), "tools[0].defer_loading"),
    (rq(tools=[{**RESP_TOOLS[0], "strict": "no"}]), "tools[0].strict"),
    (rq(text={"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": 1}}), "text.format.strict"),
    (rq(tools=RESP_TOOLS, tool_choice={"type": "function", "name": "nope"}), "tool_choice"),
    (rq(tool_choice={"type": "allowed_tools", "tools": []}), "tool_choice"),
    (rq(input=[]), "input"),
    (rq(input=[{"type": "item_reference", "id": "x"}]), "input[0].id"),
    (rq(input=[{"role": "user", "content": "hi", "name": "bob"}]), "input[0].name"),
    (rq(stream_options={"include_obfuscation": False}), "stream_options"),  # only beside stream: true
    (rq(input=[{"type": "reasoning", "id": "r", "summary": [], "encrypted_content": "x"}, "hi"]),
     "input[0].encrypted_content"),
    (rq(input=[{"type": "web_search_call", "id": "x"}]), "input[0].type"),
    (rq(input=[{"role": "user", "content": "hi"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}]),
     "input[1].call_id"),
    (rq(input=[{"type": ["message"], "role": "user", "content": "hi"}]), "input[0].type"),
    (rq(input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]), "input[0].content[0]"),
    (rq(input=[{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]), "input[0].content[0].file_id"),
    (rq(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]),
     "input[0].content[0].image_url"),
    (rq(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,", "detail": "low"}]}]),
     "input[0].content[0].detail"),  # every image is read at up to --max-pixels: "low" would not be honoured
    (rq(input=[{"role": "developer", "content": [{"type": "input_image", "image_url": "data:,"}]}, "hi"]),
     "input[0].content[0]"),  # an image in a user message only, as on the chat route
])
def test_responses_fields_refused_with_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        responses_api.parse(body, ServeOptions("m", limits=Limits()))
    assert e.value.status == 400 and e.value.param == param, e.value.message


def test_responses_text_format_is_a_response_format():
    """The Responses API's flat `text.format` json_schema becomes the chat request's constrained JSON."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    so = ServeOptions("m", limits=Limits())
    fmt = {"type": "json_schema", "name": "x", "schema": schema, "strict": True}
    r = responses_api.parse(rq(text={"format": fmt}), so)
    assert r.json_output and r.json_schema == schema
    assert r.api["echo"]["text"] == {"format": fmt}  # the response echoes the format it follows
    assert responses_api.parse(rq(), so).api["echo"]["text"] == {"format": {"type": "text"}}
    r = responses_api.parse(rq(text={"format": {"type": "json_object"}}), so)
    assert r.json_output and r.json_schema is None
    assert not responses_api.parse(rq(text={"format": {"type": "text"}}), so).json_output
    with pytest.raises(APIError, match="'text.format.name' is required"):  # named by its own (flat) path
        responses_api.parse(rq(text={"format": {"type": "json_schema", "schema": schema}}), so)


def am(**kw) -> dict:
    return {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **kw}


PNG = base64.b64encode(bytes.fromhex("89504e470d0a1a0a")).decode()


def jpeg_b64() -> str:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), (0, 90, 200)).save(buf, "JPEG")
    return base64.b64encode(buf.getvalue()).decode()


TOOL_USE = {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}


@pytest.mark.parametrize("body, param", [
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}, "model"),
    (am(thinking={"type": "enabled", "budget_tokens": 2048}), "thinking.budget_tokens"),  # not below max_tokens
    (am(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 1023}), "thinking.budget_tokens"),  # < 1024
    (am(max_tokens=4096, thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (am(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048, "display": "omitted"}), "thinking.display"),
    (am(thinking={"type": "adaptive", "budget_tokens": 2048}), "thinking.budget_tokens"),  # not a field of theirs
    (am(thinking={"type": "disabled", "budget_tokens": 2048}), "thinking.budget_tokens"),
    (am(tools=[{"name": "t", "input_schema": {"type": "string"}}]), "tools[0].input_schema"),  # input is an object
    (am(tools=[{"name": "t t", "input_schema": {"type": "object"}}]), "tools[0].name"),
    (am(max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048}, tools=ANTH_TOOLS,
        tool_choice={"type": "any"}), "tool_choice"),  # a forced call has no thinking: refused, not dropped
    (am(thinking={"type": "adaptive"}, tools=ANTH_TOOLS, tool_choice={"type": "tool", "name": "get_weather"}),
     "tool_choice"),
    (am(messages=[{"role": "user", "content": ""}]), "messages[0].content[0].text"),
    (am(messages=[{"role": "user", "content": [{"type": "text", "text": " \n"}]}]), "messages[0].content[0].text"),
    (am(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                  {"role": "user", "content": "hi"}]), "messages[1].content[0].text"),
    (am(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "4"}]}]),
     "messages[0].content[0].tool_use_id"),  # answers no call
    (am(messages=[PREFILLED[0], {"role": "assistant", "content": [TOOL_USE]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "other", "content": "4"}]}],
        tools=ANTH_TOOLS), "messages[2].content[0].tool_use_id"),
    (am(messages=[PREFILLED[0], {"role": "assistant", "content": [TOOL_USE]}, {"role": "user", "content": "and?"}],
        tools=ANTH_TOOLS), "messages[1].content[0]"),  # a call left unanswered
    (am(output_config={"effort": "huge"}), "output_config.effort"),
    (am(output_config={"task_budget": {"type": "tokens", "total": 1000}}), "output_config.task_budget"),
    (am(context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}), "context_management.edits[0].type"),
    (am(context_management={"edits": [{"type": "compact_20260112"}]}), "context_management.edits[0].type"),
    (am(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": 2}]}),
     "context_management.edits[0].keep"),
    (am(context_management={"edits": [{"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns",
                                                                                  "value": 0}}]}),
     "context_management.edits[0].keep"),
    (am(context_management={"edits": [{"type": "clear_thinking_20251015"}] * 2}), "context_management.edits[1]"),
    (am(context_management={"edits": {}}), "context_management.edits"),
    (am(output_config={"format": {"type": "text"}}), "output_config.format"),
    (am(output_config={"format": {"type": "json_schema", "schema": {}, "name": "x"}}), "output_config.format.name"),
    (am(container="c"), "container"),
    (am(mcp_servers=[{"type": "url"}]), "mcp_servers"),
    (am(inference_geo="us"), "inference_geo"),
    (am(cache_control={"type": "persistent"}), "cache_control"),
    (am(speed="fast"), "speed"),
    (am(n=2), "n"),  # not the Messages API's field
    (am(temperature=1.5), "temperature"),
    (am(stop_sequences="x"), "stop_sequences"),
    (am(metadata={"user_id": "u", "tag": "t"}), "metadata.tag"),
    (am(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools[0].type"),
    (am(tools=[{"name": "t"}]), "tools[0].input_schema"),
    (am(tool_choice={"type": "tool", "name": "nope"}, tools=ANTH_TOOLS), "tool_choice"),
    (am(tool_choice={"type": "sometimes"}), "tool_choice.type"),
    (am(tools=[{**ANTH_TOOLS[0], "strict": "no"}]), "tools[0].strict"),
    (am(tools=[{**ANTH_TOOLS[0], "description": 5}]), "tools[0].description"),
    (am(tool_choice={"type": "auto", "disable_parallel_tool_use": "no"}, tools=ANTH_TOOLS),
     "tool_choice.disable_parallel_tool_use"),
    (am(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b "}]), "messages[1].content"),
    (am(messages=PREFILLED, max_tokens=4096, thinking={"type": "enabled", "budget_tokens": 2048}), "thinking"),
    (am(messages=PREFILLED, thinking={"type": "adaptive"}), "thinking"),
    (am(messages=[PREFILLED[0], {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "get_weather",
                                                                   "input": {}}]}], tools=ANTH_TOOLS), "messages[1]"),
    (am(messages=PREFILLED, output_config={"format": {"type": "json_schema", "schema": {}}}), "output_config.format"),
    (am(messages=PREFILLED, tools=ANTH_TOOLS, tool_choice={"type": "any"}), "tool_choice"),
    (am(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]), "messages[0].content[0].type"),
    (am(messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "http://x"}}]}]),
     "messages[0].content[0].source"),
    (am(messages=[{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/bmp", "data": PNG}}]}]), "messages[0].content[0].source.media_type"),
    (am(messages=[{"role": "user", "content": [{"type": "image", "source": {  # a JPEG said to be a PNG
        "type": "base64", "media_type": "image/png", "data": jpeg_b64()}}]}]), "messages[0].content[0].source.media_type"),
    (am(messages=[{"role": "user", "content": [{"type": "text", "text": "a", "cache_control": {"type": "x"}}]}]),
     "messages[0].content[0].cache_control"),
])
def test_anthropic_fields_refused_with_400_naming_them(body, param):
    with pytest.raises(APIError) as e:
        anthropic_api.parse(body, ServeOptions("m", limits=Limits()))
    assert e.value.status == 400 and e.value.param == param, e.value.message
    assert anthropic_api.error_body(e.value) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                            "message": e.value.message}}


# ---- the Responses API over HTTP

def test_responses_retrieve_takes_the_sdks_include_where_the_response_kept_it(oc):
    kw = {"model": "tiny", "input": "What shape is it?", "temperature": 0, "max_output_tokens": 4,
          "reasoning": {"effort": "none"}}
    kept = oc.responses.create(**kw, include=["message.output_text.logprobs"])
    assert kept.output[0].content[0].logprobs
    got = oc.responses.retrieve(kept.id, include=["message.output_text.logprobs"], stream=False,
                                include_obfuscation=False)
    assert got.model_dump() == kept.model_dump()
    plain = oc.responses.create(**kw)
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.retrieve(plain.id, include=["message.output_text.logprobs"])
    assert e.value.body["param"] == "include[0]" and "answered without it" in e.value.body["message"]
    for query, param in (({"include": ["web_search_call.results"]}, "include[0]"), ({"include_obfuscation": True},
                                                                                     "include_obfuscation")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.responses.retrieve(plain.id, **query)
        assert e.value.body["param"] == param


def test_responses_a_message_cut_by_max_output_tokens_is_incomplete(oc):
    kw = {"model": "tiny", "input": "What shape is it?", "temperature": 0, "max_output_tokens": 1,
          "reasoning": {"effort": "none"}, "store": False}
    r = oc.responses.create(**kw)
    assert (r.status, r.incomplete_details.reason, r.output[0].status) == ("incomplete", "max_output_tokens", "incomplete")
    done = [e for e in oc.responses.create(**kw, stream=True) if e.type == "response.output_item.done"]
    assert [e.item.status for e in done] == ["incomplete"]


def test_responses_text_whole_and_streamed_equal_the_engine(server, oc, ref):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What shape is it?"}]
    ids = chat_ids(ref, msgs, think=False)
    want = greedy(ref, ids, 12)
    kw = {"model": "tiny", "instructions": "Be brief.", "input": "What shape is it?", "temperature": 0,
          "max_output_tokens": 12, "reasoning": {"effort": "none"}}
    raw = oc.responses.with_raw_response.create(**kw).http_response.json()
    r = Response.model_validate(raw)  # every field the official type requires, of its type
    assert r.output_text == ref.text.decode(want) and [i.type for i in r.output] == ["message"]
    assert r.usage.input_tokens == len(ids) and r.usage.output_tokens == len(want)
    assert r.status == ("incomplete" if len(want) == 12 else "completed") and r.store is True  # OpenAI's default
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.output[0].status == r.status  # a message cut by max_output_tokens is incomplete, as its response
    evs = list(oc.responses.create(**kw, stream=True))
    kinds = [e.type for e in evs]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * (len(kinds) - 8),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed" if r.status == "completed" else "response.incomplete"]
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == r.output_text
    assert evs[-1].response.output_text == r.output_text and evs[-1].response.usage.input_tokens == len(ids)
    assert evs[-1].response.usage.input_tokens_details.cached_tokens > 0  # the same prompt again: its prefix cached
    _, lines = serve_util.sse_lines(server.url + "/v1/responses", {**kw, "stream": True})
    for e in events(lines):
        validate(RESPONSE_EVENTS, e)


def test_responses_thinking_counts_reasoning_tokens(oc, ref):
    msgs = [{"role": "user", "content": "What colour is the shape?"}]
    said = ref.text.decode(greedy(ref, chat_ids(ref, msgs, think=True), 24))
    r = oc.responses.create(model="tiny", input=msgs, temperature=0, max_output_tokens=24,
                            reasoning={"effort": "high"})
    thought, answer = said.split("</think>")
    assert r.output_text == answer.lstrip("\n")
    assert [i.type for i in r.output] == (["reasoning"] if thought.strip("\n") else []) + ["message"]
    assert r.usage.output_tokens_details.reasoning_tokens == len(ref.text.encode(thought + "</think>"))


def test_responses_reasoning_round_trips_for_a_stateless_client(text, oc, ref):
    """Codex's way (`store` false, `reasoning.summary`, `include: ["reasoning.encrypted_content"]`): the reasoning item
    holds the reasoning as its content, as its summary (the same text: nothing is summarised) and sealed in
    `encrypted_content`, streamed (every event of the SDK's types) and in the final response; sent back as such a
    client sends it (the summary and the sealed text, or the sealed text alone) in a tool loop, it is the turn's
    reasoning again (which templates that keep a tool loop's thinking render): the answer is the engine's greedy
    answer to the chat with that reasoning; a sealed text this server did not write is a 400."""
    thought = "Paris is in France."
    body = {"input": "?", "tools": RESP_TOOLS, "stream": True, "store": False, "include": ["reasoning.encrypted_content"],
            "reasoning": {"effort": "high", "summary": "auto"}}
    out = responses_api.Output(job_for(responses_api.parse(body, ServeOptions("m"))), "m")
    evs = [json.loads(s.split("data: ", 1)[1]) for s in out.start()]
    for ev in answer_events(text, rendered(text, thought, "Let me look.", 1)):
        evs += [json.loads(s.split("data: ", 1)[1]) for s in out.feed(ev)]
    for e in evs:
        validate(RESPONSE_EVENTS, e)
    kinds = [e["type"] for e in evs]
    n = kinds.count("response.reasoning_text.delta")
    assert kinds[2:5 + 2 * n] == ["response.output_item.added", "response.content_part.added",
                                  "response.reasoning_summary_part.added",
                                  *["response.reasoning_text.delta", "response.reasoning_summary_text.delta"] * n]
    assert kinds[5 + 2 * n:10 + 2 * n] == ["response.reasoning_text.done", "response.content_part.done",
                                           "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                                           "response.output_item.done"]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.reasoning_summary_text.delta") == thought
    final = Response.model_validate(evs[-1]["response"])
    rs = final.output[0]
    assert rs.type == "reasoning" and rs.content[0].text == thought and [s.text for s in rs.summary] == [thought]
    assert responses_api.unseal(rs.encrypted_content, "x") == thought and final.reasoning.summary == "auto"
    assert evs[9 + 2 * n]["item"] == rs.model_dump(exclude_none=True)
    chat = [CONVO[0], {**CONVO[1], "reasoning_content": thought, "tool_calls": [{**CONVO[1]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, CONVO[2]]
    want = ref.text.decode(greedy(ref, chat_ids(ref, chat, think=False, tools=CHAT_TOOLS), 12))
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    result = {"type": "function_call_output", "call_id": "call_1", "output": CONVO[2]["content"]}
    sealed = {"type": "reasoning", "id": rs.id, "summary": [s.model_dump() for s in rs.summary],
              "encrypted_content": rs.encrypted_content}
    loop = dict(model="tiny", tools=RESP_TOOLS, temperature=0, max_output_tokens=12, reasoning={"effort": "none"})
    for back in (sealed, {**sealed, "summary": []}):
        inp = [CONVO[0], back, call, result]
        assert responses_api.parse({**loop, "input": inp}, ServeOptions("m")).messages == chat
        got = oc.responses.create(**loop, input=inp)
        assert got.output_text == want and got.usage.input_tokens == len(chat_ids(ref, chat, think=False, tools=CHAT_TOOLS))
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.create(**loop, input=[CONVO[0], {**sealed, "encrypted_content": "gAAAAB-openai"}, call, result])
    assert e.value.body["param"] == "input[1].encrypted_content"


CODEX_TOOLS = [
    {"type": "function", "name": "shell", "description": "Runs a shell command and returns its output.", "strict": False,
     "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                     "workdir": {"type": "string"}},
                    "required": ["command"], "additionalProperties": False}},
    {"type": "function", "name": "update_plan", "description": "Updates the task plan.", "strict": False,
     "parameters": {"type": "object", "properties": {"plan": {"type": "array", "items": {"type": "object"}}},
                    "required": ["plan"], "additionalProperties": False}}]


def test_a_codex_shaped_request_is_answered(server):
    """The body Codex CLI sends over HTTP (its `ResponsesApiRequest`: instructions, developer and user messages, function
    tools not strict, `tool_choice` "auto", `parallel_tool_calls` false, `reasoning` with a summary, `store` false,
    `stream`, `include` the encrypted reasoning, `prompt_cache_key`, `client_metadata`), then its next turn with the
    answer's items sent back and a call's output (reasoning items as Codex writes them, null content and all): each
    streamed to `response.completed` or `response.incomplete`, every event of the SDK's types."""
    body = {"model": "tiny", "instructions": "You are a coding agent running in a terminal.",
            "input": [{"type": "message", "role": "developer", "content": [{"type": "input_text",
                                                                            "text": "<permissions>workspace-write"}]},
                      {"type": "message", "role": "user", "content": [{"type": "input_text",
                                                                       "text": "List the files here."}]}],
            "tools": CODEX_TOOLS, "tool_choice": "auto", "parallel_tool_calls": False,
            "reasoning": {"effort": "medium", "summary": "auto"}, "store": False, "stream": True,
            "include": ["reasoning.encrypted_content"], "prompt_cache_key": "0199a1b2-thread",
            "client_metadata": {"x-codex-installation-id": "abc"}, "max_output_tokens": 24}
    for _turn in range(2):
        r, lines = serve_util.sse_lines(server.url + "/v1/responses", body)
        evs = events(lines)
        assert r.status == 200 and evs[-1]["type"] in ("response.completed", "response.incomplete"), lines[-3:]
        for e in evs:
            validate(RESPONSE_EVENTS, e)
        back = [{**i, "content": None} if i["type"] == "reasoning" else i for i in evs[-1]["response"]["output"]]
        call = {"type": "function_call", "call_id": "call_9", "name": "shell", "arguments": '{"command": ["ls"]}'}
        body = {**body, "input": [*body["input"], *back, call,
                                  {"type": "function_call_output", "call_id": "call_9", "output": "README.md\nsetup.py"}]}


def test_responses_are_stored_and_continued_by_id(server, oc):
    """OpenAI's default `store`: an ended response is kept, and `previous_response_id` continues it: the prompt is the
    stored conversation (its input items, then its output items) and this request's input, so the answer and its
    input tokens are those of a stateless request sending the whole conversation; an `item_reference` stands for the
    stored item it names. A response reads back as it was answered, streamed or not; its input items page in OpenAI's
    shape and order; deleted, it is a 404, and one that continued it can no longer be continued (a 400 naming
    `previous_response_id`); `store` false keeps nothing, and an unknown reference is a 400 naming it."""
    from openai.types.responses import (
        ResponseFunctionToolCallItem,
        ResponseFunctionToolCallOutputItem,
        ResponseInputMessageItem,
        ResponseOutputMessage,
    )

    kw = {"model": "tiny", "temperature": 0, "max_output_tokens": 16, "reasoning": {"effort": "none"}}
    first = oc.responses.create(input="What colour is the triangle?", **kw)
    assert first.store is True and first.previous_response_id is None
    assert oc.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = oc.responses.create(previous_response_id=first.id, input="And where is it?", **kw)
    whole = [{"role": "user", "content": "What colour is the triangle?"},
             *[i.model_dump(exclude_none=True) for i in first.output], {"role": "user", "content": "And where is it?"}]
    alone = oc.responses.create(input=whole, store=False, **kw)
    assert follow.previous_response_id == first.id and alone.store is False and follow.output_text
    assert follow.output_text == alone.output_text and follow.usage.input_tokens == alone.usage.input_tokens
    referenced = [whole[0], *[{"type": "item_reference", "id": i.id} for i in first.output], whole[-1]]
    again = oc.responses.create(input=referenced, store=False, **kw)
    assert again.output_text == alone.output_text and again.usage.input_tokens == alone.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(alone.id)
    evs = list(oc.responses.create(previous_response_id=follow.id, input="Thanks.", stream=True, **kw))
    last = evs[-1].response
    assert last.previous_response_id == follow.id and evs[0].response.store is True
    assert oc.responses.retrieve(last.id).model_dump() == last.model_dump()
    calls = [*whole, {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    many = oc.responses.create(input=calls, tools=RESP_TOOLS, **kw)
    asc = oc.responses.input_items.list(many.id, order="asc")
    shapes = [ResponseInputMessageItem, ResponseOutputMessage, ResponseInputMessageItem, ResponseFunctionToolCallItem,
              ResponseFunctionToolCallOutputItem]
    for item, shape in zip(asc.data, shapes, strict=True):
        shape.model_validate(item.model_dump(exclude_none=True))
    assert [i.type for i in asc.data] == ["message", "message", "message", "function_call", "function_call_output"]
    assert asc.data[1].id == first.output[0].id and len({i.id for i in asc.data}) == 5 and not asc.has_more
    assert [i.id for i in oc.responses.input_items.list(many.id).data] == [i.id for i in asc.data][::-1]  # desc
    one = oc.responses.input_items.list(many.id, order="asc", limit=2)
    assert [i.id for i in one.data] == [i.id for i in asc.data[:2]] and one.has_more and one.last_id == asc.data[1].id
    rest = oc.responses.input_items.list(many.id, order="asc", after=one.last_id)
    assert [i.id for i in rest.data] == [i.id for i in asc.data[2:]]
    for query in ("order=asc", "limit=2", "order=asc&limit=1&after=" + one.last_id):  # joined from the stored texts
        r = fetch(f"{server.url}/v1/responses/{many.id}/input_items?{query}")
        assert r.text == json.dumps(r.json(), separators=(",", ":"), ensure_ascii=False), r.text[:300]
        assert int(r.headers["content-length"]) == len(r.text.encode())
    includes = ["message.input_image.image_url", responses_api.ENCRYPTED]  # as the items are kept: listed as they are
    named = oc.responses.input_items.list(many.id, order="asc", include=includes)
    assert named.model_dump() == asc.model_dump()
    for query, param in (("limit=0", "limit"), ("limit=%C2%B2", "limit"), ("order=up", "order"), ("after=x", "after"),
                         ("page=2", "page"), ("include[]=message.output_text.logprobs&include[]=x", "include"),
                         ("include=message.input_text", "include")):
        r = fetch(f"{server.url}/v1/responses/{many.id}/input_items?{query}")
        assert r.status == 400 and r.json()["error"]["param"] == param, (query, r.text)
    page = {f.name: f.samples[0].value for f in text_string_to_metric_families(fetch(server.url + "/metrics").text)}
    assert page["streamoe_response_store_responses"] >= 4 and 0 < page["streamoe_response_store_bytes"] <= 32 * MiB
    oc.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        oc.responses.retrieve(first.id)
    after = {f.name: f.samples[0].value for f in text_string_to_metric_families(fetch(server.url + "/metrics").text)}
    assert after["streamoe_response_store_responses"] == page["streamoe_response_store_responses"] - 1
    for bad_input, param in (({"previous_response_id": last.id, "input": "x"}, "previous_response_id"),
                             ({"input": [{"type": "item_reference", "id": "msg_nope"}]}, "input[0].id")):
        with pytest.raises(openai.BadRequestError) as e:
            oc.responses.create(**kw, **bad_input)
        assert e.value.body["param"] == param, e.value.body
    assert e.value.status_code == 400


def test_the_response_store_keeps_to_its_budget():
    """The store charges each response its texts (the response, each input and output item) and a fixed cost per
    entry and item id, and past its budget drops the least recently used; a chain missing one of its responses is
    not continued; an item is found while a response holding it is kept."""
    from streamoe.runtime.serve.response_store import ENTRY, ITEM, ResponseStore

    def resp(n: int) -> dict:
        return {"id": f"resp_{n}", "output": [{"id": f"msg_{n}", "type": "message", "content": "x" * 100}]}

    def text(obj) -> bytes:
        return json.dumps(obj, separators=(",", ":")).encode()

    items = [{"id": "in", "type": "message", "role": "user", "content": "hi"}]
    cost = len(text(resp(1))) + len(text(items[0])) + len(text(resp(1)["output"][0])) + ENTRY + 2 * ITEM
    store = ResponseStore(3 * cost)
    for n in (1, 2, 3):
        assert store.put(resp(n), items, f"resp_{n - 1}" if n > 1 else None)
    assert store.used == 3 * cost
    assert [json.loads(t) for t in store.chain("resp_3")] == [*items, *resp(1)["output"], *items, *resp(2)["output"],
                                                               *items, *resp(3)["output"]]
    assert json.loads(store.response("resp_1")) == resp(1)  # read: now the most recently used
    assert store.put(resp(4), items, None) and store.response("resp_2") is None and store.used == 3 * cost
    assert [(i, json.loads(t)) for i, t in store.input_items("resp_3")] == [("in", items[0])]
    assert store.input_items("resp_2") is None
    assert store.chain("resp_3") is None and store.item("msg_2") is None
    assert json.loads(store.item("msg_1")) == resp(1)["output"][0]
    assert not store.put({"id": "resp_big", "output": [{"id": "m", "content": "x" * 4 * cost}]}, [], None)
    assert store.delete("resp_1") and not store.delete("resp_1") and store.used == 2 * cost
    assert store.delete("resp_4") and json.loads(store.item("in")) == items[0]  # still held by another response
    assert store.delete("resp_3") and store.item("in") is None and store.used == 0 and not store.item_of
    assert store.put(resp(5), items * 2, None) and store.delete("resp_5") and not store.item_of  # an id given twice


def test_tool_calls_sent_back_as_the_sdks_dump_them_parse_and_their_arguments_are_json():
    """A call the client got back, sent back as the official SDK dumps it (Anthropic's `toolset_name`, the
    Responses `async` and `caller`, each null), renders as the call; a Responses call with no output after it, or
    whose arguments are not a JSON object, is a 400 naming it, as on the chat route."""
    from anthropic.types import ToolUseBlock
    from openai.types.responses import ResponseFunctionToolCall

    so, ask = ServeOptions("m"), {"role": "user", "content": "Weather in Paris?"}
    call = ToolUseBlock(id="toolu_1", name="get_weather", input={"city": "Paris"}, type="tool_use").model_dump()
    assert "toolset_name" in call
    req = anthropic_api.parse({"model": "m", "max_tokens": 8, "messages": [
        ask, {"role": "assistant", "content": [call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18"}]}]}, so)
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    fc = ResponseFunctionToolCall(call_id="c1", name="get_weather", arguments='{"city": "Paris"}',
                                  type="function_call").model_dump(by_alias=True)
    assert {"async", "caller"} <= set(fc)
    out = {"type": "function_call_output", "call_id": "c1", "output": "18"}
    req = responses_api.parse({"input": [ask, fc, out], "tools": RESP_TOOLS}, so)
    assert req.messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    for unanswered in ([ask, fc, ask], [ask, fc]):  # a call whose output never comes: OpenAI's 400
        with pytest.raises(APIError) as e:
            responses_api.parse({"input": unanswered, "tools": RESP_TOOLS}, so)
        assert e.value.status == 400 and e.value.param == "input[1]", e.value.message
    for bad_args in ("{bad", "[1]"):
        with pytest.raises(APIError) as e:
            responses_api.parse({"input": [ask, {**fc, "arguments": bad_args}, out], "tools": RESP_TOOLS}, so)
        assert e.value.status == 400 and e.value.param == "input[1].arguments", e.value.message
        with pytest.raises(APIError) as e:
            parse_chat({"model": "m", "tools": CHAT_TOOLS, "messages": [
                ask, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": bad_args}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18"}]}, so)
        assert e.value.status == 400 and e.value.param == "messages[1].tool_calls[0].function.arguments"


def test_a_response_the_store_cannot_hold_is_refused_or_says_it_is_not_stored(text):
    """`store: true` is honoured or refused: a request whose input alone is more than the store holds is a 400
    naming `store`; an answer that makes its response more than that is not stored and says so (`store` false in
    the ended response), where a short one is stored and says true."""
    from streamoe.runtime.serve.response_store import ResponseStore

    store, so = ResponseStore(8192), ServeOptions("m")
    with pytest.raises(APIError) as e:
        responses_api.parse({"input": "x" * 9000, "store": True}, so, store=store)
    assert e.value.status == 400 and e.value.param == "store", e.value.message
    assert responses_api.parse({"input": "x" * 9000}, so, store=store).api["store"]  # the default: kept where it fits
    for said, kept in (("Short.", True), (" ".join(["Long."] * 2000), False)):
        out = responses_api.Output(job_for(responses_api.parse({"input": "?", "store": True}, so, store=store)), "m",
                                   store)
        evs = [json.loads(s.split("data: ", 1)[1]) for ev in answer_events(text, rendered(text, "", said, 0))
               for s in out.feed(ev)]
        final = evs[-1]["response"]
        assert evs[-1]["type"] == "response.completed" and final == out.result()
        assert final["store"] is kept and (store.response(final["id"]) is not None) is kept
        assert Response.model_validate(final).output_text == said


def test_a_continued_request_holds_no_more_than_a_body_may():
    """What a request names from the store (the chain before `previous_response_id`, each `item_reference`'s item) is
    weighed before it is parsed: no more than `--max-body-mib`, as if the client had sent the conversation itself;
    more is a 413 naming what named it."""
    from streamoe.runtime.serve.response_store import ResponseStore

    store = ResponseStore(8 * MiB)
    said = {"id": "msg_a", "type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": "y" * 300_000, "annotations": []}]}
    asked = {"id": "u", "type": "message", "role": "user", "content": "x" * 300_000}
    store.put({"id": "resp_a", "output": [said]}, [asked], None)
    then = {"model": "m", "previous_response_id": "resp_a", "input": "more"}
    req = responses_api.parse(then, ServeOptions("m", limits=Limits(max_body=MiB)), store=store)
    assert [m["role"] for m in req.messages] == ["user", "assistant", "user"]
    assert req.messages[1]["content"] == "y" * 300_000
    for body, max_body, param in ((then, MiB // 2, "previous_response_id"),
                                  ({"model": "m", "input": [{"type": "item_reference", "id": "msg_a"}] * 4}, MiB, "input")):
        with pytest.raises(APIError) as e:
            responses_api.parse(body, ServeOptions("m", limits=Limits(max_body=max_body)), store=store)
        assert e.value.status == 413 and e.value.param == param, e.value.message


def test_responses_image_and_tool_result_items_render_as_chat(oc, ref, triangle):
    img = {"type": "input_image", "image_url": serve_util.data_url(triangle), "detail": "auto"}
    asked = [{"role": "user", "content": [img, {"type": "input_text", "text": "What shape is in the image?"}]}]
    r = oc.responses.create(model="tiny", temperature=0, max_output_tokens=16, reasoning={"effort": "none"}, input=asked)
    assert r.output_text == "triangle"
    counted = oc.responses.input_tokens.count(model="tiny", reasoning={"effort": "none"}, input=asked)
    assert counted.object == "response.input_tokens" and counted.input_tokens == r.usage.input_tokens  # the image's too
    items = [{"role": "user", "content": CONVO[0]["content"]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"}]
    ids = chat_ids(ref, CONVO, tools=CHAT_TOOLS)
    r = oc.responses.create(model="tiny", input=items, tools=RESP_TOOLS, temperature=0, max_output_tokens=6)
    assert r.usage.input_tokens == len(ids) == oc.responses.input_tokens.count(input=items, tools=RESP_TOOLS).input_tokens
    with pytest.raises(openai.BadRequestError) as e:
        oc.responses.input_tokens.count(input=items, conversation="conv_1")
    assert e.value.body["param"] == "conversation"
    said = ref.text.decode(greedy(ref, ids, 6))
    assert r.output_text == said.split("</think>")[-1].lstrip("\n")


def test_a_strict_tool_renders_the_same_prompt_on_the_responses_and_chat_routes(oc, ref):
    """A tool marked strict reaches the template as the chat route gives it (`strict` kept in its function), so
    an agent that moves between the routes sends the same prompt and shares its cached prefix."""
    strict = [{**CHAT_TOOLS[0], "function": {**CHAT_TOOLS[0]["function"], "strict": True}}]
    ids = chat_ids(ref, CONVO[:1], tools=strict)
    assert ids != chat_ids(ref, CONVO[:1], tools=CHAT_TOOLS)  # the template writes the flag
    counted = oc.responses.input_tokens.count(input=CONVO[0]["content"], tools=[{**RESP_TOOLS[0], "strict": True}])
    assert counted.input_tokens == len(ids)


def test_responses_logprobs_are_the_chat_routes_logprobs(oc):
    """`include: ["message.output_text.logprobs"]`: the same entries the chat route gives (checked against the
    engine's logits below), on the output text, whole and streamed."""
    chat = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "What shape is it?"}],
                                      temperature=0, max_tokens=6, logprobs=True, top_logprobs=2,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    want = [e.model_dump() for e in chat.choices[0].logprobs.content]
    kw = {"model": "tiny", "input": "What shape is it?", "temperature": 0, "max_output_tokens": 6,
          "reasoning": {"effort": "none"}, "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    r = oc.responses.create(**kw)
    assert [e.model_dump() for e in r.output[0].content[0].logprobs] == want and len(want) == r.usage.output_tokens
    evs = list(oc.responses.create(**kw, stream=True))
    assert [e.model_dump() for ev in evs if ev.type == "response.output_text.delta" for e in ev.logprobs] == want


def test_openai_agents_sdk_default_agent(server, ref):
    """The default openai-agents agent (Responses model, a function tool) runs against the server: its first
    turn, and the turn after its tool ran (the loop's function_call and its output sent back as items)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "18 degrees, sunny"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                  model=OpenAIResponsesModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(temperature=0, max_tokens=16, reasoning=Reasoning(effort="none")))
    tools = [{"type": "function", "function": {"name": "get_weather", "description": get_weather.description,
                                               "parameters": get_weather.params_json_schema,
                                               "strict": get_weather.strict_json_schema}}]  # the SDK's default: True
    system = {"role": "system", "content": "Answer briefly."}
    turns = (([CONVO[0]], CONVO[0]["content"]),
             (CONVO, [{"role": "user", "content": CONVO[0]["content"]},
                      {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                      {"type": "function_call_output", "call_id": "call_1", "output": "18 degrees, sunny"}]))

    async def run_all():  # one event loop: the async client's connections belong to it
        done = [await Runner.run(agent, items) for _, items in turns]
        streamed = Runner.run_streamed(agent, turns[1][1])  # the Responses event stream, read by the SDK
        kinds = [ev.data.type async for ev in streamed.stream_events() if ev.type == "raw_response_event"]
        return done, streamed.final_output, kinds

    done, streamed, kinds = asyncio.run(run_all())
    for (convo, _), result in zip(turns, done, strict=True):
        ids = chat_ids(ref, [system, *convo], think=False, tools=tools)
        want = ref.text.decode(greedy(ref, ids, 16))
        assert result.final_output == want
        assert result.context_wrapper.usage.input_tokens == len(ids)
    assert streamed == want and kinds[0] == "response.created" and kinds[-1] == "response.completed"


def test_openai_agents_sdk_continues_a_conversation_by_previous_response_id(server, ref):
    """The openai-agents SDK's server-side conversation: a run given the last one's `last_response_id` sends only its
    new input, and is answered as the whole conversation is (the first turn, its answer, the new turn): the engine's
    greedy answer to it, and the answer of a run that sends the whole list itself (`to_input_list()`)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    agent = Agent(name="plain", instructions="Answer briefly.",
                  model=OpenAIResponsesModel(model="tiny", openai_client=client), model_settings=ModelSettings(temperature=0, max_tokens=16, reasoning=Reasoning(effort="none")))
    asks = ("What colour is the triangle?", "And where is it?")

    async def runs():
        first = await Runner.run(agent, asks[0])
        follow = await Runner.run(agent, asks[1], previous_response_id=first.last_response_id)
        whole = await Runner.run(agent, [*first.to_input_list(), {"role": "user", "content": asks[1]}])
        return first, follow, whole

    first, follow, whole = asyncio.run(runs())
    msgs = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": asks[0]},
            {"role": "assistant", "content": first.final_output}, {"role": "user", "content": asks[1]}]
    ids = chat_ids(ref, msgs, think=False)
    assert follow.final_output == whole.final_output == ref.text.decode(greedy(ref, ids, 16))
    assert follow.context_wrapper.usage.input_tokens == len(ids)


# ---- the Anthropic Messages API over HTTP

GREEDY = {"temperature": 0}  # a Messages API field that this version of the client has no argument for


def test_anthropic_text_whole_and_streamed_equal_the_engine(server, ac, ref):
    msgs = [{"role": "system", "content": "Be brief.\n\nAnswer in one word."}, {"role": "user", "content": "What shape is it?"}]
    ids = chat_ids(ref, msgs, think=False)
    want = greedy(ref, ids, 12)
    kw = {"model": "tiny", "max_tokens": 12, "extra_body": GREEDY, "thinking": {"type": "disabled"},
          "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in one word.",
                                                            "cache_control": {"type": "ephemeral"}}],
          "messages": [{"role": "user", "content": [{"type": "text", "text": "What shape is it?"}]}]}
    raw = ac.messages.with_raw_response.create(**kw).http_response.json()
    m = Message.model_validate(raw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text.decode(want)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == len(want)
    assert m.stop_reason == ("max_tokens" if len(want) == 12 else "end_turn")
    with ac.messages.stream(**kw) as s:
        kinds = [e.type for e in s if e.type not in ("text",)]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.content[0].text == m.content[0].text and final.usage.output_tokens == len(want)
    assert final.usage.cache_read_input_tokens > 0  # the same prompt again: its prefix cached
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == len(ids)
    _, lines = serve_util.sse_lines(server.url + "/v1/messages", {**{k: v for k, v in kw.items() if k != "extra_body"},
                                                                     **GREEDY, "stream": True})
    for e in events(lines):
        validate(MESSAGE_EVENTS, e)
    assert ac.messages.count_tokens(model="tiny", system=kw["system"], messages=kw["messages"],
                                    thinking={"type": "disabled"}).input_tokens == len(ids)


def test_a_final_assistant_message_is_continued(server, oc, ac, conv, ref):
    """The start of an answer given as the last message (vLLM's `continue_final_message` with `add_generation_prompt`
    false; Anthropic's prefilled final assistant turn): the prompt is transformers' `continue_final_message`
    rendering (/tokenize too), the answer the engine's greedy continuation of it, without the given start, whole and
    streamed, and with vLLM's `echo` after the given start; the turn's thinking off (the template's own choice: no
    think block opened before the text)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(conv)
    ids = hf.apply_chat_template(PREFILLED, continue_final_message=True, tokenize=True, return_dict=False)
    assert hf.decode(ids).endswith(PREFILLED[1]["content"])
    want = greedy(ref, ids, 12)
    extra = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    r = oc.chat.completions.create(model="tiny", messages=PREFILLED, max_tokens=12, temperature=0, extra_body=extra)
    assert r.prompt_token_ids == ids and r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].message.content == ref.text.decode(want) and r.usage.completion_tokens == len(want)
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    echoed = oc.chat.completions.create(model="tiny", messages=PREFILLED, max_tokens=12, temperature=0,
                                        extra_body={**extra, "echo": True}).choices[0]
    assert echoed.message.content == PREFILLED[1]["content"] + r.choices[0].message.content
    assert echoed.model_extra["token_ids"] == want
    chunks = oc.chat.completions.create(model="tiny", messages=PREFILLED, max_tokens=12, temperature=0, stream=True,
                                        extra_body={**extra, "echo": True})
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echoed.message.content
    chunks = oc.chat.completions.create(model="tiny", messages=PREFILLED, max_tokens=12, temperature=0, stream=True,
                                        extra_body=extra)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == r.choices[0].message.content
    tok = fetch(server.url + "/tokenize", "POST", {"messages": PREFILLED, "continue_final_message": True,
                                                   "add_generation_prompt": False}).json()
    assert tok["tokens"] == ids
    kw = {"model": "tiny", "max_tokens": 12, "extra_body": GREEDY, "messages": PREFILLED}
    m = ac.messages.create(**kw)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == ref.text.decode(want)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids) and m.usage.output_tokens == len(want)
    with ac.messages.stream(**kw) as s:
        assert s.get_final_message().content[0].text == m.content[0].text
    assert ac.messages.count_tokens(model="tiny", messages=PREFILLED).input_tokens == len(ids)


def test_anthropic_message_start_carries_the_prompt_caches_hit(ac, ref):
    """message_start's usage holds the input side as Anthropic sends it there, the same numbers the final
    message_delta gives: the prompt's tokens, and on a second request sharing its prefix, the tokens the prompt
    cache held (nonzero), not a 0 written before the cache was looked up."""
    msgs = [{"role": "user", "content": "Which shape is on the left, and which colour is it?"}]
    ids = chat_ids(ref, msgs, think=False)
    input_side = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
    seen = []
    for _ in range(2):
        with ac.messages.stream(model="tiny", max_tokens=4, messages=msgs, extra_body=GREEDY) as st:
            evs = list(st)
        start = evs[0].message.usage.model_dump()
        delta = next(e for e in evs if e.type == "message_delta").usage.model_dump()
        assert evs[0].type == "message_start" and start["output_tokens"] == 0
        assert {k: start[k] for k in input_side} == {k: delta[k] for k in input_side}
        assert start["input_tokens"] + start["cache_read_input_tokens"] == len(ids)
        seen.append(start["cache_read_input_tokens"])
    assert seen[1] > seen[0] and seen[1] == len(ids) - start["input_tokens"]


def test_anthropic_stop_sequences_images_and_thinking(ac, ref, triangle):
    ids = chat_ids(ref, [{"role": "user", "content": "What shape is it?"}], think=False)
    text = ref.text.decode(greedy(ref, ids, 12))
    stop = text[2:5]
    m = ac.messages.create(model="tiny", max_tokens=12, extra_body=GREEDY, thinking={"type": "disabled"},
                           stop_sequences=["zzz", stop], messages=[{"role": "user", "content": "What shape is it?"}])
    assert m.content[0].text == text[:text.index(stop)]
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", stop)
    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": base64.b64encode(triangle.read_bytes()).decode()}}
    q = {"role": "user", "content": [img, {"type": "text", "text": "What shape is in the image?"}]}
    m = ac.messages.create(model="tiny", max_tokens=16, extra_body=GREEDY, thinking={"type": "disabled"}, messages=[q])
    assert m.content[0].text == "triangle"
    n = ac.messages.count_tokens(model="tiny", messages=[q], thinking={"type": "disabled"}).input_tokens
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens  # images counted as their tokens
    msgs = [{"role": "user", "content": "What colour is the shape?"}]
    said = ref.text.decode(greedy(ref, chat_ids(ref, msgs, think=True), 24))
    m = ac.messages.create(model="tiny", max_tokens=24, extra_body=GREEDY, thinking={"type": "adaptive"}, messages=msgs)
    thought, answer = said.split("</think>")
    assert [b.type for b in m.content] == ["thinking", "text"]  # empty or not: thinking was asked for
    assert m.content[0].thinking == thought.strip("\n") and m.content[-1].text == answer.lstrip("\n")


def test_anthropic_thinks_only_when_asked_unless_the_operator_says(tiny_conv, tmp_path):
    """Anthropic's API does no extended thinking unless a request sends `thinking`: without it the prompt is rendered
    with thinking off (the prompt `run --no-think` feeds) and the answer is text alone, whole, streamed and counted;
    with `{"type": "adaptive"}` it thinks (the random model never closes its thought: one thinking block). The OpenAI
    route keeps the model's default, thinking on. An operator's --think holds on the Anthropic route too."""
    eng = Engine(tiny_conv, Options(cap_gib=8, ctx=512, runtime_bytes=64 * MiB))
    msgs = [{"role": "user", "content": "What shape is it?"}]
    off, on = chat_ids(eng, msgs, think=False), chat_ids(eng, msgs, think=True)
    detok = [Detokenizer(eng.text, skip_special=True) for _ in range(2)]  # as the server writes it: an incomplete last character held
    said_off, said_on = ("".join(map(d.add, greedy(eng, ids, 8))) for d, ids in zip(detok, (off, on), strict=True))
    eng.close()
    assert "</think>" not in said_on
    kw = {"model": "tiny", "max_tokens": 8, "messages": msgs, "extra_body": GREEDY}
    for flag in ((), ("--think",)):
        s = start_server(tiny_conv, tmp_path / f"serve{len(flag)}.log", "--cap", 8, "--ctx", 512, "--runtime-mib", 64,
                         *flag)
        try:
            ac = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=120)
            absent = ac.messages.create(**kw)
            with ac.messages.stream(**kw) as st:
                starts = [ev.content_block.type for ev in st if ev.type == "content_block_start"]
            counted = ac.messages.count_tokens(model="tiny", messages=msgs).input_tokens
            adaptive = ac.messages.create(**kw, thinking={"type": "adaptive"})
            oc = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            chat = oc.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0).choices[0].message
        finally:
            assert stop_server(s) == 0, s.text()
        prompt, said, blocks = (on, said_on, ["thinking"]) if flag else (off, said_off, ["text"])
        assert [b.type for b in absent.content] == starts == blocks
        assert absent.usage.input_tokens + absent.usage.cache_read_input_tokens == counted == len(prompt)
        assert (absent.content[0].thinking if flag else absent.content[0].text) == said.lstrip("\n")
        assert absent.usage.output_tokens == 8
        assert [b.type for b in adaptive.content] == ["thinking"] and adaptive.content[0].thinking == said_on.lstrip("\n")
        assert adaptive.usage.input_tokens + adaptive.usage.cache_read_input_tokens == len(on)
        assert chat.reasoning_content == said_on.lstrip("\n") and chat.content == ""


def test_anthropic_thinking_asked_for_opens_with_a_thinking_block_even_an_empty_one(ac):
    """The trained model closes its thought at once; with thinking asked for, the message still opens with a (empty)
    thinking block, whole and streamed, as Anthropic's API answers whenever thinking is on; not asked, none."""
    kw = {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "What shape is it?"}],
          "extra_body": GREEDY}
    m = ac.messages.create(**kw, thinking={"type": "adaptive"})
    assert [b.type for b in m.content] == ["thinking", "text"] and m.content[0].thinking == ""
    with ac.messages.stream(**kw, thinking={"type": "adaptive"}) as st:
        starts = [ev.content_block.type for ev in st if ev.type == "content_block_start"]
        assert [b.model_dump(exclude={"parsed_output"}) for b in st.get_final_message().content] == \
            [b.model_dump() for b in m.content]
    assert starts == ["thinking", "text"]
    assert [b.type for b in ac.messages.create(**kw).content] == ["text"]


def test_anthropic_thinking_budget_closes_the_thought_at_its_tokens(tiny_conv, tmp_path):
    """`thinking: {"type": "enabled", "budget_tokens": N}`: on a prompt where the random model does not close its
    thought, after N tokens of it the server writes `</think>` and the answer goes on as text: the thinking block is
    the first N tokens greedy decoding writes, the text what the model writes after that close, as the engine
    continues it. A budget not below `max_tokens` is refused, as Anthropic's API refuses it."""
    budget, n = 1024, 1030
    eng = Engine(tiny_conv, Options(cap_gib=8, ctx=1280, runtime_bytes=64 * MiB))
    msgs = [{"role": "user", "content": "Why?"}]  # a prompt whose greedy thought runs past 1,100 tokens
    on = chat_ids(eng, msgs, think=True)
    thought = greedy(eng, on, budget)
    close = eng.text.tokenizer.token_to_id("</think>")
    after = [t for t, _ in eng.generate([close], n - budget - 1, Sampler(), context=on + thought)]
    eng.close()
    assert close not in thought and len(after) == n - budget - 1
    detok = Detokenizer(eng.text, skip_special=True)  # the special tokens the random model writes: left out
    want_thought = "".join(map(detok.add, thought)).lstrip("\n")
    want_text = "".join(map(Detokenizer(eng.text, skip_special=True).add, after)).lstrip("\n")
    s = start_server(tiny_conv, tmp_path / "serve.log", "--cap", 8, "--ctx", 1280, "--runtime-mib", 64)
    try:
        ac = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
        kw = {"model": "tiny", "max_tokens": n, "messages": msgs, "extra_body": GREEDY,
              "thinking": {"type": "enabled", "budget_tokens": budget}}
        m = ac.messages.create(**kw)
        with pytest.raises(anthropic.BadRequestError) as e:
            ac.messages.create(**{**kw, "max_tokens": budget})
    finally:
        assert stop_server(s) == 0, s.text()
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.content[0].thinking == want_thought and m.content[1].text == want_text
    assert m.usage.output_tokens == n and m.stop_reason == "max_tokens"
    assert "must be less than 'max_tokens'" in e.value.message


def test_anthropic_tools_and_tool_choice(ac, ref):
    convo = [{"role": "user", "content": CONVO[0]["content"]},
             {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                "input": {"city": "Paris"}}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                           "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    ids = chat_ids(ref, CONVO, think=False, tools=CHAT_TOOLS)  # no `thinking`: none
    m = ac.messages.create(model="tiny", max_tokens=6, extra_body=GREEDY, tools=ANTH_TOOLS, messages=convo)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ids)
    assert m.content[-1].text == ref.text.decode(greedy(ref, ids, 6))
    assert ac.messages.count_tokens(model="tiny", tools=ANTH_TOOLS, messages=convo).input_tokens == len(ids)
    first = [{"role": "user", "content": CONVO[0]["content"]}]
    m = ac.messages.create(model="tiny", max_tokens=1, extra_body=GREEDY, tools=ANTH_TOOLS, messages=first,
                           tool_choice={"type": "none"})
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(chat_ids(ref, first, think=False))  # tools hidden
    rendered = ref.text.template.render(messages=first, tools=CHAT_TOOLS, add_generation_prompt=True,
                                        enable_thinking=False, bos_token="", eos_token="")
    for choice, start in (({"type": "any"}, "<tool_call>\n"),
                          ({"type": "tool", "name": "get_weather"}, '<tool_call>\n{"name": "get_weather", "arguments": ')):
        m = ac.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY, tools=ANTH_TOOLS, messages=first,
                               tool_choice=choice)
        assert m.usage.input_tokens + m.usage.cache_read_input_tokens == len(ref.text.encode(rendered + start))
        assert m.content[0].type == "tool_use" or m.content[0].text.startswith(start)  # the call forced


def test_a_forced_call_beside_a_format_is_the_answer(oc):
    """The agents SDK sends `output_type`'s format with `tool_choice` required or named: the call is the answer (the
    format holds the text of the turn after it), on Chat Completions and Responses, as OpenAI's API takes both."""
    unit = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}}}
    for choice in ("required", {"type": "function", "function": {"name": "units"}}):
        r = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Units?"}], max_tokens=32,
                                       temperature=0, response_format=fmt, tool_choice=choice, tools=[
                                           {"type": "function", "function": {"name": "units", "parameters": unit}}])
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("c", "f")
    r = oc.responses.create(model="tiny", input="Units?", max_output_tokens=32, temperature=0, tool_choice="required",
                            text={"format": {"type": "json_schema", **fmt["json_schema"]}},
                            tools=[{"type": "function", "name": "units", "parameters": unit}])
    assert [o.type for o in r.output if o.type != "reasoning"] == ["function_call"]


def test_a_format_beside_tools_lets_the_model_call_them(oc, ref):
    """An agent with tools and an output type (tool_choice auto, a JSON format): the model may call a tool (here
    pushed to by a logit_bias on `<tool_call>`) or answer in the format; it was held to the JSON and never called."""
    unit = {"type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "out", "strict": True, "schema": {
        "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Units?"}], max_tokens=32, temperature=0,
              response_format=fmt, parallel_tool_calls=False, reasoning_effort="none", tools=[
                  {"type": "function", "function": {"name": "units", "parameters": unit, "strict": True}}])
    opener = ref.text.tokenizer.token_to_id("<tool_call>")
    r = oc.chat.completions.create(**kw, logit_bias={str(opener): 100})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments)["unit"] in ("c", "f")
    r = oc.chat.completions.create(**kw, logit_bias={str(opener): -100})
    assert json.loads(r.choices[0].message.content) in ({"ok": True}, {"ok": False})


def test_anthropic_structured_outputs_follow_the_schema(ac):
    """`output_config.format` constrains the text block to the schema, as `response_format` does a chat answer. The
    schema bounds every field, so a sampled answer (its seed random) ends inside `max_tokens`: an unbounded integer
    could take every token as digits."""
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 30}},
              "required": ["city", "days"], "additionalProperties": False}
    m = ac.messages.create(model="tiny", max_tokens=60, messages=[{"role": "user", "content": "Weather plan?"}],
                           thinking={"type": "disabled"}, output_config={"format": {"type": "json_schema", "schema": schema}},
                           extra_body={"temperature": 1.0})
    Message.model_validate(m.model_dump())
    (block,) = m.content
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(block.text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "?"}],
                           output_config={"format": {"type": "json_schema", "schema": {"type": "no-such-type"}}})
    assert e.value.body["error"]["type"] == "invalid_request_error" and "does not compile" in e.value.message


def test_anthropic_errors_have_anthropics_shape(server, ac):
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="tiny", max_tokens=8, messages=[{"role": "user", "content": "hi"}],
                           thinking={"type": "enabled", "budget_tokens": 2048})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking.budget_tokens" in e.value.body["error"]["message"]
    for method, path, body, status in (("POST", "/v1/messages", b"{not json", 400),
                                       ("POST", "/v1/messages", {"model": "tiny", "messages": []}, 400),
                                       ("GET", "/v1/messages", None, 405),
                                       ("POST", "/v1/messages/nope", {}, 404)):
        r = fetch(server.url + path, method, body)
        assert r.status == status and set(r.json()) == {"type", "error"}, r.text
        assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
    assert fetch(server.url + "/v1/responses", "POST", {"model": "tiny", "input": "x", "store": "yes"}).json()[
        "error"]["param"] == "store"  # OpenAI's shape on the OpenAI routes


# ---- logprobs, models, metrics

def in_process(ref: Engine, req: GenRequest) -> tuple[list[dict], list, list[int]]:
    """A request answered by a worker over the reference engine, in this thread: (the logprobs entries it
    sends, the engine's own logits for each token (the `job.logits` hook), the tokens)."""
    worker = EngineWorker(ref, ServeOptions("tiny", prompt_cache_bytes=0))
    job = worker.prepare(req)
    job.logits, job.sink = [], []
    worker.run(job)
    assert job.sink[-1][0] == "done", job.sink[-1]
    return [e for kind, v in job.sink if kind == "logprobs" for e in v], job.logits, job.sink[-1][1]["token_ids"]


def top(lp: mx.array, k: int) -> list[int]:
    return sorted(range(lp.shape[0]), key=lambda t: (-lp[t].item(), t))[:k]


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_logprobs_are_log_softmax_of_the_engines_logits(ref, kind):
    """Exactly: the value the worker sends for each token is log_softmax of the logits the engine yielded (a chat
    answer's content tokens have entries, the thinking's before them none)."""
    body = {"temperature": 0.8, "seed": 3, "max_tokens": 6}
    if kind == "chat":
        req = parse_chat({**body, "messages": [{"role": "user", "content": "What shape is it?"}], "logprobs": True,
                          "top_logprobs": 4}, Limits())
    else:
        req = parse_completion({**body, "prompt": "def fibonacci(n):\n", "logprobs": 4})
    entries, logits, toks = in_process(ref, req)
    k = len(entries)
    assert len(logits) == len(toks) == k + (3 if kind == "chat" else 0) and k >= 2  # "\n", "</think>", "\n\n"
    assert ref.text.decode(toks[:len(toks) - k]) == ("\n</think>\n\n" if kind == "chat" else "")
    logits, toks = logits[len(toks) - k:], toks[len(toks) - k:]
    for e, lg, tok in zip(entries, logits, toks, strict=True):
        lp = mlx.nn.log_softmax(mx.array(np.asarray(lg, dtype=np.float32)))
        assert e["logprob"] == lp[tok].item() and e["token"] == ref.text.decode([tok])
        z = np.asarray(lg, dtype=np.float64)
        assert e["logprob"] == pytest.approx(z[tok] - z.max() - np.log(np.exp(z - z.max()).sum()), abs=1e-4)
        assert [(t["token"], t["logprob"]) for t in e["top_logprobs"]] == [(ref.text.decode([t]), lp[t].item())
                                                                           for t in top(lp, 4)]
    assert b"".join(bytes(e["bytes"]) for e in entries) == ref.text.decode(toks).encode()


def engine_logprobs(ref: Engine, ids: list[int], n: int) -> list[tuple[int, mx.array]]:
    """(token, log_softmax of the engine's logits for it) for a greedy answer from a fresh state."""
    ref.reset()
    return [(t, mlx.nn.log_softmax(mx.array(np.asarray(lg, dtype=np.float32)))) for t, lg in
            ref.generate(ids, n, Sampler())]


def check_entry(ref: Engine, entry: dict, tok: int, lp: mx.array, k: int) -> None:
    """The server's engine streams its experts under the cap, the reference holds them all: the same
    tokens, logits equal to float32 rounding."""
    assert entry["logprob"] == pytest.approx(lp[tok].item(), abs=1e-4)
    assert [e["token"] for e in entry["top_logprobs"]] == [ref.text.decode([t]) for t in top(lp, k)]
    assert [e["logprob"] for e in entry["top_logprobs"]] == pytest.approx([lp[t].item() for t in top(lp, k)], abs=1e-4)


def test_chat_logprobs_whole_and_streamed(oc, ref):
    msgs = [{"role": "user", "content": "What shape is it?"}]
    ids = chat_ids(ref, msgs, think=False)
    want = engine_logprobs(ref, ids, 6)
    kw = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 6, "logprobs": True, "top_logprobs": 3,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = oc.chat.completions.create(**kw)
    got = [e.model_dump() for e in r.choices[0].logprobs.content]
    assert len(got) == len(want) == r.usage.completion_tokens
    for entry, (tok, lp) in zip(got, want, strict=True):
        check_entry(ref, entry, tok, lp, 3)
    assert b"".join(bytes(e["bytes"]) for e in got) == ref.text.decode([t for t, _ in want]).encode()
    chunks = list(oc.chat.completions.create(**kw, stream=True))
    streamed = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == got
    plain = oc.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None})
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


@pytest.mark.parametrize("think", [True, False])
def test_logprobs_cover_the_content_tokens_alone(oc, ref, think):
    """OpenAI's `logprobs.content` covers the tokens of `message.content`: with thinking on, not the reasoning nor
    `</think>` and the newlines after it. Each entry's token joins to the content, whole and streamed, on the chat
    route and the Responses route; they are the entries of the answer's last tokens, the content's."""
    msgs = [{"role": "user", "content": "Where is the shape?"}]
    said = greedy(ref, chat_ids(ref, msgs, think=think), 8)
    text = ref.text.decode(said)
    assert ("</think>" in text) == think  # the tiny model's thought: empty, then its answer
    kw = {"model": "tiny", "messages": msgs, "temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": think}}}
    r = oc.chat.completions.create(**kw)
    msg, got = r.choices[0].message, [e.model_dump() for e in r.choices[0].logprobs.content]
    assert msg.content == text.split("</think>")[-1].lstrip("\n") and len(msg.content) > 0
    assert "".join(e["token"] for e in got) == msg.content
    tail = said[len(said) - len(got):]
    assert [e["token"] for e in got] == [ref.text.decode([t]) for t in tail]
    assert len(got) < len(said) if think else len(got) == len(said)
    chunks = list(oc.chat.completions.create(**kw, stream=True))
    streamed = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == got
    assert all(not c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].delta.model_extra.get("reasoning_content"))
    rkw = {"model": "tiny", "input": msgs, "temperature": 0, "max_output_tokens": 8, "top_logprobs": 2,
           "reasoning": {"effort": "medium" if think else "none"}, "include": ["message.output_text.logprobs"]}
    resp = oc.responses.create(**rkw)
    message = next(i for i in resp.output if i.type == "message")
    assert message.content[0].text == msg.content
    assert [e.model_dump() for e in message.content[0].logprobs] == got
    evs = list(oc.responses.create(**rkw, stream=True))
    assert [e.model_dump() for ev in evs if ev.type == "response.output_text.delta" for e in ev.logprobs] == got


def test_completion_logprobs_whole_and_streamed(oc, ref):
    prompt = "def fibonacci(n):\n"
    want = engine_logprobs(ref, ref.text.encode(prompt), 5)
    r = oc.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=5, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp.tokens == [ref.text.decode([t]) for t, _ in want] and "".join(lp.tokens) == r.choices[0].text
    assert lp.token_logprobs == pytest.approx([p[t].item() for t, p in want], abs=1e-4)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    for got, (_, p) in zip(lp.top_logprobs, want, strict=True):
        assert list(got) == [ref.text.decode([t]) for t in top(p, 2)]
        assert list(got.values()) == pytest.approx([p[t].item() for t in top(p, 2)], abs=1e-4)
    chunks = list(oc.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=5, logprobs=2, stream=True))
    got = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert [t for g in got for t in g.tokens] == lp.tokens and [o for g in got for o in g.text_offset] == lp.text_offset
    assert [v for g in got for v in g.token_logprobs] == lp.token_logprobs
    # a drawn token outside the likeliest is in its position's dict too: up to logprobs + 1 entries (OpenAI's legacy
    # completions: "the API will always return the logprob of the sampled token"; vLLM's the same)
    r = oc.completions.create(model="tiny", prompt=prompt, temperature=2.0, seed=3, max_tokens=24, logprobs=1)
    lp = r.choices[0].logprobs
    assert all(d[t] == v and 1 <= len(d) <= 2 for t, v, d in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True))
    assert any(len(d) == 2 for d in lp.top_logprobs)


def test_completion_echo_gives_the_prompt_with_its_logprobs_then_the_answer(oc, ref):
    """`echo` (with `logprobs`, as lm-evaluation-harness asks, `max_tokens` 0 or more): the text is the prompt and
    then the answer, the logprobs the prompt's tokens (the first null: nothing comes before it) and then the
    answer's, whole and streamed alike; the answer's entries are those of the same request without `echo`."""
    prompt = "def fibonacci(n):\n"
    ids = ref.text.encode(prompt)
    plain = oc.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=3, logprobs=2).choices[0]
    r = oc.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=3, logprobs=2, echo=True).choices[0]
    lp = r.logprobs
    assert r.text == prompt + plain.text and len(lp.tokens) == len(ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert lp.token_logprobs[len(ids):] == plain.logprobs.token_logprobs
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    zero = oc.completions.create(model="tiny", prompt=ids, max_tokens=0, logprobs=1, echo=True)
    assert zero.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)] and zero.usage.completion_tokens == 0
    chunks = list(oc.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=3, logprobs=2, echo=True,
                                        stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.text
    assert [v for c in chunks if c.choices and c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs] \
        == lp.token_logprobs
    assert oc.completions.create(model="tiny", prompt=prompt, max_tokens=2, echo=True, temperature=0).choices[0].text \
        == prompt + oc.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError):
        oc.completions.create(model="tiny", prompt=prompt, max_tokens=0)  # 0 only with echo


def test_models_by_id(oc, ac):
    assert [m.id for m in oc.models.list().data] == ["tiny", *ALIASES]
    page = ac.models.list()  # the same route read by Anthropic's client: its own fields are there
    assert [(m.id, m.type, m.display_name) for m in page.data] == [(n, "model", n) for n in ("tiny", *ALIASES)]
    assert page.has_more is False and page.first_id == "tiny" and ac.models.retrieve(ALIASES[0]).id == ALIASES[0]
    assert [oc.models.retrieve(name).id for name in ("tiny", *ALIASES)] == ["tiny", *ALIASES]
    with pytest.raises(openai.NotFoundError) as e:
        oc.models.retrieve("gpt-5")
    assert e.value.body["code"] == "model_not_found" and "gpt-5" in e.value.body["message"]


NOT_SERVED = "the model 'gpt-5' does not exist; this server serves 'tiny', 'claude-sonnet-4-5', 'claude-haiku-4-5'"


def test_a_model_not_served_is_404_in_each_apis_shape(server, oc, ac):
    """Every route that answers or counts for a model refuses a name it does not serve: 404 with OpenAI's error
    (code model_not_found, param model) or Anthropic's (not_found_error), naming the model and the served names,
    and the server goes on. A `--served-model-name` alias is answered, under that name; OpenAI's routes may leave
    `model` out (the served model)."""
    hi = [{"role": "user", "content": "hi"}]
    for call in (lambda m: oc.chat.completions.create(model=m, messages=hi, max_tokens=2),
                 lambda m: oc.completions.create(model=m, prompt="def", max_tokens=2),
                 lambda m: oc.responses.create(model=m, input="hi", max_output_tokens=2),
                 lambda m: oc.responses.input_tokens.count(model=m, input="hi")):
        with pytest.raises(openai.NotFoundError) as e:
            call("gpt-5")
        assert e.value.status_code == 404
        assert e.value.body == {"message": NOT_SERVED, "type": "invalid_request_error", "param": "model",
                                "code": "model_not_found"}
    for call in (lambda m: ac.messages.create(model=m, max_tokens=2, messages=hi),
                 lambda m: ac.messages.count_tokens(model=m, messages=hi)):
        with pytest.raises(anthropic.NotFoundError) as e:
            call("gpt-5")
        assert e.value.body == {"type": "error", "error": {"type": "not_found_error", "message": NOT_SERVED}}
    r = ac.messages.create(model="claude-haiku-4-5", max_tokens=2, messages=hi, extra_body=GREEDY)
    assert r.model == "claude-haiku-4-5" and r.usage.output_tokens == 2
    assert oc.chat.completions.create(model="claude-sonnet-4-5", messages=hi, max_tokens=2).model == "claude-sonnet-4-5"
    plain = fetch(server.url + "/v1/chat/completions", "POST", {"messages": hi, "max_tokens": 2})
    assert plain.status == 200 and plain.json()["model"] == "tiny"
    assert fetch(server.url + "/health").json()["status"] == "ok"


def test_served_model_name_must_not_be_empty(conv):
    one_error_line(cli("serve", conv, "--served-model-name", " ", "--port", 0), "--served-model-name", "empty")


def metrics(server) -> dict:
    r = fetch(server.url + "/metrics")
    assert r.status == 200 and r.headers["content-type"].startswith("text/plain; version=0.0.4")
    for ln in r.text.splitlines():
        assert ln.startswith(("# HELP streamoe_", "# TYPE streamoe_", "streamoe_", "# HELP vllm:", "# TYPE vllm:",
                              "vllm:")), ln
    out = {}
    for fam in text_string_to_metric_families(r.text):
        assert fam.name.startswith(("streamoe_", "vllm:")) and fam.documentation
        assert fam.type in ("counter", "gauge", "histogram")
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_count_what_was_served(server, oc):
    before = metrics(server)
    r = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it red?"}], temperature=0,
                                   max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    after = metrics(server)

    def grew(name, labels=()):
        return after[(name, labels)] - before.get((name, labels), 0)

    assert grew("streamoe_requests_total", (("api", "chat"),)) == 1
    assert grew("streamoe_answers_total") == 1
    assert grew("streamoe_prompt_tokens_total") == r.usage.prompt_tokens
    assert grew("streamoe_generated_tokens_total") == r.usage.completion_tokens
    tele = r.model_extra["streamoe"]
    assert after[("streamoe_last_tokens_per_second", ())] == tele["tok_s"] > 0
    assert after[("streamoe_last_hit_rate", ())] == tele["hit_rate"]
    decode_read = tele["mib_read_token"] * MiB * tele["tokens"]  # prefill reads come on top
    assert grew("streamoe_expert_bytes_read_total") >= decode_read * (1 - 1e-3) and decode_read > 0  # capped: read
    assert after[("streamoe_memory_cap_bytes", ())] == fetch(server.url + "/v1/plan").json()["cap"]
    assert 0 < after[("streamoe_memory_bytes", ())] <= after[("streamoe_memory_cap_bytes", ())]
    assert after[("streamoe_queue_depth", ())] == 0
    # the latencies: one more of each (time per output token too: 8 tokens), each histogram's buckets cumulative
    # up to its count, and the vLLM names hold the same figures, labelled with the model's name
    tiny = (("model_name", "tiny"),)
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds", "inter_token_latency_seconds"):
        gaps = r.usage.completion_tokens - 1 if name == "inter_token_latency_seconds" else 1
        assert grew(f"streamoe_{name}_count") == gaps and grew(f"streamoe_{name}_sum") >= 0
        buckets = sorted(((float(dict(k[1])["le"]), v) for k, v in after.items() if k[0] == f"streamoe_{name}_bucket"))
        assert [v for _, v in buckets] == sorted(v for _, v in buckets) and buckets[-1][1] == after[(f"streamoe_{name}_count", ())]
        assert after[(f"vllm:{name}_count", tiny)] == after[(f"streamoe_{name}_count", ())]
    e2e = after[("streamoe_e2e_request_latency_seconds_sum", ())] - before.get(("streamoe_e2e_request_latency_seconds_sum", ()), 0)
    assert 0 < grew("streamoe_time_to_first_token_seconds_sum") < e2e < 60
    assert after[("vllm:prompt_tokens_total", tiny)] == after[("streamoe_prompt_tokens_total", ())]
    assert after[("vllm:generation_tokens_total", tiny)] == after[("streamoe_generated_tokens_total", ())]
    assert after[("vllm:num_requests_waiting", tiny)] == 0 and after[("vllm:num_requests_running", tiny)] == 0
    reason = (("finished_reason", r.choices[0].finish_reason), ("model_name", "tiny"))
    assert grew("vllm:request_success_total", reason) == 1
    # the prompt cache's work under vLLM's prefix cache names: the same question again is found in it
    again = oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Is it red?"}], temperature=0,
                                       max_tokens=8, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    cached, final = again.usage.prompt_tokens_details.cached_tokens, metrics(server)
    assert cached > 0 and final[("streamoe_cached_prompt_tokens_total", ())] - after[("streamoe_cached_prompt_tokens_total", ())] == cached
    assert final[("vllm:prefix_cache_hits_total", tiny)] == final[("streamoe_cached_prompt_tokens_total", ())]
    assert final[("vllm:prefix_cache_queries_total", tiny)] == final[("streamoe_prompt_tokens_total", ())]


def test_a_response_echoes_the_sampling_in_force(oc, conv):
    """A response's `temperature` and `top_p` are the values it was drawn with: the checkpoint's where the request
    gave none (they were null), as OpenAI's API echoes its defaults."""
    gc = json.loads((conv / "generation_config.json").read_text())
    r = oc.responses.create(model="tiny", input="hi", max_output_tokens=1, reasoning={"effort": "none"})
    assert (r.temperature, r.top_p) == (gc["temperature"], gc["top_p"])
    r = oc.responses.create(model="tiny", input="hi", max_output_tokens=1, temperature=0, reasoning={"effort": "none"})
    assert (r.temperature, r.top_p) == (0, gc["top_p"])


def test_the_server_says_how_a_request_that_sets_no_sampling_draws(server, conv):
    """Once on stderr at start, as vLLM logs the generation config's defaults it took."""
    gc = json.loads((conv / "generation_config.json").read_text())
    want = f"sampling: temperature {gc['temperature']:g}, top-p {gc['top_p']:g}, top-k {gc['top_k']}"
    assert server.text().count(want) == 1 and "where a request sets none" in server.text()


def test_no_traceback_in_the_server_log(server):
    log = server.text()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_a_responses_prompt_past_the_context_names_its_input(oc):
    """The Responses API's conversation is its `input`: a prompt the planned context cannot hold is a 400 naming that
    field (the chat route's own name, `messages`, is no field of this API)."""
    for words in ("word " * 30 * CTX, "word " * (CTX + 8)):  # past any token length; past it once tokenized
        with pytest.raises(openai.BadRequestError) as e:
            oc.responses.create(model="tiny", input=words, max_output_tokens=2)
        assert e.value.body["param"] == "input" and "planned context" in e.value.body["message"]


def test_a_prompt_past_the_context_is_refused_in_the_words_agents_read(oc, ac):
    """Agents compact their conversation when the API says it is too long: OpenAI's error code
    `context_length_exceeded` and its "maximum context length" (vLLM's too); Anthropic's "prompt is too long: N tokens
    > M maximum"."""
    words = "word " * (CTX + 8)
    with pytest.raises(openai.BadRequestError) as e:
        oc.chat.completions.create(model="tiny", messages=[{"role": "user", "content": words}], max_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    assert e.value.body["message"].startswith(f"This model's maximum context length is {CTX} tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": words}])
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {CTX - 1} maximum", e.value.body["error"]["message"])


def test_a_count_refuses_an_answers_fields_by_name():
    """count_tokens counts a prompt: an answer's field (max_tokens, stream) is a 400 that says so, naming it."""
    for field_, value in (("max_tokens", 8), ("stream", True)):
        with pytest.raises(APIError, match=f"'{field_}' is a field of an answer, not of a count") as e:
            anthropic_api.parse({"model": "m", "messages": [{"role": "user", "content": "hi"}], field_: value},
                                ServeOptions("m", limits=Limits()), counting=True)
        assert e.value.param == field_


def test_anthropic_tool_result_holds_an_image(ac, ref, triangle):
    """A tool_result may hold images, as Claude Code's file reads return them: the template renders the image inside
    the tool's response, so the prompt holds the image's tokens there (counted as a call counts them); a
    tool_result after a turn's text is refused, as Anthropic's API refuses it (the images would change order)."""
    from streamoe.runtime.image import num_image_tokens
    from streamoe.runtime.image_prompt import image_config

    img = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                       "data": base64.b64encode(triangle.read_bytes()).decode()}}

    def loop(result) -> list[dict]:
        return [{"role": "user", "content": "Open picture.png"}, {"role": "assistant", "content": [TOOL_USE]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]}]

    kw = {"model": "tiny", "tools": ANTH_TOOLS, "thinking": {"type": "disabled"}}
    with_image = loop([img, {"type": "text", "text": "picture.png"}])
    m = ac.messages.create(max_tokens=4, extra_body=GREEDY, messages=with_image, **kw)
    n = ac.messages.count_tokens(messages=with_image, **kw).input_tokens
    plain = ac.messages.count_tokens(messages=loop("picture.png"), **kw).input_tokens
    with Image.open(triangle) as im:
        pads = num_image_tokens(im.height, im.width, image_config(ref))
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens == plain + pads + 2  # + vision start and end
    late = with_image[:2] + [{"role": "user", "content": [{"type": "text", "text": "here:"},
                                                          {"type": "tool_result", "tool_use_id": "t1", "content": "x"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        ac.messages.count_tokens(messages=late, **kw)
    assert "come first" in e.value.body["error"]["message"]


def test_a_still_gif_is_an_image_on_every_route():
    """A still GIF is taken where OpenAI's and Anthropic's APIs take one (`image_url` data URL, base64 `image/gif`);
    an animated one is a 400 naming its part."""
    def gif(frames: int) -> str:
        pics = [Image.new("RGB", (32, 32), (40 * i, 90, 200)) for i in range(frames)]
        buf = io.BytesIO()
        pics[0].save(buf, "GIF", save_all=frames > 1, append_images=pics[1:])
        return base64.b64encode(buf.getvalue()).decode()

    def both(data: str) -> list:
        chat = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": f"data:image/gif;base64,{data}"}}]}]}
        msgs = am(messages=[{"role": "user", "content": [{"type": "image", "source": {
            "type": "base64", "media_type": "image/gif", "data": data}}]}])
        return [lambda: parse_chat(chat, Limits()), lambda: anthropic_api.parse(msgs, ServeOptions("m", limits=Limits()))]

    assert [len(parse().images) for parse in both(gif(1))] == [1, 1]
    for parse in both(gif(2)):
        with pytest.raises(APIError, match="an animated GIF") as e:
            parse()
        assert e.value.param == "messages[0].content[0]"


def test_anthropic_gives_no_thinking_block_unless_thinking_was_asked_for():
    """A model that reasons whatever it is told (gpt-oss) still gives no thinking block to a request that did not ask
    for thinking (absent or disabled), as Anthropic's API; with thinking asked for, the block is there."""
    usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7, "prompt_tokens_details": {"cached_tokens": 0},
             "completion_tokens_details": {"reasoning_tokens": 2}}
    events = [("delta", [("reasoning", "Let me see."), ("content", "Bern.")]),
              ("done", {"finish_reason": "stop", "usage": usage, "stop_sequence": None})]
    for thinking, blocks in ((None, ["text"]), ({"type": "disabled"}, ["text"]), ({"type": "adaptive"}, ["thinking", "text"])):
        body = am(**({"thinking": thinking} if thinking else {}))
        out = anthropic_api.Output(job_for(anthropic_api.parse(body, ServeOptions("m"))), "m")
        for ev in events:
            out.feed(ev)
        assert [b["type"] for b in out.result()["content"]] == blocks, thinking
        assert out.result()["usage"]["output_tokens"] == 4  # its tokens are counted, as Anthropic bills them
