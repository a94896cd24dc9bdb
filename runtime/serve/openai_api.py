"""OpenAI API requests in, checked and normalised, or one `APIError` with the status and error object OpenAI
would answer with. Pure functions over the decoded JSON body: nothing here touches the engine.

Images come only as `data:` URLs inside the request (the server never fetches a URL and never opens a path a
request names); their bytes are size-checked and their header is read before the request is queued.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import re
import sys
import warnings
from dataclasses import dataclass, field

import jsonschema
import numpy as np

from ...formats.errors import StreamoeError
from ..image import FORMATS, check_header

ROLES = ("system", "developer", "user", "assistant", "tool")


class APIError(Exception):
    """A request the server refuses: HTTP status + OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str | None = None,
                 code: str | None = None, anthropic: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.anthropic = anthropic  # the message in Anthropic's own words, where its clients read them
        self.kind = kind or {400: "invalid_request_error", 404: "not_found_error", 408: "invalid_request_error",
                             413: "invalid_request_error", 429: "rate_limit_error",
                             503: "server_overloaded"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# vLLM's guided decoding fields before 0.12, which moved them into `structured_outputs`; older clients still send them
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_whitespace_pattern": "whitespace_pattern", "guided_decoding_backend": None}


def check_fields(body: dict, fields: set[str], honoured: set[str], where: str = "", api: str = "this API") -> None:
    """Refuse (400 naming it) a field the API does not define, or one it defines that is not implemented
    here; null counts as not set."""
    for key, value in body.items():
        name = f"{where}{key}"
        if key not in fields and key in GUIDED and "structured_outputs" in fields:
            moved = f"send {{'structured_outputs': {{'{GUIDED[key]}': ...}}}}" if GUIDED[key] else "leave it out"
            raise bad(f"'{name}' is vLLM's guided decoding field, removed in vLLM 0.12: {moved}", name)
        if key not in fields:
            raise bad(f"unknown field '{name}' ({api} defines no such field)", name)
        if key not in honoured and value is not None:
            raise bad(f"'{name}' is not supported by this server", name)


def _choice(body: dict, key: str, allowed: tuple, where: str | None = None):
    v = body.get(key)
    if v is not None and v not in allowed:
        name = where or key
        raise bad(f"'{name}' must be one of {', '.join(map(repr, allowed))}; this server implements no other", name)
    return v


def _string(body: dict, key: str, where: str | None = None) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise bad(f"'{where or key}' must be a string", where or key)
    return v


def _metadata(body: dict, key: str = "metadata", most: int = 16) -> dict | None:
    """`metadata` (or another field of labels, `key`): at most 16 string values (OpenAI's limits: keys of at most
    64 characters, values of at most 512), kept as the API echoes them."""
    metadata = body.get(key)
    if metadata is not None and (not isinstance(metadata, dict) or len(metadata) > most
                                 or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise bad(f"'{key}' must be an object of at most {most} string values", key)
    if key == "metadata" and metadata and (long := next((k for k, v in metadata.items() if len(k) > 64 or len(v) > 512), None)):
        raise bad(f"'metadata' key {long[:80]!r}: keys are at most 64 characters and values at most 512", key)
    return metadata


EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


def thinks_at(effort: str) -> bool:
    """A reasoning effort as the one switch Qwen's templates have: thinking off at "none" and "minimal"."""
    return effort not in ("none", "minimal")


def valid_arguments(call: dict, schema) -> bool:
    """Whether a parsed call's arguments satisfy its tool's parameter schema (strict tools)."""
    try:
        jsonschema.validate(json.loads(call["arguments"]), schema)
    except (jsonschema.ValidationError, jsonschema.SchemaError, ValueError):
        return False
    return True


def call_text(call: dict) -> str:
    """A call refused as a call (its arguments break a strict schema), given back as text: the block in its JSON
    form (as the XML form's parser read it, where the template writes that)."""
    return '<tool_call>\n{"name": ' + json.dumps(call["name"]) + ', "arguments": ' + call["arguments"] + "}\n</tool_call>"


def call_verdict(api: dict, call: dict, calls: int) -> str:
    """What an answer's tool call becomes, `calls` calls having been made before it: "text" where its tool is strict
    and the arguments break the tool's schema (given back as text, `call_text`), "drop" where the
    request allows one call and it was made, else "call". `api` holds the request's "strict" schemas by tool name
    and whether "parallel" calls are allowed."""
    schema = api.get("strict", {}).get(call["name"])
    if schema is not None and not valid_arguments(call, schema):
        return "text"
    return "drop" if calls and not api.get("parallel", True) else "call"


@dataclass
class Limits:
    """What one request may carry. The plan's `requests` account is sized from them."""

    max_body: int = 4 << 20
    max_answer: int = 8 << 20  # what an answer may hold for its client: a stream's unsent part, a whole answer
    max_image_bytes: int = 3 << 20
    max_images: int = 4
    max_decode_pixels: int = 1 << 24
    max_values: int = 1 << 16  # JSON values in one body (objects, arrays, strings, numbers...)
    max_depth: int = 64  # JSON nesting
    images_off: str = ""  # why this server takes no images (max_images 0), as the refusal says it; "": it takes them

    def too_many_images(self) -> str:
        """The refusal of a request with more than `max_images` images."""
        if self.images_off:
            return f"this server takes no images: it {self.images_off}"
        return f"at most {self.max_images} images per request"

    @property
    def max_kept(self) -> int:
        """Memory one admitted request may keep once parsed (its objects, their strings and its images):
        a parsed body that would hold more is refused."""
        return 2 * self.max_body

    @property
    def parse_peak(self) -> int:
        """The transient memory of parsing one body at its limits: the decoded text (up to 4 bytes a character)
        and the strings copied out of it, plus every value's object (measured at most ~82 bytes each: a
        one-key object in an array; `PARSED_VALUE_BYTES` leaves room)."""
        return 8 * self.max_body + PARSED_VALUE_BYTES * self.max_values


PARSED_VALUE_BYTES = 128
_NON_BRACKET = bytes(c for c in range(256) if c not in b"[]{}")
_SURROGATE = re.compile("[\ud800-\udfff]")


def check_shape(raw: bytes, limits: Limits) -> None:
    """Refuse, from the raw bytes and before any object is made, a body that would parse into more values or
    deeper nesting than the limits: 4 MiB of `[{},{},...]` is 1.4 M dicts, ~100 MiB of Python objects.
    Each pass is one C scan, whose work is bounded by the limits rather than by the body."""
    opens = raw.count(b"[") + raw.count(b"{")
    if opens <= limits.max_depth and 1 + opens + raw.count(b",") + raw.count(b":") <= limits.max_values:
        return  # counted with the strings' contents, an upper bound: nothing to look closer at
    # escapes out (an escaped backslash, then an escaped quote): every quote left opens or closes a string
    plain = bytes(raw).replace(b"\\\\", b"").replace(b'\\"', b"")
    if plain.count(b'"') // 2 > limits.max_values:
        raise APIError(413, f"the body holds over {limits.max_values:,} JSON strings; at most "
                            f"{limits.max_values:,} values are accepted")
    bare = b'""'.join(plain.split(b'"')[0::2])  # strings' contents hold no structure
    del plain
    values = 1 + sum(bare.count(c) for c in (b",", b":", b"[", b"{"))
    # nesting: over all of it, or (when refused for its size anyway) over a prefix, to name the better reason
    brackets = (bare if values <= limits.max_values else bare[:2 * limits.max_values]).translate(None, _NON_BRACKET)
    depth = deepest = 0
    for i in range(0, len(brackets) if len(brackets) > limits.max_depth else 0, 1 << 20):
        b = np.frombuffer(brackets, np.uint8, count=min(1 << 20, len(brackets) - i), offset=i)
        levels = depth + np.cumsum(((b == 0x5B) | (b == 0x7B)).astype(np.int8) * 2 - 1, dtype=np.int32)
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    if deepest > limits.max_depth:
        raise bad(f"the body nests {deepest} levels deep; at most {limits.max_depth} are accepted")
    if values > limits.max_values:
        raise APIError(413, f"the body holds about {values:,} JSON values; at most {limits.max_values:,} are accepted")


def kept_bytes(body) -> int:
    """What a parsed body's objects hold (each container, string and number counted once, with a quarter more
    for the allocator's rounding); a string holding a lone surrogate (`\\ud800`, which no UTF-8 text can carry)
    is refused here, naming its place in the body."""
    total, stack = 0, [(body, "")]
    while stack:
        v, where = stack.pop()
        total += sys.getsizeof(v)
        if isinstance(v, str):
            if not v.isascii() and _SURROGATE.search(v):
                raise bad(f"{where.lstrip('.') or 'the body'}: the text holds a lone UTF-16 surrogate (not a character)",
                          where.lstrip(".") or None)
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((k, where))
                stack.append((x, f"{where}.{k}" if isinstance(k, str) and k.isascii() else where))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{i}]") for i, x in enumerate(v))
    return total * 5 // 4


@dataclass
class GenRequest:
    """A request reduced to what the worker needs."""

    kind: str  # chat | completion
    model: str | None
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats: the usage so far on every chunk
    return_token_ids: bool = False  # vLLM's extension: the prompt's and the answer's token ids in the response
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)  # vLLM's: tokens that end the answer, not written
    include_stop: bool = False  # vLLM's include_stop_str_in_output: a stop string ends the answer written
    ignore_eos: bool = False  # vLLM's: the model's end-of-turn tokens drawn as any token, not ending the answer
    skip_special: bool | None = None  # vLLM's skip_special_tokens (None: as the worker decides for the model)
    min_tokens: int = 0  # vLLM's: no end of the answer (its stop tokens masked) before this many tokens
    cache_salt: str | None = None  # vLLM's: the prompt cache shared only among requests with the same salt
    allowed_token_ids: list[int] = field(default_factory=list)  # vLLM's: the only tokens the answer may draw
    sampling: dict = field(default_factory=dict)  # the fields set, keyed as `Sampler` takes them
    seed: int | None = None
    n: int = 1  # OpenAI's `n`: choices answered one after another, the i-th drawn with seed + i
    logprobs: bool = False  # each generated token's log-probability, and its `top_logprobs` most likely ones
    top_logprobs: int = 0
    # chat
    messages: list[dict] = field(default_factory=list)
    tools: list[dict] | None = None
    parse_tools: bool = False
    force_call: str | None = None  # tool_choice "required" ("") or a named tool: the answer starts a call
    continue_final: bool = False  # the last message, an assistant's, is the answer's start (a prefill), continued
    json_output: bool = False  # response_format json_object / json_schema: the answer is constrained to JSON
    json_schema: dict | None = None  # ... valid against this schema (None: any JSON object)
    answer_grammar: str | None = None  # vLLM's structured regex, choice or grammar: a grammar the whole answer follows
    template_kwargs: dict = field(default_factory=dict)
    thinking_budget: int | None = None  # the most tokens the reasoning may take (Anthropic's thinking.budget_tokens)
    images: list[bytes] = field(default_factory=list)
    # completion
    prompt: str | list[int] | None = None  # the first of `prompts`
    prompts: list[str | list[int]] = field(default_factory=list)  # each answered in its `n` choices, in order
    echo: bool = False  # the prompt comes back before the answer (with its tokens' logprobs where asked)
    # what another API's translation layer keeps for its answer (fields it echoes, tools' strictness)
    api: dict = field(default_factory=dict)


def _number(body: dict, key: str, lo: float, hi: float, integer: bool = False):
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, int) if integer else isinstance(v, int | float)
    if isinstance(v, bool) or not ok:
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {type(v).__name__}", key)
    if not lo <= v <= hi:
        raise bad(f"'{key}' must be between {_bound(lo)} and {_bound(hi)}, got {v}", key)
    return v


def _bound(x: float) -> str:
    """A range's end as a client would write it: an integer in full (1073741824, not 1.07374e+09)."""
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _flag(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false", key)
    return v


def typed(obj: dict, where: str, flags: tuple[str, ...] = (), strings: tuple[str, ...] = ()) -> None:
    """A nested object's fields that must be true or false (`flags`) or strings (`strings`) where given: a tool's
    `strict` of "false" must not read as true."""
    for key in flags:
        if obj.get(key) is not None and not isinstance(obj[key], bool):
            raise bad(f"'{where}{key}' must be true or false", f"{where}{key}")
    for key in strings:
        if obj.get(key) is not None and not isinstance(obj[key], str):
            raise bad(f"'{where}{key}' must be a string", f"{where}{key}")


# The fields of each API's body (OpenAI's, as its client types them, and the extensions of vLLM's and mlx-lm's
# servers this one implements); a field not in the API's HONOURED set is refused whenever it is set (not null).
EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "return_token_ids", "min_tokens", "stop_token_ids",
              "structured_outputs", "include_stop_str_in_output", "ignore_eos", "allowed_token_ids", "cache_salt",
              "best_of", "skip_special_tokens"}  # on chat, vLLM's (1 only here, as on completions)
COMPLETION_FIELDS = {"best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "model", "n",
                     "presence_penalty", "prompt", "seed", "stop", "stream", "stream_options", "suffix", "temperature",
                     "top_p", "user"} | EXTENSIONS
CHAT_FIELDS = {"audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
               "max_completion_tokens", "max_tokens", "messages", "metadata", "modalities", "model", "moderation", "n",
               "parallel_tool_calls", "prediction", "presence_penalty", "prompt_cache_key", "prompt_cache_options",
               "prompt_cache_retention", "reasoning_effort", "response_format", "safety_identifier", "seed",
               "service_tier", "stop", "store", "stream", "stream_options", "temperature", "tool_choice", "tools",
               "top_logprobs", "top_p", "user", "verbosity", "web_search_options", "chat_template_kwargs",
               "continue_final_message", "add_generation_prompt", "echo"} | EXTENSIONS  # the last three: vLLM's
CHAT_HONOURED = CHAT_FIELDS - {"audio", "function_call", "functions", "moderation", "prediction", "prompt_cache_options",
                               "verbosity", "web_search_options"}
MESSAGE_FIELDS = {"role", "content", "name", "tool_calls", "tool_call_id", "refusal", "audio", "function_call",
                  "reasoning_content", "reasoning"}  # the last two: vLLM's, a tool loop's earlier thinking
MESSAGE_HONOURED = MESSAGE_FIELDS - {"refusal", "audio", "function_call"}
# the fields each role's message has in OpenAI's schema (vLLM's reasoning fields an assistant's, and a tool result's
# `name`, which LangChain and others send and templates may render): any other is a 400
ROLE_FIELDS = {"assistant": MESSAGE_FIELDS - {"tool_call_id"}, "tool": {"role", "content", "tool_call_id", "name"},
               **dict.fromkeys(("system", "developer", "user"), {"role", "content", "name"})}

MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_STOP_IDS = 64  # vLLM's `stop_token_ids` one request may give
MAX_N = 16  # choices one request may ask for (`n`): the engine answers them one after another
MAX_CHOICES = 64  # ... and a completion's prompts times `n`

# (field, Sampler's name, range): OpenAI's fields and the ones vLLM and mlx-lm's server add
SAMPLING_FIELDS = (("temperature", "temp", 0, 2), ("top_p", "top_p", 0, 1), ("min_p", "min_p", 0, 1),
                   ("presence_penalty", "presence_penalty", -2, 2), ("frequency_penalty", "frequency_penalty", -2, 2),
                   ("repetition_penalty", "repetition_penalty", 0, 10))


def _common(body: dict, req: GenRequest) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    req.model = model
    req.stream = _flag(body, "stream")
    req.return_token_ids = _flag(body, "return_token_ids")
    req.cache_salt = _string(body, "cache_salt")
    if req.cache_salt == "":
        raise bad("'cache_salt' must be a non-empty string", "cache_salt")
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        keys = {"include_usage", "include_obfuscation", "continuous_usage_stats"}  # the last vLLM's
        check_fields(opts, keys, keys, "stream_options.", "the OpenAI API")
        if opts.get("include_obfuscation"):
            raise bad("'stream_options.include_obfuscation': this server adds no obfuscation",
                      "stream_options.include_obfuscation")
        if not isinstance(opts.get("include_usage", False), bool | None):
            raise bad("'stream_options.include_usage' must be true or false", "stream_options.include_usage")
        req.include_usage = _flag(opts, "include_usage")
        req.continuous_usage = _flag(opts, "continuous_usage_stats")
        if not req.stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    req.n = _number(body, "n", 1, MAX_N, integer=True) or 1
    for key in ("max_tokens", "max_completion_tokens"):  # 0: the echoed prompt alone (completions' `echo`)
        v = _number(body, key, 0 if req.kind == "completion" and body.get("echo") else 1, 1 << 30, integer=True)
        if v is not None:
            req.max_tokens = v if req.max_tokens is None else min(req.max_tokens, v)
    for key, name, lo, hi in SAMPLING_FIELDS:
        v = _number(body, key, lo, hi)
        if v is not None:
            req.sampling[name] = v
    for key in ("top_p", "repetition_penalty"):
        if body.get(key) == 0:
            raise bad(f"'{key}' must be greater than 0", key)
    top_k = _number(body, "top_k", -1, 1 << 30, integer=True)
    if top_k is not None:
        req.sampling["top_k"] = max(top_k, 0)  # -1 (vLLM's "off") is 0 here
    req.seed = _number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True)  # an int64, as OpenAI and vLLM take it
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4):
        raise bad("'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    req.stop = stop or []
    req.include_stop = _flag(body, "include_stop_str_in_output")
    req.ignore_eos = _flag(body, "ignore_eos")
    req.skip_special = None if body.get("skip_special_tokens") is None else _flag(body, "skip_special_tokens")
    req.min_tokens = _number(body, "min_tokens", 0, 1 << 30, integer=True) or 0
    if req.max_tokens is not None and req.min_tokens > req.max_tokens:
        raise bad(f"'min_tokens' ({req.min_tokens}) must be at most the answer's 'max_tokens' ({req.max_tokens})",
                  "min_tokens")
    for name, least, most in (("stop_token_ids", 0, MAX_STOP_IDS), ("allowed_token_ids", 1, MAX_LOGIT_BIAS)):
        ids = body.get(name)
        if ids is not None:
            if not isinstance(ids, list) or not least <= len(ids) <= most or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids):
                raise bad(f"'{name}' must be a list of {least} to {most} token ids", name)
            setattr(req, name, list(dict.fromkeys(ids)))
    if body.get("suffix"):
        raise bad("'suffix' is not supported by this server", "suffix")
    bias = body.get("logit_bias")
    if bias:
        if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
            raise bad(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} token ids", "logit_bias")
        for k, v in bias.items():
            if not (k.isascii() and k.isdigit()) or isinstance(v, bool) or not isinstance(v, int | float) or not -100 <= v <= 100:
                raise bad(f"'logit_bias' maps token ids (\"123\") to numbers in [-100, 100]; got {k!r}: {v!r}",
                          "logit_bias")
        req.sampling["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
    if body.get("best_of") not in (None, 1):
        raise bad("'best_of' is not supported by this server", "best_of")
    _string(body, "user")
    parse_response_format(body.get("response_format"), req)
    parse_structured_outputs(body.get("structured_outputs"), req)


# vLLM's `structured_outputs`: one shape of the answer, and options; disable_any_whitespace and disable_fallback
# hold whatever they say (JSON is written without whitespace, which any whitespace setting allows; nothing falls back)
STRUCTURED_FIELDS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace", "disable_fallback",
                     "disable_additional_properties", "whitespace_pattern", "structural_tag"}
STRUCTURED_HONOURED = STRUCTURED_FIELDS - {"disable_additional_properties", "whitespace_pattern", "structural_tag"}
MAX_CHOICE = 256  # strings a `choice` may list


def parse_structured_outputs(so, req: GenRequest) -> None:
    """vLLM's `structured_outputs`: exactly one of `json` (a schema, or its JSON text), `json_object`, `regex`,
    `choice` (the answer is one of the strings) and `grammar` (Lark, as llguidance, vLLM's guidance backend, reads
    it); JSON takes the path `response_format` takes, the others a grammar of the whole answer."""
    if so is None:
        return
    if not isinstance(so, dict):
        raise bad("'structured_outputs' must be an object", "structured_outputs")
    check_fields(so, STRUCTURED_FIELDS, STRUCTURED_HONOURED, "structured_outputs.", "vLLM")
    for key in ("disable_any_whitespace", "disable_fallback"):
        _flag(so, key)
    given = [k for k in ("json", "json_object", "regex", "choice", "grammar") if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise bad("'structured_outputs' takes exactly one of json, json_object, regex, choice and grammar",
                  "structured_outputs")
    if req.json_output:
        raise bad("'structured_outputs' and 'response_format' cannot both shape one answer", "structured_outputs")
    kind = given[0]
    where, v = f"structured_outputs.{kind}", so[kind]
    req.api = {**req.api, "format_field": where}
    if kind == "json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError:
                raise bad(f"'{where}' is not valid JSON", where) from None
        if not isinstance(v, dict):
            raise bad(f"'{where}' must be a JSON schema (an object, or its JSON text)", where)
        req.json_output, req.json_schema = True, v
    elif kind == "json_object":
        if v is not True:
            raise bad(f"'{where}' must be true", where)
        req.json_output = True
    elif kind == "choice":
        if not isinstance(v, list) or not 0 < len(v) <= MAX_CHOICE or not all(isinstance(c, str) and c for c in v):
            raise bad(f"'{where}' must be a list of 1 to {MAX_CHOICE} non-empty strings", where)
        req.answer_grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(v))
    else:
        if not isinstance(v, str) or not v.strip():
            raise bad(f"'{where}' must be a non-empty string", where)
        if kind == "regex":
            import llguidance

            v = llguidance.LLMatcher.grammar_from_regex(v)
        req.answer_grammar = v


def parse_response_format(rf, req: GenRequest) -> None:
    """OpenAI's `response_format`: text, json_object, or json_schema {name, schema, strict, description}."""
    if rf is None:
        return
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind not in ("text", "json_object", "json_schema") or set(rf) - {"type", "json_schema"}:
        raise bad("'response_format' must be {'type': 'text' | 'json_object' | 'json_schema', ...}", "response_format")
    if kind == "text":
        return
    req.json_output = True
    if kind == "json_object":
        return
    js = rf.get("json_schema")
    if not isinstance(js, dict) or not isinstance(js.get("schema"), dict) or set(js) - {"name", "schema", "strict", "description"}:
        raise bad("'response_format.json_schema' must be {'name', 'schema': {...}, 'strict', 'description'}",
                  "response_format")
    typed(js, "response_format.json_schema.", ("strict",), ("name", "description"))
    if not js.get("name"):  # OpenAI's and vLLM's: the schema's name is required
        raise bad("'response_format.json_schema.name' is required (a non-empty string)", "response_format")
    req.json_schema = js["schema"]


def decode_image(url: str, limits: Limits, where: str) -> bytes:
    """A `data:image/...;base64,...` URL -> the image's bytes, with its header checked (format, pixel count)."""
    if url[:5].lower() != "data:":  # a URL's scheme is case-insensitive
        raise bad(f"{where}: only data: URLs are accepted (the server fetches no URL and reads no file)", where)
    head, sep, data = url[5:].partition(",")
    if not sep or not head.lower().endswith(";base64"):
        raise bad(f"{where}: a data: URL must be base64 encoded (data:image/png;base64,...)", where)
    mime = head[: -len(";base64")].split(";")[0].lower()
    if mime and not mime.startswith("image/"):
        raise bad(f"{where}: media type {mime!r} is not an image", where)
    raw = decode_base64_image(data, limits, where, where, "the data: URL")
    check_image(raw, limits, where)
    return raw


def decode_base64_image(data: str, limits: Limits, where: str, param: str, what: str) -> bytes:
    """An image's base64 text -> its bytes, within the per-image limit (413). Whitespace is skipped, as in
    base64 wrapped at 76 columns (MIME) or pasted with a line break; any other stray character is a 400."""
    data = "".join(data.split())
    if len(data) * 3 // 4 > limits.max_image_bytes + 3:
        raise APIError(413, f"{where}: the image is {len(data) * 3 / 4 / 2**20:.1f} MiB; at most "
                            f"{limits.max_image_bytes / 2**20:.1f} MiB per image", where)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise bad(f"{what} is not valid base64 (standard alphabet, padded)", param) from None


MEDIA_TYPES = {"PNG": "image/png", "JPEG": "image/jpeg", "MPO": "image/jpeg", "WEBP": "image/webp",
               "GIF": "image/gif"}  # by Pillow's format


def check_image(raw: bytes, limits: Limits, where: str) -> str:
    """An image's header, checked as `run` checks a file's (`image.check_header`: format, size, aspect ratio, pixel
    mode) when the request is parsed: a 400 naming the part, before the request is queued or counted. Its media
    type (`MEDIA_TYPES`)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            img = Image.open(io.BytesIO(raw))
            check_header(img, where, limits.max_decode_pixels)
            return MEDIA_TYPES[img.format]
    except Image.DecompressionBombError:  # a header claiming more pixels than Pillow's own limit
        raise bad(f"{where}: the image's header claims more pixels than Pillow decodes; at most "
                  f"{limits.max_decode_pixels:,} pixels are decoded", where) from None
    except StreamoeError as e:
        raise bad(str(e), where) from None
    except (UnidentifiedImageError, OSError, ValueError):
        raise bad(f"{where}: not an image ({FORMATS} is)", where) from None


def image_hash(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _content(content, role: str, where: str, limits: Limits, images: list[bytes]):
    """A message's content in the form the chat template renders: a string, or parts with images as
    `{"type": "image"}` (their bytes appended to `images` in order)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where}.content must be a string or a list of parts", f"{where}.content")
    if not content:
        raise bad(f"{where}.content must be a string or a non-empty list of parts", f"{where}.content")
    parts = []
    for j, part in enumerate(content):
        pw = f"{where}.content[{j}]"
        if not isinstance(part, dict):
            raise bad(f"{pw} must be an object", pw)
        kind = part.get("type")
        if kind in ("text", "image_url"):
            check_fields(part, {"type", kind, "prompt_cache_breakpoint"}, {"type", kind}, f"{pw}.", "the OpenAI API")
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise bad(f"{pw}.text must be a string", f"{pw}.text")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            if role != "user":
                raise bad(f"{pw}: images are accepted in user messages only", pw)
            iu = part.get("image_url")
            if isinstance(iu, dict):  # "high" is what every image gets: up to --max-pixels after resizing
                check_fields(iu, {"url", "detail"}, {"url", "detail"}, f"{pw}.image_url.", "the OpenAI API")
                _choice(iu, "detail", ("auto", "high"), f"{pw}.image_url.detail")
            url = iu.get("url") if isinstance(iu, dict) else iu
            if not isinstance(url, str):
                raise bad(f"{pw}.image_url.url must be a string", pw)
            if len(images) >= limits.max_images:
                raise bad(limits.too_many_images(), pw)
            images.append(decode_image(url, limits, pw))
            parts.append({"type": "image"})
        else:
            raise bad(f"{pw}: unsupported content part type {kind!r} (text and image_url are)", pw)
    return parts


def _arguments(args, where: str) -> dict:
    """A call's arguments as the object templates iterate (`arguments|items`): OpenAI clients send them as a
    JSON string, which is decoded here (an empty one is no arguments)."""
    if isinstance(args, dict):
        return args
    if args is None or args == "":
        return {}
    if isinstance(args, str):
        try:
            obj = json.loads(args)
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            return obj
    raise bad(f"{where} must be a JSON object (or a string holding one)", where)


def _tool_calls(calls, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(calls):
        cw = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(f"{cw} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}", cw)
        # `index`: a streamed call's place, kept by clients that rebuild the message from its deltas
        check_fields(c, {"id", "type", "function", "index"}, {"id", "type", "function", "index"}, f"{cw}.", "the OpenAI API")
        if "index" in c and (type(c["index"]) is not int or c["index"] != j):
            raise bad(f"{cw}.index must be {j}, the call's place in the list", f"{cw}.index")
        check_fields(fn, {"name", "arguments"}, {"name", "arguments"}, f"{cw}.function.", "the OpenAI API")
        call = {"type": "function", "function": {"name": fn["name"],
                                                 "arguments": _arguments(fn.get("arguments"), f"{cw}.function.arguments")}}
        if isinstance(c.get("id"), str):
            call = {"id": c["id"], **call}
        out.append(call)
    return out


def parse_messages(messages, limits: Limits, images: list[bytes]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    out, asked = [], {}
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
        check_fields(m, MESSAGE_FIELDS, MESSAGE_HONOURED, f"{where}.", "the OpenAI API")
        if stray := [k for k in MESSAGE_FIELDS - ROLE_FIELDS[role] if m.get(k) is not None]:
            raise bad(f"{where}.{stray[0]}: a message of role {role!r} has no '{stray[0]}' field", f"{where}.{stray[0]}")
        msg = {"role": "system" if role == "developer" else role,
               "content": _content(m.get("content"), role, where, limits, images)}
        if _string(m, "name", f"{where}.name") is not None:  # given to the template, which renders it or not
            msg["name"] = m["name"]
        key = next((k for k in ("reasoning_content", "reasoning") if m.get(k) is not None), None)
        if role == "assistant" and key:  # templates that keep a tool loop's thinking render it
            if not isinstance(m[key], str):
                raise bad(f"{where}.{key} must be a string", f"{where}.{key}")
            msg["reasoning_content"] = m[key]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        elif msg["content"] is None and role != "assistant":
            raise bad(f"{where}.content is missing", f"{where}.content")
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id must be the id of the call this message answers", f"{where}.tool_call_id")
            msg["tool_call_id"] = m["tool_call_id"]
        asked = _answered(asked, msg, where)
        out.append(msg)
    return out


def _answered(asked: dict[str, str], msg: dict, where: str) -> dict[str, str]:
    """The calls left unanswered (id -> where each was made) after `msg`, by OpenAI's rules: an assistant message's
    calls are each answered by a tool message naming its id, before any other message; a tool message answers one of
    them. The template does not render the ids, so a history that breaks these pairs its results with the wrong
    calls: a 400 naming the message."""
    if msg["role"] == "tool":
        if asked.pop(msg["tool_call_id"], None) is None:
            raise bad(f"{where}.tool_call_id {msg['tool_call_id'][:80]!r} answers no call: a message of role 'tool' "
                      "answers one of the calls of the assistant message before it, once", f"{where}.tool_call_id")
        return asked
    if asked:
        ids = ", ".join(i[:80] for i in asked)
        raise bad(f"{where}: an assistant message with 'tool_calls' must be followed by tool messages answering each "
                  f"'tool_call_id'; not answered: {ids}", next(iter(asked.values())))
    calls: dict[str, str] = {}
    for j, c in enumerate(msg.get("tool_calls") or []):
        if "id" in c and c["id"] in calls:
            raise bad(f"{where}.tool_calls[{j}].id {c['id'][:80]!r} is given twice", f"{where}.tool_calls[{j}].id")
        if "id" in c:
            calls[c["id"]] = f"{where}.tool_calls[{j}]"
    return calls


TOOL_FIELDS = {"name", "description", "parameters", "strict"}


TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # OpenAI's and Anthropic's names, and MCP's with '.' or ':'


def parse_tools(body: dict) -> tuple[list[dict] | None, bool, str | None]:
    """(tools to render, whether to parse tool calls, the call to force) from `tools` and `tool_choice`:
    "required" forces a call ("", any tool), a named tool forces that one (the worker writes the start of
    the call, in the template's form, into the prompt)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise bad("'tool_choice' names a tool but no 'tools' were given", "tool_choice")
        return None, False, None
    if not isinstance(tools, list) or not tools:
        raise bad("'tools' must be a non-empty list", "tools")
    names = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"tools[{j}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}", f"tools[{j}]")
        check_fields(t, {"type", "function"}, {"type", "function"}, f"tools[{j}].", "the OpenAI API")
        check_fields(fn, TOOL_FIELDS, TOOL_FIELDS, f"tools[{j}].function.", "the OpenAI API")
        typed(fn, f"tools[{j}].function.", ("strict",), ("description",))
        params = fn.get("parameters")
        if not isinstance(params, dict | None):
            raise bad(f"tools[{j}].function.parameters must be a JSON schema object", f"tools[{j}].function.parameters")
        if params and params.get("type", "object") != "object":  # a call's arguments are an object
            raise bad(f"tools[{j}]: a tool's parameters must be a JSON schema of type 'object', got type "
                      f"{params['type']!r}", f"tools[{j}].function.parameters")
        if not TOOL_NAME.fullmatch(fn["name"]):
            raise bad(f"tools[{j}].function.name {fn['name'][:80]!r}: a tool's name is letters, digits, '_', '-', '.' "
                      "or ':', at most 128 (the model writes it inside its call's markup)", f"tools[{j}].function.name")
        if fn["name"] in names:
            raise bad(f"tools[{j}]: the tool name {fn['name']!r} is given twice", f"tools[{j}].function.name")
        names.append(fn["name"])
    if choice is None or choice in ("auto", "required"):
        return tools, True, "" if choice == "required" else None
    if choice == "none":  # the model is not told about the tools at all
        return None, False, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad("'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name'}}",
                  "tool_choice")
    if name not in names:
        raise bad(f"'tool_choice' names {name!r}, which is not among the tools", "tool_choice")
    return [t for t in tools if t["function"]["name"] == name], True, name


MAX_TOP_LOGPROBS = 20


def _chat_logprobs(body: dict, req: GenRequest) -> None:
    """Chat's `logprobs` (true/false) and `top_logprobs` (0-20, only with `logprobs`)."""
    req.logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, integer=True)
    if top is not None and not req.logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    req.top_logprobs = top or 0


def parse_chat(body: dict, limits: Limits) -> GenRequest:
    check_fields(body, CHAT_FIELDS, CHAT_HONOURED, api="the Chat Completions API")
    req = GenRequest(kind="chat", model=None)
    _common(body, req)
    _chat_logprobs(body, req)
    if body.get("store"):
        raise bad("'store': this server is stateless and keeps no completions; send store: false", "store")
    _choice(body, "service_tier", ("auto", "default"))
    _choice(body, "prompt_cache_retention", ("in_memory",))  # the prompt cache is in memory, LRU within its account
    for key in ("safety_identifier", "prompt_cache_key"):
        _string(body, key)
    _metadata(body)
    if body.get("modalities") not in (None, ["text"]):
        raise bad("'modalities': this server answers in text only (['text'])", "modalities")
    req.messages = parse_messages(body.get("messages"), limits, req.images)
    req.tools, req.parse_tools, req.force_call = parse_tools(body)
    if body.get("parallel_tool_calls") is not None and not isinstance(body["parallel_tool_calls"], bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    strict = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
              for t in req.tools or [] if t["function"].get("strict")}
    req.api = {**req.api, "strict": strict, "parallel": body.get("parallel_tool_calls") is not False}
    kw = body.get("chat_template_kwargs")
    if kw is not None:
        if not isinstance(kw, dict):
            raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        for k in ("messages", "tools", "add_generation_prompt", "bos_token", "eos_token"):
            if k in kw:
                raise bad(f"'chat_template_kwargs' may not set {k!r}", "chat_template_kwargs")
        if "enable_thinking" in kw and not isinstance(kw["enable_thinking"], bool):
            raise bad("'chat_template_kwargs.enable_thinking' must be true or false", "chat_template_kwargs")
        req.template_kwargs = dict(kw)
    effort = _choice(body, "reasoning_effort", EFFORTS)
    if effort is not None:
        if req.template_kwargs.get("enable_thinking", thinks_at(effort)) != thinks_at(effort):
            raise bad(f"'reasoning_effort' {effort!r} contradicts 'chat_template_kwargs.enable_thinking'",
                      "reasoning_effort")
        req.template_kwargs["enable_thinking"] = thinks_at(effort)
        req.template_kwargs.setdefault("reasoning_effort", effort)  # gpt-oss's template takes the effort itself
        if thinks_at(effort):
            req.api["asks_thinking"] = "reasoning_effort"  # the field a model without reasoning refuses
    _continue_final(body, req)
    return req


def _continue_final(body: dict, req: GenRequest) -> None:
    """vLLM's `continue_final_message` (sent with `add_generation_prompt` false, as vLLM asks): the last message, an
    assistant's, is the start of the answer, which the model continues instead of opening a turn of its own."""
    go = _flag(body, "continue_final_message")
    add = body.get("add_generation_prompt")
    if add is not None and not isinstance(add, bool):
        raise bad("'add_generation_prompt' must be true or false", "add_generation_prompt")
    if go and add:
        raise bad("'continue_final_message' and 'add_generation_prompt' cannot both be true", "add_generation_prompt")
    if add is False and not go:
        raise bad("'add_generation_prompt' false is supported with 'continue_final_message' true only (the final "
                  "assistant message continued)", "add_generation_prompt")
    if go:
        continued(req, "continue_final_message")
    req.echo = _flag(body, "echo")  # vLLM's: a continued message's text written before the answer
    if req.echo and req.messages[-1]["role"] == "assistant" and not go:
        raise bad("'echo' of a final assistant message is supported with 'continue_final_message' only (the message "
                  "continued, its text before the answer)", "echo")


def final_text(messages: list[dict]) -> str | None:
    """The text a continued conversation's last message ends with, as the template renders it (the last text part
    where it has parts, as transformers finds it); None where the last message is no assistant's text."""
    m = messages[-1]
    content = m.get("content")
    if isinstance(content, list):
        content = content[-1].get("text") if content and content[-1].get("type") == "text" else None
    if m["role"] != "assistant" or m.get("tool_calls") or not isinstance(content, str) or not content.strip():
        return None
    return content


def continued(req: GenRequest, param: str) -> None:
    """The request's last message is the answer's start (`continue_final`), which the answer continues: it must be
    an assistant's text, and nothing may shape the answer from its first token (a forced call, a format)."""
    if final_text(req.messages) is None:
        raise bad(f"'{param}': the last message must be an assistant's, ending in non-empty text (no tool calls): "
                  "the start of the answer to continue", param)
    if req.force_call is not None:
        raise bad(f"'{param}': a continued answer cannot also be a forced tool call", "tool_choice")
    if req.json_output or req.answer_grammar is not None:
        field_ = req.api.get("format_field", "response_format")
        raise bad(f"'{param}': a continued answer cannot also follow a format from its first token ('{field_}')",
                  field_)
    req.continue_final = True


# vLLM's /tokenize (a completion's `prompt` or a chat's `messages`) and /detokenize
TOKENIZE_FIELDS = {"model", "prompt", "add_special_tokens", "return_token_strs"}
TOKENIZE_CHAT_FIELDS = {"model", "messages", "add_generation_prompt", "return_token_strs", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs", "mm_processor_kwargs", "tools"}
TOKENIZE_CHAT_HONOURED = TOKENIZE_CHAT_FIELDS - {"chat_template", "mm_processor_kwargs"}


def parse_tokenize(body: dict, limits: Limits) -> tuple[GenRequest, bool, bool]:
    """vLLM's /tokenize body: the request whose prompt is tokenized (as a completion's or a chat's, through the same
    checks), whether special tokens are added (the tokenizer's BOS, where it has one: a prompt's by default, a
    chat's not, its template writing its own) and whether the tokens' text comes back too."""
    if "messages" not in body:
        check_fields(body, TOKENIZE_FIELDS, TOKENIZE_FIELDS, api="vLLM's /tokenize")
        if not isinstance(body.get("prompt"), str):
            raise bad("'prompt' must be a string (or give 'messages')", "prompt")
        req = parse_completion({"model": body.get("model"), "prompt": body["prompt"]})
        return req, _flag(body, "add_special_tokens", True), _flag(body, "return_token_strs")
    check_fields(body, TOKENIZE_CHAT_FIELDS, TOKENIZE_CHAT_HONOURED, api="vLLM's /tokenize")
    keep = ("model", "messages", "tools", "chat_template_kwargs", "continue_final_message", "add_generation_prompt")
    req = parse_chat({k: body[k] for k in keep if k in body}, limits)
    if req.images:
        raise bad("/tokenize takes text only here (an image's tokens are counted by /v1/messages/count_tokens)",
                  "messages")
    return req, _flag(body, "add_special_tokens"), _flag(body, "return_token_strs")


def parse_detokenize(body: dict) -> list[int]:
    """vLLM's /detokenize body: the token ids (their range is the model's, checked by the worker)."""
    check_fields(body, {"model", "tokens"}, {"model", "tokens"}, api="vLLM's /detokenize")
    if body.get("model") is not None and not isinstance(body["model"], str):
        raise bad("'model' must be a string", "model")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad("'tokens' must be a list of token ids", "tokens")
    return ids


def parse_completion(body: dict) -> GenRequest:
    if body.get("top_logprobs") is not None:
        raise bad("'top_logprobs' is chat's; on /v1/completions 'logprobs' is the number of top tokens", "top_logprobs")
    check_fields(body, COMPLETION_FIELDS, COMPLETION_FIELDS, api="the Completions API")
    req = GenRequest(kind="completion", model=None)
    _common(body, req)
    top = _number(body, "logprobs", 0, MAX_TOP_LOGPROBS, integer=True)  # completions: how many top ones
    req.logprobs, req.top_logprobs = top is not None, top or 0
    req.echo = _flag(body, "echo")
    p = body.get("prompt")
    several = isinstance(p, list) and bool(p) and all(isinstance(x, str | list) for x in p)  # a batch of prompts
    req.prompts = p if several else [p]
    for x in req.prompts:
        if not (isinstance(x, str) and x or isinstance(x, list) and x and all(
                isinstance(t, int) and not isinstance(t, bool) for t in x)):
            raise bad("'prompt' must be a non-empty string, a list of token ids, or a list of either", "prompt")
    if len(req.prompts) * req.n > MAX_CHOICES:
        raise bad(f"'prompt' holds {len(req.prompts)} prompts and 'n' is {req.n}: a request is answered in at most "
                  f"{MAX_CHOICES} choices", "prompt")
    req.prompt = req.prompts[0]
    return req
