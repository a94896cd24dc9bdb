"""Fuzz every parser of untrusted input; the only exception any of them may raise is `StreamoeError`.

Seven parsers, each fed hypothesis-generated inputs built from a real tiny checkpoint and conversion (so most
inputs are *almost* valid and reach deep code), plus raw random bytes:

- safetensors: header bytes (mutated JSON, bit flips, random) through `parse_header`, and files through `read_header`
- index: `model.safetensors.index.json` documents through `open_checkpoint`
- config: `config.json` documents through `open_checkpoint` + the record layout + the blob plan, and `plan`'s bare-config
  path; half of them retype only the quantization block (every JSON type in every value and override)
- manifest: manifest documents through `load_manifest`, the open checks `run` makes and `validate`'s file checks;
  half of them retype only the blobs' file records, or add to them keys used elsewhere in the manifest
- blob_table: the manifest's blob tables (offsets, sizes, shapes, dtypes, bits) through the same
- session: session files (mutated container, mutated metadata, damaged frames, random bytes) through `SessionReader`
- requests: `streamoe serve`'s request bodies (chat and text completions, /tokenize, /detokenize, the Responses and
  Anthropic Messages APIs, each a full body with tools, formats, reasoning and continued answers) through the
  server's JSON reading, each API's checks and the worker's preparing (rendering, tokenizing, the job), where the
  only refusal is a 4xx error (counted as refused) and a `StreamoeError` escaping would be a 500

Any other exception is recorded by signature (type, innermost streamoe frame); the result must list none.

    python -m bench.fuzz --examples 20000 --jobs 6      # writes bench/results/fuzz.json
    python -m bench.fuzz --examples 200 --parsers session,index --scratch /tmp/fz
"""

from __future__ import annotations

import argparse
import copy
import functools
import io
import json
import multiprocessing
import os
import struct
import subprocess
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamoe.formats.errors import StreamoeError

from .common import RESULTS, scratch_dir, write_result

LEAN = 12  # tensors kept in the manifest's blob tables and the shard header the fuzzers mutate
SPECIAL_INTS = [0, 1, -1, 2, 7, 64, 4096, 2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, -(2**63), 10**9, 10**18]


# Strategies are built once: hypothesis validates a strategy on first use, which dominates if rebuilt per example.
_LEAVES = (st.none() | st.booleans() | st.sampled_from(SPECIAL_INTS) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=8))
JSON_VALUES = st.recursive(_LEAVES, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=8)
# one JSON type drawn uniformly, then a value of it: a null or an object is as likely as a number
EACH_TYPE = st.one_of(st.none(), st.booleans(), st.sampled_from(SPECIAL_INTS), st.floats(allow_nan=True, allow_infinity=True),
                      st.text(max_size=8), st.lists(_LEAVES, max_size=3), st.dictionaries(st.text(max_size=6), _LEAVES, max_size=3))
ACTIONS = st.sampled_from(["replace", "replace", "near", "delete", "wrap", "dup", "add"])
BYTE_ACTIONS = st.sampled_from(["flip", "truncate", "insert", "zero"])


def json_values() -> st.SearchStrategy:
    """Any JSON value, biased toward the ones parsers get wrong: huge/negative ints, bools, floats, nesting."""
    return JSON_VALUES


def pick(draw, items: list):
    """One of `items`, drawn as an index (a fresh `sampled_from` per draw is slow)."""
    return items[draw(st.integers(0, len(items) - 1))]


def paths(doc: object, prefix: tuple = ()) -> list[tuple]:
    """Every path (keys and indices) to a node of a JSON document."""
    out = [prefix]
    if isinstance(doc, dict):
        for k, v in doc.items():
            out += paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out += paths(v, (*prefix, i))
    return out


def key_names(doc: object) -> list[str]:
    """Every object key used anywhere in `doc`: the names an added key is drawn from (a key that is valid in one
    place, such as an expert file's `layer`, is the likeliest to be mistaken for valid in another)."""
    return sorted({k for p in paths(doc) for k in p if isinstance(k, str)})


@st.composite
def mutated(draw, base: object, focus: Callable[[tuple], bool] = lambda p: True, max_mutations: int = 3) -> object:
    """`base` with 1..max_mutations nodes replaced by another value, a near value, or deleted, or grown, or an
    object given a key it does not have (a name from elsewhere in `base`, or any text)."""
    doc = copy.deepcopy(base)
    names = key_names(base)
    for _ in range(draw(st.integers(1, max_mutations))):
        candidates = [p for p in paths(doc) if focus(p)] or [()]
        path = pick(draw, candidates)
        action = draw(ACTIONS)
        if action == "add":
            node = doc
            for k in path:
                node = node[k]
            if isinstance(node, dict):
                key = pick(draw, names) if names and draw(st.booleans()) else draw(st.text(max_size=6))
                node[key] = draw(json_values())
                continue
            action = "replace"
        if not path:
            if action == "replace":
                doc = draw(json_values())
            continue
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        key = path[-1]
        old = parent[key]
        if action == "replace":
            parent[key] = draw(json_values())
        elif action == "near":
            if isinstance(old, int) and not isinstance(old, bool):
                parent[key] = pick(draw, [old + 1, old - 1, -old, old * 2, old * 4096, float(old), str(old), old * 10**9,
                                          True])
            else:
                parent[key] = draw(json_values())
        elif action == "delete":
            if isinstance(parent, dict):
                del parent[key]
            elif isinstance(parent, list):
                parent.pop(key)
        elif action == "wrap":
            parent[key] = [old] if draw(st.booleans()) else {"x": old}
        elif action == "dup" and isinstance(parent, list):
            parent.append(copy.deepcopy(old))
    return doc


def kin_keys(doc: object, node: dict) -> dict[str, object]:
    """Keys (with a value each has there) that objects of the same kind as `node` (sharing most of its keys) have
    elsewhere in `doc` and `node` lacks: an expert file's `layer` for a blob's file record."""
    out: dict[str, object] = {}
    stack = [doc]
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            if len(node.keys() & x.keys()) * 2 > len(node):
                out.update({k: v for k, v in x.items() if k not in node})
            stack += x.values()
        elif isinstance(x, list):
            stack += x
    return out


@st.composite
def retyped(draw, base: object, focus: Callable[[tuple], bool], max_mutations: int = 2) -> object:
    """`base` with 1..max_mutations nodes under `focus` set to a value of a uniformly drawn JSON type, or (an
    object) given a key named elsewhere in `base`: the directed form of `mutated` for a few fields that matter."""
    doc = copy.deepcopy(base)
    names = key_names(base)
    for _ in range(draw(st.integers(1, max_mutations))):
        path = pick(draw, [p for p in paths(doc) if p and focus(p)] or [()])
        if not path:
            break
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        node = parent[path[-1]]
        if isinstance(node, dict) and draw(st.booleans()):
            kin = kin_keys(base, node)
            if kin and draw(st.booleans()):  # the key with the value it has there, or any value
                key = pick(draw, sorted(kin))
                node[key] = copy.deepcopy(kin[key]) if draw(st.booleans()) else draw(EACH_TYPE)
            else:
                node[pick(draw, names)] = draw(EACH_TYPE)
        else:
            parent[path[-1]] = draw(EACH_TYPE)
    return doc


def encode(doc: object) -> bytes:
    return json.dumps(doc).encode()  # NaN/Infinity are written as such: the parsers must refuse them


@st.composite
def damaged_bytes(draw, base: bytes) -> bytes:
    """`base` truncated, bit-flipped, or spliced with random bytes."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        action = draw(BYTE_ACTIONS)
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        if action == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif action == "truncate":
            del data[i:]
        elif action == "insert":
            data[i:i] = draw(st.binary(max_size=16))
        else:
            data[i:i + 8] = bytes(min(8, len(data) - i))
    return bytes(data)


# ---------------------------------------------------------------------------------------------- fixtures


class World:
    """A tiny checkpoint, its conversion and a session, built once in the scratch directory."""

    def __init__(self, scratch: Path, ck: Path | None = None, conv: Path | None = None):
        from streamoe.convert.convert import convert
        from streamoe.convert.synth import synth

        self.scratch = scratch
        self.ck = ck or scratch / "ck"
        self.conv = conv or scratch / "conv"
        if not (self.ck / "config.json").exists():
            synth(self.ck, size="tiny", variant="qwen3.6", text_only=False, seed=0, shard_bytes=300_000, dry_run=False)
        if not (self.conv / "manifest.json").exists():
            convert(self.ck, self.conv, formats=["q4", "q3"], progress=False)
        self.config = json.loads((self.ck / "config.json").read_text())
        self.index = json.loads((self.ck / "model.safetensors.index.json").read_text())
        self.manifest = self._lean_manifest(json.loads((self.conv / "manifest.json").read_text()))
        shard = self.ck / sorted(set(self.index["weight_map"].values()))[1]
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        self.header, self.shard_data = self._lean_header(json.loads(raw[8:8 + n]), raw[8 + n:])
        self.session = self._session()

    def worker(self):
        """An `EngineWorker` over the conversion, as `streamoe serve` opens it (once per process)."""
        if getattr(self, "_worker", None) is None:
            from streamoe.runtime.plan import MiB, Options
            from streamoe.runtime.serve.openai_api import Limits
            from streamoe.runtime.serve.worker import EngineWorker, ServeOptions, open_engine

            so = ServeOptions("m", limits=Limits(), prompt_cache_bytes=0)
            opts = Options(cap_gib=8, ctx=4096, images=True, runtime_bytes=256 * MiB)
            self._worker = EngineWorker(open_engine(self.conv, opts, so), so)
        return self._worker

    @staticmethod
    def _lean_manifest(doc: dict, keep: int = LEAN) -> dict:
        """The manifest with its blob tables cut to a few tensors each: every code path is still reached (the
        open check then reports the missing tensors), at a fraction of the cost per example."""
        for b in doc["blobs"].values():
            b["tensors"] = b["tensors"][:keep]
        return doc

    @staticmethod
    def _lean_header(doc: dict, data: bytes, keep: int = LEAN) -> tuple[dict, bytes]:
        """A shard header of its first few tensors (in data order) and exactly their bytes."""
        meta = doc.pop("__metadata__", None)
        first = sorted(doc.items(), key=lambda kv: kv[1]["data_offsets"][0])[:keep]
        end = max(t["data_offsets"][1] for _, t in first)
        lean = dict(first)
        if meta is not None:
            lean["__metadata__"] = meta
        return lean, data[:end]

    def _session(self) -> bytes:
        from streamoe.formats.session import write_session

        p = self.scratch / "base.zst"
        meta = {"model": "m", "experts": "q4", "dtype": "F32", "kv": "float32", "tokens": 3, "rope_delta": 0,
                "extra": {"raw": False, "messages": [{"role": "user", "content": "hi"}], "tokens": [1, 2, 3],
                          "sampler": {"seed": 1, "drawn": 4}}}
        entries = [("layers.0.keys", "F32", (1, 2, 3, 4)), ("layers.1.state", "BF16", (2, 4))]
        write_session(p, meta, entries, [bytes(96), bytes(16)])
        return p.read_bytes()

    def case_dir(self, name: str) -> Path:
        """A scratch copy of the checkpoint whose small files one example may overwrite (shards are links)."""
        d = self.scratch / f"case-{name}"
        if not d.exists():
            d.mkdir()
            for f in self.ck.iterdir():
                if f.suffix == ".safetensors":
                    os.link(f, d / f.name)
                else:
                    (d / f.name).write_bytes(f.read_bytes())
        return d

    def conv_dir(self, name: str) -> Path:
        """A copy of the conversion whose manifest one example may overwrite (data files are links)."""
        d = self.scratch / f"case-conv-{name}"
        if not d.exists():
            d.mkdir()
            for f in self.conv.rglob("*"):
                rel = f.relative_to(self.conv)
                if f.is_dir():
                    (d / rel).mkdir(parents=True, exist_ok=True)
                elif f.name != "manifest.json":
                    os.link(f, d / rel)
        return d


# ---------------------------------------------------------------------------------------------- targets


def target_safetensors(world: World, raw: bytes, as_file: bool) -> None:
    from streamoe.formats.safetensors import parse_header, read_header

    if as_file:
        p = world.scratch / "fuzz.safetensors"
        p.write_bytes(raw)
        read_header(p)
    else:
        parse_header(Path("fuzz.safetensors"), raw, len(raw) + 8 + len(world.shard_data))
        parse_header(Path("fuzz.safetensors"), raw, None)


def open_and_plan(ck: Path) -> None:
    """What convert does before it writes a byte: open, the expert layout, the blob plans."""
    from streamoe.convert.convert import blob_entries, classify
    from streamoe.convert.source import open_checkpoint
    from streamoe.formats.blobs import plan_blob

    ckpt = open_checkpoint(ck)
    ckpt.layer_layout()
    prefix, _ = ckpt.expert_keys()
    names = sorted(n for n in ckpt.tensors if classify(n, prefix) in ("nonexpert", "vision"))
    plan_blob(blob_entries(ckpt, names))


def target_index(world: World, raw: bytes) -> None:
    d = world.case_dir("index")
    (d / "model.safetensors.index.json").write_bytes(raw)
    open_and_plan(d)


def target_config(world: World, raw: bytes) -> None:
    from streamoe.cli import plan_from_config
    from streamoe.runtime.plan import Options

    d = world.case_dir("config")
    (d / "config.json").write_bytes(raw)
    refusals = []
    for step in (lambda: open_and_plan(d),
                 lambda: plan_from_config(d / "config.json", Options(cap_gib=4.0, ctx=4096, experts="q4", kv="float32",
                                                           dtype="float32", runtime_bytes=100 << 20))):
        try:  # both paths see every input; any other exception leaves at once (a refusal never masks it)
            step()
        except StreamoeError as e:
            refusals.append(e)
    if refusals:
        raise refusals[0]


def target_manifest(world: World, raw: bytes, name: str) -> None:
    from streamoe.convert.validate import validate
    from streamoe.formats.checks import open_problems
    from streamoe.formats.manifest import load_manifest

    d = world.conv_dir(name)
    (d / "manifest.json").write_bytes(raw)
    m = load_manifest(d)
    open_problems(m)
    m.expert_formats()
    for kind in m.doc["blobs"]:
        m.blob(kind)
    validate(d)  # what `streamoe validate` does with the files the manifest names


def target_session(world: World, raw: bytes) -> None:
    from streamoe.formats.session import SessionReader
    from streamoe.runtime.session import check_extra

    p = world.scratch / "fuzz.zst"
    p.write_bytes(raw)
    with SessionReader(p) as r:
        for t in r.tensors:
            r.read(t.nbytes)
        r.finish()
        check_extra(p, r.meta["extra"], r.meta["tokens"], 4096)


TOOL = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT = {"model": "m", "messages": [
    {"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]},
    {"role": "assistant", "content": None, "reasoning_content": "r", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "c", "content": "o"}]}
def png_url() -> str:
    """A small picture as a `data:` URL (what an image part carries)."""
    import base64

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (40, 32), (245, 130, 15)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


REQUESTS = [  # a full body of each kind the server takes, each accepted as it is, for `mutated` to break
    ("chat", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": TOOL, "strict": True}}],
              "tool_choice": "auto", "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": TOOL}},
              "logprobs": True, "top_logprobs": 2, "stop": ["a"], "n": 2, "seed": 1, "temperature": 0.5, "stream": True,
              "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stop_token_ids": [1],
              "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none", "logit_bias": {"1": 2}}),
    ("chat", {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "The"}], "min_tokens": 1,
              "continue_final_message": True, "add_generation_prompt": False, "echo": True, "max_tokens": 4,
              "structured_outputs": None, "allowed_token_ids": [1, 2, 3], "cache_salt": "tenant",
              "ignore_eos": True, "skip_special_tokens": False}),
    ("chat", {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is it?"}, {"type": "image_url", "image_url": {"url": png_url(), "detail": "auto"}}]}],
        "max_completion_tokens": 4}),
    ("completion", {"model": "m", "prompt": ["a", "b"], "echo": True, "logprobs": 2, "best_of": 1, "n": 2, "max_tokens": 4,
                    "stop": "x", "include_stop_str_in_output": True,
                    "structured_outputs": {"choice": ["a", "b"]}}),
    ("tokenize", {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The"}],
                  "continue_final_message": True, "add_generation_prompt": False, "return_token_strs": True}),
    ("detokenize", {"model": "m", "tokens": [1, 2]}),
    ("messages", {"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
                  "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                               {"role": "assistant", "content": [{"type": "thinking", "thinking": "t", "signature": "s"},
                                                                 {"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "o"}]},
                               {"role": "assistant", "content": "The"}],
                  "tools": [{"name": "f", "input_schema": TOOL}], "tool_choice": {"type": "auto"}, "stop_sequences": ["x"],
                  "thinking": {"type": "disabled"}, "metadata": {"user_id": "u"}, "output_config": {"effort": "max"},
                  "context_management": {"edits": [{"type": "clear_thinking_20251015",
                                                    "keep": {"type": "thinking_turns", "value": 1}}]}}),
    ("responses", {"model": "m", "instructions": "i", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "reasoning", "id": "r", "summary": [{"type": "summary_text", "text": "s"}],
         "content": [{"type": "reasoning_text", "text": "t"}], "encrypted_content": "streamoe.1.dA=="},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": "o"}]}],
        "tools": [{"type": "function", "name": "f", "parameters": TOOL, "strict": True}], "tool_choice": "auto",
        "reasoning": {"effort": "high", "summary": "auto"}, "top_logprobs": 2, "stream": True, "metadata": {"a": "b"},
        "include": ["reasoning.encrypted_content", "message.output_text.logprobs"], "client_metadata": {"k": "v"},
        "text": {"format": {"type": "json_schema", "name": "n", "schema": TOOL}}}),
    ("responses", {"model": "m", "previous_response_id": "resp_f", "store": True, "input": [  # what `STORED` holds
        {"type": "item_reference", "id": "msg_f"}, {"role": "user", "content": "And?"}]}),
]
# a stored response the last body continues and names an item of (a store's ids, resolved or refused)
STORED = ({"id": "resp_f", "output": [{"id": "msg_f", "type": "message", "role": "assistant", "status": "completed",
                                       "content": [{"type": "output_text", "text": "The", "annotations": []}]}]},
          [{"id": "msg_in", "type": "message", "role": "user", "status": "completed", "content": "hi"}])


@functools.cache
def response_store():
    from streamoe.runtime.serve.response_store import ResponseStore

    store = ResponseStore(1 << 20)
    store.put(*STORED, None)
    return store


def target_requests(world: World, raw: tuple[str, object]) -> None:
    """A request body as the server takes it, short of answering: read as JSON (`decode_json`), checked by its API,
    then rendered, tokenized and made into a job by the worker over the tiny conversion (`EngineWorker.prepare`, or
    /tokenize's and /detokenize's calls). A 4xx error is the refusal (raised as `StreamoeError`, to be counted so);
    anything else escaping, a `StreamoeError` among them, is a finding: the server would answer it with a 500."""
    from streamoe.runtime.serve import anthropic_api, responses_api
    from streamoe.runtime.serve.openai_api import (
        APIError,
        parse_chat,
        parse_completion,
        parse_detokenize,
        parse_tokenize,
    )
    from streamoe.runtime.serve.server import decode_json

    api, body = raw
    worker = world.worker()
    so = worker.so
    try:
        body = decode_json(bytearray(json.dumps(body).encode()), so.limits)
        if api == "tokenize":
            req, special, _ = parse_tokenize(body, so.limits)
            worker.tokenize(req, special)
        elif api == "detokenize":
            worker.detokenize(parse_detokenize(body))
        else:
            parse = {"chat": lambda b: parse_chat(b, so.limits), "completion": parse_completion,
                     "messages": lambda b: anthropic_api.parse(b, so),
                     "responses": lambda b: responses_api.parse(b, so, store=response_store())}
            worker.prepare(parse[api](body))
    except APIError as e:
        if not 400 <= e.status < 500:
            raise
        raise StreamoeError(e.message) from None
    except StreamoeError as e:
        raise RuntimeError(f"a 500 from the server: {e}") from e


# ---------------------------------------------------------------------------------------------- strategies


def header_inputs(world: World) -> st.SearchStrategy:
    text = st.one_of(
        mutated(world.header).map(encode),
        st.builds(lambda b: b, st.binary(max_size=64)),
        damaged_bytes(encode(world.header)),
        st.sampled_from([b"[" * 50_000, b'{"a": ' * 5_000, b"{}", b'{"__metadata__": 5}']),
    )
    return st.tuples(text, st.booleans()).map(
        lambda t: (t[0], t[1]) if not t[1] else (struct.pack("<Q", len(t[0])) + t[0] + world.shard_data, True))


def session_inputs(world: World) -> st.SearchStrategy:
    raw = zstandard.ZstdDecompressor().decompress(world.session)
    (n,) = struct.unpack("<Q", raw[:8])
    head, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    meta = json.loads(head["__metadata__"]["streamoe_session"])

    def pack(h: dict, m: dict | None, body: bytes, sized: bool) -> bytes:
        if m is not None:
            h = {**h, "__metadata__": {"streamoe_session": json.dumps(m)}}
        hb = encode(h)
        content = struct.pack("<Q", len(hb)) + hb + body
        return zstandard.ZstdCompressor(write_content_size=sized, write_checksum=True).compress(content)

    def frame_declaring(length: int) -> bytes:
        buf = io.BytesIO()
        with zstandard.ZstdCompressor(write_checksum=True).stream_writer(buf, closefd=False) as w:
            w.write(struct.pack("<Q", length) + b"{" * 64)
        return buf.getvalue()

    return st.one_of(
        st.builds(pack, mutated(head), st.none(), st.just(data), st.booleans()),
        st.builds(pack, st.just(head), mutated(meta), st.just(data), st.booleans()),
        st.builds(pack, st.just(head), st.just(meta), damaged_bytes(data), st.booleans()),
        damaged_bytes(world.session),
        st.binary(max_size=64),
        st.sampled_from([2**63, 2**40, 100 << 20, 9 << 20, 0]).map(frame_declaring),
    )


def manifest_focus(kind: str) -> Callable[[tuple], bool]:
    if kind == "blob_table":
        return lambda p: len(p) >= 4 and p[0] == "blobs" and p[2] == "tensors"
    if kind == "blob_file":  # each blob's file record and its keys (an expert file's `layer` on a blob's file...)
        return lambda p: len(p) >= 3 and p[0] == "blobs" and p[2] == "file"
    return lambda p: not (len(p) >= 4 and p[0] == "blobs" and p[2] == "tensors")


def in_quantization(p: tuple) -> bool:
    """The config's quantization block: its values, and each per-module override's, of every JSON type."""
    return len(p) >= 1 and p[0] in ("quantization", "quantization_config")


def strategies(world: World) -> dict[str, tuple[st.SearchStrategy, Callable]]:
    return {
        "safetensors": (header_inputs(world), lambda x: target_safetensors(world, x[0], x[1])),
        "index": (st.one_of(mutated(world.index).map(encode), damaged_bytes(encode(world.index))),
                  lambda x: target_index(world, x)),
        "config": (st.one_of(mutated(world.config).map(encode), retyped(world.config, in_quantization).map(encode),
                             damaged_bytes(encode(world.config)), st.just(b"[" * 100_000)),
                   lambda x: target_config(world, x)),
        "manifest": (st.one_of(mutated(world.manifest, manifest_focus("manifest")),
                               retyped(world.manifest, manifest_focus("blob_file"))).map(encode),
                     lambda x: target_manifest(world, x, "manifest")),
        "blob_table": (mutated(world.manifest, manifest_focus("blob_table")).map(encode),
                       lambda x: target_manifest(world, x, "blob_table")),
        "session": (session_inputs(world), lambda x: target_session(world, x)),
        "requests": (st.one_of(*(st.tuples(st.just(api), mutated(body)) for api, body in REQUESTS)),
                     lambda x: target_requests(world, x)),
    }


# ---------------------------------------------------------------------------------------------- driver


def signature(e: BaseException) -> str:
    """Type and the innermost frame inside streamoe: one signature per distinct bug."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "streamoe" in f.filename or "/formats/" in f.filename
              or "/convert/" in f.filename or "/runtime/" in f.filename]
    where = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"
    return f"{type(e).__name__} at {where}: {str(e)[:120]}"


def fuzz(name: str, world: World, examples: int, seed: int | None = None) -> dict:
    """Run `examples` inputs through one parser; count clean refusals, acceptances and other exceptions."""
    strategy, target = strategies(world)[name]
    counts: Counter = Counter()
    bad: Counter = Counter()
    samples: dict[str, str] = {}

    @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is not None,
              suppress_health_check=list(HealthCheck), phases=[p for p in __import__("hypothesis").Phase
                                                                if p.name in ("generate",)])
    @given(strategy)
    def run(x):
        counts["examples"] += 1
        try:
            target(x)
            counts["accepted"] += 1
        except StreamoeError:
            counts["refused"] += 1
        except BaseException as e:  # everything else is a finding (a Rust panic through pyo3 is a BaseException)
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise
            sig = signature(e)
            bad[sig] += 1
            samples.setdefault(sig, repr(x)[:300])

    t = time.perf_counter()
    run()
    return {"parser": name, "examples": counts["examples"], "refused": counts["refused"], "accepted": counts["accepted"],
            "other_exceptions": sum(bad.values()), "signatures": dict(bad), "samples": samples,
            "seconds": round(time.perf_counter() - t, 1)}


def fuzz_one(name: str, scratch: Path, examples: int) -> dict:
    """One parser in its own process (a worker of `--jobs`)."""
    r = fuzz(name, World(scratch), examples)
    print(f"{name}: {r['examples']} examples, {r['refused']} refused, {r['accepted']} accepted, "
          f"{r['other_exceptions']} other exceptions in {len(r['signatures'])} signatures ({r['seconds']} s)",
          file=sys.stderr, flush=True)
    return r


PARSERS = ("safetensors", "index", "config", "manifest", "blob_table", "session", "requests")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=20_000, help="examples per parser")
    ap.add_argument("--parsers", default=",".join(PARSERS))
    ap.add_argument("--scratch", type=Path, default=None, help="working directory (default: a new temporary one)")
    ap.add_argument("--name", default="fuzz", help="result file bench/results/NAME.json")
    ap.add_argument("--jobs", type=int, default=1, help="parsers fuzzed in parallel processes")
    ap.add_argument("--update", action="store_true",
                    help="replace only these parsers' entries in an existing bench/results/NAME.json (after a fix)")
    a = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()  # at the start: the code the workers load
    with scratch_dir(a.scratch) as scratch:
        World(scratch)  # build the checkpoint and conversion once, before the workers read them
        names = a.parsers.split(",")
        with multiprocessing.get_context("spawn").Pool(max(1, a.jobs)) as pool:
            results = pool.starmap(fuzz_one, [(name, scratch, a.examples) for name in names])
    for r in results:
        r["commit"] = commit  # the code each parser's count holds for
    if a.update:
        old = json.loads((RESULTS / f"{a.name}.json").read_text())["results"]
        fresh = {r["parser"] for r in results}
        results = [r for r in old if r["parser"] not in fresh] + results
        results.sort(key=lambda r: PARSERS.index(r["parser"]) if r["parser"] in PARSERS else len(PARSERS))
    write_result(a.name, "fuzz", results)
    if any(r["other_exceptions"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
