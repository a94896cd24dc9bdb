"""The `streamoe` command line: synth, convert, validate, plan, run.

Results go to stdout, diagnostics to stderr. Every `StreamoeError` (a bad input) becomes one stderr line
and exit status 2; heavy imports happen inside the commands so `--help` stays instant.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import click

from streamoe.formats.errors import StreamoeError


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
    from streamoe.convert.synth import synth as run_synth

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
    from streamoe.convert.convert import convert as run_convert

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

    from streamoe.convert.validate import validate as run_validate

    report = run_validate(out, source=source, samples=samples)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        for check in report["checks"]:
            click.echo(f"{'ok  ' if check['ok'] else 'FAIL'} {check['name']}: {check['detail']}")
    if not report["ok"]:
        bad = next(c for c in report["checks"] if not c["ok"])
        raise StreamoeError(f"{bad['detail']}")


if __name__ == "__main__":
    main()
