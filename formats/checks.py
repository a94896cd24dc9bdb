"""The facts `run` relies on and `validate` reports: every file the run reads is there at its manifest size,
and the blob tables hold the tensors the config implies, with the dtypes, shapes and quantization it says.
These cost a few stats and a table walk, so `run` makes them at every open; a file's checksum
(`checksum_problem`) is read in full, so only `validate` and `run --verify` ask for it.
"""

from __future__ import annotations

import stat
from pathlib import Path

from .config import family_of, is_expert_tensor, text_config
from .direct import file_checksum
from .errors import StreamoeError, fail
from .files import kind as file_kind
from .manifest import MANIFEST, Manifest, load_manifest, safe_path

FLOATS = ("BF16", "F16", "F32")
QPARTS = {"qweight": "weight", "scales": "scales", "biases": "biases"}


def _strip(name: str) -> str:
    """A tensor name without the VLM export's `language_model.` prefix (mlx-lm text-only exports lack it)."""
    return name.removeprefix("language_model.")


UNREADABLE_CONFIG = "not a config this version can check the weights against"


def expected_tensors(config: dict, vision: bool, path: object = "config.json") -> list:
    """The non-expert tensors the runtime loads for this config (synth's table of the real export), as Specs;
    `path`: the config's file, which a config this version cannot read is named by."""
    from .export import specs

    q = config.get("quantization") or {}
    cfg = {"text_config": text_config(config), "quantization": q}
    if "model_type" in config:
        cfg["model_type"] = config["model_type"]
    if vision and config.get("vision_config") is not None:
        cfg["vision_config"] = config["vision_config"]
    try:
        table = specs(cfg, path=path)
    except StreamoeError:
        raise
    except KeyError as e:
        raise fail(path, f"{UNREADABLE_CONFIG}: it has no {str(e.args[0])[:40]!r}") from None
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise fail(path, f"{UNREADABLE_CONFIG} ({type(e).__name__}: {str(e)[:80]})") from None
    tied = bool(text_config(config).get("tie_word_embeddings", False))
    family = family_of(config) or ""
    return [s for s in table if not is_expert_tensor(s.name, family)
            and not (tied and s.name.endswith("lm_head." + s.name.rsplit(".", 1)[1]))]


def _first_mismatch(specs: list, have: dict, where: str, check=None) -> str | None:
    """The first of `specs` that `have` (name without the VLM prefix -> an object with `.shape`) lacks, holds in
    another shape, or that `check(spec, found)` faults, as one line; None if all are there as implied."""
    for spec in specs:
        t = have.get(_strip(spec.name))
        if t is None:
            return f"tensor {spec.name} is missing{where}"
        if tuple(t.shape) != tuple(spec.shape):
            return f"tensor {spec.name} has shape {list(t.shape)}, the config implies {list(spec.shape)}"
        problem = check(spec, t) if check else None
        if problem:
            return problem
    return None


def _dtype_problem(spec, t) -> str | None:
    """A quantized module's parts at the config's bits and group size (the module's own); anything else a float.
    A source checkpoint's tensor records no bits or group size (its shape, checked first, follows from them)."""
    if spec.bits:
        want = "U32" if spec.kind == "qweight" else t.dtype if t.dtype in FLOATS else "BF16"
        bits, group = getattr(t, "bits", spec.bits), getattr(t, "group_size", spec.group)
        if t.dtype != want or bits != spec.bits or group != spec.group:
            return (f"tensor {t.name} is {t.dtype} at {bits} bits, group {group}; the config says "
                    f"{want} at {spec.bits} bits, group {spec.group}")
    elif t.dtype not in FLOATS:
        return f"tensor {t.name} is {t.dtype}, expected a float dtype"
    return None


def tensor_problem(m: Manifest, kind: str) -> str | None:
    """The first tensor the model needs that the `kind` blob lacks, or holds with the wrong dtype, shape or
    quantization (bits and group size as the config's quantization block says), or None."""
    blob = m.blob(kind)
    if blob is None:
        return None
    have = {_strip(t.name): t for t in blob[1]}
    specs = [s for s in expected_tensors(m.config, kind == "vision", m.root / MANIFEST)
             if (kind == "vision") == s.name.startswith("vision_tower.")]
    return _first_mismatch(specs, have, f" from the {kind} blob", _dtype_problem)


def source_problem(config: dict, tensors: dict, path: object = "config.json") -> str | None:
    """The first non-expert tensor the model needs that a source checkpoint (`tensors`: name -> its header entry,
    with `.name`, `.dtype` and `.shape`) lacks, or holds in another shape or dtype than its config implies, or
    None: checked before `convert` writes anything, so it never publishes a directory that `validate` and `run`
    refuse."""
    have = {_strip(name): t for name, t in tensors.items()}
    head = next((name for name in have if name.startswith("lm_head.")), None)
    if head is not None and text_config(config).get("tie_word_embeddings", False):  # mlx-lm refuses it too
        return (f"tensor {head} is there, but tie_word_embeddings says the output head is the embedding: one of the "
                "two is wrong")
    return _first_mismatch(expected_tensors(config, True, path), have, "", _dtype_problem)


def file_problem(m: Manifest, f: dict) -> str | None:
    """What is wrong with the file a manifest entry {"path", "size", ...} names: missing, not a regular file,
    or not the manifest's size (None: nothing a stat can see)."""
    path = safe_path(m.root, f["path"])
    try:
        st = path.stat()
    except OSError:
        return f"{path}: missing"
    if not stat.S_ISREG(st.st_mode):
        return f"{path}: is {file_kind(st.st_mode)}, expected a regular file"
    if st.st_size != f["size"]:
        what = "truncated" if st.st_size < f["size"] else "too long"
        return f"{path}: {what}: {st.st_size} bytes, manifest says {f['size']}"
    return None


def checksum_problem(m: Manifest, f: dict) -> str | None:
    """The file's checksum against the manifest's (the whole file read; run `file_problem` first)."""
    path = safe_path(m.root, f["path"])
    ck = file_checksum(path)
    return None if ck == f["checksum"] else f"{path}: checksum mismatch ({ck} != {f['checksum']})"


def open_problems(m: Manifest, experts: str | None = None, checksums: bool = False) -> list[tuple[str, str]]:
    """(check name, problem) for the facts `run` relies on: every file it reads exists, is a regular file and
    has the manifest's size; the blob tables hold the tensors the model needs. `checksums` (`run --verify`):
    every file of the directory also against its checksum, as `validate` checks it."""
    problems = []
    fmts = m.expert_formats()
    if checksums:
        files = list(m.all_files())
    else:
        files = [f for name, ef in fmts.items() if experts in (None, name) for f in ef.files]
        files += [b["file"] for b in m.doc["blobs"].values()]
    for f in files:
        problem = file_problem(m, f)
        if problem is None and checksums:
            problem = checksum_problem(m, f)
        if problem:
            problems.append((f"file:{f['path']}", problem))
    for blob_kind in m.doc["blobs"]:
        problem = tensor_problem(m, blob_kind)
        if problem:
            problems.append((f"tensors:{blob_kind}", f"{m.root / 'manifest.json'}: {problem}"))
    return problems


def check_open(root: Path, experts: str, m=None, checksums: bool = False) -> None:
    """What every run checks at open (`Engine` calls it before it loads anything): file sizes and blob tables
    as `validate` checks them, and with `checksums` (--verify) every file's checksum too."""
    m = m or load_manifest(root)
    if experts not in m.expert_formats():
        return  # the engine names the missing format itself
    problems = open_problems(m, experts, checksums)
    if problems:
        raise StreamoeError(problems[0][1])
