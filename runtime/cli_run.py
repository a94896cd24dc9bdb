"""`streamoe run`: one prompt or a multi-turn chat, tokens streamed to stdout, summary to stderr."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from tqdm import tqdm

from ..formats.direct import new_hash
from ..formats.errors import ContextFull, StreamoeError, fail
from ..formats.files import write_whole
from ..formats.manifest import load_manifest
from ..formats.session import session_lock
from . import ranks, session
from .constrain import (
    Constraint,
    ThinkingBudget,
    guide_tokenizer,
    json_answer,
    reasoning_close,
    reasoning_header,
    think_opener,
)
from .engine import Engine, Options
from .image import PipedImage, check_preprocessor, load_image
from .sampling import Sampler
from .serve.chat_output import ChatOutput, HarmonyOutput
from .telemetry import summary_line
from .text import Detokenizer


def prefill_bar(tokens: int, show: bool, delay: float = 1.0, mininterval: float = 0.1) -> tqdm:
    """The prompt's prefill on stderr: shown only on a terminal and once it has taken `delay` seconds (a short prompt
    shows none), cleared once the prompt is in."""
    return tqdm(total=tokens, desc="prefill", unit=" tok", file=sys.stderr, disable=None if show else True,
                leave=False, dynamic_ncols=True, delay=delay, mininterval=mininterval)


class ReasoningApart:
    """An answer's text as `--json-schema` writes it: the JSON alone on stdout, so that it parses; the reasoning
    before it (the thinking, or harmony's analysis) on stderr, the markup between them (`</think>`, the final
    message's header) in neither. Read as the server reads an answer (`ChatOutput`, `HarmonyOutput`)."""

    def __init__(self, thinking: bool, harmony: bool):
        self.parser = HarmonyOutput(None, []) if harmony else ChatOutput(thinking, None, [])

    def write(self, text: str) -> None:
        self._show(self.parser.feed(text))

    def flush(self) -> None:
        self._show(self.parser.flush())

    @staticmethod
    def _show(events: list) -> None:
        for kind, text in events:
            (sys.stdout if kind == "content" else sys.stderr).write(text)
        sys.stderr.flush()


def answer(eng: Engine, prompt_ids: list[int], max_tokens: int, sampler: Sampler, logits: list | None,
           images: list | None = None, context: list[int] | None = None,
           constraint: Constraint | ThinkingBudget | None = None, stop: threading.Event | None = None,
           progress: bool = False, apart: ReasoningApart | None = None) -> list[int]:
    """The answer's tokens, streamed to stdout (with `apart`, its reasoning to stderr). Once `stop` is set (Ctrl-C
    in a chat) it ends after the token in hand, which is then fed as the last token of an answer cut by
    --max-tokens is: the conversation holds what was shown (where the context is full, that token is left out of
    the caches, as the engine leaves an answer's last token there: `Engine.unfed`, which a saved session keeps).
    `progress`: a bar for the prompt's prefill (`prefill_bar`)."""
    detok = Detokenizer(eng.text)
    write = apart.write if apart is not None else sys.stdout.write
    out = []
    bar = prefill_bar(len(prompt_ids), progress)

    def advance(n: int, total: int) -> None:  # total: the prompt as its images expand it
        bar.total = total
        bar.update(n - bar.n)
        if n == total:  # the prompt is in: the bar gives way to the answer
            bar.close()

    tokens = eng.generate(prompt_ids, max_tokens, sampler, images=images, context=context, constraint=constraint,
                          progress=advance)
    for tok, lg in tokens:
        if logits is not None:
            logits.append(lg)
        out.append(tok)
        write(detok.add(tok))
        sys.stdout.flush()
        if stop is not None and stop.is_set():
            break
    else:
        stop = None
    write(detok.tail())  # bytes that form no character, as mlx-lm ends an answer: U+FFFD
    tokens.close()  # a step queued past the last token is taken back
    bar.close()  # where the prefill never told its end (a prompt refused before it)
    if apart is not None:
        apart.flush()
    sys.stdout.write("\n")
    if stop is not None and out:
        print("(stopped)", file=sys.stderr, flush=True)
        if eng.offset < eng.opts.ctx:
            eng.decode(out[-1])
        else:
            eng.unfed = out[-1:]
    return out


@contextlib.contextmanager
def ctrl_c_stops_the_answer(on: bool) -> Iterator[threading.Event | None]:
    """While `on` (a chat's answer streams), Ctrl-C sets the event the token loop reads instead of raising in
    whatever the engine is doing, so the answer ends between two tokens and the chat goes on."""
    if not on or threading.current_thread() is not threading.main_thread():
        yield None
        return
    stop = threading.Event()
    before = signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, before)


def run_cli(model: Path, opts: Options, *, prompt: str | None, images: list, chat: bool, raw: bool, system: str | None, think: bool,
            max_tokens: int, sampling: dict, stats: Path | None, logits_out: Path | None, quiet: bool,
            save_session: Path | None = None, load_session: Path | None = None, json_schema: dict | None = None,
            thinking_budget: int | None = None, seed_given: bool = False, drawn: str | None = None) -> int:
    """Answer the prompt or chat; the exit status: 0, or 1 where an answer's constrained format (--json-schema) was
    cut short (its line already said so). `seed_given`: the sampling's seed was asked for (`--seed`), so a loaded
    session drawing with another one is refused. `drawn`: how a sampled run draws, said before its first answer."""
    sampler = Sampler(**sampling)
    group = ranks.find_group()
    if group is None:
        check_preprocessor(Path(model), load_manifest(model).config)
        for path in images:  # a file that cannot be the image fails before the model loads
            load_image(path, max_decode_pixels=opts.max_decode_pixels).close()
    else:  # the engine's open checks what this rank reads, and every rank learns whether all could
        if load_session:
            raise StreamoeError("across ranks (mlx.launch), --load-session needs one host")
        piped = next((i.path for i in images if isinstance(i, PipedImage)), None)
        if piped is not None:
            raise StreamoeError(f"{piped}: across ranks (mlx.launch) every host reads --image itself: give a file")
        if group.rank() != 0:  # rank 0 alone prints and writes files
            sys.stdout = open(os.devnull, "w")
            save_session = None
    # a run that will save a session holds its lock from here: a second one saving the same file fails before it
    # opens the model, not after its answer (and a lock that cannot be made is found now too)
    with session_lock(save_session) if save_session else contextlib.nullcontext():
        try:
            eng = Engine(model, opts, group)
            if eng.plan.past_native and opts.rank == 0:
                print(f"streamoe: note: {eng.plan.past_native}", file=sys.stderr, flush=True)
            harmony = not raw and eng.text.template is not None and eng.text.template.tool_format == "harmony"  # gpt-oss
            # where the prompt leaves the model inside `<think>` (Qwen3.5's template), the answer reasons until `</think>`;
            # where the template leaves the tag to the model (Qwen3's), an answer that opens with it does (`opener`)
            if not think and not raw and (harmony or think_opener(eng.text.tokenizer) is None):
                eng.close()
                raise StreamoeError("--no-think: " + ("gpt-oss always reasons (its harmony format has no way to turn it "
                                                      "off)" if harmony else "this model's template has no thinking to "
                                                      "turn off"))
            tag = think_opener(eng.text.tokenizer) if think and not raw and not harmony else None
            opens = tag is not None and eng.text.chat_prompt([{"role": "user", "content": "."}]).rstrip().endswith("<think>")
            opener = None if opens else tag
            work = {"--json-schema": digest(json.dumps(json_schema, sort_keys=True).encode()) if json_schema else None,
                    "--thinking-budget": thinking_budget, "-n": max_tokens, "--chat": chat, "-q": quiet, "--raw": raw,
                    "--no-think": not think}
            return _run(eng, group, prompt=prompt, images=images, chat=chat, raw=raw, system=system, think=think,
                        max_tokens=max_tokens, sampler=sampler, stats=stats, logits_out=logits_out, quiet=quiet,
                        save_session=save_session, load_session=load_session, seed_given=seed_given, drawn=drawn,
                        constrained=answer_shape(eng, json_schema, opens, thinking_budget, harmony, opener), work=work,
                        apart=(lambda: ReasoningApart(opens, harmony)) if json_schema is not None and not raw else None)
        except RuntimeError as e:
            lost = ranks.lost_peer(e, group) if group is not None else None
            if lost is None:
                raise
            raise lost from None
        except StreamoeError as e:
            if group is None or group.rank() == 0:
                raise
            raise StreamoeError(f"{ranks.where(group)}: {e}") from None  # which rank said it, beside rank 0's line


def answer_shape(eng: Engine, schema: dict | None, thinking: bool, budget: int | None, harmony: bool = False,
                 opener: int | None = None) -> Callable[[], Constraint | ThinkingBudget] | None:
    """What shapes each answer, made fresh for each: JSON valid against `schema` (`json_constraint`), under a cap of
    `budget` tokens on the thinking (`ThinkingBudget`: the template's `</think>` forced once the thinking took them,
    as the server does for Anthropic's budget_tokens). `thinking`: the prompt leaves the model inside `<think>`;
    `opener`: the `<think>` an answer may open its own reasoning with, where the template leaves it to the model.
    None: nothing."""
    json = json_constraint(eng, schema, thinking, harmony, opener) if schema is not None else None
    if budget is None:
        return json
    close = reasoning_close(eng.text, harmony)
    if close is None:
        eng.close()
        raise StreamoeError("--thinking-budget needs the template's '</think>' token, which the model's tokenizer lacks")
    header = reasoning_header(eng.text, harmony)
    return lambda: ThinkingBudget(close, budget, eng.args.vocab_size, json() if json is not None else None, header,
                                  opener=opener)


def json_constraint(eng: Engine, schema: dict, thinking: bool, harmony: bool = False,
                    opener: int | None = None) -> Callable[[], Constraint]:
    """A fresh constraint for each answer: JSON valid against `schema`, after the reasoning closes where the
    template leaves the model thinking; in a harmony chat (gpt-oss), the `final` message's text, after a free
    `analysis` message, as `serve` holds it. A schema llguidance cannot compile fails here, in one line, the engine
    closed."""
    guide = guide_tokenizer(eng.text.tokenizer, eng.args.vocab_size, eng.text.stop_ids)

    def made() -> Constraint:
        return json_answer(guide, schema, eng.text.tokenizer, eng.args.vocab_size, thinking, harmony, opener)
    try:
        made()
    except StreamoeError as e:
        eng.close()
        raise StreamoeError(f"--json-schema: {e}") from None
    return made


def _run(eng: Engine, group, *, prompt: str | None, images: list, chat: bool, raw: bool, system: str | None, think: bool,
         max_tokens: int, sampler: Sampler, stats: Path | None, logits_out: Path | None, quiet: bool,
         save_session: Path | None, load_session: Path | None, seed_given: bool = False,
         constrained: Callable[[], Constraint | ThinkingBudget] | None = None, work: dict | None = None,
         apart: Callable[[], ReasoningApart] | None = None, drawn: str | None = None) -> int:
    """`work`: what decides the run's collectives besides each prompt, which every rank checks it shares
    (`ranks.same_work`) before the first. `apart`: each answer's reasoning written apart from it (`ReasoningApart`).
    `drawn`: how a sampled run draws, said once before the first answer (after every check that may refuse it)."""
    logits: list | None = [] if logits_out else None
    status = 0
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
        if not raw and saved.get("think", think) != think:  # the template renders each turn with or without thinking
            eng.close()
            raise StreamoeError(f"{load_session}: saved {'without' if saved['think'] else 'with'} --no-think; run it the "
                                "same way")
        messages, fed = saved.get("messages", []), saved.get("tokens", [])
        if saved.get("unfed"):  # shown, left out of a full context: fed now, as a context with room fed it
            if eng.offset + len(saved["unfed"]) > eng.opts.ctx:
                eng.close()
                raise StreamoeError(f"{load_session}: the last answer's final token did not fit its context; load it "
                                    f"with --ctx {eng.offset + len(saved['unfed'])} or more to go on")
            for tok in saved["unfed"]:
                eng.decode(tok)
        if "sampler" in saved:  # a sampled conversation goes on drawing where it stopped
            try:
                asked = sampler.seed
                session.restore_sampler(sampler, saved["sampler"], load_session)
                if seed_given and sampler.seed != asked:
                    raise StreamoeError(f"{load_session}: the conversation draws with seed {sampler.seed}, not --seed "
                                        f"{asked}: drop --seed, or give {sampler.seed}")
            except BaseException:
                eng.close()
                raise
    try:
        if group is not None:
            ranks.same_work(group, work or {})
        turns = [prompt] if prompt is not None else []  # with --chat, -p is the chat's first turn
        interrupted = False
        if chat:  # a turn's bytes that are not UTF-8 then arrive as surrogates (`utf8_turn`), whatever the locale
            with contextlib.suppress(AttributeError, ValueError, OSError):
                sys.stdin.reconfigure(errors="surrogateescape")
        if chat and sys.stdin.isatty():
            with contextlib.suppress(ImportError):
                import readline  # noqa: F401  (input() then edits the line and keeps the turns' history)
        if chat and group is None and threading.current_thread() is threading.main_thread():
            # explicitly, as serve does: a process started with SIGINT ignored (a shell's background job, some test
            # runners) gets no Ctrl-C handler from Python, and Ctrl-C at the prompt would not end the chat
            signal.signal(signal.SIGINT, signal.default_int_handler)
        while True:
            if turns:
                user = turns.pop(0)
            elif not chat:
                break
            else:
                if group is not None:
                    eng.watchdog.idle()  # a person may take their time: only a step waits on the peers
                try:
                    user = read_turn(eng, images, raw, group is not None) if eng.opts.rank == 0 else None
                except KeyboardInterrupt:  # Ctrl-C at the prompt ends the chat as Ctrl-D does: its session saved
                    user, interrupted = None, True
                if group is not None:
                    user = ranks.from_rank0(group, user)  # every rank answers rank 0's turn
                if user is None:
                    if images and eng.opts.rank == 0:
                        print(f"(the chat ends: the {len(images)} image(s) attached to a next turn are not sent)",
                              file=sys.stderr, flush=True)
                    break
                if user == CLEAR:  # the conversation emptied; its system message (and the sampler's draws) kept
                    eng.reset()
                    fed, messages = [], messages[:1] if messages and messages[0]["role"] == "system" else []
                    dropped = f" and the {len(images)} image(s) attached to the next turn dropped" if images else ""
                    images = []
                    if eng.opts.rank == 0:
                        print(f"(the conversation is cleared{dropped})", file=sys.stderr, flush=True)
                    continue
            n0, offset0, sent = len(eng.steps), eng.offset, len(messages)
            turn_images, images = list(images), []
            try:
                ids, msg = turn_ids(eng, user, fed, messages, len(turn_images), raw, think)
                if msg is not None:
                    messages.append(msg)
                if group is not None:  # each host reads its own --image files
                    ranks.same_work(group, {"the prompt": f"{len(ids)} tokens {digest(np.array(ids, np.int64).tobytes())}",
                                            "--image": " ".join(file_digest(p) for p in turn_images) or None})
                constraint = constrained() if constrained is not None else None
                if not turn_images:  # refused before anything is said (with images, once they are expanded)
                    eng.require_room(len(ids))
                if drawn is not None and eng.opts.rank == 0:
                    print(f"streamoe: {drawn}", file=sys.stderr, flush=True)
                    drawn = None
                with ctrl_c_stops_the_answer(chat and group is None) as stop:
                    out = answer(eng, ids, max_tokens, sampler, logits, images=turn_images, context=fed + ids,
                                 constraint=constraint, stop=stop, progress=not quiet and eng.opts.rank == 0,
                                 apart=apart() if apart is not None else None)
            except StreamoeError as e:  # a chat's turn refused before it changed the conversation: the chat goes on
                if not chat or group is not None or eng.offset != offset0 or len(eng.steps) != n0:
                    raise
                clear = "; /clear empties the conversation" if isinstance(e, ContextFull) and eng.offset else ""
                kept = f"; its {len(turn_images)} image(s) stay attached to the next turn" if turn_images else ""
                print(f"streamoe: error: {e} (not sent; the chat goes on{clear}{kept})", file=sys.stderr, flush=True)
                del messages[sent:]
                images = turn_images + images
                continue
            fed += ids + out  # as rendered (one pad per image); the cache holds the expanded run, same history
            if not raw:
                messages.append({"role": "assistant", "content": eng.text.decode(out)})
            if not quiet:
                s = eng.summary(eng.steps[n0:])
                line = summary_line(s)
                if not sampler.greedy:  # what repeats these draws (`--seed`)
                    line = line[:-1] + f"; seed {sampler.seed}]"
                if group is not None:  # every rank's reads and hits, on rank 0's line
                    line = line[:-1] + "; " + ranks.ranks_line(ranks.rank_summaries(group, s)) + "]"
                if eng.opts.rank == 0:
                    print(line, file=sys.stderr)
            stopped = stop is not None and stop.is_set()
            if constraint is not None and not constraint.complete and not stopped:
                status = 1
                if eng.opts.rank == 0:
                    print(f"streamoe: error: {cut_short(len(out), max_tokens, eng, constraint)}", file=sys.stderr, flush=True)
            elif not stopped and len(out) < max_tokens and eng.offset >= eng.opts.ctx and eng.opts.rank == 0:
                clear = "; /clear empties the conversation" if chat else ""
                print(f"(the answer was cut by the context: --ctx {eng.opts.ctx} is full{clear})", file=sys.stderr, flush=True)
            if stats is None:  # kept only for --stats: a long chat must not grow them outside the plan
                del eng.steps[:]
            if not chat:
                break
        if save_session:
            extra = {"raw": raw, **({} if raw else {"think": think}), "messages": messages, "tokens": fed,
                     **({"unfed": eng.unfed} if eng.unfed else {})}
            if not sampler.greedy or (load_session and "sampler" in saved):  # a greedy conversation drew with no seed
                extra["sampler"] = sampler.state()
            size = session.save_session(eng, save_session, extra, locked=True)
            print(f"(saved {eng.offset} tokens of conversation to {save_session}, {size / 2**20:.2f} MiB)", file=sys.stderr)
        if interrupted:
            raise KeyboardInterrupt  # then the command ends as any Ctrl-C ends it (130, one line)
    finally:
        eng.close()
        if group is None:
            write_outputs([st.to_json() for st in eng.steps] if stats else [], stats, logits_out, logits)
    if group is not None:  # after a whole answer only: a collective after a failure would wait on a lost peer
        records = ranks.gather_steps(group, [st.to_json() for st in eng.steps] if stats else [])
        if group.rank() == 0:  # its file holds every rank's records
            write_outputs(records, stats, logits_out, logits)
    return status


def turn_ids(eng: Engine, user: str, fed: list[int], messages: list[dict], images: int, raw: bool,
             think: bool) -> tuple[list[int], dict | None]:
    """A turn's token ids (only the new turn once the conversation has begun: re-rendering the history would differ
    from what the cache holds, templates dropping past thinking, and a Gated DeltaNet state cannot be rewound to a
    common prefix), and the message it adds to the history (None with --raw). A text that cannot fit the context
    at any token length is refused before it is tokenized: the tokenizer's working set grows with the text."""
    least = eng.text.bound.at_least(user)
    if eng.offset + least > eng.opts.ctx:
        raise eng.too_long(least, at_least=True)
    if raw:
        return (eng.text.encode(user) if fed else eng.text.encode_prompt(user)), None
    msg = {"role": "user", "content": [{"type": "image"} for _ in range(images)] + [{"type": "text", "text": user}]
           if images else user}
    text = eng.text.chat_prompt([msg] if fed else messages + [msg], think=think)
    return eng.text.encode_chat(eng.text.turn_close() + text if fed else text), msg


def digest(data: bytes) -> str:
    """A short name for what two ranks compare (`ranks.same_work`), by the project's one hash (`formats.direct`)."""
    h = new_hash()
    h.update(data)
    return h.hexdigest()[:12]


def file_digest(path: Path) -> str:
    """`digest` of a file's bytes; "unreadable" where it cannot be read (the image's own check then says why)."""
    try:
        return digest(Path(path).read_bytes())
    except OSError:
        return "unreadable"


def cut_short(n: int, max_tokens: int, eng: Engine, constraint=None) -> str:
    """Why an answer held to --json-schema stopped before its JSON closed (what stdout holds does not parse)."""
    if n >= max_tokens:
        return f"the answer was cut by -n {max_tokens} before its JSON ended (give a larger -n)"
    if eng.offset >= eng.opts.ctx:
        return f"the answer was cut by the context (--ctx {eng.opts.ctx}) before its JSON ended"
    if constraint is not None and constraint.dead_end:
        return ("the answer's JSON reached a point where llguidance lets no token continue it (a constraint of the "
                "schema it cannot write every value of: a multipleOf of a fraction, a cycle of $refs)")
    return "the answer ended in its thinking, before its JSON began"


def read_line(prompt: str) -> str | None:
    """One line of stdin (None at its end). The prompt is shown only to a person at a terminal, and never into
    what stdout is redirected to (stdout holds the answers alone)."""
    shown = prompt if sys.stdin.isatty() else ""
    try:
        if shown and not sys.stdout.isatty():
            print(shown, end="", file=sys.stderr, flush=True)
            shown = ""
        return input(shown)
    except EOFError:
        return None
    except UnicodeDecodeError:
        raise fail("<stdin>", "the input is not valid UTF-8 text") from None


def utf8_turn(turn: str) -> bool:
    """Whether a chat's turn is UTF-8 text (stdin's undecodable bytes arrive as surrogates); one line says it is
    not, and the chat goes on."""
    try:
        turn.encode("utf-8")
        return True
    except UnicodeEncodeError:
        print("streamoe: error: <stdin>: the turn is not valid UTF-8 text (not sent; the chat goes on)",
              file=sys.stderr, flush=True)
        return False


CLEAR = "/clear"  # a chat's command: empty the conversation
COMMANDS = "/image PATH (attach an image to the next turn), /clear (empty the conversation), /help (this list), /quit"


def image_path(text: str) -> Path | None:
    """The file an `/image` line names, as a terminal's drag and drop writes it: quoted ('my pic.png'), with
    escaped spaces (my\\ pic.png) or bare (my pic.png); `~` is the home directory. None: no file named."""
    text = text.strip()
    if not text:
        return None
    try:
        words = shlex.split(text)
    except ValueError:  # an unclosed quote: the text as typed
        words = []
    return Path(os.path.expanduser(words[0] if len(words) == 1 else text))


def read_turn(eng: Engine, images: list, raw: bool, across: bool) -> str | None:
    """The chat's next turn from stdin (None: the chat ends); `/image PATH` lines attach images to it. A turn of
    several lines (pasted code) is written between two lines of three double quotes (ollama's form), or as lines
    that end in a backslash (llama.cpp's), which joins them with a newline. `/clear` (`CLEAR`) empties the
    conversation; an empty line is no turn."""
    while True:
        user = read_line("> ")
        if user is None:
            return None
        if user.strip() == '"""':
            lines = []
            while (line := read_line(". ")) is not None and line.strip() != '"""':
                lines.append(line)
            if utf8_turn(turn := "\n".join(lines)):
                return turn
            continue
        while user.endswith("\\") and (line := read_line(". ")) is not None:
            user = user[:-1] + "\n" + line
        if user.strip() in ("/quit", "/exit"):
            return None
        if user.strip() == CLEAR:
            return CLEAR
        if not user.strip():  # an empty line is no turn
            continue
        command = user.split()[0] if user.startswith("/") else ""
        if command not in ("", "/image") and re.fullmatch(r"/[A-Za-z]+", command):  # /help, or a mistyped command
            known = "" if command == "/help" else (f"unknown command {command} (not sent; a turn that starts with '/' "
                                                   "is sent with a space before it). ")
            print(f"({known}The commands: {COMMANDS})", file=sys.stderr, flush=True)
            continue
        if command != "/image":
            if utf8_turn(user):
                return user
            continue
        path = image_path(user[len("/image"):])
        if path is None:
            print("(/image needs a file: /image PATH)", file=sys.stderr, flush=True)
            continue
        try:  # a file that cannot be the image is said now, in one line, and the chat goes on
            if across:
                raise StreamoeError(f"{path}: across ranks a chat takes no /image (give --image with --prompt)")
            if raw:
                raise StreamoeError(f"{path}: an image needs the chat template; run the chat without --raw")
            if not eng.opts.images:
                raise StreamoeError(f"{path}: this model is text-only (no vision tower)")
            load_image(path, max_decode_pixels=eng.opts.max_decode_pixels)
        except StreamoeError as e:
            print(f"streamoe: error: {e} (not attached; the chat goes on)", file=sys.stderr, flush=True)
            continue
        images.append(path)
        print(f"(attached {path} to the next turn)", file=sys.stderr)


def write_outputs(records: list[dict], stats: Path | None, logits_out: Path | None, logits: list | None) -> None:
    """The telemetry and logits files, after the answer, each whole or not at all (`write_whole`): a full disk is
    one line naming the file, and an earlier file there stays as it was."""
    if stats:
        write_whole(stats, lambda f: f.writelines((json.dumps(r) + "\n").encode() for r in records), "telemetry")
    if logits_out is not None and logits:
        stacked = np.stack([np.array(lg) for lg in logits])
        write_whole(logits_out, lambda f: np.savez(f, logits=stacked), "logits")
