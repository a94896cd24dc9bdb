"""The manifest: what a converted directory holds, validated against schemas/manifest.schema.json.

It is written last and atomically by the converter, so a directory with a valid manifest is complete.
Loading checks the schema, that every path stays inside the directory, and that expert segments agree
with the layout `formats/record.py` derives from the model dims (the one source of truth).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path

import jsonschema

from .blobs import BlobTensor, table_problem
from .errors import StreamoeError, fail
from .files import check_input_dir, read_json
from .layout import FORMAT_MODE
from .limits import CONFIG_INTS, MAX_FILE_BYTES, check_config_sizes, check_int, check_shape
from .record import RecordLayout

MANIFEST = "manifest.json"


@cache
def schema(name: str = "manifest.schema.json") -> dict:
    return json.loads(resources.files("streamoe.schemas").joinpath(name).read_text())


@cache
def validator(name: str = "manifest.schema.json") -> jsonschema.protocols.Validator:
    """One compiled validator per schema (`jsonschema.validate` re-checks the schema itself on every call)."""
    s = schema(name)
    return jsonschema.validators.validator_for(s)(s)


def layout_of(m: dict, e: dict) -> RecordLayout:
    """The record layout a manifest's expert format states (`mode` and `bias_dtype` absent: affine, no bias)."""
    return RecordLayout.make(m["hidden_size"], m["moe_intermediate_size"], e["bits"], e["group_size"], e["scale_dtype"],
                             e.get("mode", "affine"), e.get("bias_dtype"))


def format_json(lay: RecordLayout) -> dict:
    """The layout's keys of a manifest's expert format (`mode`/`bias_dtype` only where they are not the default, so
    an affine record without biases reads as it always did)."""
    out = {"bits": lay.bits, "group_size": lay.group_size, "scale_dtype": lay.scale_dtype}
    if lay.mode != "affine":
        out["mode"] = lay.mode
    if lay.bias_dtype is not None:
        out["bias_dtype"] = lay.bias_dtype
    return {**out, "raw_size": lay.raw_size, "stride": lay.stride, "segments": segments_json(lay)}


def segments_json(lay: RecordLayout) -> list[dict]:
    return [{"proj": s.proj, "part": s.part, "dtype": s.dtype, "shape": list(s.shape), "offset": s.offset, "nbytes": s.nbytes}
            for s in lay.segments]


@dataclass(frozen=True)
class ExpertFormat:
    name: str  # q4 | q3 | mxfp4
    layout: RecordLayout
    files: list[dict]  # one per layer: path, size, checksum, layer
    derivation: str


@dataclass(frozen=True)
class Manifest:
    root: Path
    doc: dict

    @property
    def config(self) -> dict:
        return self.doc["config"]

    @property
    def model(self) -> dict:
        return self.doc["model"]

    def expert_formats(self) -> dict[str, ExpertFormat]:
        m = self.model
        out = {}
        for name, e in self.doc["experts"].items():
            lay = layout_of(m, e)
            out[name] = ExpertFormat(name, lay, sorted(e["files"], key=lambda f: f["layer"]), e["derivation"])
        return out

    def blob(self, name: str) -> tuple[dict, list[BlobTensor]] | None:
        b = self.doc["blobs"].get(name)
        if b is None:
            return None
        return b["file"], [BlobTensor.from_json(t) for t in b["tensors"]]

    def all_files(self) -> list[dict]:
        """Every file the manifest vouches for (expert layers, blobs, tokenizer and config files)."""
        files = [f for e in self.doc["experts"].values() for f in e["files"]]
        files += [b["file"] for b in self.doc["blobs"].values()]
        return files + list(self.doc["files"])


MODEL_BOUNDS = {"num_layers": "num_hidden_layers", "num_experts": "num_experts", "top_k": "num_experts_per_tok",
                "hidden_size": "hidden_size", "moe_intermediate_size": "moe_intermediate_size"}


def check_doc(doc: object, where: Path) -> None:
    """Schema, sizes within bounds, path containment, layout and blob-table agreement; raises StreamoeError
    naming `where`."""
    try:
        e = jsonschema.exceptions.best_match(validator().iter_errors(doc))
    except RecursionError:
        raise fail(where, "manifest is nested too deeply") from None
    if e is not None:
        loc = "/".join(str(p) for p in e.absolute_path) or "(top level)"
        raise fail(where, f"manifest fails its schema at {loc}: {' '.join(e.message.split())[:300]}")
    m = doc["model"]
    for key, ckey in MODEL_BOUNDS.items():
        lo, hi = CONFIG_INTS[ckey]
        check_int(m[key], lo, hi, f"model.{key}", where)
    if m["top_k"] > m["num_experts"]:
        raise fail(where, f"model.top_k = {m['top_k']} exceeds model.num_experts = {m['num_experts']}")
    check_config_sizes(doc["config"], where)
    for f in [f for e in doc["experts"].values() for f in e["files"]] + [b["file"] for b in doc["blobs"].values()]:
        check_int(f["size"], 0, MAX_FILE_BYTES, f"size of {f['path']}", where)
    unlayered = [(f"blobs.{name}.file", b["file"]) for name, b in doc["blobs"].items()]
    for at, f in unlayered + [(f"files[{i}]", f) for i, f in enumerate(doc["files"])]:
        if "layer" in f:
            raise fail(where, f"{at} ({f['path']}) has a layer: only expert layer files have one")
    for name, b in doc["blobs"].items():
        for t in b["tensors"]:
            check_shape(t["shape"], where, t["name"])
        problem = table_problem([BlobTensor.from_json(t) for t in b["tensors"]], b["file"]["size"])
        if problem:
            raise fail(where, f"{name} blob ({b['file']['path']}): {problem}")
    for name, e in doc["experts"].items():
        try:
            want = layout_of(m, e)
        except (ValueError, StreamoeError) as err:
            raise fail(where, f"expert format {name}: {err}") from None
        if segments_json(want) != e["segments"] or want.stride != e["stride"] or want.raw_size != e["raw_size"]:
            raise fail(where, f"expert format {name}: segments/stride disagree with the {e['bits']}-bit "
                              f"{want.mode} record layout")
        if FORMAT_MODE.get(name) != want.mode:
            raise fail(where, f"expert format {name} holds {want.mode} records, not {FORMAT_MODE.get(name)} ones")
        layers = sorted(f.get("layer", -1) for f in e["files"])
        if layers != list(range(m["num_layers"])):
            raise fail(where, f"expert format {name}: needs one file per layer 0..{m['num_layers'] - 1}")


def safe_path(root: Path, rel: str) -> Path:
    try:
        p = (root / rel).resolve()
        inside = p.is_relative_to(root.resolve())
    except (OSError, RuntimeError):  # a symlink loop
        raise fail(root / rel, "cannot be resolved (a symbolic link loop?)") from None
    if not inside:
        raise fail(root / MANIFEST, f"path {rel!r} points outside the directory")
    return p


def load_manifest(root: str | os.PathLike) -> Manifest:
    root = Path(root)
    path = root / MANIFEST
    check_input_dir(root, "a converted streamoe model")
    if not os.path.lexists(path):
        if os.path.lexists(root / "config.json") and not os.path.lexists(root / "experts"):  # a checkpoint, unconverted
            raise fail(path, f"missing: {root} is a checkpoint, not a converted streamoe model: convert it first "
                             f"(`streamoe plan {root / 'config.json'}` plans it as it is)")
        raise fail(path, "missing: not a converted streamoe model, or an incomplete conversion")
    doc = read_json(path, "streamoe manifest")
    check_doc(doc, path)
    m = Manifest(root, doc)
    for f in m.all_files():
        safe_path(root, f["path"])
    return m


def write_manifest(root: Path, doc: dict) -> None:
    """Validate, then write atomically (temp file, fsync, rename)."""
    check_doc(doc, root / MANIFEST)
    tmp = root / (MANIFEST + ".tmp")
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / MANIFEST)


