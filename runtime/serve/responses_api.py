"""OpenAI's Responses API (`POST /v1/responses`) as a translation layer: a request becomes the same `GenRequest` a
chat completion does (input items -> chat messages, function tools -> chat tools), and the job's events become a
`response` object or its event stream (`response.created` ... `response.completed`).

An ended response is kept (`store`, true unless the request says false) in the server's `ResponseStore`, so a
client may continue it by `previous_response_id` or name its items by `item_reference`, and read it back or delete
it (`GET`/`DELETE /v1/responses/{id}`, `GET .../input_items`); with no store (`--response-store-mib 0`) the server is
stateless and refuses those. `conversation`, `background` and the other fields this server does not implement are
refused with a 400 naming them, as is any field the API does not define.
Reasoning (the template's thinking) comes back as a `reasoning` item with `reasoning_text` content; asked for
(`reasoning.summary`), its `summary` holds the same text (this server does not summarise), and with
`include: ["reasoning.encrypted_content"]` the item carries its text encoded for a stateless client (Codex) to
send back, which restores the reasoning as the model wrote it.
"""

from __future__ import annotations

import base64
import binascii
import json

from ..plan import MiB
from .openai_api import (
    EFFORTS,
    APIError,
    GenRequest,
    _arguments,
    _choice,
    _metadata,
    _number,
    _string,
    bad,
    call_text,
    call_verdict,
    check_fields,
    decode_image,
    kept_bytes,
    parse_response_format,
    parse_tools,
    thinks_at,
    typed,
)
from .response_store import ResponseStore

# every field of the API's request body (and `client_metadata`, Codex's labels for its own requests, which change
# nothing here); those not in HONOURED are refused whenever they are set (not null)
FIELDS = {"access_programs", "background", "background_options", "client_metadata", "context_management",
          "conversation", "image", "include", "input", "instructions", "max_output_tokens", "max_tool_calls", "metadata", "model",
          "moderation", "parallel_tool_calls", "previous_response_id", "prompt", "prompt_cache_key",
          "prompt_cache_options", "prompt_cache_retention", "reasoning", "safety_identifier", "service_tier", "store",
          "stream", "stream_options", "temperature", "text", "tool_choice", "tools", "top_logprobs", "top_p",
          "truncation", "user"}
HONOURED = {"background", "client_metadata", "include", "input", "instructions", "max_output_tokens", "metadata",
            "model", "parallel_tool_calls", "previous_response_id", "prompt_cache_key", "reasoning", "safety_identifier",
            "service_tier", "store", "stream", "stream_options", "temperature", "text", "tool_choice", "tools",
            "top_logprobs", "top_p", "truncation", "user"}
COUNT_FIELDS = {"conversation", "input", "instructions", "model", "parallel_tool_calls", "personality",
                "previous_response_id", "reasoning", "text", "tool_choice", "tools", "truncation"}
LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"
# what `include` may name (the SDK's ResponseIncludable); a listed input item carries all of it that it holds, as
# given: its image URLs, its reasoning's encrypted content (the tool calls that hold the others are refused here)
INCLUDABLE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
              "message.input_image.image_url", "computer_call_output.output.image_url", "code_interpreter_call.outputs",
              ENCRYPTED, LOGPROBS)
SUMMARIES = ("auto", "concise", "detailed")
SEALED = "streamoe.1."  # what opens this server's `encrypted_content`: the reasoning's UTF-8, base64url-encoded
# the fields of each input item: (defined, honoured); `id` and `status` name an item a client got back
ITEM_FIELDS = {
    "message": ({"type", "role", "content", "id", "status", "phase"}, {"type", "role", "content", "id", "status"}),
    "function_call": ({"type", "call_id", "name", "arguments", "id", "status", "namespace", "async", "caller"},
                      {"type", "call_id", "name", "arguments", "id", "status"}),
    "function_call_output": ({"type", "call_id", "output", "id", "status"}, {"type", "call_id", "output", "id", "status"}),
    "reasoning": ({"type", "id", "summary", "content", "encrypted_content", "status"},
                  {"type", "id", "summary", "content", "encrypted_content", "status"}),
}


def seal(reasoning: str) -> str:
    """A reasoning item's `encrypted_content`: its text encoded, not encrypted (the client is shown the reasoning
    anyway); what a stateless client sends back to keep the model's reasoning in its next prompt."""
    return SEALED + base64.urlsafe_b64encode(reasoning.encode()).decode()


def unseal(sealed, where: str) -> str:
    """The reasoning an `encrypted_content` holds (a 400 where this server did not write it)."""
    try:
        if isinstance(sealed, str) and sealed.startswith(SEALED):
            return base64.urlsafe_b64decode(sealed[len(SEALED):].encode()).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        pass
    raise bad(f"{where}.encrypted_content was not written by this server: its reasoning cannot be restored",
              f"{where}.encrypted_content")


def _text_of(parts, where: str, kinds: tuple[str, ...]) -> str:
    """Text parts (of the given types) -> one string; any other part is refused."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise bad(f"{where} must be a string or a list of parts", where)
    out = []
    for j, part in enumerate(parts):
        pw = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds:
            raise bad(f"{pw}: unsupported part type {kind!r} here ({', '.join(kinds)} are)", pw)
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad(f"{pw}.text must be a string", pw)
        out.append(text)
    return "".join(out)


def _user_content(content, where: str, so, images: list[bytes], user: bool = True):
    """A user or system message's content: a string, or input_text/input_image parts in the chat template's
    form (images decoded from their data: URLs, appended to `images`; in a user message only, as on the chat
    route: the templates place images in user turns)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad(f"{where} must be a string or a non-empty list of parts", where)
    parts = []
    for j, part in enumerate(content):
        pw = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "input_text":
            if not isinstance(part.get("text"), str):
                raise bad(f"{pw}.text must be a string", pw)
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image":
            if not user:
                raise bad(f"{pw}: an image goes in a user message (as on the chat route), not a system or developer "
                          "one", pw)
            if part.get("file_id") is not None:
                raise bad(f"{pw}.file_id: this server keeps no files; send the image as a data: URL", f"{pw}.file_id")
            _choice(part, "detail", ("auto", "high"), f"{pw}.detail")  # every image is read at up to --max-pixels
            url = part.get("image_url")
            if not isinstance(url, str):
                raise bad(f"{pw}.image_url must be a data: URL string", f"{pw}.image_url")
            if len(images) >= so.limits.max_images:
                raise bad(so.limits.too_many_images(), pw)
            images.append(decode_image(url, so.limits, f"{pw}.image_url"))
            parts.append({"type": "image"})
        else:
            raise bad(f"{pw}: unsupported content part type {kind!r} (input_text and input_image are)", pw)
    if all(p["type"] == "text" for p in parts):  # text only: one string, the form every template renders
        return "".join(p["text"] for p in parts)
    return parts


def parse_input(items, so, images: list[bytes]) -> list[dict]:
    """`input` (a string, or message / function_call / function_call_output / reasoning items) -> chat
    messages. Calls join the assistant message before them; reasoning joins the assistant turn after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    msgs: list[dict] = []
    reasoning, called = "", {}  # the function_call items so far not answered: call id -> where

    def assistant() -> dict:
        nonlocal reasoning
        if not msgs or msgs[-1]["role"] != "assistant":
            msgs.append({"role": "assistant", "content": ""})
        if reasoning:
            msgs[-1]["reasoning_content"], reasoning = reasoning, ""
        return msgs[-1]

    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message" if "role" in item else None)
        if not isinstance(kind, str | None):
            raise bad(f"{where}.type must be a string", f"{where}.type")
        if kind in ITEM_FIELDS:
            check_fields(item, *ITEM_FIELDS[kind], f"{where}.", "the Responses API")
        if kind == "message":
            role = item.get("role")
            if role in ("user", "system", "developer"):
                msgs.append({"role": "user" if role == "user" else "system",
                             "content": _user_content(item.get("content"), f"{where}.content", so, images, role == "user")})
            elif role == "assistant":
                text = _text_of(item.get("content"), f"{where}.content", ("output_text", "input_text", "refusal"))
                if msgs and msgs[-1]["role"] == "assistant" and not msgs[-1].get("tool_calls"):
                    msgs[-1]["content"] += text
                else:
                    msgs.append({"role": "assistant", "content": text})
                assistant()
            else:
                raise bad(f"{where}.role must be user, assistant, system or developer, got {role!r}", f"{where}.role")
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            if not isinstance(name, str) or not name or not isinstance(call_id, str):
                raise bad(f"{where} must have a string 'name' and 'call_id'", where)
            called[call_id] = where
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": _arguments(item.get("arguments", "{}"), f"{where}.arguments")}})
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad(f"{where}.call_id must be a string", f"{where}.call_id")
            if called.pop(call_id, None) is None:  # OpenAI's check: an output answers a call the conversation holds
                raise bad(f"{where}: no tool call found for function call output with call_id {call_id[:80]!r}",
                          f"{where}.call_id")
            out = _text_of(item.get("output"), f"{where}.output", ("input_text", "output_text"))
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": out})
        elif kind == "reasoning":  # its text, else its sealed text, else its summary's, joins the next assistant turn
            texts = []
            for key, part_kind in (("content", "reasoning_text"), ("summary", "summary_text")):
                parts = item.get(key) or []
                if not isinstance(parts, list):
                    raise bad(f"{where}.{key} must be a list", f"{where}.{key}")
                texts.append(_text_of(parts, f"{where}.{key}", (part_kind,)) if parts else "")
            if item.get("encrypted_content") is not None:
                texts.insert(1, unseal(item["encrypted_content"], where))
            reasoning += next((t for t in texts if t), "")
        else:
            raise bad(f"{where}.type {kind!r} is not supported (message, function_call, function_call_output and "
                      "reasoning items are)", f"{where}.type")
    if called:  # and each call has its output (the template renders no ids: results would pair with other calls)
        call_id, where = next(iter(called.items()))
        raise bad(f"{where}: no tool output found for function call {call_id[:80]!r}: send a function_call_output "
                  "item with its call_id", where)
    if not any(m["role"] != "system" for m in msgs):
        raise bad("'input' holds no user, assistant or tool item", "input")
    return msgs


def parse_tools_choice(body: dict) -> tuple[list[dict] | None, bool, str | None, dict]:
    """Function tools and `tool_choice` -> the chat form's (tools, parse, call prefix), and the strict
    tools' parameter schemas (their calls are checked against them)."""
    tools, strict = body.get("tools"), {}
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list", "tools")
        chat_tools = []
        for j, t in enumerate(tools):
            where = f"tools[{j}]"
            if not isinstance(t, dict) or t.get("type") != "function":
                kind = t.get("type") if isinstance(t, dict) else None
                raise bad(f"{where}.type {kind!r}: only function tools are supported", f"{where}.type")
            check_fields(t, {"type", "name", "description", "parameters", "strict", "defer_loading"},
                         {"type", "name", "description", "parameters", "strict"}, f"{where}.", "the Responses API")
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise bad(f"{where}.name must be a non-empty string", f"{where}.name")
            typed(t, f"{where}.", ("strict",), ("description",))
            params = t.get("parameters") or {"type": "object", "properties": {}}
            fn = {"name": t["name"], **({"description": t["description"]} if t.get("description") is not None else {}),
                  "parameters": params, **({"strict": t["strict"]} if "strict" in t else {})}  # as the chat route renders it
            chat_tools.append({"type": "function", "function": fn})
            if t.get("strict"):
                strict[t["name"]] = params
        chat_tools = chat_tools or None
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}",
                      "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice not in (None, "none", "auto", "required"):
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}", "tool_choice")
    try:
        got = parse_tools({"tools": chat_tools, "tool_choice": choice})
    except APIError as e:
        raise bad(e.message, "tools" if e.param and e.param.startswith("tools") else e.param) from None
    return (*got, strict)


KEEPS_NONE = "this server keeps no responses (it runs with --response-store-mib 0)"


def resolve(body: dict, previous: str | None, store: ResponseStore | None, limits) -> tuple[list, list]:
    """`input` with what it names from the store -> (the whole conversation's items: the chain of stored responses
    before `previous_response_id`, then this request's; this request's items), each `item_reference` replaced by the
    item it names. What the store gives is weighed before it is parsed: with the body, no more than a body may hold
    (as if the client had sent the whole conversation itself)."""
    items = body["input"]
    given = [{"type": "message", "role": "user", "content": items}] if isinstance(items, str) else items
    if not isinstance(given, list) or not given:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    texts: list[bytes] = []
    if previous is not None:
        texts = store.chain(previous) if store is not None else None
        if texts is None:
            why = KEEPS_NONE if store is None else "not stored, or no longer (it or a response before it)"
            raise APIError(400, f"previous response with id {previous!r} not found: {why}; send the whole "
                           "conversation in 'input'", "previous_response_id", code="previous_response_not_found")
    at: dict[int, bytes] = {}  # the references' items, by their place in `given`
    for i, item in enumerate(given):
        if isinstance(item, dict) and item.get("type") == "item_reference":
            where = f"input[{i}]"
            check_fields(item, {"type", "id"}, {"type", "id"}, f"{where}.", "the Responses API")
            if not isinstance(item.get("id"), str):
                raise bad(f"{where}.id must be a string", f"{where}.id")
            found = store.item(item["id"]) if store is not None else None
            if found is None:
                why = KEEPS_NONE if store is None else "not stored, or no longer"
                raise bad(f"{where}: item {item['id']!r} not found: {why}", f"{where}.id")
            at[i] = found
    if not texts and not at:
        return given, given
    weight = sum(map(len, texts)) + sum(map(len, at.values()))
    if weight > limits.max_body:
        raise APIError(413, f"the stored items this request names hold {weight / MiB:.1f} MiB, over the "
                            f"{limits.max_body / MiB:g} MiB a request may hold (--max-body-mib): send less of the "
                            "conversation", "previous_response_id" if previous is not None else "input")
    before, named = [json.loads(t) for t in texts], {i: json.loads(t) for i, t in at.items()}
    resolved = [named.get(i, item) for i, item in enumerate(given)]
    if (kept := kept_bytes(before) + kept_bytes(list(named.values())) + kept_bytes(body)) > limits.max_kept:
        raise APIError(413, f"with the stored items it names, this request holds {kept / MiB:.1f} MiB of objects; "
                            f"at most {limits.max_kept / MiB:.1f} MiB are kept per request")
    return before + resolved, resolved


def parse(body: dict, so, counting: bool = False, store: ResponseStore | None = None) -> GenRequest:
    """A Responses request (or, `counting`, an input-token count's: `POST /v1/responses/input_tokens`) -> the chat
    `GenRequest` that answers it (or a 400 naming the field). With a `store`, what the request names from it is
    read there, and the answer is stored unless `store` is false."""
    check_fields(body, COUNT_FIELDS if counting else FIELDS, HONOURED, api="the Responses API")
    if body.get("store") is not None and not isinstance(body["store"], bool):
        raise bad("'store' must be true or false", "store")
    if body.get("store") and store is None:
        raise bad(f"'store': {KEEPS_NONE}; send store: false", "store")
    previous = _string(body, "previous_response_id")
    if body.get("background"):
        raise bad("'background': responses are answered in the foreground only", "background")
    _choice(body, "truncation", ("disabled",))
    _choice(body, "service_tier", ("auto", "default"))
    req = GenRequest(kind="chat", model=_string(body, "model"))
    for key in ("stream", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise bad(f"'{key}' must be true or false", key)
    req.stream = bool(body.get("stream"))
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        check_fields(opts, {"include_obfuscation"}, {"include_obfuscation"}, "stream_options.", "the Responses API")
        if opts.get("include_obfuscation"):
            raise bad("'stream_options.include_obfuscation': this server adds no obfuscation",
                      "stream_options.include_obfuscation")
        if not req.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    req.max_tokens = _number(body, "max_output_tokens", 1, 1 << 30, integer=True)
    for key, name, hi in (("temperature", "temp", 2), ("top_p", "top_p", 1)):
        v = _number(body, key, 0, hi)
        if v is not None:
            req.sampling[name] = v
    if body.get("top_p") == 0:
        raise bad("'top_p' must be greater than 0", "top_p")
    include = body.get("include") or []
    if not isinstance(include, list):
        raise bad("'include' must be a list", "include")
    for j, inc in enumerate(include):
        if inc not in (LOGPROBS, ENCRYPTED):
            raise bad(f"'include' value {inc!r} is not supported ({LOGPROBS!r} and {ENCRYPTED!r} are)", f"include[{j}]")
    req.logprobs = LOGPROBS in include
    top = _number(body, "top_logprobs", 0, 20, integer=True)
    if top and not req.logprobs:
        raise bad(f"'top_logprobs' needs 'include': [{LOGPROBS!r}]", "top_logprobs")
    req.top_logprobs = top or 0
    text = body.get("text")
    echoed_format = None
    if text is not None:
        if not isinstance(text, dict):
            raise bad("'text' must be an object", "text")
        check_fields(text, {"format", "verbosity"}, {"format"}, "text.", "the Responses API")
        fmt = text.get("format")
        echoed_format = fmt
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":  # Responses puts the schema's fields flat
            typed(fmt, "text.format.", ("strict",), ("name", "description"))
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        try:
            parse_response_format(fmt, req)
        except APIError as e:
            message = str(e.message).replace("'response_format.json_schema", "'text.format")  # its fields are flat
            raise bad(message.replace("'response_format", "'text.format"), "text.format") from None
    reasoning, summary, effort = body.get("reasoning"), None, None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise bad("'reasoning' must be an object", "reasoning")
        check_fields(reasoning, {"effort", "summary", "generate_summary", "context"},
                     {"effort", "summary", "generate_summary"}, "reasoning.", "the Responses API")
        effort = _choice(reasoning, "effort", EFFORTS, "reasoning.effort")
        summary = _choice(reasoning, "summary", SUMMARIES, "reasoning.summary")
        old_name = _choice(reasoning, "generate_summary", SUMMARIES, "reasoning.generate_summary")  # its older name
        if summary is not None and old_name is not None and summary != old_name:
            raise bad("'reasoning.generate_summary' contradicts 'reasoning.summary'", "reasoning.generate_summary")
        summary = summary or old_name
        if effort is not None:
            req.template_kwargs["enable_thinking"] = thinks_at(effort)
            req.template_kwargs["reasoning_effort"] = effort  # gpt-oss's template takes the effort itself
    instructions = _string(body, "instructions")
    if "input" not in body:
        raise bad("'input' is required", "input")
    items, given = resolve(body, previous, store, so.limits)
    if body.get("store") is True and store is not None and not store.fits(given):
        raise bad(f"'store': true, and the input alone is more than the server keeps of all responses "
                  f"(--response-store-mib {store.budget / 2**20:g}): send store: false", "store")
    msgs = parse_input(items, so, req.images)
    req.messages = ([{"role": "system", "content": instructions}] if instructions else []) + msgs
    req.tools, req.parse_tools, req.force_call, strict = parse_tools_choice(body)
    metadata = _metadata(body)
    _metadata(body, "client_metadata", 64)
    for key in ("user", "safety_identifier", "prompt_cache_key"):
        _string(body, key)
    req.api = {"strict": strict, "parallel": body.get("parallel_tool_calls") is not False, "format_field": "text.format",
               "messages_field": "input", "effort_field": "reasoning.effort",
               "asks_thinking": "reasoning.effort" if effort is not None and thinks_at(effort) else None,
               "summary": summary is not None, "sealed": ENCRYPTED in include,
               "store": store is not None and body.get("store") is not False, "previous": previous, "given": given,
               "echo": {"instructions": instructions, "max_output_tokens": req.max_tokens, "metadata": metadata or {},
                        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
                        "top_logprobs": req.top_logprobs, "text": {"format": echoed_format or {"type": "text"}},
                        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
                        "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": summary},
                        "user": body.get("user"), "safety_identifier": body.get("safety_identifier"),
                        "prompt_cache_key": body.get("prompt_cache_key")}}
    return req




class Output:
    """The job's events -> the Responses event stream, item by item, and the final `response` object (the
    same state either way: a whole answer is the stream's last `response`)."""

    def __init__(self, job, model: str, store: ResponseStore | None = None):
        self.job, self.model, self.api, self.store = job, model, job.req.api, store
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning or message item text is flowing into
        self.final: dict | None = None  # the ended response
        self.seq, self.lps, self.usage, self.status, self.incomplete, self.error = 0, [], None, "in_progress", None, None

    def _ev(self, kind: str, **fields) -> str:
        obj = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"

    def response(self) -> dict:
        e, drawn = self.api["echo"], self.job.choices[0].sampler  # the sampling in force: the checkpoint's where not given
        return {"id": f"resp_{self.job.id}", "object": "response", "created_at": self.job.created,
                "status": self.status, "model": self.model, "output": [dict(i) for i in self.items],
                "error": self.error, "incomplete_details": self.incomplete, "instructions": e["instructions"],
                "max_output_tokens": e["max_output_tokens"], "metadata": e["metadata"],
                "parallel_tool_calls": e["parallel_tool_calls"], "previous_response_id": self.api.get("previous"),
                "reasoning": e["reasoning"], "store": self.api.get("store", False), "background": False,
                "temperature": drawn.temp, "top_p": drawn.top_p, "top_logprobs": e["top_logprobs"], "text": e["text"],
                "tool_choice": e["tool_choice"], "tools": e["tools"], "truncation": "disabled", "user": e["user"],
                "safety_identifier": e["safety_identifier"], "prompt_cache_key": e["prompt_cache_key"],
                "usage": self.usage}

    def start(self) -> list[str]:
        return [self._ev("response.created", response=self.response()),
                self._ev("response.in_progress", response=self.response())]

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}

    def _open(self, kind: str) -> list[str]:
        out = self._close()
        n = len(self.items)
        if kind == "reasoning":
            item = {"id": f"rs_{self.job.id}{n}", "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": f"msg_{self.job.id}{n}", "type": "message", "status": "in_progress", "role": "assistant",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self.open = item
        out.append(self._ev("response.output_item.added", output_index=n, item=dict(item)))
        item["content"] = [part]
        out.append(self._ev("response.content_part.added", **self._where(), part=dict(part)))
        if kind == "reasoning" and self.api.get("summary"):
            item["summary"] = [{"type": "summary_text", "text": ""}]
            out.append(self._ev("response.reasoning_summary_part.added", **self._summary(), part=dict(item["summary"][0])))
        return out

    def _summary(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1, "summary_index": 0}

    def _close(self, status: str = "completed") -> list[str]:
        """The open item ended: `status` "incomplete" where the answer was cut inside it (max_output_tokens)."""
        item, out = self.open, []
        if item is None:
            return out
        part = item["content"][0]
        if item["type"] == "reasoning":
            out.append(self._ev("response.reasoning_text.done", **self._where(), text=part["text"]))
        else:
            out.append(self._ev("response.output_text.done", **self._where(), text=part["text"],
                                logprobs=part["logprobs"]))
        out.append(self._ev("response.content_part.done", **self._where(), part=part))
        if item["type"] == "reasoning" and item["summary"]:
            summary = item["summary"][0]
            summary["text"] = part["text"]
            out.append(self._ev("response.reasoning_summary_text.done", **self._summary(), text=summary["text"]))
            out.append(self._ev("response.reasoning_summary_part.done", **self._summary(), part=dict(summary)))
        if item["type"] == "reasoning" and self.api.get("sealed"):
            item["encrypted_content"] = seal(part["text"])
        item["status"] = status
        out.append(self._ev("response.output_item.done", output_index=len(self.items) - 1, item=item))
        self.open = None
        return out

    def _text(self, kind: str, text: str) -> list[str]:
        out = self._open(kind) if self.open is None or self.open["type"] != ("reasoning" if kind == "reasoning"
                                                                              else "message") else []
        part = self.open["content"][0]
        part["text"] += text
        if kind == "reasoning":
            self.lps = []  # reasoning has no logprobs in this API
            out.append(self._ev("response.reasoning_text.delta", **self._where(), delta=text))
            if self.open["summary"]:
                out.append(self._ev("response.reasoning_summary_text.delta", **self._summary(), delta=text))
            return out
        lps, self.lps = self.lps, []
        part["logprobs"] += lps
        return out + [self._ev("response.output_text.delta", **self._where(), delta=text, logprobs=lps)]

    def _call(self, call: dict) -> list[str]:
        calls = sum(i["type"] == "function_call" for i in self.items)
        verdict = call_verdict(self.api, call, calls)
        if verdict != "call":
            return self._text("content", call_text(call)) if verdict == "text" else []
        out = self._close()
        n = len(self.items)
        item = {"id": f"fc_{self.job.id}{n}", "type": "function_call", "call_id": f"call_{self.job.id[:8]}{calls}",
                "name": call["name"], "arguments": "", "status": "in_progress"}
        self.items.append(item)
        out.append(self._ev("response.output_item.added", output_index=n, item=dict(item)))
        out.append(self._ev("response.function_call_arguments.delta", item_id=item["id"], output_index=n,
                            delta=call["arguments"]))
        item.update(arguments=call["arguments"], status="completed")
        out.append(self._ev("response.function_call_arguments.done", item_id=item["id"], output_index=n,
                            name=call["name"], arguments=call["arguments"]))
        out.append(self._ev("response.output_item.done", output_index=n, item=item))
        return out

    def feed(self, ev: tuple) -> list[str]:
        kind, v = ev
        if kind == "started":
            return []
        if kind == "logprobs":
            self.lps += v
            return []
        if kind == "delta":
            out = []
            for what, x in v:
                out += self._call(x) if what == "tool_call" else self._text(what, x)
            return out
        cut = kind == "error" or (v["finish_reason"] == "length" and not any(i["type"] == "function_call" for i in self.items))
        out = self._close("incomplete" if cut else "completed")
        if kind == "error":
            err: APIError = v
            self.status, self.error = "failed", {"code": err.code or err.kind, "message": err.message}
            return out + [self._ev("error", code=err.code or err.kind, message=err.message, param=err.param),
                          self._ev("response.failed", response=self.response())]
        u = v["usage"]
        self.usage = {"input_tokens": u["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"],
                                               "cache_write_tokens": 0},
                      "output_tokens": u["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": u["completion_tokens_details"]["reasoning_tokens"]},
                      "total_tokens": u["total_tokens"]}
        if cut:
            self.status, self.incomplete = "incomplete", {"reason": "max_output_tokens"}
        else:
            self.status = "completed"
        self.final = self.response()  # built once: the last event's, the stored one and a whole answer's
        if not self._keep(self.final):  # too large for the store: the response says it is not stored
            self.final = self.response()
        return out + [self._ev(f"response.{self.status}", response=self.final)]

    def result(self) -> dict:
        return self.final if self.final is not None else self.response()

    def _keep(self, response: dict) -> bool:
        """An ended response into the store (where its request did not say `store: false`), with its request's
        input items, each given an id where the client gave none (`GET .../input_items` lists them by id).
        False where it alone is more than the store holds: then it is not stored, and says so (`store` false)."""
        if self.store is None or not self.api.get("store"):
            return True
        items = [kept_item(it, f"{self.job.id}in{n}") for n, it in enumerate(self.api["given"])]
        if self.store.put(response, items, self.api.get("previous")):
            return True
        self.api["store"] = False
        return False


def check_kept(response: dict, include: list[str]) -> None:
    """That a stored response holds what a retrieval's `include` names: the logprobs of its text and the encrypted
    content of its reasoning are kept only where the request that made it included them."""
    for j, inc in enumerate(include):
        if inc not in (LOGPROBS, ENCRYPTED):
            raise bad(f"'include' value {inc!r} is not supported ({LOGPROBS!r} and {ENCRYPTED!r} are)", f"include[{j}]")
        if inc == LOGPROBS:
            lacking = any(p.get("text") and not p.get("logprobs") for i in response["output"] if i["type"] == "message"
                          for p in i["content"])
        else:
            lacking = any("encrypted_content" not in i for i in response["output"] if i["type"] == "reasoning")
        if lacking:
            raise bad(f"'include' value {inc!r}: {response['id']} was answered without it, so it holds none", f"include[{j}]")


ITEM_PREFIX = {"function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}  # else "msg"


def kept_item(item: dict, suffix: str) -> dict:
    """An input item as the store keeps and lists it, in OpenAI's shape of a listed item: an id (its own, else its
    type's prefix and `suffix`), a status, and a message's text as one part. It renders as the item given."""
    kind = item.get("type", "message")
    it = {"type": kind, **item}
    if not isinstance(it.get("id"), str):
        it["id"] = f"{ITEM_PREFIX.get(kind, 'msg')}_{suffix}"
    it.setdefault("status", "completed")
    if kind == "message":
        if isinstance(it.get("content"), str):
            assistant = it.get("role") == "assistant"
            it["content"] = [{"type": "output_text", "text": it["content"], "annotations": []} if assistant
                             else {"type": "input_text", "text": it["content"]}]
    return it

