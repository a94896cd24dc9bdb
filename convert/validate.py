"""`streamoe validate`: is a converted directory complete and true to its source?

Checks the manifest schema, every file's size, each layer file's format as derived from its size
against what the manifest says, every checksum, and with a source checkpoint, sampled expert records
and every blob tensor byte for byte (q3 records against the shift of the source's 4-bit bytes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..formats.checks import checksum_problem, file_problem, tensor_problem
from ..formats.direct import RangeReader
from ..formats.errors import StreamoeError
from ..formats.layout import detect_format
from ..formats.manifest import Manifest, load_manifest, safe_path
from ..formats.record import PROJS, RecordLayout
from .convert import record_arrays
from .source import open_checkpoint


def sample_experts(n_experts: int, k: int) -> list[int]:
    """First, last, and evenly spread experts: deterministic, so a failure reproduces."""
    if k >= n_experts:
        return list(range(n_experts))
    return sorted({0, n_experts - 1, *np.linspace(0, n_experts - 1, k).astype(int).tolist()})


def expected_record(src_bytes: dict, lay4: RecordLayout, lay: RecordLayout) -> bytes:
    """The record a layer file must hold for one expert, from its source byte strings (as the converter derives it)."""
    rec = bytearray(lay.stride)
    for proj in PROJS:
        source = {part: np.frombuffer(src_bytes[(proj, part)], np.uint8)[None] for part in lay4.parts}
        for part, arr in record_arrays(lay, source).items():
            seg = lay.segment(proj, part)
            rec[seg.offset:seg.offset + seg.nbytes] = arr.tobytes()
    return bytes(rec)


def compare_source(m: Manifest, source: Path, samples: int) -> list[dict]:
    ckpt = open_checkpoint(source)
    if ckpt.config != m.config:
        return [{"name": "source", "ok": False,
                 "detail": f"{source / 'config.json'}: not the checkpoint {m.root} was converted from (configs differ)"}]
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
                        bad.append(f"{path} expert {e}")
        checks.append({"name": f"source-experts-{name}", "ok": not bad,
                       "detail": f"{len(picks)} experts x {len(ef.files)} layers equal the source" if not bad
                       else f"{bad[0]}: bytes differ from the source checkpoint ({len(bad)} "
                            f"record{'s' * (len(bad) != 1)} in all)"})
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
    formats = m.expert_formats()
    layouts = {name: ef.layout for name, ef in formats.items()}
    fmt_of = {id(f): name for name, ef in formats.items() for f in ef.files}  # expert layer files only
    for f in m.all_files():
        path = safe_path(m.root, f["path"])
        problem = file_problem(m, f)
        if problem:
            checks.append({"name": f"file:{f['path']}", "ok": False, "detail": problem})
            continue
        size = f["size"]
        if id(f) in fmt_of:
            try:
                want = fmt_of[id(f)]
                fmt = detect_format(path, size, n_exp, layouts, claimed=want)
                if fmt != want:
                    raise StreamoeError(f"{path}: size says {fmt}, manifest says {want}")
            except StreamoeError as e:
                checks.append({"name": f"layout:{f['path']}", "ok": False, "detail": str(e)})
                continue
        problem = checksum_problem(m, f)
        checks.append({"name": f"file:{f['path']}", "ok": problem is None, "detail": problem or f"{size} bytes, checksum ok"})
    if source is not None:
        checks += compare_source(m, Path(source), samples)
    return {"ok": all(c["ok"] for c in checks), "checks": checks}
