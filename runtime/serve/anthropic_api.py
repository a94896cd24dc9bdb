"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a translation layer:
a request becomes the chat `GenRequest` (blocks -> chat messages, tool_use/tool_result -> tool calls and
tool messages, `input_schema` tools -> function tools), the job's events become a `message` or its event
stream (message_start, content_block_start/delta/stop, message_delta, message_stop), and every error on these
routes is Anthropic's error object. Fields the API defines that this server does not implement, and fields
it does not define, are refused with a 400 naming them.
"""

from __future__ import annotations

import json

from ..tool_calls import loads_exact
from .door import anthropic_error
from .openai_api import (
    APIError,
    GenRequest,
    _choice,
    _number,
    bad,
    call_text,
    call_verdict,
    check_fields,
    check_image,
    continued,
    decode_base64_image,
    final_text,
    parse_tools,
    typed,
)

FIELDS = {"max_tokens", "messages", "model", "cache_control", "container", "context_management", "diagnostics",
          "inference_geo", "mcp_servers", "metadata", "output_config", "service_tier", "speed", "stop_sequences",
          "stream", "system", "temperature", "thinking", "tool_choice", "tools", "top_k", "top_p", "user_profile_id",
          "workspace_id"}
HONOURED = {"max_tokens", "messages", "model", "cache_control", "context_management", "metadata", "output_config",
            "service_tier", "stop_sequences", "stream", "system", "temperature", "thinking", "tool_choice", "tools",
            "top_k", "top_p"}
EFFORT_OF = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}  # as templates take it
COUNT_FIELDS = {"messages", "model", "cache_control", "context_management", "mcp_servers", "output_config", "speed",
                "system", "thinking", "tool_choice", "tools", "user_profile_id", "workspace_id"}
API = "the Anthropic Messages API"
IMAGE_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")


def error_body(err: APIError) -> dict:
    """Anthropic's error object: `{"type": "error", "error": {"type", "message"}}`."""
    return anthropic_error(err.status, err.anthropic or err.message)


def _cache_control(block: dict, where: str) -> None:
    """`cache_control` is honoured by construction: a conversation's prefix is cached at its assistant headers, and
    the system prompt and tools where they end (`EngineWorker.head_tokens`), whatever the breakpoints say."""
    cc, name = block.get("cache_control"), f"{where}.cache_control" if where else "cache_control"
    if cc is not None and (not isinstance(cc, dict) or cc.get("type") != "ephemeral"):
        raise bad(f"'{name}' must be {{'type': 'ephemeral'}}", name)


def _text_block(block: dict, where: str) -> str:
    check_fields(block, {"type", "text", "cache_control", "citations"}, {"type", "text", "cache_control"}, f"{where}.", API)
    _cache_control(block, where)
    if not isinstance(block.get("text"), str):
        raise bad(f"{where}.text must be a string", f"{where}.text")
    return block["text"]


def _image(block: dict, where: str, so, images: list[bytes]) -> dict:
    check_fields(block, {"type", "source", "cache_control"}, {"type", "source", "cache_control"}, f"{where}.", API)
    _cache_control(block, where)
    src = block.get("source")
    if not isinstance(src, dict) or src.get("type") != "base64":
        raise bad(f"{where}.source: only base64 image sources are accepted (the server fetches no URL and keeps "
                  "no files)", f"{where}.source")
    if src.get("media_type") not in IMAGE_TYPES:
        raise bad(f"{where}.source.media_type must be one of {', '.join(IMAGE_TYPES)}", f"{where}.source.media_type")
    data = src.get("data")
    if not isinstance(data, str):
        raise bad(f"{where}.source.data must be a base64 string", f"{where}.source.data")
    raw = decode_base64_image(data, so.limits, where, f"{where}.source.data", f"{where}.source.data")
    if (found := check_image(raw, so.limits, where)) != src["media_type"]:  # as Anthropic's API checks it
        raise bad(f"{where}.source: the image is {found}, not the media_type given ({src['media_type']})",
                  f"{where}.source.media_type")
    if len(images) >= so.limits.max_images:
        raise bad(so.limits.too_many_images(), where)
    images.append(raw)
    return {"type": "image"}


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not content:
        raise bad(f"{where} must be a string or a non-empty list of content blocks", where)
    for j, b in enumerate(content):
        if not isinstance(b, dict):
            raise bad(f"{where}[{j}] must be an object", f"{where}[{j}]")
    return content


def _tool_result(block: dict, where: str, so, images: list[bytes]) -> dict:
    """A tool_result block -> a tool message: its text, or its text and images as parts (a tool that read an image
    file, as Claude Code's does), which the template renders inside the tool's response."""
    check_fields(block, {"type", "tool_use_id", "content", "is_error", "cache_control"},
                 {"type", "tool_use_id", "content", "is_error", "cache_control"}, f"{where}.", API)
    _cache_control(block, where)
    if not isinstance(block.get("tool_use_id"), str):
        raise bad(f"{where}.tool_use_id must be a string", f"{where}.tool_use_id")
    content = block.get("content", "")
    if isinstance(content, str):
        parts = [{"type": "text", "text": content}]
    elif isinstance(content, list):
        parts = []
        for k, b in enumerate(content):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text":
                parts.append({"type": "text", "text": _text_block(b, f"{where}.content[{k}]")})
            elif kind == "image":
                parts.append(_image(b, f"{where}.content[{k}]", so, images))
            else:
                raise bad(f"{where}.content[{k}]: only text and image blocks are accepted in a tool result",
                          f"{where}.content[{k}]")
    else:
        raise bad(f"{where}.content must be a string or a list of text and image blocks", f"{where}.content")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise bad(f"{where}.is_error must be true or false", f"{where}.is_error")
    if block.get("is_error"):  # the template has no error flag: the model reads it in the result
        parts.insert(0, {"type": "text", "text": "Error: "})
    if all(p["type"] == "text" for p in parts):
        return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": "".join(p["text"] for p in parts)}
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": parts}


def _turns(messages) -> list[tuple[str, list[tuple[dict, str]]]]:
    """The request's messages as turns: (role, [(block, where)]), consecutive messages of one role combined into one
    turn, as Anthropic's API combines them; each block keeps the place it was given at, for errors."""
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    turns: list[tuple[str, list[tuple[dict, str]]]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        check_fields(m, {"role", "content"}, {"role", "content"}, f"{where}.", API)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be 'user' or 'assistant', got {role!r}", f"{where}.role")
        final = i == len(messages) - 1 and role == "assistant"
        if final and m.get("content") in ("", []):  # an empty final assistant turn: no prefill, as Anthropic's API
            break
        blocks = [(b, f"{where}.content[{j}]") for j, b in enumerate(_blocks(m.get("content"), f"{where}.content"))]
        for b, bw in blocks:  # every text non-empty, as Anthropic's API requires (a prefill's trailing space: `_prefill`)
            if b.get("type") == "text" and isinstance(b.get("text"), str) and not (b["text"].strip() or final):
                raise bad(f"{bw}: text content blocks must contain non-whitespace text", f"{bw}.text")
        if turns and turns[-1][0] == role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((role, blocks))
    return turns


def parse_messages(messages, so, images: list[bytes]) -> list[dict]:
    """Anthropic turns -> chat messages: a user turn's tool_result blocks become tool messages (first, as
    the API orders them), its text and images one user message; an assistant turn's text, tool_use and
    thinking blocks one assistant message. As Anthropic's API checks them: each tool_use is answered by a
    tool_result in the next turn, each tool_result answers a tool_use of the turn before it, and a turn's
    tool_result blocks come before its other blocks (so images, in results and beside them, keep their order)."""
    out: list[dict] = []
    asked: dict[str, str] = {}  # the last assistant turn's tool_use ids not yet answered -> where each was given
    for role, blocks in _turns(messages):
        if role == "user":
            parts: list[dict] = []
            for b, bw in blocks:
                kind = b.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": _text_block(b, bw)})
                elif kind == "image":
                    parts.append(_image(b, bw, so, images))
                elif kind == "tool_result":
                    if parts:
                        raise bad(f"{bw}: a turn's tool_result blocks come first, before its text and images",
                                  f"{bw}.type")
                    result = _tool_result(b, bw, so, images)
                    if asked.pop(result["tool_call_id"], None) is None:
                        raise bad(f"{bw}: unexpected tool_use_id {result['tool_call_id'][:80]!r}: each tool_result "
                                  "must answer a tool_use block of the turn before it", f"{bw}.tool_use_id")
                    out.append(result)
                else:
                    raise bad(f"{bw}.type {kind!r} is not supported in a user turn (text, image and tool_result "
                              "are)", f"{bw}.type")
            if asked:
                _unanswered(asked)
            if parts:
                simple = all(p["type"] == "text" for p in parts)
                out.append({"role": "user", "content": "".join(p["text"] for p in parts) if simple else parts})
        else:
            if asked:
                _unanswered(asked)
            msg: dict = {"role": "assistant", "content": ""}
            for b, bw in blocks:
                kind = b.get("type")
                if kind == "text":
                    msg["content"] += _text_block(b, bw)
                elif kind == "tool_use":
                    check_fields(b, {"type", "id", "name", "input", "cache_control", "caller", "toolset_name"},
                                 {"type", "id", "name", "input", "cache_control"}, f"{bw}.", API)
                    if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) or not b["name"]:
                        raise bad(f"{bw} must have a string 'id' and 'name'", bw)
                    if not isinstance(b.get("input", {}), dict):
                        raise bad(f"{bw}.input must be an object", f"{bw}.input")
                    asked[b["id"]] = bw
                    msg.setdefault("tool_calls", []).append(
                        {"id": b["id"], "type": "function", "function": {"name": b["name"], "arguments": b.get("input", {})}})
                elif kind == "thinking":
                    check_fields(b, {"type", "thinking", "signature"}, {"type", "thinking", "signature"}, f"{bw}.", API)
                    if not isinstance(b.get("thinking"), str):
                        raise bad(f"{bw}.thinking must be a string", f"{bw}.thinking")
                    msg["reasoning_content"] = msg.get("reasoning_content", "") + b["thinking"]
                else:
                    raise bad(f"{bw}.type {kind!r} is not supported in an assistant turn (text, tool_use and "
                              "thinking are)", f"{bw}.type")
            out.append(msg)
    if not out:
        raise bad("'messages' holds only an empty assistant turn", "messages")
    return out


def _unanswered(asked: dict[str, str]) -> None:
    ids, where = list(asked), next(iter(asked.values()))
    raise bad(f"{where}: tool_use ids were found without tool_result blocks immediately after: "
              f"{', '.join(i[:80] for i in ids)}. Each tool_use block must have a corresponding tool_result block in "
              "the next message", where)


def _system(system) -> list[dict]:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise bad("'system' must be a string or a list of text blocks", "system")
    texts = []
    for j, b in enumerate(system):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise bad(f"system[{j}] must be a text block", f"system[{j}]")
        texts.append(_text_block(b, f"system[{j}]"))
    return [{"role": "system", "content": "\n\n".join(texts)}] if texts else []


def _tools(body: dict) -> tuple[list[dict] | None, bool, str | None, dict, bool]:
    """`tools` and `tool_choice` -> chat (tools, parse, call prefix), strict tools' schemas, and whether
    more than one call may be returned (`disable_parallel_tool_use`)."""
    tools, strict, chat_tools = body.get("tools"), {}, None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list", "tools")
        chat_tools = []
        for j, t in enumerate(tools):
            where = f"tools[{j}]"
            if not isinstance(t, dict) or t.get("type", "custom") != "custom":
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad(f"{where}.type {kind!r}: only custom tools (name, input_schema) are supported",
                          f"{where}.type")
            check_fields(t, {"type", "name", "description", "input_schema", "cache_control", "strict", "defer_loading",
                             "allowed_callers", "input_examples", "eager_input_streaming"},
                         {"type", "name", "description", "input_schema", "cache_control", "strict"}, f"{where}.", API)
            _cache_control(t, where)
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
            typed(t, f"{where}.", ("strict",), ("description",))
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise bad(f"{where}.input_schema must be a JSON schema object", f"{where}.input_schema")
            fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") is not None else {}),
                  "parameters": schema}
            chat_tools.append({"type": "function", "function": fn})
            if t.get("strict"):
                strict[t["name"]] = schema
        chat_tools = chat_tools or None
    tc, parallel = body.get("tool_choice"), True
    choice = None
    if tc is not None:
        if not isinstance(tc, dict):
            raise bad("'tool_choice' must be an object ({'type': 'auto' | 'any' | 'tool' | 'none'})", "tool_choice")
        check_fields(tc, {"type", "name", "disable_parallel_tool_use"}, {"type", "name", "disable_parallel_tool_use"},
                     "tool_choice.", API)
        typed(tc, "tool_choice.", ("disable_parallel_tool_use",))
        kind = tc.get("type")
        if kind == "tool":
            if not isinstance(tc.get("name"), str):
                raise bad("'tool_choice.name' must name a tool", "tool_choice.name")
            choice = {"type": "function", "function": {"name": tc["name"]}}
        elif kind in ("auto", "any", "none"):
            choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise bad("'tool_choice.type' must be 'auto', 'any', 'tool' or 'none'", "tool_choice.type")
        parallel = not tc.get("disable_parallel_tool_use")
    try:
        got = parse_tools({"tools": chat_tools, "tool_choice": choice})
    except APIError as e:  # the chat form's path to a field ("tools[0].function.name") as this API names it
        def named(text: str) -> str:
            return text.replace(".function.parameters", ".input_schema").replace(".function.", ".")
        raise bad(named(e.message), e.param and named(e.param)) from None
    return (*got, strict, parallel)


def parse(body: dict, so, counting: bool = False) -> GenRequest:
    """A Messages (or count_tokens) request -> the chat `GenRequest` that answers it, or a 400 naming the field."""
    if counting and (answer := next((k for k in body if k in FIELDS - COUNT_FIELDS), None)):
        raise bad(f"'{answer}' is a field of an answer, not of a count (count_tokens counts the prompt)", answer)
    check_fields(body, COUNT_FIELDS if counting else FIELDS, HONOURED, api=API)
    req = GenRequest(kind="chat", model=body.get("model"))
    if not isinstance(req.model, str) or not req.model:
        raise bad("'model' is required (a string)", "model")
    if not counting:
        if body.get("max_tokens") is None:
            raise bad("'max_tokens' is required", "max_tokens")
        req.max_tokens = _number(body, "max_tokens", 1, 1 << 30, integer=True)
        if body.get("stream") is not None and not isinstance(body["stream"], bool):
            raise bad("'stream' must be true or false", "stream")
        req.stream = bool(body.get("stream"))
        for key, name, hi, integer in (("temperature", "temp", 1, False), ("top_p", "top_p", 1, False),
                                       ("top_k", "top_k", 1 << 30, True)):
            v = _number(body, key, 0, hi, integer=integer)
            if v is not None:
                req.sampling[name] = v
        if body.get("top_p") == 0:
            raise bad("'top_p' must be greater than 0", "top_p")
        stops = body.get("stop_sequences")
        if stops is not None and (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)):
            raise bad("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
        req.stop = list(stops or [])
        md = body.get("metadata")
        if md is not None:
            if not isinstance(md, dict):
                raise bad("'metadata' must be an object", "metadata")
            check_fields(md, {"user_id"}, {"user_id"}, "metadata.", API)
            if md.get("user_id") is not None and not isinstance(md["user_id"], str):
                raise bad("'metadata.user_id' must be a string", "metadata.user_id")
        if body.get("service_tier") not in (None, "auto", "standard_only"):
            raise bad("'service_tier' must be 'auto' or 'standard_only'", "service_tier")
    _cache_control(body, "")
    thinking = body.get("thinking")
    if thinking is None:  # Anthropic's API thinks only when asked; the operator's --think/--no-think, where given
        req.template_kwargs["enable_thinking"] = bool(so.think)
    else:
        if not isinstance(thinking, dict):
            raise bad("'thinking' must be an object", "thinking")
        kind = thinking.get("type")
        if kind not in ("enabled", "adaptive", "disabled"):
            raise bad("'thinking.type' must be 'enabled', 'adaptive' or 'disabled'", "thinking.type")
        check_fields(thinking, {"type", "budget_tokens", "display"}, {"type"} | ({"budget_tokens"} if kind == "enabled"
                                                                                else set()), "thinking.", API)
        if kind == "enabled":  # as Anthropic's API checks it: at least 1,024 tokens, fewer than max_tokens
            budget = thinking.get("budget_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or not 1024 <= budget <= 1 << 30:
                raise bad("'thinking.budget_tokens' must be an integer of at least 1024 with 'type': 'enabled'",
                          "thinking.budget_tokens")
            if not counting and budget >= req.max_tokens:
                raise bad(f"'thinking.budget_tokens' ({budget}) must be less than 'max_tokens' ({req.max_tokens})",
                          "thinking.budget_tokens")
            req.thinking_budget = budget
        req.template_kwargs["enable_thinking"] = kind != "disabled"
    _output_config(body, req)
    req.messages = _system(body.get("system")) + parse_messages(body.get("messages"), so, req.images)
    req.tools, req.parse_tools, req.force_call, strict, parallel = _tools(body)
    if req.force_call is not None and req.template_kwargs["enable_thinking"] and thinking is not None:
        raise bad("thinking may not be enabled when tool_choice forces tool use (give 'thinking': {'type': "
                  "'disabled'}, or 'tool_choice' auto)", "tool_choice")
    req.api = {"strict": strict, "parallel": parallel, "format_field": "output_config.format",
               "asks_thinking": "thinking" if thinking is not None and thinking["type"] != "disabled" else None}
    _context_management(body, req)
    if req.messages[-1]["role"] == "assistant":
        _prefill(req, thinking, f"messages[{len(body['messages']) - 1}]")
    return req


def _prefill(req: GenRequest, thinking: dict | None, where: str) -> None:
    """A final assistant turn is the start of the answer, which the model continues (the answer's content is what
    follows it), with the API's own rules: text only, not ending in white space, not beside extended thinking."""
    text = final_text(req.messages)
    if text is not None and text != text.rstrip():
        raise bad(f"{where}: final assistant content cannot end with trailing whitespace", f"{where}.content")
    if thinking is not None and thinking.get("type") != "disabled":
        raise bad(f"{where}: a final assistant turn (a prefilled answer) cannot be continued with thinking "
                  f"{thinking.get('type')!r}", "thinking")
    continued(req, where)


def _context_management(body: dict, req: GenRequest) -> None:
    """`context_management` (Claude Code sends `clear_thinking_20251015` with `keep` "all"): its thinking edit applied
    to the messages before they are rendered, the thinking of all but the last `keep` assistant turns that hold
    some taken out (default: the last one's kept, as Anthropic's API does); the other edits are refused. What it
    cleared is reported with the answer (`context_management.applied_edits`)."""
    cm = body.get("context_management")
    if cm is None:
        return
    if not isinstance(cm, dict):
        raise bad("'context_management' must be an object", "context_management")
    check_fields(cm, {"edits"}, {"edits"}, "context_management.", API)
    edits = [] if cm.get("edits") is None else cm["edits"]
    if not isinstance(edits, list):
        raise bad("'context_management.edits' must be a list", "context_management.edits")
    keep, edited = 0, False  # the thinking turns kept (inf: all); whether a thinking edit was given
    for j, e in enumerate(edits):
        where = f"context_management.edits[{j}]"
        kind = e.get("type") if isinstance(e, dict) else None
        if kind != "clear_thinking_20251015":
            raise bad(f"{where}.type {kind!r} is not implemented here (clear_thinking_20251015 is)", f"{where}.type")
        if edited:
            raise bad(f"{where}: clear_thinking_20251015 is given twice", where)
        edited = True
        check_fields(e, {"type", "keep"}, {"type", "keep"}, f"{where}.", API)
        k = e.get("keep", {"type": "thinking_turns", "value": 1})
        if k == "all" or k == {"type": "all"}:
            keep = float("inf")
        elif (isinstance(k, dict) and set(k) == {"type", "value"} and k["type"] == "thinking_turns"
              and type(k["value"]) is int and k["value"] >= 1):
            keep = k["value"]
        else:
            raise bad(f"{where}.keep must be 'all', {{'type': 'all'}} or {{'type': 'thinking_turns', 'value': N}} "
                      "with N at least 1", f"{where}.keep")
    thought = [m for m in req.messages if m["role"] == "assistant" and m.get("reasoning_content")]
    cleared = thought[:max(0, len(thought) - keep)] if edited else []
    req.api["context_management"] = {"cleared_thinking_turns": len(cleared)}
    if cleared:
        req.api["before_edits"] = [dict(m) for m in req.messages]  # what the worker counts the cleared tokens from
        for m in cleared:
            del m["reasoning_content"]


def applied_edits(req: GenRequest) -> list[dict]:
    """The `context_management.applied_edits` of an answer: the thinking edit, where it cleared any turn."""
    cm = req.api["context_management"]
    if not cm["cleared_thinking_turns"]:
        return []
    return [{"type": "clear_thinking_20251015", "cleared_thinking_turns": cm["cleared_thinking_turns"],
             "cleared_input_tokens": req.api.get("cleared_tokens", 0)}]


def _output_config(body: dict, req: GenRequest) -> None:
    """`output_config.format` (structured outputs: a JSON schema the answer's text follows, constrained as a chat
    request's `response_format` is); `effort`, the reasoning effort of templates that take one (gpt-oss's, with
    "xhigh" and "max" as its "high"; Qwen's templates take none, so there it changes nothing)."""
    oc = body.get("output_config")
    if oc is None:
        return
    if not isinstance(oc, dict):
        raise bad("'output_config' must be an object", "output_config")
    check_fields(oc, {"effort", "format", "task_budget"}, {"effort", "format"}, "output_config.", API)
    effort = _choice(oc, "effort", tuple(EFFORT_OF), "output_config.effort")
    if effort is not None:
        req.template_kwargs["reasoning_effort"] = EFFORT_OF[effort]
    fmt = oc.get("format")
    if fmt is None:
        return
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad("'output_config.format' must be {'type': 'json_schema', 'schema': {...}}", "output_config.format")
    check_fields(fmt, {"type", "schema"}, {"type", "schema"}, "output_config.format.", API)
    req.json_output, req.json_schema = True, fmt["schema"]


class Output:
    """The job's events -> Anthropic's event stream, block by block, and the final `message` (the same
    state either way)."""

    def __init__(self, job, model: str):
        self.job, self.model, self.api = job, model, job.req.api
        self.blocks: list[dict] = []
        self.open: dict | None = None  # the text or thinking block text is flowing into
        self.stop_reason = self.stop_sequence = None
        self.usage = {"input_tokens": len(job.ids), "output_tokens": 0, "cache_read_input_tokens": 0,
                      "cache_creation_input_tokens": 0}
        self.started = False  # message_start sent

    @staticmethod
    def _ev(kind: str, **fields) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n"

    def message(self) -> dict:
        return {"id": f"msg_{self.job.id}", "type": "message", "role": "assistant", "model": self.model,
                "content": [dict(b) for b in self.blocks], "stop_reason": self.stop_reason,
                "stop_sequence": self.stop_sequence, "usage": dict(self.usage), **self._edits()}

    def _edits(self) -> dict:
        """`context_management` with the edits applied, where the request gave it (Anthropic's beta field)."""
        req = self.job.req
        return {"context_management": {"applied_edits": applied_edits(req)}} if "context_management" in req.api else {}

    def start(self) -> list[str]:
        """message_start, with the input side of the usage as Anthropic sends it there: the prompt's tokens and how
        many the prompt cache held (then a ping, as Anthropic's stream has one there). Those are known once the
        worker looked the prompt up ("started"): until then (a request still queued when the stream began) it waits
        for that event."""
        if self.job.started is None or self.started:
            return []
        u, self.started = self.job.started, True
        cached = u["cached_tokens"]
        self.usage.update(input_tokens=u["prompt_tokens"] - cached, cache_read_input_tokens=cached)
        return [self._ev("message_start", message=self.message()), self._ev("ping")]  # Anthropic's order

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [self._ev("content_block_stop", index=len(self.blocks) - 1)]

    def _thinking_first(self) -> list[str]:
        """An empty thinking block where thinking was asked for and the answer opens with another block (the
        model's reasoning was empty): Anthropic's API answers with a thinking block first whenever thinking is on."""
        if self.blocks or self.api.get("asks_thinking") != "thinking":
            return []
        self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
        return [self._ev("content_block_start", index=0, content_block=dict(self.blocks[0])),
                self._ev("content_block_stop", index=0)]

    def _text(self, kind: str, text: str) -> list[str]:
        if kind == "reasoning" and not self.job.req.template_kwargs.get("enable_thinking", True):
            return []  # thinking not asked for: no thinking block, as Anthropic's API (gpt-oss reasons regardless)
        block = "thinking" if kind == "reasoning" else "text"
        out = [] if block == "thinking" else self._thinking_first()
        if self.open is None or self.open["type"] != block:
            out += self._close()
            self.open = {"type": "thinking", "thinking": "", "signature": ""} if block == "thinking" else \
                {"type": "text", "text": ""}
            self.blocks.append(self.open)
            out.append(self._ev("content_block_start", index=len(self.blocks) - 1, content_block=dict(self.open)))
        self.open[block] += text
        delta = {"type": "thinking_delta", "thinking": text} if block == "thinking" else {"type": "text_delta", "text": text}
        return out + [self._ev("content_block_delta", index=len(self.blocks) - 1, delta=delta)]

    def _call(self, call: dict) -> list[str]:
        calls = sum(b["type"] == "tool_use" for b in self.blocks)
        verdict = call_verdict(self.api, call, calls)
        if verdict != "call":
            return self._text("content", call_text(call)) if verdict == "text" else []
        out = self._thinking_first() + self._close()
        block = {"type": "tool_use", "id": f"toolu_{self.job.id[:12]}{calls}", "name": call["name"], "input": {}}
        self.blocks.append(block)
        i = len(self.blocks) - 1
        out.append(self._ev("content_block_start", index=i, content_block=dict(block)))
        out.append(self._ev("content_block_delta", index=i, delta={"type": "input_json_delta",
                                                                 "partial_json": call["arguments"]}))
        block["input"] = loads_exact(call["arguments"])  # its numbers as written (the response: `dumps_exact`)
        out.append(self._ev("content_block_stop", index=i))
        return out

    def feed(self, ev: tuple) -> list[str]:
        kind, v = ev
        if kind == "started":
            return self.start()
        if kind == "logprobs":
            return []  # not requested by this API: the parser never asks for them
        if kind == "delta":
            out = []
            for what, x in v:
                out += self._call(x) if what == "tool_call" else self._text(what, x)
            return out
        out = self._close()
        if kind == "error":
            return out + [self._ev("error", error=error_body(v)["error"])]
        out += self._thinking_first()
        u = v["usage"]
        cached = u["prompt_tokens_details"]["cached_tokens"]
        self.usage = {"input_tokens": u["prompt_tokens"] - cached, "output_tokens": u["completion_tokens"],
                      "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}
        if v["finish_reason"] == "length":  # before tool_use: an answer cut short is not one to run the calls of
            # Anthropic's reason for an answer the context window ended before its max_tokens
            self.stop_reason = "model_context_window_exceeded" if v.get("context_full") else "max_tokens"
        elif any(b["type"] == "tool_use" for b in self.blocks):
            self.stop_reason = "tool_use"
        elif v.get("stop_sequence") is not None:
            self.stop_reason, self.stop_sequence = "stop_sequence", v["stop_sequence"]
        else:
            self.stop_reason = "end_turn"
        return out + [self._ev("message_delta", delta={"stop_reason": self.stop_reason,
                                                       "stop_sequence": self.stop_sequence}, usage=dict(self.usage),
                               **self._edits()),
                      self._ev("message_stop")]

    def result(self) -> dict:
        return self.message()
