"""`streamoe run`: one prompt or a multi-turn chat, tokens streamed to stdout, summary to stderr."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from ..formats.errors import StreamoeError, fail
from ..formats.files import os_fail
from ..formats.manifest import load_manifest
from . import session
from .engine import Engine, Options
from .image import check_preprocessor, load_image
from .sampling import Sampler
from .telemetry import summarize, summary_line
from .text import Detokenizer


def answer(eng: Engine, prompt_ids: list[int], max_tokens: int, sampler: Sampler, logits: list | None,
           images: list | None = None, context: list[int] | None = None) -> list[int]:
    detok = Detokenizer(eng.text)
    out = []
    for tok, lg in eng.generate(prompt_ids, max_tokens, sampler, images=images, context=context):
        if logits is not None:
            logits.append(lg)
        out.append(tok)
        sys.stdout.write(detok.add(tok))
        sys.stdout.flush()
    sys.stdout.write("\n")
    return out


def run_cli(model: Path, opts: Options, *, prompt: str | None, images: list, chat: bool, raw: bool, system: str | None, think: bool,
            max_tokens: int, sampling: dict, stats: Path | None, logits_out: Path | None, quiet: bool,
            save_session: Path | None = None, load_session: Path | None = None) -> None:
    sampler = Sampler(**sampling)
    check_preprocessor(Path(model), load_manifest(model).config)
    for path in images:  # a file that cannot be the image fails before the model loads
        load_image(path, max_decode_pixels=opts.max_decode_pixels).close()
    eng = Engine(model, opts)
    logits: list | None = [] if logits_out else None
    messages: list[dict] = [{"role": "system", "content": system}] if system else []
    fed: list[int] = []  # every token fed so far, as rendered: the history a saved session keeps
    if load_session:
        try:
            saved = session.load_session(eng, load_session)
        except BaseException:
            eng.close()
            raise
        if saved.get("raw", raw) != raw:
            eng.close()
            raise StreamoeError(f"{load_session}: saved {'with' if saved['raw'] else 'without'} --raw; run it the same way")
        messages, fed = saved.get("messages", []), saved.get("tokens", [])
        if "sampler" in saved:  # a sampled conversation goes on drawing where it stopped
            try:
                session.restore_sampler(sampler, saved["sampler"], load_session)
            except BaseException:
                eng.close()
                raise
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
                except UnicodeDecodeError:
                    raise fail("<stdin>", "the input is not valid UTF-8 text") from None
                if user.strip() in ("/quit", "/exit"):
                    break
                if user.startswith("/image "):
                    path = Path(user[7:].strip())
                    try:  # a file that cannot be the image is said now, in one line, and the chat goes on
                        if raw:
                            raise StreamoeError(f"{path}: an image needs the chat template; run the chat without --raw")
                        load_image(path, max_decode_pixels=eng.opts.max_decode_pixels)
                    except StreamoeError as e:
                        print(f"streamoe: error: {e} (not attached; the chat goes on)", file=sys.stderr, flush=True)
                        continue
                    images.append(path)
                    print(f"(attached {path} to the next turn)", file=sys.stderr)
                    continue
            if raw:
                ids = eng.text.encode(user)
            else:
                # only the new turn: re-rendering the history would differ from what the cache holds (templates
                # drop past thinking), and a Gated DeltaNet state cannot be rewound to a common prefix
                msg = {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": user}]
                       if images else user}
                text = eng.text.chat_prompt([msg] if fed else messages + [msg], think=think)
                ids = eng.text.encode_chat(eng.text.turn_close() + text if fed else text)
                messages.append(msg)
            n0 = len(eng.steps)
            turn_images, images = list(images), []
            out = answer(eng, ids, max_tokens, sampler, logits, images=turn_images, context=fed + ids)
            fed += ids + out  # as rendered (one pad per image); the cache holds the expanded run, same history
            if not raw:
                messages.append({"role": "assistant", "content": eng.text.decode(out)})
            if not quiet:
                s = summarize(eng.steps[n0:], eng.peak_rss, eng.plan.cap)
                print(summary_line(s), file=sys.stderr)
            if stats is None:  # kept only for --stats: a long chat must not grow them outside the plan
                del eng.steps[:]
            if not chat:
                break
        if save_session:
            extra = {"raw": raw, "messages": messages, "tokens": fed, "sampler": sampler.state()}
            size = session.save_session(eng, save_session, extra)
            print(f"(saved {eng.offset} tokens of conversation to {save_session}, {size / 2**20:.2f} MiB)", file=sys.stderr)
    finally:
        eng.close()
        write_outputs(eng, stats, logits_out, logits)


def write_outputs(eng: Engine, stats: Path | None, logits_out: Path | None, logits: list | None) -> None:
    """The telemetry and logits files, after the answer; a full disk is one line naming the file."""
    try:
        if stats:
            with open(stats, "w") as f:
                for st in eng.steps:
                    f.write(json.dumps(st.to_json()) + "\n")
    except OSError as e:
        raise os_fail(stats, e, "cannot write the telemetry") from None
    try:
        if logits_out is not None and logits:
            np.savez(logits_out, logits=np.stack([np.array(lg) for lg in logits]))
    except OSError as e:
        raise os_fail(logits_out, e, "cannot write the logits") from None
