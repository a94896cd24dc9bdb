"""`streamoe run`: one prompt or a multi-turn chat, tokens streamed to stdout, summary to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from .engine import Engine, Options
from .telemetry import summarize, summary_line, validate_record
from .text import Detokenizer, Sampler


def answer(eng: Engine, prompt_ids: list[int], max_tokens: int, sampler: Sampler, logits: list | None,
           images: list | None = None) -> list[int]:
    detok = Detokenizer(eng.text)
    out = []
    for tok, lg in eng.generate(prompt_ids, max_tokens, sampler, images=images):
        if logits is not None:
            logits.append(lg)
        out.append(tok)
        sys.stdout.write(detok.add(tok))
        sys.stdout.flush()
    sys.stdout.write("\n")
    return out


def run_cli(model: Path, opts: dict, *, prompt: str | None, images: list, chat: bool, raw: bool, system: str | None, think: bool,
            max_tokens: int, sampling: dict, stats: Path | None, logits_out: Path | None, quiet: bool) -> None:
    sampler = Sampler(**sampling)
    eng = Engine(model, Options(**opts))
    logits: list | None = [] if logits_out else None
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    fed: list[int] = []  # the rendered tokens the cache holds, so a chat turn feeds only what is new
    try:
        turns = [prompt] if prompt is not None else None
        while True:
            if turns is not None:
                if not turns:
                    break
                user = turns.pop(0)
            else:
                try:
                    user = input("> ")
                except EOFError:
                    break
                if user.strip() in ("/quit", "/exit"):
                    break
                if user.startswith("/image "):
                    images.append(Path(user[7:].strip()))
                    print(f"(attached {images[-1]} to the next turn)", file=sys.stderr)
                    continue
            if raw:
                full = fed + eng.text.encode(user)
            else:
                content = [{"type": "image"} for _ in images] + [{"type": "text", "text": user}] if images else user
                messages.append({"role": "user", "content": content})
                full = eng.text.encode(eng.text.chat_prompt(messages, think=think))
            if full[:len(fed)] != fed:  # history re-rendered differently: start the cache over
                eng.reset()
                fed = []
            ids = full[len(fed):]
            n0 = len(eng.steps)
            turn_images, images = list(images), []
            out = answer(eng, ids, max_tokens, sampler, logits, images=turn_images)
            fed = full + out  # as rendered (one pad per image); the cache holds the expanded run, same history
            if not raw:
                messages.append({"role": "assistant", "content": eng.text.decode(out)})
            if not quiet:
                s = summarize(eng.steps[n0:], eng.peak_rss, eng.plan.cap)
                print(summary_line(s), file=sys.stderr)
            if not chat:
                break
    finally:
        eng.close()
        if stats:
            with open(stats, "w") as f:
                for st in eng.steps:
                    rec = st.to_json()
                    validate_record(rec)
                    f.write(json.dumps(rec) + "\n")
        if logits_out is not None and logits:
            np.savez(logits_out, logits=np.stack(logits))
