"""The `streamoe` command line: synth, convert, validate, plan, run, serve.

Results go to stdout, diagnostics to stderr. Every `StreamoeError` (a bad input) becomes one stderr line
and exit status 2; heavy imports happen inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import math
import os
import secrets
import signal
import sys
import threading
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import click

from .formats.config import FAMILIES
from .formats.errors import StreamoeError

if TYPE_CHECKING:
    from .runtime.plan import Options


def _line(text: str) -> str:
    """One stderr line: newlines folded, and undecodable argv bytes (surrogates) shown escaped, not crashing."""
    return " ".join(text.split()).encode("utf-8", "backslashreplace").decode("utf-8")


class Terminated(BaseException):
    """SIGTERM or SIGHUP, raised in the main thread: what a command had begun is undone as for Ctrl-C (temporaries
    removed, locks let go) before it exits 128 + the signal's number, as the signal's own exit would."""


def _terminated(signum, frame) -> None:
    raise Terminated(signum)


def _signal_not_lost(unraisable) -> None:
    """`sys.unraisablehook`: a signal's exception raised where Python drops exceptions (a weakref callback, such as
    the import system's, or a `__del__`) is delivered to the main thread again, from another thread a moment after
    this hook has returned (raised in the hook, it would be dropped too), instead of being printed and lost: the command ran
    on to its end, exit 0, as if never signalled. Dropped again, it comes back here and is sent again."""
    import _thread

    if isinstance(unraisable.exc_value, Terminated | KeyboardInterrupt):
        args = unraisable.exc_value.args[:1] if isinstance(unraisable.exc_value, Terminated) else ()
        later = threading.Timer(0.005, _thread.interrupt_main, args)  # after the hook: a thread begun at once runs
        later.daemon = True  # before `start` returns, and its signal is handled here again
        later.start()
    else:
        sys.__unraisablehook__(unraisable)


def user_errors(fn):
    """Turn every failure into one clear stderr line (no traceback) and keep library warnings off stderr.

    - `StreamoeError` (a bad input, its message names the file): exit 2.
    - `BrokenPipeError` (stdout's reader went away, `| head`): no line, exit 141 (128 + SIGPIPE), as a shell tool.
    - `OSError` that escaped a check (the OS refused a path): the same one line, naming the path, exit 2.
    - `RecursionError`, `MemoryError` (an input too deep or too large to hold): one line, exit 2.
    - anything else is a bug in streamoe: one line saying so, exit 70, and the traceback only when
      STREAMOE_TRACEBACK=1 — a hostile input must never dump a traceback, a bug must never pass silently.
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP):
                if signal.getsignal(sig) == signal.SIG_DFL:  # not one `nohup` set aside
                    signal.signal(sig, _terminated)
            sys.unraisablehook = _signal_not_lost
        if sys.stdin is None:  # started with stdin closed (`<&-`): an empty input, as /dev/null gives
            sys.stdin = open(os.devnull, encoding="utf-8")  # noqa: SIM115 (the process's stdin for its life)
        if sys.stdout is None:  # started with stdout closed (`>&-`): a result would be lost without a word
            click.echo("streamoe: error: stdout is closed, so the result has nowhere to go (redirect it: > FILE, "
                       "> /dev/null)", err=True)
            sys.exit(2)
        try:
            with warnings.catch_warnings():
                if not os.environ.get("STREAMOE_WARNINGS"):
                    warnings.simplefilter("ignore")  # Pillow EXIF, numpy overflow: not the user's business
                return fn(*args, **kwargs)
        except StreamoeError as e:
            click.echo(_line(f"streamoe: error: {e}"), err=True)
            sys.exit(2)
        except BrokenPipeError:  # stdout's reader left (`| head`): stop quietly, as a shell tool does
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
            sys.exit(141)
        except OSError as e:
            from .formats.files import os_fail

            click.echo(_line(f"streamoe: error: {os_fail('(unknown path)', e)}"), err=True)
            sys.exit(2)
        except RecursionError:
            click.echo("streamoe: error: an input is nested too deeply to read", err=True)
            sys.exit(2)
        except MemoryError:
            click.echo("streamoe: error: out of memory reading the input (a size in a file is too large?)", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("streamoe: interrupted", err=True)
            sys.exit(130)
        except Terminated as e:
            click.echo(f"streamoe: terminated ({signal.Signals(e.args[0]).name})", err=True)
            sys.exit(128 + e.args[0])
        except Exception as e:
            if os.environ.get("STREAMOE_TRACEBACK"):
                raise
            click.echo(_line(f"streamoe: internal error: {type(e).__name__}: {str(e)[:300]} (a bug in streamoe; "
                             "rerun with STREAMOE_TRACEBACK=1 and report the traceback)"), err=True)
            sys.exit(70)

    return wrapper


class Finite(click.FloatRange):
    """A float option that must be a finite number in range (click's FloatRange lets nan and inf through)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return v


class PrefillChunk(click.ParamType):
    """--prefill-chunk: `auto` (the plan's: as many tokens as fit beside the fixed accounts) or a token count."""

    name = "auto|tokens"

    def convert(self, value, param, ctx):
        if isinstance(value, int) or str(value).strip().lower() == "auto":
            return value if isinstance(value, int) else "auto"
        try:
            n = int(str(value).strip())
        except ValueError:
            self.fail(f"{value!r}: give auto or a number of tokens", param, ctx)
        if not 1 <= n <= 1 << 20:
            self.fail(f"{value!r} is not in the range 1 to {1 << 20}.", param, ctx)
        return n


PREFILL_CHUNK = click.option("--prefill-chunk", type=PrefillChunk(), default="auto", show_default=True,
                             help="Prompt tokens per chunk: each chunk reads a layer's experts once. auto: the largest "
                                  "that fits beside the fixed accounts with the hot tier keeping half its size; the "
                                  "logits are the same at every cap (kernels run over 256 tokens at a time). A number: "
                                  "chunks and kernel calls of that many tokens (other kernel shapes round otherwise: "
                                  "logits differ from auto's in their last bits).")


def expert_list(ctx, param, value: str | None) -> list[str] | None:
    """--experts for convert: a comma list of expert formats, not empty, no unknown names (None: the checkpoint's)."""
    from .formats.layout import FORMATS

    if value is None:
        return None
    names = [f.strip() for f in value.split(",")]
    if not value.strip() or any(n not in FORMATS for n in names):
        raise click.BadParameter(f"{value!r}: give q4, q3 or q4,q3 (affine exports), or mxfp4 (MXFP4 exports)")
    return list(dict.fromkeys(names))


def api_key_value(ctx, param, value: str | None) -> str | None:
    """--api-key (or STREAMOE_API_KEY): a key a client can send, visible ASCII without spaces. An empty one (an unset
    variable expanded) is refused, not taken as no key: that would serve without the key the user meant to set."""
    if value is None and os.environ.get("STREAMOE_API_KEY") == "":  # click reads an empty variable as unset
        value = ""
    if value is None:
        return None
    if not value:
        raise click.BadParameter("is empty (an unset variable?): give a key, or leave --api-key and "
                                 "STREAMOE_API_KEY out to serve without one")
    if not all("!" <= c <= "~" for c in value):
        raise click.BadParameter("holds a space, a control or a non-ASCII character, which no client sends in a "
                                 "header as given: use visible ASCII characters only")
    return value


class FilePath(click.Path):
    """A file or directory a command names: an empty one (an unset shell variable) is refused, where it would
    name the working directory."""

    def convert(self, value, param, ctx):
        if isinstance(value, str) and not value:
            self.fail("is empty (an unset variable?): give a path", param, ctx)
        return super().convert(value, param, ctx)


def expert_format(ctx, param, value: str | None) -> str | None:
    """--experts for plan/run/serve: one expert format's name (None: the one the converted directory has)."""
    from .formats.layout import FORMATS

    if value is not None and value not in FORMATS:
        raise click.BadParameter(f"{value!r} is not one of {', '.join(FORMATS)}")
    return value


def utf8_text(ctx, param, value: str | None) -> str | None:
    """Text options (prompt, system) must be valid UTF-8: undecodable argv bytes arrive as surrogates."""
    if value is not None:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise click.BadParameter("is not valid UTF-8 text") from None
    return value


class OneLineGroup(click.Group):
    """Usage errors (a bad option value, a missing argument) are one stderr line too, not click's usage block."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:  # the command is `streamoe` however it was started (`python -m streamoe`): in usage lines and hints
            return super().main(args, prog_name or "streamoe", complete_var, standalone_mode=False, **extra)
        except click.ClickException as e:
            if isinstance(e, getattr(click.exceptions, "NoArgsIsHelpError", ())):  # bare `streamoe`: the help, whole
                click.echo(e.format_message(), err=True)
                sys.exit(e.exit_code)
            cmd = e.ctx.command_path if getattr(e, "ctx", None) is not None else "streamoe"
            hint = f" (see {cmd} --help)" if isinstance(e, click.UsageError) else ""
            click.echo(_line(f"streamoe: error: {e.format_message()}{hint}"), err=True)
            sys.exit(e.exit_code)
        except OSError as e:  # --help or --version written to a stdout that refuses it (/dev/full, a closed pipe)
            from .formats.files import os_fail

            if isinstance(e, BrokenPipeError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
                sys.exit(141)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
            click.echo(_line(f"streamoe: error: {os_fail('stdout', e)}"), err=True)
            sys.exit(2)
        except click.exceptions.Abort:  # Ctrl-C outside a command's own handling (`user_errors`): the same exit
            click.echo("streamoe: interrupted", err=True)
            sys.exit(130)


@click.group(cls=OneLineGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="streamoe")
def main() -> None:
    """Run Mixture-of-Experts models larger than RAM inside a hard memory cap."""


@main.command()
@click.argument("out", type=FilePath(path_type=Path))
@click.option("--family", type=click.Choice(FAMILIES), default="qwen3_5_moe", show_default=True,
              help="The model family (model_type) whose mlx-community export to write: qwen3_5_moe Qwen3.6-35B-A3B, "
                   "qwen3_moe Qwen3-30B-A3B, gpt_oss gpt-oss-20b, mixtral Mixtral-8x7B-Instruct-v0.1, qwen3_next "
                   "Qwen3-Next-80B-A3B (text only but the first).")
@click.option("--size", type=click.Choice(["tiny", "small", "small-vocab", "full"]), default="tiny", show_default=True)
@click.option("--variant", default=None,
              help="An export variant of the family (default: its first): qwen3_5_moe qwen3.6 (8-bit routers, bf16 "
                   "A_log) or qwen3.5; qwen3_moe qwen3 (every module 4-bit) or qwen3-gate8 (8-bit routers); gpt_oss "
                   "mxfp4-q8 (MXFP4 experts, the rest 8-bit) or mxfp4-q4; mixtral mixtral (every module 4-bit); qwen3_next qwen3-next (8-bit routers and shared-expert gates).")
@click.option("--text-only", is_flag=True, help="Write an mlx-lm style text-only export (no vision tower).")
@click.option("--seed", type=click.IntRange(min=0, max=(1 << 63) - 1), default=0, show_default=True)
@click.option("--shard-mb", type=Finite(min=0.001, max=1 << 30), default=None, help="Shard cap in MiB (default: 5 GiB, as mlx-vlm).")
@click.option("--dry-run", is_flag=True, help="Print the tensor table and total; write nothing.")
@user_errors
def synth(out: Path, family: str, size: str, variant: str | None, text_only: bool, seed: int, shard_mb: float | None,
          dry_run: bool) -> None:
    """Write a synthetic checkpoint shaped exactly like an mlx-community export (Qwen3.6-35B-A3B-4bit; with
    --family, Qwen3-30B-A3B-4bit, gpt-oss-20b-MXFP4-Q8, Mixtral-8x7B-Instruct-v0.1-4bit or Qwen3-Next-80B-A3B-4bit)."""
    from .convert.synth import synth as run_synth

    run_synth(out, size=size, variant=variant, text_only=text_only, seed=seed, family=family,
              shard_bytes=None if shard_mb is None else int(shard_mb * (1 << 20)), dry_run=dry_run)
    if not dry_run:
        click.echo(str(out))  # what it wrote, as `convert` says it (a dry run's result is its table)


@main.command()
@click.argument("ckpt", type=FilePath(path_type=Path))
@click.argument("out", type=FilePath(path_type=Path))
@click.option("--experts", default=None, callback=expert_list,
              help="Expert formats to write: q4, q3 or q4,q3 (4-bit affine exports), mxfp4 (MXFP4 exports). "
                   "Default: the format the checkpoint holds (q4, or mxfp4).")
@click.option("--force", is_flag=True, help="Replace an earlier streamoe conversion in OUT (never other files).")
@user_errors
def convert(ckpt: Path, out: Path, experts: list[str], force: bool) -> None:
    """Convert an mlx-community MoE checkpoint CKPT into a streamoe directory OUT."""
    from .convert.convert import convert as run_convert

    run_convert(ckpt, out, formats=experts, force=force)
    click.echo(str(out))


@main.command()
@click.argument("out", type=FilePath(path_type=Path))
@click.option("--source", type=FilePath(path_type=Path), default=None,
              help="Also compare sampled experts and tensors byte for byte with this checkpoint.")
@click.option("--samples", type=click.IntRange(min=1, max=1 << 20), default=16, show_default=True, help="Experts sampled per layer with --source.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report.")
@user_errors
def validate(out: Path, source: Path | None, samples: int, as_json: bool) -> None:
    """Check a converted directory: schema, sizes, layouts, checksums (and bytes against --source)."""
    import json

    from .convert.validate import validate as run_validate

    if source is None and given("samples"):
        raise StreamoeError("--samples counts the experts compared with --source: give --source")
    report = run_validate(out, source=source, samples=samples)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for check in report["checks"]:
            click.echo(f"{'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['detail']}")
    if not report["ok"]:
        bad = next(c for c in report["checks"] if not c["ok"])
        raise StreamoeError(f"{bad['detail']}")


def plan_from_config(path: Path, opts: Options, rank: int = 0, ranks: int = 1, extra: tuple = ()):
    """A plan from a bare config.json, before any download or conversion (`opts.experts` None: the format its
    checkpoint holds, as `convert` writes it by default; `extra`: the caller's own accounts, as
    `Options.extra_accounts`)."""
    from .convert.source import read_json, source_expert_quant
    from .formats.config import ModelArgs, is_expert_tensor
    from .formats.dtypes import itemsize
    from .formats.export import tensor_table
    from .formats.layout import format_layout, source_layout
    from .formats.limits import check_config_sizes
    from .formats.safetensors import tensor_nbytes
    from .runtime.image import read_preprocessor
    from .runtime.plan import (
        GiB,
        default_dtype,
        kv_format,
        memories,
        native_context,
        plan_with_limits,
        read_ring,
        slot_bytes,
    )
    from .runtime.text import prompt_account
    from .runtime.vision import vision_account
    from .runtime.weights import resident_bytes

    split, host_bytes = memories(opts.host_cap_gib)
    config = read_json(path)
    check_config_sizes(config, path)
    args = ModelArgs.from_config(config, path)
    source_expert_quant(args, path)  # what convert would refuse, a plan refuses: its sizes would be another model's
    dtype = opts.dtype or default_dtype()
    if opts.images and not isinstance(config.get("vision_config"), dict):
        raise StreamoeError(f"{path}: the model has no vision tower (no vision_config); images are not supported")
    try:
        table = tensor_table(config)
        experts = opts.experts or args.expert_format
        lay = format_layout(experts, source_layout(args))
        nonexpert = resident_bytes(((name, dt, tensor_nbytes(dt, shape)) for name, dt, shape in table
                                    if not is_expert_tensor(name, args.model_type) and not name.startswith("vision_tower.")),
                                   itemsize(dtype))
        vision = (vision_account(config, opts.max_pixels, opts.max_decode_pixels, read_preprocessor(Path(path).parent))
                  if opts.images else 0)
        return plan_with_limits(native_context(config), args=args, cap=int(opts.cap_gib * GiB), ctx=opts.ctx,
                                expert_format=experts, stride=lay.stride, slot=slot_bytes(lay, dtype), expert_mode=lay.mode,
                                nonexpert_resident=nonexpert, dtype=dtype, kv_dtype=kv_format(opts),
                                runtime_bytes=opts.runtime_bytes, prefill_chunk=opts.prefill_chunk, rank=rank,
                                ranks=ranks, split=split, host_cap=host_bytes, vision_bytes=vision,
                                ring=read_ring(opts, args.num_experts_per_tok, args.num_experts),
                                extra=(*extra, *([prompt_account(opts.prompt, None, opts.ctx)] if opts.prompt else [])))
    except (KeyError, TypeError, ValueError, ZeroDivisionError, AttributeError) as e:
        raise StreamoeError(f"{path}: not a config this version can plan for ({type(e).__name__}: {str(e)[:80]})") from None
    except StreamoeError as e:
        raise StreamoeError(e.args[0] if str(path) in str(e) else f"{path}: {e}") from None


COMMON = [
    click.option("--cap", type=Finite(min=0, min_open=True, max=1 << 20), default=4.0, show_default=True,
                 help="Memory cap in GiB (a GPU with memory of its own, CUDA: the GPU's memory)."),
    click.option("--host-cap", type=Finite(min=0, min_open=True, max=1 << 20), default=None,
                 help="A GPU with memory of its own (CUDA): the cap on this process's host memory in GiB; what its "
                      "accounts leave holds expert records, so a GPU miss is copied over the bus, not read from disk. "
                      "Refused on unified memory (Metal, CPU), where --cap bounds all of it."),
    click.option("--ctx", type=click.IntRange(min=1, max=1 << 31), default=4096, show_default=True, help="Context length to plan for."),
    click.option("--experts", default=None, callback=expert_format,
                 help="Expert format to run: q4, q3 or mxfp4 (default: the one the converted directory has; q4 "
                      "where it has q4 and q3; `plan` of a bare config.json: the one its checkpoint holds)."),
    click.option("--kv", type=click.Choice(["auto", "float32", "bfloat16", "float16", "q8", "q4"]), default="auto",
                 show_default=True, help="KV cache format: a float dtype (auto: the compute dtype), or 8-/4-bit affine codes "
                                         "in groups of 64 (q8, q4), attention scored on the codes."),
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                 help="Compute dtype (default float32 on the CPU backend, bfloat16 on GPUs)."),
    click.option("--runtime-mib", type=click.IntRange(min=1, max=1 << 30), default=None,
                 help="Fix the interpreter/runtime allowance (default: measured at open) so plans are reproducible."),
]


# how the engine streams and what it plans for: `run` and `serve` take the same ones (defaults as runtime.plan.Options);
# those that size an account of the plan, `plan` takes too
PREFETCH_WIDTH = click.option("--prefetch-width", type=click.IntRange(min=0, max=1 << 14), default=None,
                              help="Cross-layer guesses per layer (default: the model's top-k); 0 = off. Sizes the read "
                                   "staging.")
IO_THREADS = click.option("--io-threads", type=click.IntRange(min=1, max=256), default=8, show_default=True,
                          help="Expert reads in flight. Sizes the read staging.")
MAX_PIXELS = click.option("--max-pixels", type=click.IntRange(min=1024, max=1 << 28), default=640 * 640, show_default=True,
                          help="Largest image after resizing, in pixels (the vision account is planned for it).")
ENGINE = [
    click.option("--tier", type=click.Choice(["freq", "lru"]), default="freq", show_default=True, help="Hot-tier admission policy."),
    PREFETCH_WIDTH,
    click.option("--prefetch-waste", type=Finite(min=0, max=1), default=0.05, show_default=True,
                 help="Share of the bytes read in decode that wrong guesses may cost: more guesses fill a disk that "
                      "idles between layers (0 = only guesses that are nearly always right)."),
    PREFILL_CHUNK,
    IO_THREADS,
    MAX_PIXELS,
]

# what `serve` adds to the plan besides the engine's: `serve` and `plan --serve` take the same ones
SERVE_PLAN = [
    click.option("--no-images", is_flag=True, help="Refuse image inputs and plan no vision account (a text-only model "
                                                   "always does)."),
    click.option("--prompt-cache-mib", type=Finite(min=0, max=1 << 20), default=256, show_default=True,
                 help="Plan account for snapshots of repeated conversations (LRU); 0 = no prompt cache."),
    click.option("--response-store-mib", type=Finite(min=0, max=1 << 20), default=32, show_default=True,
                 help="Plan account for the Responses API's stored responses, which clients continue by "
                      "previous_response_id or item_reference (LRU); 0 = stateless: store true refused."),
    click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
                 help="Requests that may wait behind the running one; more are answered 503."),
    click.option("--max-body-mib", type=Finite(min=0.01, max=1024), default=4, show_default=True, help="Largest request body."),
    click.option("--max-answer-mib", type=Finite(min=0.01, max=1 << 20), default=8, show_default=True,
                 help="What one answer may hold on the server for its client: a stream's unsent part (a slower "
                      "client's stream ends with an error), a whole answer (a larger one is a 400: stream it)."),
    click.option("--max-connections", type=click.IntRange(min=1), default=512, show_default=True,
                 help="Connections held at once (within the open-file limit); at the bound, the oldest idle one is closed."),
]
SERVE_PLAN_KEYS = ("no_images", "prompt_cache_mib", "response_store_mib", "max_queue", "max_body_mib", "max_answer_mib",
                   "max_connections")


# how tokens are chosen: `run` samples its answer with them, `serve` uses them for requests that set none; each
# one left unset comes from the checkpoint's generation_config.json (runtime.text.generation_defaults)
SAMPLING = [
    click.option("--temp", type=Finite(min=0, max=1e6), default=None,
                 help="Sampling temperature; 0 = greedy. Default: the checkpoint's generation_config.json (greedy without one)."),
    click.option("--top-p", type=Finite(min=0, max=1, min_open=True), default=None, help="Nucleus mass (default: generation_config.json)."),
    click.option("--top-k", type=click.IntRange(min=0, max=1 << 31), default=None, help="0 = off (default: generation_config.json)."),
    click.option("--min-p", type=Finite(min=0, max=1), default=None,
                 help="Drop tokens less likely than this times the likeliest (default: generation_config.json, else 0)."),
    click.option("--presence-penalty", type=Finite(min=-2, max=2), default=None,
                 help="Taken off the logit of every token already in the answer (OpenAI's; Qwen suggests 0-2)."),
    click.option("--frequency-penalty", type=Finite(min=-2, max=2), default=None,
                 help="Taken off a token's logit once per time it is already in the answer (OpenAI's)."),
    click.option("--repetition-penalty", type=Finite(min=0, max=10, min_open=True), default=None,
                 help="Divides a positive logit (multiplies a negative one) of every token in the prompt or answer "
                      "(transformers'; 1 = off)."),
]
SAMPLING_KEYS = ("temp", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_options(fn):
    """The SAMPLING options, handed to the command as one `sampling` dict of the ones given."""

    @functools.wraps(fn)
    def wrapper(*args, **kw):
        given = {k: kw.pop(k) for k in SAMPLING_KEYS}
        return fn(*args, sampling={k: v for k, v in given.items() if v is not None}, **kw)

    for opt in reversed(SAMPLING):
        wrapper = opt(wrapper)
    return wrapper


def common(fn):
    for opt in reversed(COMMON):
        fn = opt(fn)
    return fn


def engine_options(fn):
    for opt in reversed(ENGINE):
        fn = opt(fn)
    return fn


def serve_plan_options(fn):
    for opt in reversed(SERVE_PLAN):
        fn = opt(fn)
    return fn


def serve_sizes(prompt_cache_mib: float, response_store_mib: float, max_queue: int, max_body_mib: float,
                max_answer_mib: float, max_connections: int) -> dict:
    """The `ServeOptions` fields the plan's serve accounts are sized from, from the SERVE_PLAN options: `serve` and
    `plan --serve` make them by this one function, so both plan the same accounts."""
    from .runtime.serve.openai_api import Limits

    limits = Limits(max_body=int(max_body_mib * (1 << 20)), max_answer=int(max_answer_mib * (1 << 20)))
    return {"limits": limits, "max_queue": max_queue,
            "prompt_cache_bytes": int(prompt_cache_mib * (1 << 20)),
            "response_store_bytes": int(response_store_mib * (1 << 20)), "max_connections": max_connections}


def prompt_options(purpose: str):
    """`--prompt` and `--prompt-file`, as `run` reads them (and `plan` sizes them): `purpose` ends --prompt's help."""
    def add(f):
        f = click.option("--prompt-file", "-f", type=FilePath(path_type=Path), default=None,
                         help="Read the prompt from this UTF-8 file (a prompt too long for a command line), or a "
                              "pipe: -f <(git diff).")(f)
        return click.option("--prompt", "-p", default=None, callback=utf8_text,
                            help=f"One prompt; {purpose}. '-' reads it from stdin.")(f)
    return add


@main.command()
@click.argument("model", type=FilePath(path_type=Path))
@common
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes per account).")
@click.option("--images", is_flag=True, help="Include the vision account (runs with --image or --chat).")
@click.option("--serve", "serving", is_flag=True,
              help="Plan `serve`: its prompt cache and requests accounts, and images where MODEL has a vision tower "
                   "(serve plans them unless --no-images); the serve options below size them as they do for serve.")
@PREFILL_CHUNK
@PREFETCH_WIDTH
@IO_THREADS
@MAX_PIXELS
@serve_plan_options
@click.option("--ranks", type=click.IntRange(min=1, max=1 << 10), default=1, show_default=True,
              help="Plan each rank of an expert-parallel group of this many hosts (mlx.launch; --cap is per host).")
@prompt_options("the plan holds what tokenizing it takes, as the run given it does")
@user_errors
def plan(model: Path, cap: float, host_cap: float | None, ctx: int, experts: str, kv: str,
         dtype: str | None, runtime_mib: int | None, as_json: bool, images: bool, serving: bool, prefill_chunk: int | str,
         prefetch_width: int | None, io_threads: int, max_pixels: int, no_images: bool, prompt_cache_mib: float,
         response_store_mib: float, max_queue: int, max_body_mib: float, max_answer_mib: float, max_connections: int,
         ranks: int, prompt: str | None, prompt_file: Path | None) -> None:
    """Print the memory plan for MODEL (a converted directory, or a bare config.json) and exit. Given the options a
    `run` or `serve` is given (those that size an account), it is the plan that one opens with.

    Exit status 0 when it fits, 2 when it does not (the smallest cap that fits is printed)."""
    from .runtime.plan import default_dtype, plan_for

    if not serving and (serve_only := [k for k in SERVE_PLAN_KEYS if given(k)]):
        raise StreamoeError(f"--{serve_only[0].replace('_', '-')} sizes what `serve` plans: add --serve")
    if images and no_images:
        raise StreamoeError("give --images or --no-images, not both")
    dtype = dtype or default_dtype()
    bare = model.is_file() and model.suffix == ".json"
    if serving and not no_images and not bare:
        images = images or has_vision(model)
    if given("max_pixels") and not images:
        why = "--no-images" if no_images else "a text-only model" if serving and not bare else "add --images"
        raise StreamoeError(f"--max-pixels sizes the vision account, and this plan has none ({why})")
    opts = options_of(cap, ctx, experts, kv, dtype, "freq", prefetch_width, 0.05, prefill_chunk, io_threads, False, images,
                      max_pixels, runtime_mib, host_cap)
    if (prompt is not None or prompt_file is not None) and serving:
        raise StreamoeError("--prompt and --prompt-file size what `run` plans for its prompt; `serve` plans its requests")
    opts = dataclasses.replace(opts, prompt=read_prompt(prompt, prompt_file) or None)
    plans = []
    for rank in range(ranks):
        extra: tuple = ()
        if serving:
            import uvicorn  # noqa: F401  (imported as serve imports them before it opens: the runtime account measures them)

            from .runtime.serve import server  # noqa: F401
            from .runtime.serve.worker import ServeOptions, serve_accounts

            so = ServeOptions(model_name="", **serve_sizes(prompt_cache_mib, response_store_mib, max_queue, max_body_mib,
                                                           max_answer_mib, max_connections))
            extra = serve_accounts(model.parent if bare else model, ctx, so, rank, ranks)
        else:
            from .runtime import cli_run  # noqa: F401  (imported as run imports it before it opens: likewise)
        if bare:
            plans.append(plan_from_config(model, opts, rank, ranks, extra))
        else:
            plans.append(plan_for(model, dataclasses.replace(opts, rank=rank, ranks=ranks, extra_accounts=extra)))
    if as_json:
        import json

        click.echo(json.dumps(plans[0].to_json() if ranks == 1 else [p.to_json() for p in plans], indent=2))
    else:
        click.echo("\n".join(p.render() for p in plans))
    for p in plans:
        p.require_fit()


@main.command()
@click.argument("model", type=FilePath(path_type=Path))
@common
@engine_options
@prompt_options("answered, then exit")
@click.option("--chat", is_flag=True, help="Multi-turn REPL keeping the cache between turns; '/image PATH' attaches an image.")
@click.option("--json-schema", default=None, metavar="SCHEMA|FILE",
              help="Constrain each answer (after its thinking) to JSON valid against this schema, given inline or as a "
                   "file or pipe holding it ('{}': any JSON object), by llguidance. stdout holds the JSON alone (the "
                   "thinking goes to stderr). An answer cut before its JSON ends (by -n or the context) is printed as "
                   "far as it got, one line says so, and the exit status is 1.")
@click.option("--image", "images", multiple=True, type=FilePath(path_type=Path),
              help="An image for the prompt (repeatable): a PNG, JPEG, WebP or still GIF file, or a pipe (--image <(curl -s URL), "
                   "--image - for stdin; read whole, at most 64 MiB, its bytes planned in the cap).")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--system", default=None, callback=utf8_text, help="System message for the chat template.")
@click.option("--no-think", is_flag=True, help="Render the template with thinking off (refused where it has none to turn off: Mixtral, gpt-oss).")
@click.option("--thinking-budget", type=click.IntRange(min=0, max=1 << 31), default=None, metavar="N",
              help="End each answer's thinking after N tokens: the template's </think> is then written for the model "
                   "and the answer goes on (Anthropic's thinking.budget_tokens). Needs the template's thinking on.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1, max=1 << 31), default=256, show_default=True,
              help="Tokens an answer may take at most (each turn's, with --chat); the context may end it sooner.")
@sampling_options
@click.option("--seed", type=click.IntRange(min=0, max=(1 << 63) - 1), default=None,
              help="Seed of the sampled tokens (default: a new one each run, shown in the summary line): the same seed "
                   "and inputs give the same tokens, at every cap.")
@click.option("--stats", type=FilePath(path_type=Path), default=None, help="Write per-step telemetry as JSON lines (a file, or a pipe: --stats >(jq -c .), /dev/stderr).")
@click.option("--logits-out", type=FilePath(path_type=Path), default=None, help="Save every step's logits (.npz).")
@click.option("--verify", is_flag=True, help="Check every file's checksum before running.")
@click.option("--quiet", "-q", is_flag=True, help="No summary line.")
@click.option("--save-session", type=FilePath(path_type=Path), default=None,
              help="At the end, save the conversation (caches, history) to this file (zstd).")
@click.option("--load-session", type=FilePath(path_type=Path), default=None,
              help="Continue a saved conversation: the prompt (or chat) is its next turn.")
@user_errors
def run(model: Path, cap: float, host_cap: float | None, ctx: int, experts: str, kv: str, dtype: str | None,
        runtime_mib: int | None,
        prompt: str | None, prompt_file: Path | None, chat: bool, json_schema: str | None,
        images: tuple[Path, ...], max_pixels: int, raw: bool, system: str | None, no_think: bool, thinking_budget: int | None,
        max_tokens: int, sampling: dict, seed: int | None,
        tier: str, prefetch_width: int | None, prefetch_waste: float, prefill_chunk: int | str, io_threads: int, stats: Path | None, logits_out: Path | None,
        verify: bool, quiet: bool, save_session: Path | None, load_session: Path | None) -> None:
    """Answer a prompt (or chat) with MODEL, a converted directory, inside --cap GiB."""
    from .runtime.cli_run import run_cli
    from .runtime.image import PipedImage, read_image_source
    from .runtime.ranks import find_group
    from .runtime.sampling import Sampler

    if any(not str(p).strip() or str(p) == "." for p in images):  # blank, or the working directory
        raise StreamoeError("--image needs an image file, not an empty path or '.'")
    images = tuple(Path("/dev/stdin") if str(p) == "-" else p for p in images)  # `--image -`: stdin, as `-p -`
    stdin_read_by = ("--chat" if chat else "-p -" if prompt == "-" else
                     "--prompt-file" if prompt_file is not None and is_stdin(prompt_file) else None)
    if prompt == "-" and chat:
        raise StreamoeError("--chat reads its turns from stdin, so '-p -' cannot read a prompt from it")
    if stdin_read_by and any(is_stdin(p) for p in images):
        raise StreamoeError(f"--image and {stdin_read_by} both read stdin: give one of them another file or pipe")
    group = find_group()
    whole_stdin = [flag for flag, reads in ((stdin_read_by, stdin_read_by in ("-p -", "--prompt-file")),
                                           ("--image -", any(is_stdin(p) for p in images)),
                                           ("--json-schema", bool(json_schema) and not json_schema.lstrip().startswith(
                                               ("{", "[")) and is_stdin(Path(json_schema)))) if reads]
    if group is not None and whole_stdin:  # mlx.launch never ends the ranks' stdin
        if group.rank() != 0:
            sys.exit(2)
        raise StreamoeError(f"across ranks (mlx.launch) {whole_stdin[0]} would wait for ever: stdin never ends there; "
                            "give a file (-p TEXT for a prompt)")
    source = prompt_file or ("stdin" if prompt == "-" else "--prompt")
    prompt = read_prompt(prompt, prompt_file)
    if raw and prompt == "":  # no template around it: nothing to answer
        raise StreamoeError(f"{source}: the prompt is empty, and --raw feeds it as it is: give some text")
    schema = read_schema(json_schema) if json_schema is not None else None
    if prompt is None and not chat:
        raise StreamoeError("give --prompt TEXT, --prompt-file PATH or --chat")
    if images and raw:
        raise StreamoeError("--image needs the chat template; drop --raw")
    if system is not None and raw:
        raise StreamoeError("--system needs the chat template; drop --raw")
    if no_think and raw:
        raise StreamoeError("--no-think renders the chat template, which --raw leaves out: give one of them")
    if prefetch_width == 0 and given("prefetch_waste"):
        raise StreamoeError("--prefetch-waste bounds the guesses that --prefetch-width 0 turns off: give one of them")
    if thinking_budget is not None and (raw or no_think):
        raise StreamoeError(f"--thinking-budget bounds the thinking the chat template opens; drop {'--raw' if raw else '--no-think'}")
    if load_session and system is not None:
        raise StreamoeError("a loaded session keeps its own system message; drop --system")
    check_run_paths(model, stats, logits_out, save_session, load_session,
                    ((prompt_file, "prompt file (--prompt-file)"), *((p, "image (--image)") for p in images),
                     *(((Path(json_schema), "schema file (--json-schema)"),) if json_schema and os.path.isfile(json_schema) else ())))
    given_sampling, sampling = sampling, {**(generation_defaults_of(model)), **sampling}
    if seed is None:  # as mlx-lm and llama.cpp: each sampled run its own draws; a greedy one draws nothing
        seed = 0 if Sampler(**sampling).greedy else secrets.randbits(63)
    sampling["seed"] = seed
    drawn = None if quiet or Sampler(**sampling).greedy else sampling_line(sampling, given_sampling)
    # a text-only model's chat is text, and so is a chat across ranks (no /image there)
    vision = bool(images) or (chat and not raw and group is None and has_vision(model))
    if given("max_pixels") and not vision:
        raise StreamoeError("--max-pixels sizes the vision account, and this run plans none (no --image"
                            f"{'' if raw or not chat else ': the model has no vision tower'})")
    opts = options_of(cap, ctx, experts, kv, dtype, tier, prefetch_width, prefetch_waste, prefill_chunk, io_threads, verify,
                      vision, max_pixels, runtime_mib, host_cap)
    if prompt:
        opts = dataclasses.replace(opts, prompt=prompt)
    sources = [read_image_source(p) for p in images]
    piped = sum(len(s.data) for s in sources if isinstance(s, PipedImage))
    if piped:
        opts = dataclasses.replace(opts, extra_accounts=(("piped images", piped, "the --image bytes read from pipes, "
                                                                                 "held until encoded"),))
    if hasattr(sys.stdout, "reconfigure") and codecs.lookup(sys.stdout.encoding or "utf-8").name != "utf-8":
        sys.stdout.reconfigure(errors="backslashreplace")  # PYTHONIOENCODING=ascii, a Latin-1 locale
        if not quiet:
            click.echo(f"streamoe: stdout is {sys.stdout.encoding}: characters it cannot hold are written as "
                       "backslash escapes (PYTHONIOENCODING=utf-8 writes them)", err=True)
    status = run_cli(model, opts, prompt=prompt, images=sources, chat=chat, raw=raw, system=system,
                     think=not no_think, max_tokens=max_tokens, sampling=sampling, stats=stats, logits_out=logits_out,
                     quiet=quiet, save_session=save_session, load_session=load_session, json_schema=schema,
                     thinking_budget=thinking_budget, seed_given=given("seed"), drawn=drawn)
    if status:
        sys.exit(status)


def options_of(cap: float, ctx: int, experts: str, kv: str, dtype: str | None, tier: str, prefetch_width: int,
                   prefetch_waste: float, prefill_chunk: int | str, io_threads: int, verify: bool, images: bool,
                   max_pixels: int | None, runtime_mib: int | None, host_cap: float | None = None) -> Options:
    """The engine's `Options` from the flags `run` and `serve` share: one typed path for both."""
    from .runtime.plan import Options

    return Options(cap_gib=cap, ctx=ctx, experts=experts, kv=kv, dtype=dtype, tier=tier, prefetch_width=prefetch_width,
                   prefetch_waste=prefetch_waste, prefill_chunk=prefill_chunk, io_threads=io_threads, verify=verify,
                   images=images, max_pixels=max_pixels, runtime_bytes=runtime_mib and runtime_mib << 20,
                   host_cap_gib=host_cap)


def is_stdin(path: Path) -> bool:
    """Whether `path` is this process's standard input (`/dev/stdin`, `/dev/fd/0`, or the file it was redirected from)."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(0))
    except OSError:
        return False


def has_vision(model: Path) -> bool:
    """Whether a converted directory has a vision tower (a bad directory answers False: opening it fails in its
    own words)."""
    from .formats.errors import StreamoeError
    from .formats.manifest import load_manifest

    try:
        return load_manifest(model).blob("vision") is not None
    except StreamoeError:
        return False


def sampling_line(sampling: dict, given: dict, hint: str = "--temp 0 for greedy") -> str:
    """How a sampled run draws, once on stderr as llama.cpp says it: the settings in force, and which of them came
    from the checkpoint's generation_config.json rather than a flag."""
    names = {"temp": "temperature", "top_p": "top-p", "top_k": "top-k", "min_p": "min-p",
             "presence_penalty": "presence penalty", "frequency_penalty": "frequency penalty",
             "repetition_penalty": "repetition penalty"}
    off = {"top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
           "repetition_penalty": 1.0}
    shown = [f"{names[k]} {sampling[k]:g}" for k in names if k in sampling and sampling[k] != off.get(k)]
    config = [names[k] for k in names if k in sampling and k not in given and sampling[k] != off.get(k)]
    source = f" ({', '.join(config)} from generation_config.json)" if config else ""
    return f"sampling: {', '.join(shown)}{source}; {hint}"


def generation_defaults_of(model: Path) -> dict:
    """What the command line leaves unset comes from the checkpoint's generation_config.json, as a server
    request's does; --temp 0 is greedy whatever the checkpoint says."""
    from .runtime.text import GREEDY, generation_defaults

    return generation_defaults(model) if model.is_dir() else dict(GREEDY)


PROMPT_FILE_MAX = 64 << 20  # bytes: far more text than any context holds


def given(option: str) -> bool:
    """Whether the command line (or its environment) set this option of the running command, not its default."""
    return click.get_current_context().get_parameter_source(option) is not click.core.ParameterSource.DEFAULT


def read_prompt(prompt: str | None, prompt_file: Path | None) -> str | None:
    """The prompt: --prompt's text, stdin where it is '-' (as mlx-lm's generate reads it), or --prompt-file's (as
    llama.cpp's -f reads it); UTF-8, at most `PROMPT_FILE_MAX` bytes."""
    from .formats.errors import fail
    from .formats.files import read_text

    if prompt is not None and prompt_file is not None:
        raise StreamoeError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        return read_text(prompt_file, "prompt file", PROMPT_FILE_MAX, named=True)
    if prompt != "-":
        return prompt
    raw = sys.stdin.buffer.read(PROMPT_FILE_MAX + 1)
    if len(raw) > PROMPT_FILE_MAX:
        raise fail("stdin", f"a prompt of more than {PROMPT_FILE_MAX >> 20} MiB")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail("stdin", f"is not UTF-8 text (byte {e.start})") from None


def read_schema(value: str) -> dict:
    """--json-schema's schema: the value itself where it is JSON (it starts with `{` or `[`), else the JSON file it
    names; it must be an object. `{}` asks for any JSON object."""
    from .formats.errors import fail
    from .formats.files import parse_json, read_json

    if not value.lstrip().startswith(("{", "[")):
        return read_json(value, "JSON schema file (--json-schema)", named=True) or {"type": "object"}
    schema = parse_json("--json-schema", value)
    if not isinstance(schema, dict):
        raise fail("--json-schema", f"is not a JSON object ({type(schema).__name__} at the top level)")
    return schema or {"type": "object"}


def check_run_paths(model: Path, stats: Path | None, logits_out: Path | None, save_session: Path | None,
                    load_session: Path | None, inputs: tuple[tuple[Path, str], ...] = ()) -> None:
    """Before the model opens: every output can be written (so the answer is never lost at the end), no output is
    another output, one of the run's inputs (`inputs`: (path, what it is)) or a file of the model, and the session
    to load is a regular file (a FIFO would block the open). A session saved where it was loaded from is the one
    overwrite asked for."""
    from .formats.errors import fail
    from .formats.files import check_input_file, check_output_file

    outputs = [(path, flag, what) for path, flag, what in ((stats, "--stats", "telemetry file"),
                                                           (logits_out, "--logits-out", "logits file"),
                                                           (save_session, "--save-session", "session file"))
               if path is not None]
    for path, flag, what in outputs:
        check_output_file(path, f"{what} ({flag})", stream=flag != "--save-session")
    if load_session is not None:
        check_input_file(load_session, "session file")
    taken: dict[Path, str] = {}
    root = model.resolve()
    for path, flag, _ in outputs:
        real = path.resolve()
        if real in taken:
            raise fail(path, f"is given as both {taken[real]} and {flag}: each output needs a file of its own")
        taken[real] = flag
        if real.is_relative_to(root):
            raise fail(path, f"is inside the model directory {model}: {flag} would change the model")
        read = [*inputs, *(((load_session, "session loaded (--load-session)"),) if flag != "--save-session" else ())]
        for given, what in read:
            if given is not None and given.resolve() == real:
                raise fail(path, f"is the {what}: {flag} would overwrite it")


@main.command()
@click.argument("model", type=FilePath(path_type=Path))
@common
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback is reachable "
              "from other machines (give them --api-key).")
@click.option("--api-key", envvar="STREAMOE_API_KEY", default=None, metavar="KEY", callback=api_key_value,
              help="Every /v1/ route, /metrics, /tokenize and /detokenize need this key (Authorization: Bearer KEY, or "
                   "x-api-key: KEY); the chat "
                   "page asks for it. Also read from STREAMOE_API_KEY, which keeps it out of the process list.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True)
@click.option("--model-name", default=None, help="The model id clients see (default: MODEL's directory name).")
@click.option("--served-model-name", "aliases", multiple=True, metavar="NAME",
              help="Another name a request's `model` may give (repeatable; vLLM's flag): a client that asks for a "
                   "model of its own (Claude Code: claude-sonnet-4-5, claude-haiku-4-5) is answered by this one. "
                   "Any other name is refused with 404; /v1/models lists them all.")
@serve_plan_options
@click.option("--think/--no-think", default=None,
              help="Thinking on or off where a request does not say (chat_template_kwargs.enable_thinking, "
                   "reasoning_effort, reasoning.effort, Anthropic's thinking). Neither given: on, except on the "
                   "Anthropic Messages API, where a request without `thinking` does not think (as Anthropic's API); "
                   "given, it holds there too.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=None,
              help="Answer length when a request sets none (default: what the planned context holds).")
@sampling_options
@click.option("--verify", is_flag=True, help="Check every file's checksum before serving.")
@click.option("--max-image-mib", type=Finite(min=0.01, max=1024), default=3, show_default=True, help="Largest image (decoded bytes).")
@click.option("--max-images", type=click.IntRange(min=0), default=4, show_default=True, help="Images per request.")
@click.option("--allow-host", multiple=True, metavar="NAME", help="Another name clients reach this server by (the Host "
              "header); loopback names and the bound address always work; '*' allows any. Repeatable.")
@click.option("--cors-origin", multiple=True, metavar="ORIGIN", help="An origin (https://app.example) whose pages may call "
              "the API; other cross-origin requests are refused with 403. Repeatable; '*' allows any.")
@click.option("--head-timeout", type=Finite(min=0.1, max=86400), default=10, show_default=True,
              help="Seconds a connection may take to send a request's head.")
@click.option("--body-timeout", type=Finite(min=0.1, max=86400), default=30, show_default=True,
              help="Seconds a request may take to send its body.")
@click.option("--idle-timeout", type=Finite(min=1, max=86400), default=5, show_default=True,
              help="Seconds an idle keep-alive connection stays open.")
@click.option("--send-timeout", type=Finite(min=0.1, max=86400), default=30, show_default=True,
              help="Seconds a client may leave its answer unread (the connection's buffer full) before it is dropped.")
@click.option("--sse-keepalive", type=Finite(min=0.1, max=86400), default=5, show_default=True,
              help="Seconds between keep-alive comments while a streamed request waits or prefills.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@user_errors
def serve(model: Path, cap: float, host_cap: float | None, ctx: int, experts: str, kv: str, dtype: str | None,
          runtime_mib: int | None, host: str, api_key: str | None,
          port: int, model_name: str | None, aliases: tuple[str, ...], no_images: bool, max_pixels: int, think: bool | None,
          max_tokens: int | None,
          sampling: dict, tier: str, prefetch_width: int | None,
          prefetch_waste: float, prefill_chunk: int | str, io_threads: int, verify: bool, prompt_cache_mib: float, response_store_mib: float, max_queue: int, max_body_mib: float,
          max_answer_mib: float, max_image_mib: float, max_images: int, allow_host: tuple[str, ...], cors_origin: tuple[str, ...],
          max_connections: int, head_timeout: float, body_timeout: float, idle_timeout: float, send_timeout: float,
          sse_keepalive: float, log_level: str) -> None:
    """Serve MODEL (a converted directory) inside --cap GiB: an OpenAI-compatible API under /v1 and a chat page at /."""
    from .runtime.serve.server import serve as run_server
    from .runtime.serve.worker import ServeOptions

    vision = has_vision(model)  # a text-only model serves text, no flag needed
    images = vision and not no_images
    off = "" if images else "was started with --no-images" if vision else "serves a text-only model (no vision tower)"
    if given("max_pixels") and not images:
        raise StreamoeError("--max-pixels sizes the vision account, and this server plans none "
                            f"({'--no-images' if vision else 'a text-only model'})")
    sizes = serve_sizes(prompt_cache_mib, response_store_mib, max_queue, max_body_mib, max_answer_mib, max_connections)
    limits = dataclasses.replace(sizes.pop("limits"), max_image_bytes=int(max_image_mib * (1 << 20)),
                                 max_images=max_images if images else 0, images_off=off)
    if any(not a.strip() for a in aliases):
        raise StreamoeError("--served-model-name: a name must not be empty")
    so = ServeOptions(model_name=model_name or model.resolve().name, aliases=aliases, limits=limits, **sizes,
                      max_tokens=max_tokens, sampling=sampling, think=think, allow_hosts=allow_host,
                      cors_origins=cors_origin, api_key=api_key, head_timeout_s=head_timeout,
                      body_timeout_s=body_timeout, idle_timeout_s=idle_timeout, send_timeout_s=send_timeout,
                      keepalive_s=sse_keepalive)
    opts = options_of(cap, ctx, experts, kv, dtype, tier, prefetch_width, prefetch_waste, prefill_chunk, io_threads,
                          verify, images, max_pixels, runtime_mib, host_cap)
    from .runtime.sampling import Sampler

    # what a request that sets no sampling field gets, as vLLM logs the generation config's defaults it took
    drawn = {**generation_defaults_of(model), **sampling}
    note = (sampling_line(drawn, sampling, "where a request sets none") if not Sampler(**drawn).greedy
            else "sampling: greedy where a request sets none")
    run_server(model, opts, so, host, port, log_level, note)  # the note after the plan: a model that opens


if __name__ == "__main__":
    main()
