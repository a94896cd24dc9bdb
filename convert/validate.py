"""`streamoe validate`: is a converted directory complete and true to its source?

Checks the manifest schema, every file's size, each layer file's format as derived from its size
against what the manifest says, every checksum, and with a source checkpoint, sampled expert records
and every blob tensor byte for byte (q3 records against the shift of the source's 4-bit bytes).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np

from ..formats import quant
from ..formats.direct import RangeReader, file_checksum
from ..formats.errors import StreamoeError
from ..formats.files import kind as file_kind
from ..formats.layout import detect_format
from ..formats.manifest import Manifest, load_manifest, safe_path
from ..formats.record import PROJS, RecordLayout
from .source import open_checkpoint, text_config


def sample_experts(n_experts: int, k: int) -> list[int]:
    """First, last, and evenly spread experts: deterministic, so a failure reproduces."""
    if k >= n_experts:
        return list(range(n_experts))
    return sorted({0, n_experts - 1, *np.linspace(0, n_experts - 1, k).astype(int).tolist()})


def expected_record(src_bytes: dict, lay4: RecordLayout, lay: RecordLayout) -> bytes:
    """The record a layer file must hold for one expert, from its nine source byte strings."""
    rec = bytearray(lay.stride)
    for proj in PROJS:
        w, s, b = (src_bytes[(proj, p)] for p in ("weight", "scales", "biases"))
        if lay.bits == 3:
            w = quant.shift_words_4_to_3(np.frombuffer(w, np.uint32)).tobytes()
            s, b = (a.tobytes() for a in quant.shift_scales_bf16(np.frombuffer(s, np.uint16), np.frombuffer(b, np.uint16)))
        for part, data in (("weight", w), ("scales", s), ("biases", b)):
            seg = lay.segment(proj, part)
            rec[seg.offset:seg.offset + seg.nbytes] = data
    return bytes(rec)


def compare_source(m: Manifest, source: Path, samples: int) -> list[dict]:
    ckpt = open_checkpoint(source)
    lay4 = ckpt.layer_layout()
    _, layers = ckpt.expert_keys()
    checks = []
    n_exp = m.model["num_experts"]
    picks = sample_experts(n_exp, samples)
    for name, ef in m.expert_formats().items():
        bad = []
        for f in ef.files:
            path = safe_path(m.root, f["path"])
            with RangeReader(path, ef.layout.stride) as r:
                for e in picks:
                    src = {}
                    for key, t in layers[f["layer"]].items():
                        seg = lay4.segment(*key)
                        with open(t.file, "rb") as fh:
                            fh.seek(t.offset + e * seg.nbytes)
                            src[key] = fh.read(seg.nbytes)
                    if bytes(r.read(e * ef.layout.stride, ef.layout.stride)) != expected_record(src, lay4, ef.layout):
                        bad.append(f"{f['path']} expert {e}")
        checks.append({"name": f"source-experts-{name}", "ok": not bad,
                       "detail": f"{len(picks)} experts x {len(ef.files)} layers equal the source" if not bad
                       else f"{bad[0]}: bytes differ from the source checkpoint ({len(bad)} records)"})
    for kind in ("nonexpert", "vision"):
        blob = m.blob(kind)
        if blob is None:
            continue
        file, table = blob
        path = safe_path(m.root, file["path"])
        bad = []
        with open(path, "rb") as out:
            for t in table:
                s = ckpt.tensors.get(t.name)
                out.seek(t.offset)
                mine = out.read(t.nbytes)
                if s is None:
                    bad.append(f"{t.name} (not in source)")
                    continue
                with open(s.file, "rb") as fh:
                    fh.seek(s.offset)
                    if fh.read(s.nbytes) != mine or (s.dtype, s.shape) != (t.dtype, t.shape):
                        bad.append(t.name)
        checks.append({"name": f"source-{kind}", "ok": not bad,
                       "detail": f"{len(table)} tensors equal the source" if not bad else f"{path}: tensor {bad[0]} differs from the source"})
    return checks


FLOATS = ("BF16", "F16", "F32")
QPARTS = {"qweight": "weight", "scales": "scales", "biases": "biases"}


def _strip(name: str) -> str:
    """A tensor name without the VLM export's `language_model.` prefix (mlx-lm text-only exports lack it)."""
    return name.removeprefix("language_model.")


def expected_tensors(config: dict, vision: bool) -> list:
    """The non-expert tensors the runtime loads for this config (synth's table of the real export), as Specs."""
    from .synth import specs

    q = config.get("quantization") or {}
    cfg = {"text_config": text_config(config), "quantization": q}
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
    return [s for s in table if ".switch_mlp." not in s.name and not (tied and s.name.endswith("lm_head." + s.name.rsplit(".", 1)[1]))]


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
            group = (m.config.get("quantization") or {}).get("group_size")
            override = (m.config.get("quantization") or {}).get(spec.module)
            if isinstance(override, dict):
                group = override.get("group_size", group)
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


def check_side_files(root: Path, config: dict) -> None:
    """The image preprocessor's config parses and holds sane numbers (the engine reads it on the first image)."""
    import math

    from ..formats.files import read_json
    from ..runtime.image import ImageConfig

    for name in ("preprocessor_config.json", "processor_config.json"):
        p = root / name
        if not os.path.lexists(p):
            continue
        pre = read_json(p, "preprocessor config")
        try:
            cfg = ImageConfig.from_config(config, pre)
            ok = (len(cfg.image_mean) == 3 and len(cfg.image_std) == 3 and all(s != 0 for s in cfg.image_std)
                  and all(math.isfinite(v) for v in (*cfg.image_mean, *cfg.image_std, cfg.rescale_factor))
                  and 0 < cfg.min_pixels <= cfg.max_pixels and cfg.patch_size > 0 and cfg.merge_size > 0)
        except (TypeError, ValueError, AttributeError, OverflowError):
            ok = False
        if not ok:
            raise StreamoeError(f"{p}: preprocessor values are not usable (sizes must be positive integers, "
                                "image_mean/image_std three finite numbers, std non-zero)")
        return


def check_open(root: Path, experts: str) -> None:
    """What `run` checks at open without --verify (the engine should call this before it loads anything)."""
    m = load_manifest(root)
    check_side_files(m.root, m.config)
    if experts not in m.expert_formats():
        return  # the engine names the missing format itself
    problems = open_problems(m, experts)
    if problems:
        raise StreamoeError(problems[0][1])


def validate(root: Path, source: Path | None = None, samples: int = 16) -> dict:
    """A report {"ok": bool, "checks": [{"name", "ok", "detail"}]}; bad manifests raise StreamoeError."""
    m = load_manifest(root)
    checks: list[dict] = [{"name": "schema", "ok": True, "detail": f"{root}/manifest.json is valid (format version 1)"}]
    for blob_kind in m.doc["blobs"]:
        problem = tensor_problem(m, blob_kind)
        checks.append({"name": f"tensors:{blob_kind}", "ok": problem is None,
                       "detail": f"{m.root / 'manifest.json'}: {problem}" if problem
                       else f"the {blob_kind} blob holds every tensor the config needs, in bounds"})
    n_exp = m.model["num_experts"]
    layouts = {name: ef.layout for name, ef in m.expert_formats().items()}
    for f in m.all_files():
        path = safe_path(m.root, f["path"])
        if not path.is_file():
            checks.append({"name": f"file:{f['path']}", "ok": False,
                           "detail": f"{path}: missing" if not os.path.lexists(path) else f"{path}: not a regular file"})
            continue
        size = path.stat().st_size
        if size != f["size"]:
            checks.append({"name": f"file:{f['path']}", "ok": False, "detail": f"{path}: size {size} bytes, manifest says {f['size']}"})
            continue
        if "layer" in f:
            try:
                want = f["path"].split("/")[1]
                fmt = detect_format(path, size, n_exp, layouts, claimed=want)
                if fmt != want:
                    raise StreamoeError(f"{path}: size says {fmt}, manifest says {want}")
            except StreamoeError as e:
                checks.append({"name": f"layout:{f['path']}", "ok": False, "detail": str(e)})
                continue
        ck = file_checksum(path)
        checks.append({"name": f"file:{f['path']}", "ok": ck == f["checksum"],
                       "detail": f"{size} bytes, checksum ok" if ck == f["checksum"] else f"{path}: checksum mismatch ({ck} != {f['checksum']})"})
    if source is not None:
        checks += compare_source(m, Path(source), samples)
    return {"ok": all(c["ok"] for c in checks), "checks": checks}
