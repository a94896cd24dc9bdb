"""The `streamoe` command line: synth, convert, validate, plan, run, serve.

Results go to stdout, diagnostics to stderr. Every `StreamoeError` (a bad input) becomes one stderr line
and exit status 2; heavy imports happen inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from .formats.errors import StreamoeError


def user_errors(fn):
    """Turn StreamoeError into one clear line and exit 2 (SPEC §7)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except StreamoeError as e:
            click.echo(f"streamoe: error: {e}", err=True)
            sys.exit(2)
        except KeyboardInterrupt:
            click.echo("streamoe: interrupted", err=True)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="streamoe")
def main() -> None:
    """Run Mixture-of-Experts models larger than RAM inside a hard memory cap."""


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--size", type=click.Choice(["tiny", "small", "full"]), default="tiny", show_default=True)
@click.option("--variant", type=click.Choice(["qwen3.6", "qwen3.5"]), default="qwen3.6", show_default=True,
              help="qwen3.6: 8-bit routers, bf16 A_log; qwen3.5: 4-bit routers, f32 A_log.")
@click.option("--text-only", is_flag=True, help="Write an mlx-lm style text-only export (no vision tower).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--shard-mb", type=float, default=None, help="Shard cap in MiB (default: 5 GiB, as mlx-vlm).")
@click.option("--dry-run", is_flag=True, help="Print the tensor table and total; write nothing.")
@user_errors
def synth(out: Path, size: str, variant: str, text_only: bool, seed: int, shard_mb: float | None, dry_run: bool) -> None:
    """Write a synthetic checkpoint shaped exactly like the mlx-community Qwen3.6-35B-A3B-4bit export."""
    from .convert.synth import synth as run_synth

    run_synth(out, size=size, variant=variant, text_only=text_only, seed=seed,
              shard_bytes=None if shard_mb is None else int(shard_mb * (1 << 20)), dry_run=dry_run)


@main.command()
@click.argument("ckpt", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--experts", default="q4", show_default=True, help="Expert formats to write: q4, q3 or q4,q3.")
@click.option("--force", is_flag=True, help="Replace an existing converted directory.")
@user_errors
def convert(ckpt: Path, out: Path, experts: str, force: bool) -> None:
    """Convert an mlx-community MoE checkpoint CKPT into a streamoe directory OUT."""
    from .convert.convert import convert as run_convert

    formats = [f.strip() for f in experts.split(",") if f.strip()]
    run_convert(ckpt, out, formats=formats, force=force)
    click.echo(str(out))


@main.command()
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--source", type=click.Path(path_type=Path), default=None,
              help="Also compare sampled experts and tensors byte for byte with this checkpoint.")
@click.option("--samples", type=int, default=16, show_default=True, help="Experts sampled per layer with --source.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable report.")
@user_errors
def validate(out: Path, source: Path | None, samples: int, as_json: bool) -> None:
    """Check a converted directory: schema, sizes, layouts, checksums (and bytes against --source)."""
    import json

    from .convert.validate import validate as run_validate

    report = run_validate(out, source=source, samples=samples)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for check in report["checks"]:
            click.echo(f"{'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['detail']}")
    if not report["ok"]:
        bad = next(c for c in report["checks"] if not c["ok"])
        raise StreamoeError(f"{bad['detail']}")


def plan_from_config(path: Path, cap: float, ctx: int, experts: str, kv: str, dtype: str, runtime_mib: int | None = None):
    """A plan from a bare config.json, before any download or conversion."""
    from .convert.source import read_json, text_config
    from .convert.synth import tensor_table
    from .formats.record import RecordLayout
    from .formats.safetensors import tensor_nbytes
    from .runtime.plan import ITEMSIZE, GiB
    from .runtime.plan import make_plan as mk
    from .runtime.weights import resident_bytes

    config = read_json(path)
    tc = text_config(config)
    try:
        table = tensor_table(config)
        q = config["quantization"]
        lay = RecordLayout.make(tc["hidden_size"], tc["moe_intermediate_size"], {"q4": 4, "q3": 3}[experts], q["group_size"])
    except (KeyError, TypeError, ValueError) as e:
        raise StreamoeError(f"{path}: not a config this version can plan for ({e})") from None
    item = ITEMSIZE[dtype]
    nonexpert = resident_bytes(((name, dt, tensor_nbytes(dt, shape)) for name, dt, shape in table
                                if ".switch_mlp." not in name and not name.startswith("vision_tower.")), item)
    return mk(tc=tc, cap=int(cap * GiB), ctx=ctx, expert_format=experts, stride=lay.stride, nonexpert_resident=nonexpert,
              dtype=dtype, kv_dtype=kv, runtime_bytes=runtime_mib and runtime_mib << 20)


COMMON = [
    click.option("--cap", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True, help="Memory cap in GiB."),
    click.option("--ctx", type=click.IntRange(min=1), default=4096, show_default=True, help="Context length to plan for."),
    click.option("--experts", type=click.Choice(["q4", "q3"]), default="q4", show_default=True),
    click.option("--kv", type=click.Choice(["float32", "float16"]), default="float32", show_default=True, help="KV cache dtype."),
    click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
                 help="Compute dtype (default float32 on the CPU backend, bfloat16 on GPUs)."),
    click.option("--runtime-mib", type=click.IntRange(min=1), default=None,
                 help="Fix the interpreter/runtime allowance (default: measured at open) so plans are reproducible."),
]


def common(fn):
    for opt in reversed(COMMON):
        fn = opt(fn)
    return fn


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@common
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (bytes per account).")
@click.option("--images", is_flag=True, help="Include the vision account (runs with --image or --chat).")
@user_errors
def plan(model: Path, cap: float, ctx: int, experts: str, kv: str, dtype: str | None, runtime_mib: int | None, as_json: bool,
         images: bool) -> None:
    """Print the memory plan for MODEL (a converted directory, or a bare config.json) and exit.

    Exit status 0 when it fits, 2 when it does not (the smallest cap that fits is printed)."""
    from .runtime.engine import Options, default_dtype, plan_for

    dtype = dtype or default_dtype()
    if model.is_file() and model.suffix == ".json":
        p = plan_from_config(model, cap, ctx, experts, kv, dtype, runtime_mib)
    else:
        p = plan_for(model, Options(cap_gib=cap, ctx=ctx, experts=experts, kv=kv, dtype=dtype, images=images,
                                    runtime_bytes=runtime_mib and runtime_mib << 20))
    if as_json:
        import json

        click.echo(json.dumps(p.to_json(), indent=2))
    else:
        click.echo(p.render())
    p.require_fit()


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@common
@click.option("--prompt", "-p", default=None, help="One prompt; answered, then exit.")
@click.option("--chat", is_flag=True, help="Multi-turn REPL keeping the cache between turns; '/image PATH' attaches an image.")
@click.option("--image", "images", multiple=True, type=click.Path(path_type=Path), help="An image for the prompt (repeatable).")
@click.option("--max-pixels", type=click.IntRange(min=1024), default=640 * 640, show_default=True,
              help="Largest image after resizing, in pixels (the vision account is planned for it).")
@click.option("--raw", is_flag=True, help="Feed the prompt as is, without the chat template.")
@click.option("--system", default=None, help="System message for the chat template.")
@click.option("--no-think", is_flag=True, help="Render the template with thinking off.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--temp", type=click.FloatRange(min=0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=1.0, show_default=True)
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--tier", type=click.Choice(["freq", "lru"]), default="freq", show_default=True, help="Hot-tier admission policy.")
@click.option("--prefetch-width", type=click.IntRange(min=0), default=6, show_default=True, help="Cross-layer guesses; 0 = off.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--io-threads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--stats", type=click.Path(path_type=Path), default=None, help="Write per-step telemetry as JSON lines.")
@click.option("--logits-out", type=click.Path(path_type=Path), default=None, help="Save every step's logits (.npz).")
@click.option("--verify", is_flag=True, help="Check every file's checksum before running.")
@click.option("--quiet", "-q", is_flag=True, help="No summary line.")
@click.option("--save-session", type=click.Path(path_type=Path), default=None,
              help="At the end, save the conversation (caches, history) to this file (zstd).")
@click.option("--load-session", type=click.Path(path_type=Path), default=None,
              help="Continue a saved conversation: the prompt (or chat) is its next turn.")
@user_errors
def run(model: Path, cap: float, ctx: int, experts: str, kv: str, dtype: str | None, runtime_mib: int | None,
        prompt: str | None, chat: bool,
        images: tuple[Path, ...], max_pixels: int, raw: bool, system: str | None, no_think: bool, max_tokens: int, temp: float, top_p: float, top_k: int, seed: int,
        tier: str, prefetch_width: int, prefill_chunk: int, io_threads: int, stats: Path | None, logits_out: Path | None,
        verify: bool, quiet: bool, save_session: Path | None, load_session: Path | None) -> None:
    """Answer a prompt (or chat) with MODEL, a converted directory, inside --cap GiB."""
    from .runtime.cli_run import run_cli

    if prompt is None and not chat:
        raise click.UsageError("give --prompt TEXT or --chat")
    if images and raw:
        raise click.UsageError("--image needs the chat template; drop --raw")
    if load_session and system is not None:
        raise click.UsageError("a loaded session keeps its own system message; drop --system")
    vision = bool(images) or (chat and not raw)
    run_cli(model, dict(cap_gib=cap, ctx=ctx, experts=experts, kv=kv, dtype=dtype, tier=tier, prefetch_width=prefetch_width,
                        prefill_chunk=prefill_chunk, io_threads=io_threads, verify=verify, images=vision, max_pixels=max_pixels,
                        runtime_bytes=runtime_mib and runtime_mib << 20),
            prompt=prompt, images=list(images), chat=chat, raw=raw, system=system, think=not no_think, max_tokens=max_tokens,
            sampling=dict(temp=temp, top_p=top_p, top_k=top_k, seed=seed), stats=stats, logits_out=logits_out, quiet=quiet,
            save_session=save_session, load_session=load_session)


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@common
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind; anything but loopback is reachable "
              "from other machines (the API has no authentication).")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True)
@click.option("--model-name", default=None, help="The model id clients see (default: MODEL's directory name).")
@click.option("--no-images", is_flag=True, help="Refuse image inputs and plan no vision account.")
@click.option("--max-pixels", type=click.IntRange(min=1024), default=640 * 640, show_default=True,
              help="Largest image after resizing, in pixels (the vision account is planned for it).")
@click.option("--no-think", is_flag=True, help="Thinking off when a request does not set chat_template_kwargs.enable_thinking.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=1), default=None,
              help="Answer length when a request sets none (default: what the planned context holds).")
@click.option("--temp", type=click.FloatRange(min=0), default=None, help="Default temperature (else generation_config.json).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, help="Default top-p (else generation_config.json).")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="Default top-k (else generation_config.json).")
@click.option("--tier", type=click.Choice(["freq", "lru"]), default="freq", show_default=True, help="Hot-tier admission policy.")
@click.option("--prefetch-width", type=click.IntRange(min=0), default=6, show_default=True, help="Cross-layer guesses; 0 = off.")
@click.option("--prefill-chunk", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--io-threads", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--verify", is_flag=True, help="Check every file's checksum before serving.")
@click.option("--prompt-cache-mib", type=click.FloatRange(min=0), default=256, show_default=True,
              help="Plan account for snapshots of repeated conversations (LRU); 0 = no prompt cache.")
@click.option("--max-queue", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests that may wait behind the running one; more are answered 503.")
@click.option("--max-body-mib", type=click.FloatRange(min=0.01), default=4, show_default=True, help="Largest request body.")
@click.option("--max-image-mib", type=click.FloatRange(min=0.01), default=3, show_default=True, help="Largest image (decoded bytes).")
@click.option("--max-images", type=click.IntRange(min=0), default=4, show_default=True, help="Images per request.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@user_errors
def serve(model: Path, cap: float, ctx: int, experts: str, kv: str, dtype: str | None, runtime_mib: int | None, host: str,
          port: int, model_name: str | None, no_images: bool, max_pixels: int, no_think: bool, max_tokens: int | None,
          temp: float | None, top_p: float | None, top_k: int | None, tier: str, prefetch_width: int, prefill_chunk: int,
          io_threads: int, verify: bool, prompt_cache_mib: float, max_queue: int, max_body_mib: float,
          max_image_mib: float, max_images: int, log_level: str) -> None:
    """Serve MODEL (a converted directory) inside --cap GiB: an OpenAI-compatible API under /v1 and a chat page at /."""
    from .runtime.engine import Options
    from .runtime.openai_api import Limits
    from .runtime.server import serve as run_server
    from .runtime.worker import ServeOptions

    sampling = {k: v for k, v in (("temperature", temp), ("top_p", top_p), ("top_k", top_k)) if v is not None}
    limits = Limits(max_body=int(max_body_mib * (1 << 20)), max_image_bytes=int(max_image_mib * (1 << 20)),
                    max_images=0 if no_images else max_images)
    so = ServeOptions(model_name=model_name or model.resolve().name, limits=limits, max_queue=max_queue,
                      prompt_cache_bytes=int(prompt_cache_mib * (1 << 20)), max_tokens=max_tokens, sampling=sampling,
                      think=not no_think)
    opts = Options(cap_gib=cap, ctx=ctx, experts=experts, kv=kv, dtype=dtype, tier=tier, prefetch_width=prefetch_width,
                   prefill_chunk=prefill_chunk, io_threads=io_threads, verify=verify, images=not no_images,
                   max_pixels=max_pixels, runtime_bytes=runtime_mib and runtime_mib << 20)
    run_server(model, opts, so, host, port, log_level)


if __name__ == "__main__":
    main()
