"""Text in and out: tokenizer.json through `tokenizers`, the checkpoint's chat template (see `chat_template`),
stop tokens and sampling defaults from generation_config, and incremental detokenization for streaming output."""

from __future__ import annotations

import functools
import json
import os
import unicodedata
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..formats import files
from ..formats.config import eos_ids
from ..formats.errors import ContextFull, fail
from .chat_template import ChatTemplate


class TextIO:
    def __init__(self, root: Path, config: dict):
        tok = root / "tokenizer.json"
        if not os.path.lexists(tok):
            raise fail(tok, "missing (the converted directory must carry the checkpoint's tokenizer)")
        st = files.check_input_file(tok, "tokenizer")  # a FIFO would block the tokenizer's reader
        if st.st_size > files.MAX_TOKENIZER_BYTES:
            raise fail(tok, f"{st.st_size} bytes is too large for a tokenizer (at most {files.MAX_TOKENIZER_BYTES})")
        try:
            self.tokenizer = Tokenizer.from_file(str(tok))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise fail(tok, f"does not load ({str(e).splitlines()[0]})") from None
        self.tokenizer_path = tok
        cfg = tokenizer_config(root)  # read once: the template, the named tokens and the BOS rule are in it
        self.template_path, text = chat_template_text(root, cfg)
        added = [(t.content, t.special) for _, t in sorted(self.tokenizer.get_added_tokens_decoder().items())]
        named = named_tokens(root, cfg)
        self.template = ChatTemplate(text, self.template_path, added, named) if text else None
        # the tokenizer's BOS where tokenizer_config.json asks for it (Llama, Mistral): a raw prompt gets it first
        bos_first = cfg.get("add_bos_token") is True and "bos_token" in named
        self.bos = self.tokenizer.token_to_id(named["bos_token"]) if bos_first else None
        self.newline = self.encode("\n")
        self.stop_ids = stop_tokens(root, config)

    @functools.cached_property
    def bound(self) -> PromptBound:
        """The lower bound on a text's token count that refuses a text too long for the context before the
        tokenizer holds it (read from tokenizer.json once, when first needed)."""
        return PromptBound(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Text whose special-token strings are control tokens (a raw prompt, the template's own markup)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A raw prompt that opens a conversation: `encode`, with the tokenizer's BOS first where its config adds one
        (`add_bos_token`) and the text does not already start with it, as mlx-lm's `generate` and transformers'
        `encode` give it."""
        ids = self.encode(text)
        return [self.bos, *ids] if self.bos is not None and ids[:1] != [self.bos] else ids

    def encode_plain(self, text: str) -> list[int]:
        """Text in which no added token is matched: `<|im_end|>` is the characters it is made of."""
        t = self.tokenizer
        if t.normalizer is not None:
            text = t.normalizer.normalize_str(text)
        splits = [s for s, _ in t.pre_tokenizer.pre_tokenize_str(text)] if t.pre_tokenizer is not None else [text]
        return [tok.id for s in splits for tok in t.model.tokenize(s)]

    def encode_chat(self, rendered: str) -> list[int]:
        """A rendering from `chat_text`: the template's markup as control tokens, the request's text as text.
        Each piece after the first is encoded after a newline that is then taken off, as transformers does
        (a SentencePiece tokenizer would otherwise give it the prefix space of a string's start)."""
        pieces = self._template().pieces(rendered)
        ids = self.encode(pieces[0][0])
        for piece, as_text in pieces[1:]:
            enc = self.encode_plain if as_text else self.encode
            got = enc("\n" + piece)
            got = got[len(self.newline):] if got[:len(self.newline)] == self.newline else enc(piece)
            if as_text and self.tokenizer.token_to_id(piece) in got:
                raise fail(self.tokenizer_path, f"encodes {piece!r} as its control token even as plain text")
            ids += got
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _template(self) -> ChatTemplate:
        if self.template is None:
            raise fail("chat_template.jinja", "the model has no chat template; use --raw")
        return self.template

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                  **kw) -> str:
        """The template's rendering, with the messages' control-token strings marked as text: encode it with
        `encode_chat` (its failures name the template file)."""
        return self._template().render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **kw)

    def chat_prompt(self, messages: list[dict], think: bool = True) -> str:
        return self.chat_text(messages, enable_thinking=think)

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, **kw) -> list[int]:
        return self.encode_chat(self.chat_text(messages, tools=tools, **kw))

    def turn_close(self) -> str:
        """What the template writes after an assistant message's content (`<|im_end|>\n` for ChatML): fed
        after a generated answer, before the next turn, so a chat only ever appends to what the cache holds."""
        mark = "\u2063"
        msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": mark}]
        s = self.chat_text(msgs, add_generation_prompt=False, enable_thinking=False)
        if mark not in s:
            raise fail(self.template_path, "chat template drops the assistant's message; cannot continue a chat")
        return s[s.rindex(mark) + len(mark):]


def tokenizer_config(root: Path) -> dict:
    """tokenizer_config.json ({} where there is none)."""
    cfg = root / "tokenizer_config.json"
    return files.read_json(cfg, "tokenizer config") if os.path.lexists(cfg) else {}


def named_tokens(root: Path, cfg: dict | None = None) -> dict[str, str]:
    """tokenizer_config.json's named tokens (`eos_token`, `pad_token`, `image_token`...), which transformers
    gives every template rendering; those set to null are left out. `cfg`: the file, already read."""
    out = {}
    for k, v in (tokenizer_config(root) if cfg is None else cfg).items():
        v = v.get("content") if isinstance(v, dict) else v
        if k.endswith("_token") and isinstance(v, str):
            out[k] = v
    return out


def chat_template_text(root: Path, cfg: dict | None = None) -> tuple[Path, str | None]:
    """(file, template source): chat_template.jinja, else tokenizer_config.json's `chat_template`, else None.
    `cfg`: tokenizer_config.json, already read."""
    tpl = root / "chat_template.jinja"
    if os.path.lexists(tpl):
        return tpl, files.read_text(tpl, "chat template")
    path = root / "tokenizer_config.json"
    text = (tokenizer_config(root) if cfg is None else cfg).get("chat_template")
    if text is not None and not isinstance(text, str):
        raise fail(path, "chat_template must be a string")
    return (path, text) if text is not None or os.path.lexists(path) else (tpl, None)


GREEDY = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(root: Path) -> dict:
    """The sampling a checkpoint asks for in generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty), keyed as `Sampler` takes them, used where a request or `run` sets none: greedy when the
    file is absent, says do_sample false, or asks for no sampling at all (no do_sample and none of those fields:
    Mixtral's holds only its token ids), as transformers reads it."""
    p = root / "generation_config.json"
    gen = files.read_json(p, "generation config") if p.is_file() else {}
    asked = gen.get("do_sample", any(k in gen for k in ("temperature", "top_p", "top_k", "min_p")))
    if not asked:
        return dict(GREEDY)
    try:
        return {"temp": float(gen.get("temperature", 1.0)), "top_p": float(gen.get("top_p", 1.0)),
                "top_k": int(gen.get("top_k", 0) or 0), "min_p": float(gen.get("min_p", 0.0) or 0.0),
                "repetition_penalty": float(gen.get("repetition_penalty", 1.0) or 1.0)}
    except (TypeError, ValueError):
        raise fail(p, "temperature/top_p/top_k/min_p/repetition_penalty are not numbers") from None


def stop_tokens(root: Path, config: dict) -> set[int]:
    gen = root / "generation_config.json"
    return set(eos_ids(config, files.read_json(gen, "generation config") if os.path.lexists(gen) else None))


PRIME_TOKENS = 8  # a continued text's last tokens the streaming decoder steps through first (`Detokenizer`)


@functools.cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed (Qwen's tokenizers keep it): the printable character that stands for
    each byte in a byte-level BPE vocabulary -> that byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {chr(b): b for b in kept} | {chr(256 + i): b for i, b in enumerate(moved)}


class Detokenizer:
    """Emits text as tokens arrive, through the `tokenizers` streaming decoder: each token costs the same
    however long the answer (re-decoding the answer every token made 4,000 tokens cost 1.5 s), and an
    incomplete UTF-8 sequence is held back until it completes. The pieces join to `TextIO.decode` of all ids.
    `skip_special`: the tokenizer's special tokens (Qwen's `<|im_end|>`, not its `<think>`) written as nothing, as
    vLLM's `skip_special_tokens` writes them.

    A byte-fallback tokenizer (Llama's, Mixtral's) can break the join: bytes that form no character decode as one
    U+FFFD each, together with any byte token before them ("c" then 0xBB decode as two), so text already written
    would change; the streaming decoder refuses the token then. Such a token is written as what it adds to the
    token before it, the bytes that form no character left out, and the stream goes on from it."""

    def __init__(self, text: TextIO, skip_special: bool = False, context: list[int] | None = None):
        """`context`: the ids the answer continues (a completion's prompt, a continued assistant message), whose
        last few are stepped through first, their text left out: the answer's first piece is then what it adds to
        them, as vLLM primes its detokenizer, so a SentencePiece tokenizer's space before the first word stays and
        a character the prompt's last tokens began is completed, not lost."""
        self.tokenizer, self.skip_special = text.tokenizer, skip_special
        self.stream, self.last = DecodeStream(skip_special_tokens=skip_special), None
        self.held: list[int] = []  # tokens since the last piece written (part of a character)
        if context:
            # from a token that opens a character: a window opening inside one would write its stray bytes with the
            # answer's first piece
            start = max(0, len(context) - PRIME_TOKENS)
            while start > 0 and not self._opens_character(context[start]):
                start -= 1
            for tok in context[start:]:
                self.add(tok)
            self.held = []  # the prompt's own unfinished character is not the answer's to write at its end

    def _opens_character(self, tok: int) -> bool:
        """Whether a token's bytes do not open with a UTF-8 continuation byte: a byte-fallback token (`<0xNN>`) by
        its byte, a byte-level BPE token (GPT-2's table: Qwen's) by its first character's byte, any other by its
        text, which is whole characters."""
        piece = self.tokenizer.id_to_token(tok) or ""
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            first = int(piece[3:5], 16)
        elif piece and piece[0] in byte_decoder():
            first = byte_decoder()[piece[0]]
        else:
            return True
        return not 0x80 <= first < 0xC0

    def add(self, tok: int) -> str:
        piece = self._step(tok)
        self.held = [] if piece else [*self.held, tok]
        return piece

    def tail(self) -> str:
        """The text of the tokens still held back at the answer's end (bytes that form no character), as
        `tokenizers` decodes them: U+FFFD for each such sequence, as mlx-lm's detokenizer ends an answer."""
        return self.tokenizer.decode(self.held, skip_special_tokens=self.skip_special) if self.held else ""

    def _step(self, tok: int) -> str:
        before, self.last = self.last, tok
        try:
            return self.stream.step(self.tokenizer, tok) or ""
        except Exception:  # tokenizers' "Invalid prefix encountered while decoding stream" (a bare Exception)
            pass
        context = [before] if before is not None else []
        alone = self.tokenizer.decode(context, skip_special_tokens=self.skip_special)
        both = self.tokenizer.decode([*context, tok], skip_special_tokens=self.skip_special)
        piece = both[len(alone):] if both.startswith(alone) else both
        self.stream = DecodeStream(skip_special_tokens=self.skip_special)
        self.stream.step(self.tokenizer, tok)  # what comes next is written as it adds to this token
        return piece.lstrip("\ufffd")


# the tokenizer's working set per byte of text it is given (measured 210-250, tokenizers 0.2x, byte-level BPE)
TOKENIZE_BYTES = 320


def too_long(tokens: int, ctx: int, held: int = 0, at_least: bool = False, images: bool = False) -> ContextFull:
    """A prompt of `tokens` (`at_least`: a bound, counted before tokenizing; `images`: with its images' tokens)
    that a context of `ctx` tokens cannot hold beside the `held` it holds already."""
    least, more = ("at least ", " or more") if at_least else ("", "")
    beside = f" beside the {held} in context" if held else ""
    return ContextFull(f"prompt of {least}{tokens} token{'s' * (tokens != 1)}{' with its images' if images else ''}"
                       f"{beside} is longer than the planned context --ctx {ctx}: it needs --ctx {held + tokens}{more} "
                       "and the answer's tokens")


def prompt_account(prompt: str, bound: PromptBound | None, ctx: int) -> tuple[str, int, str]:
    """The plan's account for tokenizing `prompt` (given before the run opens): TOKENIZE_BYTES a byte. A prompt
    the context cannot hold at the tokenizer's longest token (`bound`; None: no tokenizer to bound it) is
    refused here, unread."""
    if bound is not None and (least := bound.at_least(prompt)) > ctx:  # as `run` holds a prompt (`require_room`)
        raise too_long(least, ctx, at_least=True)
    size = len(prompt.encode("utf-8", "replace"))
    return "prompt", TOKENIZE_BYTES * size, f"the tokenizer's working set for the prompt's {size:,} bytes"


class PromptBound:
    """A lower bound on a text's token count, found without tokenizing it: a token covers at most
    `token_bytes` bytes of the normalised text (the longest vocabulary entry), so N bytes are at least
    ceil(N / token_bytes) tokens. `token_bytes` is None for a tokenizer that may drop text (a pre-tokenizer
    that removes whitespace, unknown runs fused into one token): then no bound holds and none is claimed."""

    def __init__(self, tokenizer):
        spec = json.loads(tokenizer.to_str())
        model = spec.get("model") or {}
        parts = _parts(spec.get("pre_tokenizer")) + _parts(spec.get("decoder"))
        byte_level = any(p.get("type") == "ByteLevel" for p in parts)
        vocab = model.get("vocab") or {}
        pieces = list(vocab) if isinstance(vocab, dict) else [v[0] for v in vocab if isinstance(v, list) and v]
        pieces += [a.get("content", "") for a in spec.get("added_tokens") or []]
        # a byte-level entry spells each byte as one character; any other spells its text (or more)
        span = max((len(p) if byte_level else len(p.encode("utf-8", "surrogatepass")) for p in pieces), default=1)
        forms, self.token_bytes = [], max(1, span)
        for n in _parts(spec.get("normalizer")):
            if n.get("type") in ("NFC", "NFD", "NFKC", "NFKD"):
                forms.append(n["type"])
            elif n.get("type") != "Prepend" and not _grows(n):
                self.token_bytes = None  # a normaliser that may remove text
        self.forms = forms
        drops = [p for p in _parts(spec.get("pre_tokenizer")) if p.get("type") in ("Whitespace", "WhitespaceSplit",
                 "BertPreTokenizer") or p.get("behavior") == "Removed"]
        fused = model.get("fuse_unk") and not model.get("byte_fallback")  # byte fallback: no unknown run to fuse
        if drops or fused or model.get("type") in ("WordPiece", "WordLevel"):
            self.token_bytes = None

    CHUNK = 1 << 16

    def at_least(self, text: str) -> int:
        """Tokens `text` is at least (0 when no bound holds). Normalised and measured a chunk at a time (no
        copy of a long text); a composition split by a chunk's end is allowed for (8 bytes a chunk)."""
        if self.token_bytes is None:
            return 0
        if text.isascii():
            return -(-len(text) // self.token_bytes)
        n = 0
        for i in range(0, len(text), self.CHUNK):
            part = text[i:i + self.CHUNK]
            for form in self.forms:
                part = unicodedata.normalize(form, part)
            n += len(part.encode("utf-8", "surrogatepass")) - (8 if self.forms and i else 0)
        return max(0, -(-n // self.token_bytes))

    def quick(self, chars: int) -> int:
        """Tokens a text of `chars` characters is at least before normalisation (which composes at most 4
        characters into one): the gate before a template renders it."""
        return 0 if self.token_bytes is None else chars // ((4 if self.forms else 1) * self.token_bytes)


def _grows(normalizer: dict) -> bool:
    """Whether a normaliser only replaces a string by one at least as long in UTF-8 (SentencePiece's space to "▁"),
    so the text it gives is no shorter than the text it was given."""
    pattern = normalizer.get("pattern") or {}
    return (normalizer.get("type") == "Replace" and isinstance(pattern.get("String"), str) and pattern["String"] != ""
            and len(str(normalizer.get("content", "")).encode()) >= len(pattern["String"].encode()))


def _parts(node) -> list[dict]:
    """A tokenizer.json component flattened (a Sequence's members, in order)."""
    if not isinstance(node, dict):
        return []
    inner = node.get("normalizers") or node.get("pretokenizers") or node.get("decoders")
    return [p for x in inner for p in _parts(x)] if node.get("type") == "Sequence" and inner else [node]
