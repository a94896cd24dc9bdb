"""One engine, many clients: the thread that owns the engine and answers queued requests one at a time.

Requests are prepared (rendered, tokenized, checked against the planned context) where they arrive and then
queued in order in a bounded queue; the worker thread restores the longest cached prompt prefix or clears
the state (nothing one request did reaches the next one's answer), prefills the rest in segments that end at
assistant headers (see `prompt_cache`), generates, and sends events back to the request's event loop. A
request whose client went away is skipped if still queued, and stops at the next token if running. Across
ranks the worker runs on rank 0, and each of its engine calls is told to the other ranks first (`lockstep`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import io
import itertools
import json
import os
import queue
import secrets
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from ...formats.errors import StreamoeError
from ..chat_template import TemplateFailure
from ..constrain import (
    Constraint,
    ThinkingBudget,
    TokenMask,
    guide_tokenizer,
    json_answer,
    json_or_calls_grammar,
    reasoning_close,
    reasoning_header,
    think_opener,
    tool_call_grammar,
)
from ..engine import Engine, Options
from ..image import num_image_tokens
from ..image_prompt import image_config, prefill_images
from ..plan import MiB, current_rss
from ..sampling import Sampler
from ..text import TOKENIZE_BYTES, Detokenizer, PromptBound, generation_defaults
from ..tool_calls import CALL_OPEN, call_prefix
from .chat_output import ChatOutput, HarmonyOutput
from .door import PIECE, READ_AHEAD, SOCKET_BUFFER, WRITE_BUFFER, socket_bytes
from .lockstep import Lockstep, rank_summary, snapshot_id
from .logprobs import ContentTokens, PromptScores, TokenText
from .metrics import LATENCIES, Histogram
from .openai_api import APIError, GenRequest, Limits, bad, final_text, image_hash
from .prompt_cache import PromptCache, boundaries, capture, clear, key_items, restore, snapshot_nbytes


@dataclass
class ServeOptions:
    model_name: str
    aliases: tuple[str, ...] = ()  # more names requests may give the model (`--served-model-name`)
    limits: Limits = field(default_factory=Limits)
    max_queue: int = 8
    prompt_cache_bytes: int = 256 * MiB
    response_store_bytes: int = 32 * MiB  # the Responses API's stored responses (0: stateless)
    max_tokens: int | None = None  # when a request sets none; None = what the planned context holds
    sampling: dict = field(default_factory=dict)  # Sampler arguments overriding generation_config.json
    # enable_thinking where a request does not say; None (the operator did not say either): on, but off where a
    # request's API means no thinking by leaving it out (Anthropic's Messages: `thinking` absent)
    think: bool | None = None
    # the door: Host names accepted besides loopback names and the bound address; origins allowed cross-origin
    allow_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    api_key: str | None = None  # every /v1/ route and /metrics need it (door.Door)
    # connections: how many at once, how long a request head and body may take, how long one may idle
    max_connections: int = 512
    head_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    idle_timeout_s: float = 5.0
    send_timeout_s: float = 30.0  # how long a connection's unsent answer may wait for its client to read (door)
    keepalive_s: float = 5.0  # an SSE comment this often while a streamed request waits or prefills

    @property
    def served_names(self) -> tuple[str, ...]:
        """The names a request's `model` may give (`/v1/models` lists them): the model's, then its aliases."""
        return tuple(dict.fromkeys((self.model_name, *self.aliases)))

    @property
    def admitted(self) -> int:
        """Requests admitted at once (reading their body, queued, or running); one more is answered 503
        before its body is read."""
        return self.max_queue + 1

    def requests_bytes(self, ctx: int, prompt_bytes: int) -> int:
        """The worst case of what admitted requests hold: each admitted request (and one whose client left
        while the engine still runs it) keeps at most `Limits.max_kept`, its prompt's token ids and
        `Limits.max_answer` of its answer (`Job.arrive`); the
        prepare thread parses one body or renders and tokenizes one prompt at a time (counted as if both at
        once; a rendered prompt holds at most the text a request keeps, a character at least a byte there and
        at most 4 in the prompt, and the template's join doubles it for a moment), a prompt of more than
        `prompt_bytes` being refused before it is tokenized (`PromptBound`); the
        running request's images are also files in memory (`image_files`), less than its body; and every
        connection's kernel socket buffers and parsed request heads, bounded (`door.socket_bytes`)."""
        lim = self.limits
        kept = (self.admitted + 1) * (lim.max_kept + IDS_BYTES * ctx + lim.max_answer)
        work = lim.parse_peak + 2 * 4 * lim.max_kept + TOKENIZE_BYTES * prompt_bytes + lim.max_body
        return kept + work + socket_bytes(self.max_connections)


IDS_BYTES = 40  # a token id in a Python list: its pointer and its int object
ID_CHARS = 8  # a token id in a command's JSON text, with its comma (ids below 10^7)
def message_chars(messages: list[dict]) -> int:
    """Characters of the messages' text a template renders verbatim (past answers excepted: templates may
    drop their reasoning)."""
    n = 0
    for m in messages:
        if m["role"] == "assistant":
            continue
        c = m["content"]
        for part in c if isinstance(c, list) else [{"text": c}]:
            if isinstance(part.get("text"), str):
                n += len(part["text"])
    return n


def requests_bytes(so: ServeOptions, root: Path, ctx: int) -> int:
    """The plan's `requests` account for serving the model at ROOT with this context."""
    from tokenizers import Tokenizer

    try:
        bound = PromptBound(Tokenizer.from_file(str(Path(root) / "tokenizer.json")))
    except Exception:  # no readable tokenizer: the engine refuses the model in its own words
        return so.requests_bytes(ctx, 4 * so.limits.max_kept)
    return so.requests_bytes(ctx, prompt_bytes(bound, ctx, so.limits))


def prompt_bytes(bound: PromptBound, ctx: int, limits: Limits) -> int:
    """The largest prompt (UTF-8 bytes) that reaches the tokenizer: what ctx tokens cover, or without a bound
    the text an admitted request may keep (4 bytes a character)."""
    return ctx * bound.token_bytes if bound.token_bytes else 4 * limits.max_kept


@dataclass
class Choice:
    """What one answer of a request starts from: its sampler (its seed), prompt ids, token budget and, for a
    completion given as text, that text. Its grammar is made as it starts: one matcher held at a time."""

    sampler: Sampler
    ids: list[int]
    max_tokens: int
    prompt_text: str | None


@dataclass
class Job:
    """One request between its handler (an event loop) and the worker thread: its answers (`choices`, one unless
    `n` or a batch of completion prompts asks for more), answered one after another."""

    req: GenRequest
    choices: list[Choice]
    thinking: bool
    id: str = field(default_factory=lambda: secrets.token_hex(12))
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.monotonic)  # for the latency histograms (`metrics`)
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancel: threading.Event = field(default_factory=threading.Event)
    prefix: str = ""  # the start of the answer written into the prompt (a forced tool call; an echoed continued text)
    # what shapes the first answer (structured output, forced call, thinking budget), made as the request is
    # prepared so that a bad one is refused before it queues; each later choice's is made as it starts
    constraint: Constraint | ThinkingBudget | TokenMask | None = None
    logits: list | None = None  # kept when a test asks for them
    started: dict | None = None  # the prompt's usage once its cache was looked up (the "started" event), on the loop's side
    sink: list | None = None  # events kept here when there is no event loop (tests, benches in one thread)
    max_answer: int = 0  # bytes the answer may hold for its client (`Limits.max_answer`); 0: unbounded
    held: int = 0  # bytes it holds now, on the loop's side (`arrive`)
    writing: int = 0  # of which the event a stream's handler is writing
    overflowed: bool = False
    heard: float = field(default_factory=time.monotonic)  # when its handler last asked whether the client is there
    head: int = 0  # the prompt's system messages and tools, a prompt cache boundary (`EngineWorker.head_tokens`)

    @property
    def ids(self) -> list[int]:
        """The (first) prompt's token ids."""
        return self.choices[0].ids

    def emit(self, ev: tuple) -> None:
        if self.loop is None:
            if self.sink is not None:
                self.sink.append(ev)
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(self.arrive, ev)

    def arrive(self, ev: tuple) -> None:
        """An event reaches the request's loop (sized here, while the engine's thread computes the next token). What
        the answer holds for its client is counted: a streamed answer's events until its handler takes them (it then
        writes them to a bounded socket), a whole answer's all (the response is built from them). Past `max_answer`
        the job stops: a stream's unsent events are dropped for one error (its client reads too slowly), a whole
        answer ends as an error (it would be too large to hold). Every later event of the job is dropped."""
        if self.overflowed:
            return
        size = answer_bytes(ev, whole=not self.req.stream)
        self.held += size
        if self.max_answer and self.held > self.max_answer and ev[0] not in ("done", "error"):
            self.overflowed = True
            self.cancel.set()
            mib = f"{self.max_answer / MiB:g} MiB"
            if self.req.stream:
                while not self.events.empty():
                    self.events.get_nowait()
                err = APIError(503, f"the answer's unsent part passed {mib}: its client reads too slowly",
                               code="slow_reader")
            else:
                err = APIError(400, f"the answer passed {mib}, the most a whole answer may hold on this server "
                                    "(--max-answer-mib): stream it, or ask for fewer tokens or logprobs",
                               code="answer_too_large")
            self.held = self.writing
            self.events.put_nowait((("error", err), 0))
            return
        self.events.put_nowait((ev, size))

    async def next(self, timeout_s: float | None) -> tuple:
        """The next event (asyncio.TimeoutError after `timeout_s`). A streamed answer's handler asks for it once
        the one before is written (into a bounded socket): that one is no longer held."""
        if self.req.stream:
            self.held, self.writing = self.held - self.writing, 0
        ev, size = await asyncio.wait_for(self.events.get(), timeout_s)
        if self.req.stream:
            self.writing = size
        return ev


def answer_bytes(ev: tuple, whole: bool) -> int:
    """What an event holds on the server until its client has it: its objects, each counted once, with a quarter
    more for the allocator's rounding; for a whole answer twice that (the response's object is built from the
    events, then rendered: `server.PacedJSONResponse`)."""
    total, seen, stack = 0, set(), [ev[1]]
    while stack:
        v = stack.pop()
        if id(v) in seen:
            continue
        seen.add(id(v))
        total += sys.getsizeof(v)
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total * 5 // 4 * (2 if whole else 1)


HEAD_MARK = "\u2063"  # a user message's text that no template writes: where a rendering's head ends


def assistant_header(text) -> list[int]:
    """The tokens a chat template writes to open an assistant turn, both as the generation prompt and when
    it re-renders a past answer (`<|im_start|>assistant\\n` for ChatML): the boundary a conversation's next
    rendering shares with this one."""
    if text.template is None:
        return []
    user = [{"role": "user", "content": "\u2063"}]
    base, gen = text.chat_text(user, add_generation_prompt=False), text.chat_text(user)
    past = text.chat_text(user + [{"role": "assistant", "content": "\u2064"}], add_generation_prompt=False)
    shared = os.path.commonprefix([gen, past])
    if not shared.startswith(base) or len(shared) == len(base):
        return []
    return text.encode(shared[len(base):])


class Cancelled(Exception):
    """Raised from a prefill's progress, between its layers, where the request's client left."""


class EngineWorker:
    """The engine and everything that answers with it: prompt cache, sampling defaults, live telemetry.
    `run` must only ever be called from one thread at a time."""

    def __init__(self, eng: Engine, so: ServeOptions):
        self.eng, self.so = eng, so
        self.cache = PromptCache(so.prompt_cache_bytes)
        self.defaults = {**generation_defaults(eng.root), **so.sampling}
        self.header = assistant_header(eng.text)
        self.last_head = (b"", np.zeros(0, np.int32))  # the last head's digest and ids (prepare thread's: head_tokens)
        self.tool_format = eng.text.template.tool_format if eng.text.template is not None else "json"
        self.pad = eng.manifest.config.get("image_token_id")
        self.vocab = eng.args.vocab_size
        self.guide = None  # llguidance's tokenizer, made on the first constrained request
        self.live: dict = {"state": "idle"}
        self.served = 0
        self.totals = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0, "bytes_read": 0,
                       "host_hits": 0}  # over the server's lifetime
        self.latency = {name: Histogram(bounds) for name, (_, bounds) in LATENCIES.items()}  # the requests', ditto
        self.finished: Counter = Counter()  # answers by finish reason, ditto
        self.token_text = TokenText(eng.text)
        self.bound = eng.text.bound
        self.lock = Lockstep(eng) if eng.group is not None else None  # across ranks: every engine call told first
        if self.lock is not None:
            self.totals["rank_bytes_read"] = [0] * eng.group.size()

    def skips_special(self, req: GenRequest) -> bool:
        """Whether the answer's text leaves the tokenizer's special tokens out (vLLM's `skip_special_tokens`): unless
        the request says, yes, but not on a harmony model (gpt-oss), whose text is written in them; a harmony chat
        keeps them whatever it says, as its channels are read from them (its content holds none)."""
        harmony = self.tool_format == "harmony"
        if harmony and req.kind == "chat":
            return False
        return not harmony if req.skip_special is None else req.skip_special

    def harmony(self, req: GenRequest) -> bool:
        """Whether the answer is a harmony chat (gpt-oss): read by channel, its JSON in the final message. A
        completion's text is its own, whatever the template."""
        return self.tool_format == "harmony" and req.kind == "chat"

    # ---- on the server's prepare thread: turn a request into a job (or an APIError)
    def render(self, req: GenRequest, generation: bool | None = None) -> str:
        """The prompt as the template renders it, the request's text marked as text (see `chat_template`);
        `generation`: with the generation prompt (default: unless the request continues its last message)."""
        if self.eng.text.template is None:
            raise bad("the model has no chat template; use /v1/completions")
        if req.tools and not self.eng.text.template.takes_tools:
            raise bad(f"the model's chat template ({self.eng.text.template.path.name}) does not show tools to the "
                      "model, so it cannot call them", "tools")
        kw = {"enable_thinking": self.so.think is not False, **req.template_kwargs}
        if req.force_call is not None:  # a forced tool call is the whole answer: no thinking before it
            kw["enable_thinking"] = False
        try:
            return self.eng.text.chat_text(req.messages, tools=req.tools, add_generation_prompt=not req.continue_final
                                           if generation is None else generation, **kw)
        except TemplateFailure as e:
            raise bad(f"the chat template ({e.path.name}) refused the messages: {e.reason}",
                      req.api.get("messages_field", "messages")) from None

    def cut_after_final(self, prompt: str, final: str) -> tuple[str, int, str]:
        """A continued conversation's rendering (`continue_final`) cut right after its last message's text, where
        that text last appears (or, stripped, where a template trims it), as transformers' `continue_final_message`
        cuts it; where the text begins, and the text as found."""
        template = self.eng.text.template
        for text in (final, final.strip()):
            marked = template.mark_text(text)
            if (at := prompt.rfind(marked)) >= 0:
                return prompt[:at + len(marked)], at, text
        raise bad(f"the chat template ({template.path.name}) does not write the last assistant message's text as "
                  "given, so the answer cannot continue it", "messages")

    def too_long(self, tokens: int, param: str, how: str = "") -> APIError:
        """A prompt the planned context cannot hold, in the words agents read to compact their conversation: OpenAI's
        code `context_length_exceeded` and "maximum context length" (vLLM's too), Anthropic's "prompt is too long:
        N tokens > M maximum"."""
        ctx = self.eng.opts.ctx
        return APIError(400, f"This model's maximum context length is {ctx} tokens: the prompt is {how}{tokens} tokens; "
                        f"the planned context (--ctx {ctx}) holds {ctx - 1} with one token to answer", param,
                        code="context_length_exceeded", anthropic=f"prompt is too long: {tokens} tokens > {ctx - 1} maximum")

    def check_length(self, text: str, param: str) -> None:
        """Refuse, before tokenizing it, a text that cannot fit the planned context at any token length."""
        if (least := self.bound.at_least(text)) >= self.eng.opts.ctx:
            raise self.too_long(least, param, "at least ")

    def prompt_ids(self, req: GenRequest) -> tuple[list[int], bool, str]:
        """The (first) prompt's token ids, rendered and checked; whether the model starts in its reasoning; and
        the answer's forced start (a tool call's opening, written into the prompt)."""
        thinking, given = False, ""
        field = req.api.get("messages_field", "messages")  # the request's own name for its conversation
        if req.kind == "chat":
            if req.images and self.lock is not None:
                raise bad("across ranks (mlx.launch) a request takes no images: they reach rank 0 alone, and every "
                          "rank must encode them; serve images on one host", field)
            if req.images and not self.eng.opts.images:
                raise bad(f"this server takes no images: it {self.so.limits.images_off or 'was started without them'}",
                          field)
            if (least := self.bound.quick(message_chars(req.messages))) >= self.eng.opts.ctx:
                raise self.too_long(least, field, "at least ")  # before the template copies the text
            if req.continue_final and self.harmony(req):
                raise bad("a harmony chat (gpt-oss) cannot continue its last message here: its answer is read by "
                          "channel from the start of its turn", field)
            prompt = self.render(req)
            self.check_length(prompt, field)
            before = len(prompt)  # where the answer's text begins: the answer's own, or the start it continues
            if req.continue_final:
                prompt, before, text = self.cut_after_final(prompt, final_text(req.messages))
                given = text if req.echo else ""  # vLLM's `echo`: the continued text first in the answer sent
            head = self.eng.text.decode(self.header)
            opened = prompt[:before]
            tail = opened[opened.rfind(head):] if head and head in opened else ""  # the header may open <think>
            thinking = "<think>" in tail and "</think>" not in tail
            if req.force_call is not None:
                name = req.force_call or None
                given = call_prefix(self.tool_format, name)
                marked = call_prefix(self.tool_format, name and self.eng.text.template.mark_text(name))
                prompt, thinking = prompt + ("</think>\n\n" if thinking else "") + marked, False  # a template that ignores the flag
            ids = self.eng.text.encode_chat(prompt)
            if ids.count(self.pad) != len(req.images):  # message text never holds one (it is encoded as text)
                raise bad(f"the chat template wrote {ids.count(self.pad)} image placeholders for {len(req.images)} "
                          "images", field)
        else:
            ids = self.completion_ids(req.prompt)
        if len(ids) >= self.eng.opts.ctx:
            raise self.too_long(len(ids), field if req.kind == "chat" else "prompt")
        return ids, thinking, given

    def head_tokens(self, req: GenRequest, ids: list[int]) -> int:
        """How many of a chat prompt's tokens are its system messages and tools and the user header after them: the
        prefix every conversation on the same system prompt and tools shares (an agent's next session, its
        sub-agents), a prompt cache boundary where it holds at least a prefill step (0: none)."""
        lead = list(itertools.takewhile(lambda m: m.get("role") in ("system", "developer"), req.messages))
        if not lead and not req.tools:
            return 0
        probe = dataclasses.replace(req, messages=[*lead, {"role": "user", "content": HEAD_MARK}], continue_final=False)
        try:
            text = self.render(probe, generation=False)
        except APIError:
            return 0
        if HEAD_MARK not in text:
            return 0
        text = text[:text.find(HEAD_MARK)]
        digest = hashlib.blake2b(text.encode()).digest()
        if digest != self.last_head[0]:  # an agent sends the same head every request: encoded once
            self.last_head = (digest, np.array(self.eng.text.encode_chat(text), np.int32))
        n, head = len(self.last_head[1]), self.last_head[1]
        return n if n >= self.eng.plan.prefill_step and np.array_equal(np.array(ids[:n], np.int32), head) else 0

    def prepare(self, req: GenRequest) -> Job:
        """The request rendered, length-checked and tokenized into a job (or an APIError). It runs on the
        server's prepare thread, one at a time: the plan's `requests` account counts one prompt in work."""
        if self.harmony(req):
            harmony_effort(req)
        if self.tool_format == "xml":
            xml_keys(req.tools or [])
        ids, thinking, given = self.prompt_ids(req)
        if (before := req.api.get("before_edits")) is not None:  # an API's context edits: the tokens they cleared
            sent, edited = (self.eng.text.encode_chat(self.render(r))
                            for r in (dataclasses.replace(req, messages=before), req))
            req.api["cleared_tokens"] = len(sent) - len(edited)
        ctx = self.eng.opts.ctx
        prompts = [ids]  # a completion's batch of prompts: together inside the context, as the plan holds one's ids
        for prompt in req.prompts[1:]:
            prompts.append(self.completion_ids(prompt, ctx - sum(map(len, prompts))))
        seed = secrets.randbits(64) if req.seed is None else req.seed % (1 << 64)  # each int64 its own 64-bit key
        if req.kind == "completion" and req.echo and req.logprobs:
            if self.lock is not None:
                raise bad("'echo' with 'logprobs' (the prompt's logprobs) needs one host, not ranks", "echo")
            # a prompt's logprobs are one event: at least this much, and a whole answer holds every choice's
            scored = max(map(len, prompts)) if req.stream else sum(map(len, prompts)) * req.n
            entry = self.token_text.scored(ids[0], (-0.5, [(ids[0], -1.0 - j) for j in range(req.top_logprobs)]))
            least = scored * answer_bytes(("prompt", entry), whole=not req.stream)  # each its own floats, as sent
            if least > self.so.limits.max_answer:
                raise bad(f"'echo' with 'logprobs' {req.top_logprobs}: the logprobs of {scored:,} prompt tokens hold "
                          f"at least {least / MiB:.1f} MiB, over the {self.so.limits.max_answer / MiB:g} MiB an answer "
                          "may hold on this server (--max-answer-mib)", "echo")
        if req.sampling.get("logit_bias"):
            words = min(self.vocab, self.eng.text.tokenizer.get_vocab_size())  # not the embedding's padding rows
            beyond = [t for t in req.sampling["logit_bias"] if t >= words]
            if beyond:
                raise bad(f"'logit_bias' names token id {beyond[0]}; the tokenizer has {words:,}", "logit_bias")
        sampling = {**self.defaults, **req.sampling}
        for name in ("stop_token_ids", "allowed_token_ids"):
            if beyond := [t for t in getattr(req, name) if t >= self.vocab]:
                raise bad(f"'{name}' names token id {beyond[0]}; the model has {self.vocab:,}", name)
        if len(prompts) * req.n > 1 and self.lock is not None:
            raise bad("across ranks (mlx.launch) a request is answered in one choice: one prompt, 'n' 1",
                      "n" if req.n > 1 else "prompt")
        # the choices share what the context leaves (a request's tokens, prompts and answers, stay inside --ctx as one
        # answer's do, whatever n): each at most its share, as one answer is clamped to what is left
        share = (ctx - sum(map(len, prompts))) // (len(prompts) * req.n)
        want = req.max_tokens if req.max_tokens is not None else self.so.max_tokens or share
        if share < 1 and want:
            raise bad(f"the prompts leave {ctx - sum(map(len, prompts))} tokens of the planned context (--ctx {ctx}) "
                      f"for {len(prompts) * req.n} answers", "n" if req.n > 1 else "prompt")
        choices = [Choice(Sampler(**sampling, seed=(seed + i) % (1 << 64)), p, min(want, share),
                          text if isinstance(text, str) else None)
                   for p, text in zip(prompts, req.prompts or [None], strict=False) for i in range(req.n)]
        # each prompt's i-th choice is drawn with seed + i, as vLLM seeds its choices
        return Job(req, choices, thinking, prefix=given, constraint=self.constraint(req, thinking),
                   head=self.head_tokens(req, ids) if req.kind == "chat" else 0)

    def tokenize(self, req: GenRequest, special: bool) -> list[int]:
        """vLLM's /tokenize: the ids the request's prompt is prefilled as (`prepare`'s), with the tokenizer's BOS
        first where it has one and `special` asks (a raw prompt gets it by default, a chat's template writes its
        own), without it where `special` is false."""
        ids, bos = self.prompt_ids(req)[0], self.eng.text.bos
        if bos is not None and special and ids[:1] != [bos]:
            return [bos, *ids]
        if bos is not None and not special and req.kind == "completion" and ids[:1] == [bos]:
            return ids[1:]
        return ids

    def detokenize(self, ids: list[int]) -> str:
        """vLLM's /detokenize: the text of token ids, each one of the tokenizer's."""
        words = self.eng.text.tokenizer.get_vocab_size()
        if beyond := [t for t in ids if not 0 <= t < words]:
            raise bad(f"'tokens' holds {beyond[0]}; token ids are in [0, {words:,})", "tokens")
        return self.eng.text.decode(ids)

    def completion_ids(self, prompt: str | list[int], room: int | None = None) -> list[int]:
        """A completion prompt's token ids, checked: its text no longer than the planned context can hold, its ids
        in the vocabulary, and no more than `room` of them where the prompts before it in a batch took the rest."""
        if isinstance(prompt, str):
            self.check_length(prompt, "prompt")
            ids = self.eng.text.encode_prompt(prompt)
        else:
            ids = list(prompt)
            if any(not 0 <= t < self.vocab for t in ids):
                raise bad(f"token ids must be in [0, {self.vocab})", "prompt")
        if room is not None and len(ids) >= room:
            raise bad(f"the prompts hold more tokens together than the planned context (--ctx {self.eng.opts.ctx}): "
                      "send the batch in smaller requests", "prompt")
        return ids

    def constraint(self, req: GenRequest, thinking: bool) -> Constraint | ThinkingBudget | TokenMask | None:
        """What shapes the answer: the request's grammar (`grammar`), under a cap on its reasoning where the request
        sets one (`thinking_budget`: the template's `</think>` forced once the reasoning took that many tokens),
        no end before `min_tokens` (vLLM's: the stop tokens masked until then), and only `allowed_token_ids`
        (vLLM's)."""
        grammar = req.json_output or req.answer_grammar is not None or req.force_call is not None
        for field_name in ("min_tokens", "allowed_token_ids", "ignore_eos"):
            if getattr(req, field_name) and grammar:
                raise bad(f"'{field_name}' cannot hold a structured output or a forced call: their grammar shapes the "
                          "answer", field_name)
        shaped = self.shaped(req, thinking)
        if req.ignore_eos and isinstance(shaped.then if isinstance(shaped, ThinkingBudget) else shaped, Constraint):
            raise bad("'ignore_eos' cannot hold strict tools: their grammar lets only the end of the turn follow a "
                      "call", "ignore_eos")
        if req.min_tokens:
            shaped = TokenMask.without(sorted(set(self.eng.text.stop_ids) | set(req.stop_token_ids)), req.min_tokens,
                                       self.vocab, shaped)
        if req.allowed_token_ids:
            shaped = TokenMask.only(req.allowed_token_ids, self.vocab, shaped)
        return shaped

    def shaped(self, req: GenRequest, thinking: bool) -> Constraint | ThinkingBudget | None:
        opener = self.model_opens_thinking(req, thinking)
        grammar = self.grammar(req, thinking, opener)
        harmony = self.harmony(req) and req.force_call is None  # gpt-oss reasons whatever the request says
        close = reasoning_close(self.eng.text, harmony)
        if close is None and not self.harmony(req) and (asked := req.api.get("asks_thinking")):
            # a model without reasoning (Mixtral) asked to reason: refused, as OpenAI's API refuses reasoning_effort
            # on a model without reasoning; asked not to (effort "none", thinking disabled), it does as asked
            raise bad(f"'{asked}': this model does not reason (its tokenizer has no '</think>'); leave it out",
                      asked)
        if close is None and req.thinking_budget is not None:  # a budget it cannot be held to: refused, not dropped
            raise bad("a thinking budget needs the template's '</think>' token, which the model's tokenizer lacks",
                      "thinking.budget_tokens")
        if req.thinking_budget is None:
            return grammar
        if not (thinking or harmony or opener is not None):
            return grammar  # no reasoning in this answer: nothing to cap
        return ThinkingBudget(close, req.thinking_budget, self.vocab, grammar, reasoning_header(self.eng.text, harmony),
                              opener=opener)

    def grammar(self, req: GenRequest, thinking: bool, opener: int | None = None) -> Constraint | None:
        """The grammar a request asks for: the JSON of `response_format` (after the reasoning closes, with
        thinking on), or vLLM's structured regex, choice or grammar (the same way), a forced call's arguments,
        valid against the tool's schema, or, with strict tools, each call block the model opens after its
        reasoning: a strict tool's arguments valid against its schema (the other tools' free), the text around the
        calls free; without parallel calls, only a stop after the first; a JSON format beside tools the model may
        call, the JSON or the calls. `opener`: the `<think>` the model may open the answer with
        (`model_opens_thinking`), after whose close the grammar starts."""
        fmt = req.api.get("format_field", "response_format")  # the field that shaped the answer, in the request's API
        # a forced call is the whole answer, so a format, which holds an answer's text, holds the text of the turn
        # after the call (OpenAI's API takes both; the agents SDK sends both, then tool_choice auto)
        shaped = (req.json_output or req.answer_grammar is not None) and req.force_call is None
        if shaped and req.answer_grammar is not None and self.harmony(req):
            raise bad(f"'{fmt}': on a harmony model (gpt-oss) this server holds an answer to JSON only", fmt)
        tok = self.eng.text.tokenizer
        trigger = tok.token_to_id(CALL_OPEN)
        strict, once = set(req.api.get("strict") or {}), not req.api.get("parallel", True)
        lazy = (not shaped and req.force_call is None and req.parse_tools and bool(req.tools)
                and bool(strict or once) and trigger in tok.get_added_tokens_decoder())  # calls open with one token
        # a JSON format beside tools the model may call: the answer is the JSON or the calls (OpenAI's API lets it
        # choose; held to the format from its first token, an agent with an output type never got to call a tool)
        calls_too = (shaped and req.json_output and req.parse_tools and bool(req.tools) and not self.harmony(req)
                     and trigger in tok.get_added_tokens_decoder())
        if not shaped and req.force_call is None and not lazy:
            return None
        if self.guide is None:
            self.guide = guide_tokenizer(tok, self.vocab, self.eng.text.stop_ids)
        where = fmt if shaped else "tools"
        after = tok.token_to_id("</think>") if thinking or opener is not None else None
        free = frozenset(t["function"]["name"] for t in req.tools or ()) - strict  # the tools taking any arguments
        try:
            if calls_too:
                grammar = json_or_calls_grammar(self.tool_format, req.tools, tok, req.json_schema, free, once)
                return Constraint(self.guide, grammar, self.vocab, after=after, opener=opener)
            if shaped and req.json_output:
                return json_answer(self.guide, req.json_schema, tok, self.vocab, thinking, self.harmony(req), opener)
            if shaped:
                return Constraint(self.guide, req.answer_grammar, self.vocab, after=after, opener=opener)
            if lazy:
                grammar = tool_call_grammar(self.tool_format, req.tools, None, tok, free=free, opened=True)
                return Constraint(self.guide, grammar, self.vocab, after=after, trigger=trigger, once=once, opener=opener)
            grammar = tool_call_grammar(self.tool_format, req.tools, req.force_call or None, tok)
            return Constraint(self.guide, grammar, self.vocab)
        except StreamoeError as e:
            raise bad(str(e), where) from None

    def model_opens_thinking(self, req: GenRequest, thinking: bool) -> int | None:
        """`<think>` where the answer may open its own reasoning: a chat with thinking on whose template leaves the
        tag to the model (Qwen3's; Qwen3.5's opens it in the prompt: `thinking`), so a grammar waits for the close
        if the model thinks; None elsewhere."""
        on = req.template_kwargs.get("enable_thinking", self.so.think is not False)
        if thinking or not on or req.kind != "chat" or self.harmony(req) or req.force_call is not None:
            return None
        return think_opener(self.eng.text.tokenizer)

    def prompt_tokens(self, job: Job) -> int:
        """How many tokens the job's prompt prefills: its ids, each image placeholder counted as the tokens
        its image becomes (from the image's size alone, as the preprocessor resizes it; its header was checked
        when the request was parsed, `openai_api.check_image`)."""
        if not job.req.images:
            return len(job.ids)
        eng = self.eng
        cfg = image_config(eng)
        n = len(job.ids) - len(job.req.images)
        for raw in job.req.images:
            with Image.open(io.BytesIO(raw)) as im:
                n += num_image_tokens(im.height, im.width, cfg)
        return n

    # ---- on the worker thread
    def told(self, op: str, **fields):
        """The context of an engine call: across ranks, the same call told to every other rank first."""
        return self.lock.call(op, **fields) if self.lock is not None else contextlib.nullcontext()

    def run(self, job: Job) -> None:
        """Answer one job, sending ("started", the prompt's usage) once the prompt cache was looked up, ("logprobs",
        entries) and ("delta", events), then ("done", info) or ("error", APIError). With further choices (`n`, a batch
        of completion prompts), each answered after the one before (a prompt's cached part restored), a
        ("choice_done", info) between them, and the "done" info's usage counts each prompt once and every choice's
        tokens."""
        self.latency["request_queue_time_seconds"].observe(time.monotonic() - job.arrived)
        try:
            with image_files(job.req.images) as paths:
                answers = [self._answer(job, 0, job.constraint, paths)]
                for i in range(1, len(job.choices)):
                    if answers[-1].get("cancelled"):
                        break
                    job.emit(("choice_done", answers[-1]))
                    answers.append(self._answer(job, i, self.constraint(job.req, job.thinking), paths))
            info = answers[-1]
            if len(answers) > 1 and not info.get("cancelled"):
                info = {**info, "usage": choices_usage([a["usage"] for a in answers], job.req.n)}
            job.emit(("done", info))
            if not info.get("cancelled"):
                self.latency["e2e_request_latency_seconds"].observe(time.monotonic() - job.arrived)
        except Exception as e:
            if self.lock is not None and self.lock.lost:  # across ranks, a peer gone: the server stops (below)
                job.emit(("error", APIError(503, "the server lost one of its ranks and is stopping", code="shutting_down")))
            elif isinstance(e, APIError):
                job.emit(("error", e))
            elif isinstance(e, StreamoeError):
                msg = str(e)
                for i, p in enumerate(getattr(self, "_paths", [])):
                    msg = msg.replace(str(p), f"image {i + 1}")
                job.emit(("error", APIError(400, msg)))
            else:  # a bug: logged with its traceback, the client gets a 500 without it
                traceback.print_exc(file=sys.stderr)
                job.emit(("error", APIError(500, f"internal error: {type(e).__name__}")))
        finally:
            self._paths = []
            self.eng.scorer = None
            self.live = {"state": "idle", "last": self.live.get("last"), "prompt_cache": self.cache.to_json()}
            if self.lock is not None:
                self.eng.watchdog.idle()  # the next request may come hours later: only a step waits on the peers
        if self.lock is not None and self.lock.broken is not None:
            raise self.lock.broken  # the ranks may be out of step: the server stops, and its peers with it

    def cancelled(self, job: Job, n: int) -> dict:
        """The end of an answer whose client went away (or the server is stopping) after `n` tokens."""
        print(f"streamoe: {job.id} cancelled after {n} tokens (its client went away or the server is stopping)",
              file=sys.stderr, flush=True)
        return {"finish_reason": None, "cancelled": True, "tokens": n}

    def keep(self, key: tuple) -> None:
        """The conversation's state now, the first `len(key)` items of its prompt, into the prompt cache (where it
        is not there already and fits its budget)."""
        if self.cache.wants(need := snapshot_nbytes(self.eng)) and not self.cache.holds(key):
            self.cache.make_room(need)
            self.cache.add(capture(self.eng, key))
            if self.lock is not None:  # every rank keeps the same snapshots, each its own copy
                self.lock.tell("capture", id=snapshot_id(key), keep=[snapshot_id(k) for k in self.cache.snaps])

    def _answer(self, job: Job, index: int, constraint, paths: list[str]) -> dict:
        """The job's choice at `index`, shaped by `constraint`: its info for the "choice_done" or "done" event."""
        eng, req, choice = self.eng, job.req, job.choices[index]
        ids = choice.ids
        stops = [] if req.ignore_eos else None  # vLLM's ignore_eos: an end of turn is drawn as any token, and kept
        self._paths = paths
        del eng.steps[:]  # telemetry is per request; the list must not grow for the server's lifetime
        hashes = [image_hash(b) for b in req.images]
        key = key_items(ids, self.pad, hashes, req.cache_salt, req.kind)  # a chat's and a completion's cuts differ
        echo = req.kind == "completion" and req.echo
        scores = None
        if echo and req.logprobs:  # every prompt position's prediction: the whole prompt prefilled, none restored
            scores = PromptScores(ids, req.top_logprobs)
        marks = sorted({job.head, *boundaries(ids, self.header)} - {0}) if req.kind == "chat" else None
        step = eng.plan.prefill_step
        # restored only where this prompt's own prefill cuts (a chat's after each assistant header, a completion's
        # on the engine's prefill steps), so the rest is prefilled as a fresh prompt's is: the same bits
        fits = marks.__contains__ if marks is not None else (lambda n: n % step == 0)
        snap = self.cache.lookup(key, fits) if self.cache.budget and scores is None else None
        with self.told("begin", restore=None if snap is None else snapshot_id(snap.key)):
            if snap is not None:
                restore(eng, snap)
            else:
                clear(eng)
        start = 0 if snap is None else len(snap.key)
        cached = eng.offset
        if index == 0:
            job.emit(("started", {"prompt_tokens": self.prompt_tokens(job), "cached_tokens": cached}))
        where = [i for i, t in enumerate(ids) if t == self.pad][:len(paths)]  # image i sits at ids[where[i]]

        def images(a: int, b: int) -> list[str]:
            return [paths[i] for i, w in enumerate(where) if a <= w < b]

        cuts = [b for b in marks or [] if b > start]
        if req.kind == "completion" and scores is None and (grid := (len(ids) - 1) // step * step) > start:
            # a completion's prompt kept up to the last whole prefill step before its last token: for its further
            # choices (`n`) and for a longer prompt that begins with it (an agent's next turn, rendered by the
            # client); cut where the engine's prefill steps fall anyway, so the logits are one prefill's bits
            cuts = [grid]
        self.live = {"state": "prefill", "id": job.id, "prompt_tokens": len(ids), "cached_tokens": cached,
                     "rss": current_rss(), "cap": eng.plan.cap}
        a = start
        eng.scorer = scores  # taken off by `run`, however the answer ends

        def stop_if_cancelled(done: int, total: int) -> None:
            """A prefill's progress, layer by layer: a request whose client left stops there (on one host: across
            ranks every rank runs the same layers, and the answer ends at its first token)."""
            if job.cancel.is_set():
                raise Cancelled
        watch = stop_if_cancelled if self.lock is None else None
        try:
            for b in cuts:
                if job.cancel.is_set():
                    raise Cancelled
                seg = images(a, b)
                with self.told("prefill", ids=ids[a:b]):
                    if seg:
                        prefill_images(eng, ids[a:b], seg, watch)
                    else:
                        eng.prefill(ids[a:b], watch)
                a = b
                if b == job.head or b == cuts[-1]:  # the head new conversations share, and the prompt's last cut
                    self.keep(key[:b])
        except Cancelled:
            return self.cancelled(job, 0)
        tools = (req.tools or True) if req.parse_tools else None
        out = (HarmonyOutput(tools, req.stop, req.include_stop) if self.harmony(req) else
               ChatOutput(job.thinking, tools, req.stop, self.tool_format, req.include_stop, reasons=req.kind == "chat"))
        echoed = not echo  # completions' `echo`: the prompt, and its tokens' logprobs, go out before the answer

        def echo_prompt() -> None:
            nonlocal echoed
            if not echoed:
                echoed = True
                text = choice.prompt_text if choice.prompt_text is not None else eng.text.decode(ids)
                entries = [self.token_text.scored(t, s) for t, s in zip(ids, scores.scores, strict=True)] if scores else []
                job.emit(("prompt", {"text": text, "logprobs": entries}))
        evs = out.given(job.prefix)  # a forced call's start, an echoed text: part of the answer the client gets
        if evs:
            job.emit(("delta", evs))
        # a completion, or a continued assistant message, writes what its tokens add to the prompt's text
        continues = req.kind == "completion" or req.continue_final
        detok = Detokenizer(eng.text, skip_special=self.skips_special(req), context=ids if continues else None)
        streamed_ids = req.return_token_ids and req.stream
        if streamed_ids:  # the choice's prompt, as rendered, before its first tokens
            job.emit(("prompt_ids", list(ids)))
        n, t0, seen, dec, toks = 0, time.perf_counter(), 0, _Running(), []
        first = last = 0.0  # when the answer's first and latest tokens came (the latency histograms)
        finish, reasoning, stop_token = None, 0, None
        content = ContentTokens() if req.logprobs else None  # the tokens logprobs are given for
        if self.lock is not None:  # every rank runs the same loop; closing it early ends it there on every rank
            gen = self.lock.generate(ids, a, choice.max_tokens, choice.sampler, constraint, stops)
        else:
            gen = eng.generate(ids[a:], choice.max_tokens, choice.sampler, images=images(a, len(ids)) or None,
                               context=ids, constraint=constraint, stops=stops, progress=watch)
        with contextlib.closing(gen):
            tokens = iter(gen)
            while True:
                try:
                    tok, lg = next(tokens)
                except StopIteration:
                    break
                except Cancelled:  # in the prompt's prefill
                    return self.cancelled(job, 0)
                if job.cancel.is_set():
                    return self.cancelled(job, n)
                if tok in req.stop_token_ids:  # as the model's own end of turn: not written, not counted
                    finish, stop_token = "stop", tok
                    break
                n += 1
                toks.append(tok)
                if streamed_ids:  # vLLM's `return_token_ids` streamed: each chunk's tokens on it
                    job.emit(("ids", [tok]))
                if job.logits is not None:
                    job.logits.append(lg)
                now = time.monotonic()
                if n > 1:
                    self.latency["inter_token_latency_seconds"].observe(now - last)
                last = now
                if n == 1:
                    self.live["ttft_s"], first = time.perf_counter() - t0, last
                    if index == 0:
                        self.latency["time_to_first_token_seconds"].observe(last - job.arrived)
                if out.phase == "reasoning":  # the token is fed before it can close the thinking
                    reasoning += 1
                out.stop.held = n <= req.min_tokens  # vLLM's: no stop string ends an answer of min_tokens or fewer
                piece = detok.add(tok)
                evs = out.feed(piece)
                echo_prompt()
                if content is not None:  # a token's logprobs go out just before the content text it is part of
                    content.add(self.token_text.entry(lg, tok, req.top_logprobs), piece)
                    if lps := content.place(out.spans, settled=out.phase == "reasoning"):
                        job.emit(("logprobs", lps))
                if evs:
                    if req.continuous_usage:
                        job.emit(("count", n))
                    job.emit(("delta", evs))
                seen = dec.add(eng.steps, seen)
                self.live = {**self.live, "state": "decode", "tokens": n, **dec.stats(), "rss": eng.rss}
                if out.stopped:
                    finish = "stop"
                    break
        if n > 1:
            self.latency["request_time_per_output_token_seconds"].observe((last - first) / (n - 1))
        evs = out.flush()
        echo_prompt()
        if content is not None and (lps := content.finish(out.spans, out.phase == "content")):
            job.emit(("logprobs", lps))
        if evs:
            job.emit(("delta", evs))
        if finish is None:
            finish = "length" if n >= choice.max_tokens or eng.offset >= eng.opts.ctx else "stop"
            if finish == "stop" and constraint is not None and constraint.dead_end:
                field_ = (req.api.get("format_field", "response_format") if req.json_output or req.answer_grammar
                          is not None else "tools")
                raise APIError(400, f"the answer's grammar ('{field_}') reached a point where llguidance lets no "
                               "token continue it, before its value ended, so what was written does not parse: "
                               "the schema holds a constraint it cannot write every value of (a multipleOf of a "
                               "fraction, a cycle of $refs); loosen that part", field_)
        prompt_tokens = cached + sum(s.n_tokens for s in eng.steps if s.phase == "prefill")
        s = eng.summary(eng.steps)
        self.served += 1
        self.finished[finish] += 1
        self.totals["prompt_tokens"] += prompt_tokens
        self.totals["cached_tokens"] += cached
        self.totals["generated_tokens"] += n
        self.totals["bytes_read"] += sum(ly.bytes_read for st in eng.steps for ly in st.layers)
        self.totals["host_hits"] += sum(ly.hits_host for st in eng.steps for ly in st.layers)
        tele = {k: round(v, 4) if isinstance(v, float) else v for k, v in s.items()}
        tele.update(cached_tokens=cached, prefilled_tokens=prompt_tokens - cached, rss=current_rss(), cap=eng.plan.cap)
        if self.lock is not None:  # every rank's reads: this one's, then each follower's reply to `done`
            every = [rank_summary(eng)] + [json.loads(b) for b in self.lock.tell("done")]
            tele["ranks"] = [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in every]
            for r in every:
                self.totals["rank_bytes_read"][r["rank"]] += r["bytes_read"]
        self.live = {**self.live, "last": tele}
        print(f"streamoe: {job.id} {prompt_tokens} prompt tokens ({cached} cached), {n} generated, "
              f"{s['tok_s']:.1f} tok/s, hit rate {100 * s['hit_rate']:.0f}%", file=sys.stderr, flush=True)
        # cut by the planned context rather than the tokens asked for (max_tokens above what the context leaves)
        context_full = finish == "length" and (req.max_tokens is None or n < req.max_tokens)
        return {"finish_reason": finish, "context_full": context_full,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                          "prompt_tokens_details": {"cached_tokens": cached},
                          "completion_tokens_details": {"reasoning_tokens": reasoning}},
                "telemetry": tele, "token_ids": toks, "prompt_token_ids": ids, "stop_sequence": out.stop.matched,
                "stop_reason": stop_token if stop_token is not None else out.stop.matched}


def choices_usage(usages: list[dict], n: int) -> dict:
    """The usage of a request answered in several choices, `n` a prompt: each prompt once (its first choice's
    prefill, as the client sent it once), the tokens of every choice."""
    firsts = usages[::n]
    prompt, done = sum(u["prompt_tokens"] for u in firsts), sum(u["completion_tokens"] for u in usages)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"] for u in firsts)},
            "completion_tokens_details": {"reasoning_tokens": sum(u["completion_tokens_details"]["reasoning_tokens"]
                                                                  for u in usages)}}


class _Running:
    """Decode telemetry summed as it happens (the page shows it while the answer streams)."""

    def __init__(self):
        self.tokens = self.ms = self.picks = self.hits = self.read = self.busy_ms = 0

    def add(self, steps: list, seen: int) -> int:
        """Counts the steps from `seen` on; returns where to start next time: at a decode step whose token has not
        reached the client yet (one queued ahead of it), which is counted once it has."""
        for i in range(seen, len(steps)):
            st = steps[i]
            if st.phase != "decode":
                continue
            if st.t_token is None:
                return i
            self.tokens += 1
            self.ms += st.ms
            self.busy_ms += st.disk_busy_ms
            for ly in st.layers:
                self.picks += ly.picks
                self.hits += ly.hits_hot + ly.hits_lent  # read-ahead experts were read for this step: not hits
                self.read += ly.bytes_read
        return len(steps)

    def stats(self) -> dict:
        n = max(1, self.tokens)
        return {"tok_s": self.tokens / (self.ms / 1000) if self.ms else 0.0,
                # resident (no picks counted, nothing read): every expert was in memory, as the summary says it
                "hit_rate": self.hits / self.picks if self.picks else float(self.tokens > 0 and not self.read),
                "mib_read_token": self.read / MiB / n,
                "disk_busy": self.busy_ms / self.ms if self.ms else 0.0}


def xml_keys(tools: list[dict]) -> None:
    """In the XML tool-call form (Qwen3.5/3.6) a parameter's name is written inside `<parameter=NAME>`: one holding
    '<', '>' or a line break would split its block, so it is refused (400 naming the tool)."""
    for j, t in enumerate(tools):
        params = t["function"].get("parameters") or {}
        props = params.get("properties") if isinstance(params, dict) else None
        for key in props if isinstance(props, dict) else ():
            if any(c in key for c in "<>\n\r"):
                raise bad(f"tools[{j}]: parameter name {key[:60]!r}: this model's calls write it inside "
                          "<parameter=...>, so it may hold no '<', '>' or line break", f"tools[{j}].function.parameters")


def harmony_effort(req: GenRequest) -> None:
    """The reasoning effort as gpt-oss's template takes it (low, medium, high): "xhigh" is its "high", as on the
    Anthropic route; "none" and "minimal", which turn thinking off in templates with that switch, are refused:
    gpt-oss always reasons."""
    effort = req.template_kwargs.get("reasoning_effort")
    if effort in ("none", "minimal"):
        field_ = req.api.get("effort_field", "reasoning_effort")  # the request's own name for it
        raise bad(f"'{field_}' {effort!r}: gpt-oss always reasons; give low, medium or high", field_)
    if effort == "xhigh":
        req.template_kwargs["reasoning_effort"] = "high"


@contextlib.contextmanager
def image_files(images: list[bytes]):
    """Each image's bytes as a path the engine's loader opens, named by the server, never by the request: an
    anonymous memory file (Linux) or a private temporary file."""
    paths, fds, tmp = [], [], None
    try:
        for raw in images:
            if hasattr(os, "memfd_create"):
                fd = os.memfd_create("streamoe-image")
                fds.append(fd)
                os.write(fd, raw)
                paths.append(f"/proc/self/fd/{fd}")
            else:
                tmp = tmp or tempfile.TemporaryDirectory(prefix="streamoe-")
                p = Path(tmp.name) / f"image-{len(paths)}"
                p.write_bytes(raw)
                paths.append(str(p))
        yield paths
    finally:
        for fd in fds:
            os.close(fd)
        if tmp is not None:
            tmp.cleanup()


def command_bytes(ctx: int, n_ranks: int) -> int:
    """What the largest command across ranks (`lockstep`: a prompt of ctx tokens) holds at once: its JSON text
    and its bytes, the gather's buffers (the bytes padded, on the host and the device, every rank's gathered
    there and read back) and the ids parsed into a list."""
    return ctx * (ID_CHARS * (5 + 2 * n_ranks) + IDS_BYTES)


def serve_accounts(root: Path, ctx: int, so: ServeOptions, rank: int = 0, ranks: int = 1) -> tuple:
    """The accounts serving adds to the engine's plan, fixed before its hot tier is sized: the prompt cache and
    the requests in flight; across ranks, the commands rank 0 sends (`lockstep`) on every rank, and the requests
    on rank 0 alone, which serves them (every rank keeps the same snapshots: the same prompt cache)."""
    requests = (f"{so.admitted} admitted at once (read, queued or running) + 1 left by its client, each keeping at "
                f"most {so.limits.max_kept / MiB:g} MiB and {so.limits.max_answer / MiB:g} MiB of its answer; one body "
                "parsed and one prompt tokenized at a time; "
                f"{socket_bytes(so.max_connections) / MiB:g} MiB of connections ({SOCKET_BUFFER >> 10} KiB "
                f"each way a socket, doubled by the kernel, {(WRITE_BUFFER + PIECE) >> 10} KiB written and "
                f"{READ_AHEAD + 2} request heads parsed)")
    extra = (("prompt cache", so.prompt_cache_bytes, "snapshots of conversation state for repeated prompts, LRU"),)
    if rank == 0:
        extra += (("requests", requests_bytes(so, root, ctx), requests),)
        if so.response_store_bytes:
            extra += (("response store", so.response_store_bytes,
                       "the Responses API's stored responses (previous_response_id, item_reference), LRU"),)
    if ranks > 1:
        extra += (("rank commands", command_bytes(ctx, ranks),
                   f"rank 0's command for one engine call, a prompt of up to {ctx} tokens, gathered"),)
    return extra


def open_engine(root: Path, opts: Options, so: ServeOptions, group=None) -> Engine:
    """The engine with the accounts of serving in its plan (`serve_accounts`); `group`: the ranks it is one of."""
    where = (group.rank(), group.size()) if group is not None else ()
    extra = serve_accounts(root, opts.ctx, so, *where)
    return Engine(root, dataclasses.replace(opts, extra_accounts=opts.extra_accounts + extra), group)


class Server:
    """The engine's thread (the one that opens it: MLX streams belong to the thread that made them) running
    the queue, and the bounded queue the HTTP handlers put jobs in."""

    def __init__(self, root: Path, opts: Options, so: ServeOptions, group=None):
        self.so = so
        # every request the door admits finds room, also while the engine still ends one whose client left (the
        # plan's `requests` account holds that one beside them): a full queue is a bug's, not a load's
        self.queue: queue.Queue = queue.Queue(maxsize=so.admitted)
        self.worker = EngineWorker(open_engine(root, opts, so, group), so)
        self.current: Job | None = None
        self.stopping = threading.Event()

    def run(self, alive=lambda: True) -> None:
        """Answer queued jobs in order until `stop()` or until `alive()` turns false."""
        while not self.stopping.is_set() and alive():
            try:
                job = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if job.cancel.is_set():  # its client went away while it waited
                job.emit(("done", {"finish_reason": None, "cancelled": True}))
                continue
            self.current = job
            try:
                self.worker.run(job)
            finally:
                self.current = None

    def withdraw(self, job: Job) -> None:
        """Take a job whose client went away out of the queue (its memory goes with it)."""
        job.cancel.set()
        with self.queue.mutex:
            if job in self.queue.queue:
                self.queue.queue.remove(job)
                self.queue.not_full.notify()

    def submit(self, job: Job) -> None:
        if self.stopping.is_set():
            raise APIError(503, "the server is shutting down", code="shutting_down")
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise APIError(503, f"the server is busy: {self.queue.maxsize} requests are already waiting; retry later",
                           code="queue_full") from None

    def stop(self) -> None:
        """Stop taking jobs; the running one stops at its next token, and it and the queued ones end with a
        `shutting_down` error (a stream's last events are that error and `[DONE]`)."""
        self.stopping.set()
        jobs = [self.current] if self.current is not None else []
        while True:
            try:
                jobs.append(self.queue.get_nowait())
            except queue.Empty:
                break
        for job in jobs:
            if not job.cancel.is_set():
                job.cancel.set()
                job.emit(("error", APIError(503, "the server is shutting down", code="shutting_down")))

    def close(self) -> None:
        self.stop()
        if self.worker.lock is not None:
            self.worker.lock.stop()  # every other rank closes and exits with this one
        self.worker.eng.close()
