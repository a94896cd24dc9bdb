"""The cheap facts `run` relies on and `validate` reports: every file the run reads is there at its manifest
size, and the blob tables hold the tensors the config implies, with the dtypes, shapes and quantization it
says. No checksums: these checks cost a few stats and a table walk, so `run` makes them at every open.
"""

from __future__ import annotations

import stat
from pathlib import Path

from .config import family_of, is_expert_tensor, text_config
from .errors import StreamoeError
from .files import kind as file_kind
from .manifest import Manifest, load_manifest, safe_path

FLOATS = ("BF16", "F16", "F32")
QPARTS = {"qweight": "weight", "scales": "scales", "biases": "biases"}


def _strip(name: str) -> str:
    """A tensor name without the VLM export's `language_model.` prefix (mlx-lm text-only exports lack it)."""
    return name.removeprefix("language_model.")


def expected_tensors(config: dict, vision: bool) -> list:
    """The non-expert tensors the runtime loads for this config (synth's table of the real export), as Specs."""
    from .export import specs

    q = config.get("quantization") or {}
    cfg = {"text_config": text_config(config), "quantization": q}
    if "model_type" in config:
        cfg["model_type"] = config["model_type"]
    if vision and config.get("vision_config") is not None:
        cfg["vision_config"] = config["vision_config"]
    try:
        table = specs(cfg)
    except StreamoeError:
        raise
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise StreamoeError(f"config.json: not a config this version can check the weights against ({type(e).__name__}: "
                            f"{str(e)[:80]})") from None
    tied = bool(text_config(config).get("tie_word_embeddings", False))
    family = family_of(config) or ""
    return [s for s in table if not is_expert_tensor(s.name, family)
            and not (tied and s.name.endswith("lm_head." + s.name.rsplit(".", 1)[1]))]


def tensor_problem(m: Manifest, kind: str) -> str | None:
    """The first tensor the model needs that the `kind` blob lacks, or holds with the wrong dtype, shape or
    quantization (bits and group size as the config's quantization block says), or None."""
    blob = m.blob(kind)
    if blob is None:
        return None
    _, table = blob
    have = {_strip(t.name): t for t in table}
    for spec in expected_tensors(m.config, vision=kind == "vision"):
        if (kind == "vision") != spec.name.startswith("vision_tower."):
            continue
        t = have.get(_strip(spec.name))
        if t is None:
            return f"tensor {spec.name} is missing from the {kind} blob"
        if t.shape != spec.shape:
            return f"tensor {t.name} has shape {list(t.shape)}, the config implies {list(spec.shape)}"
        if spec.bits:
            group = spec.group  # the module's own, as the config's quantization block says
            want_dtype = "U32" if spec.kind == "qweight" else t.dtype if t.dtype in FLOATS else "BF16"
            if t.dtype != want_dtype or t.bits != spec.bits or t.group_size != group:
                return (f"tensor {t.name} is {t.dtype} at {t.bits} bits, group {t.group_size}; the config says "
                        f"{want_dtype} at {spec.bits} bits, group {group}")
        elif t.dtype not in FLOATS:
            return f"tensor {t.name} is {t.dtype}, expected a float dtype"
    return None


def open_problems(m: Manifest, experts: str | None = None) -> list[tuple[str, str]]:
    """(check name, problem) for the cheap facts `run` relies on: every file it reads exists, is a regular
    file and has the manifest's size; the blob tables hold the tensors the model needs. No checksums."""
    problems = []
    fmts = m.expert_formats()
    files = [f for name, ef in fmts.items() if experts in (None, name) for f in ef.files]
    files += [b["file"] for b in m.doc["blobs"].values()]
    for f in files:
        path = safe_path(m.root, f["path"])
        try:
            st = path.stat()
        except OSError:
            problems.append((f"file:{f['path']}", f"{path}: missing"))
            continue
        if not stat.S_ISREG(st.st_mode):
            problems.append((f"file:{f['path']}", f"{path}: is {file_kind(st.st_mode)}, expected a regular file"))
        elif st.st_size != f["size"]:
            what = "truncated" if st.st_size < f["size"] else "too long"
            problems.append((f"file:{f['path']}", f"{path}: {what}: {st.st_size} bytes, manifest says {f['size']}"))
    for blob_kind in m.doc["blobs"]:
        problem = tensor_problem(m, blob_kind)
        if problem:
            problems.append((f"tensors:{blob_kind}", f"{m.root / 'manifest.json'}: {problem}"))
    return problems


def check_open(root: Path, experts: str, m=None) -> None:
    """What every run checks at open without --verify (`Engine` calls it before it loads anything): file sizes
    and blob tables as `validate` checks them."""
    m = m or load_manifest(root)
    if experts not in m.expert_formats():
        return  # the engine names the missing format itself
    problems = open_problems(m, experts)
    if problems:
        raise StreamoeError(problems[0][1])
