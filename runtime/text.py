"""Text in and out: tokenizer.json through `tokenizers`, the checkpoint's chat template through jinja2,
stop tokens and sampling defaults from generation_config, and incremental detokenization for streaming output."""

from __future__ import annotations

import os
from pathlib import Path

import jinja2
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from ..formats import files
from ..formats.config import eos_ids
from ..formats.errors import fail


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
        self.template_path, text = chat_template_text(root)
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
        env.globals["raise_exception"] = _raise
        try:
            self.template = env.from_string(text) if text else None
        except (jinja2.TemplateError, RecursionError, MemoryError) as e:
            raise fail(self.template_path, f"chat template does not parse ({_first_line(e)})") from None
        self.stop_ids = stop_tokens(root, config)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def chat_prompt(self, messages: list[dict], think: bool = True) -> str:
        if self.template is None:
            raise fail("chat_template.jinja", "the model has no chat template; use --raw")
        return self._render(messages=messages, add_generation_prompt=True, enable_thinking=think)

    def _render(self, **kw) -> str:
        """The template rendered; its own errors (raise_exception, bad expressions) name the template file."""
        try:
            return self.template.render(bos_token="", eos_token="", **kw)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError,
                ZeroDivisionError, RecursionError) as e:
            raise fail(self.template_path, f"chat template fails to render ({_first_line(e)})") from None

    def turn_close(self) -> str:
        """What the template writes after an assistant message's content (`<|im_end|>\n` for ChatML): fed
        after a generated answer, before the next turn, so a chat only ever appends to what the cache holds."""
        if self.template is None:
            raise fail("chat_template.jinja", "the model has no chat template; use --raw")
        mark = "\u2063"
        msgs = [{"role": "user", "content": "."}, {"role": "assistant", "content": mark}]
        s = self._render(messages=msgs, add_generation_prompt=False, enable_thinking=False)
        if mark not in s:
            raise fail(self.template_path, "chat template drops the assistant's message; cannot continue a chat")
        return s[s.rindex(mark) + len(mark):]


def _raise(msg: str):
    raise jinja2.TemplateError(msg)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def chat_template_text(root: Path) -> tuple[Path, str | None]:
    """(file, template source): chat_template.jinja, else tokenizer_config.json's `chat_template`, else None."""
    tpl = root / "chat_template.jinja"
    if os.path.lexists(tpl):
        return tpl, files.read_text(tpl, "chat template")
    cfg = root / "tokenizer_config.json"
    if os.path.lexists(cfg):
        text = files.read_json(cfg, "tokenizer config").get("chat_template")
        if text is not None and not isinstance(text, str):
            raise fail(cfg, "chat_template must be a string")
        return cfg, text
    return tpl, None


GREEDY = {"temp": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}


def generation_defaults(root: Path) -> dict:
    """The sampling a checkpoint asks for in generation_config.json (temperature, top_p, top_k, min_p,
    repetition_penalty), keyed as `Sampler` takes them, used where a request or `run` sets none: greedy when the
    file is absent or says do_sample false."""
    p = root / "generation_config.json"
    gen = files.read_json(p, "generation config") if p.is_file() else {}
    if not gen or gen.get("do_sample") is False:
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


class Detokenizer:
    """Emits text as tokens arrive, through the `tokenizers` streaming decoder: each token costs the same
    however long the answer (re-decoding the answer every token made 4,000 tokens cost 1.5 s), and an
    incomplete UTF-8 sequence is held back until it completes. The pieces join to `TextIO.decode` of all ids."""

    def __init__(self, text: TextIO):
        self.tokenizer, self.stream = text.tokenizer, DecodeStream(skip_special_tokens=False)

    def add(self, tok: int) -> str:
        return self.stream.step(self.tokenizer, tok) or ""
