"""The bad-input catalogue (issue 12): hostile inputs through the real console script.

Every case builds its inputs in a scratch directory, snapshots the whole tree, runs `streamoe ...` and
asserts: a non-zero exit (2), exactly one stderr line, no traceback or "internal error", the line names the
file (or option) at fault and says what is wrong, and the tree is unchanged: nothing written, nothing
deleted. Cases with FIFOs run under a timeout, so a hang fails the test instead of blocking the suite.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from streamoe.formats.session import write_session

from .conftest import cli, one_error_line

Case = Callable[[Path, Path, Path], tuple[list, tuple[str, ...]]]
CASES: dict[str, Case] = {}


def case(name: str):
    def register(fn: Case) -> Case:
        CASES[name] = fn
        return fn
    return register


# ---------------------------------------------------------------------------------------------- helpers

def tree(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every entry under `root`: (type, size, mtime) for files, (type, 0, 0) for the rest (a directory's mtime
    moves when a lock file comes and goes, which is not a write of user data)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            reg = stat.S_ISREG(st.st_mode)
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_size if reg else 0, st.st_mtime_ns if reg else 0)
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_json(path: Path, fn: Callable[[dict], object]) -> Path:
    doc = json.loads(path.read_text())
    fn(doc)
    path.write_text(json.dumps(doc))
    return path


def shard_files(ck: Path) -> list[Path]:
    wm = json.loads((ck / "model.safetensors.index.json").read_text())["weight_map"]
    return [ck / f for f in sorted(set(wm.values()))]


def edit_header(path: Path, fn: Callable[[dict], object]) -> Path:
    """Rewrite a shard's JSON header through `fn`, keeping its data bytes."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    doc = json.loads(raw[8:8 + n])
    fn(doc)
    head = json.dumps(doc).encode()
    path.write_bytes(struct.pack("<Q", len(head)) + head + raw[8 + n:])
    return path


def first_tensor(doc: dict) -> dict:
    return doc[next(k for k in doc if k != "__metadata__")]


def overlap_two(doc: dict) -> None:
    """Make the second tensor of a header alias the first one's bytes (same dtype, shape and range)."""
    names = [k for k in doc if k != "__metadata__"]
    doc[names[1]] = dict(doc[names[0]])


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def config_case(mutate: Callable[[dict], object]) -> Case:
    """convert with a checkpoint whose config.json is `mutate`d."""
    def build(tmp: Path, ck: Path, conv: Path):
        c = copy(ck, tmp / "ck")
        edit_json(c / "config.json", mutate)
        return ["convert", c, tmp / "out"], (str(c / "config.json"),)
    return build


def manifest_case(mutate: Callable[[dict], object], command: str = "validate") -> Case:
    """`validate` (or `run`) with a conversion whose manifest.json is `mutate`d."""
    def build(tmp: Path, ck: Path, conv: Path):
        c = copy(conv, tmp / "conv")
        edit_json(c / "manifest.json", mutate)
        args = ["validate", c] if command == "validate" else ["run", c, "--cap", "1", "-p", "hi", "-n", "1"]
        return args, (str(c / "manifest.json"),)
    return build


def nonexpert(doc: dict) -> list[dict]:
    return doc["blobs"]["nonexpert"]["tensors"]


def session_file(path: Path, meta: dict) -> Path:
    base = {"model": "m", "experts": "q4", "dtype": "F32", "kv": "float32", "tokens": 0, "rope_delta": 0, "extra": {}}
    write_session(path, {**base, **meta}, [], [])
    return path


def run_args(conv: Path, *more) -> list:
    return ["run", conv, "--cap", "1", "-p", "hi", "-n", "1", "-q", *more]


# ---------------------------------------------------------------------------------------------- convert: the source

@case("empty-path")  # an unset variable: "" would be the working directory
def _(tmp, ck, conv):
    return ["run", conv, "-p", "hi", "--save-session", ""], ("--save-session", "is empty (an unset variable?)")


@case("empty-model")
def _(tmp, ck, conv):
    return ["plan", ""], ("MODEL", "is empty (an unset variable?)")


@case("ckpt-missing")
def _(tmp, ck, conv):
    return ["convert", tmp / "nope", tmp / "out"], (str(tmp / "nope"), "missing")


@case("ckpt-is-a-file")
def _(tmp, ck, conv):
    (tmp / "f").write_text("x")
    return ["convert", tmp / "f", tmp / "out"], (str(tmp / "f"), "not a directory")


@case("ckpt-is-a-fifo")
def _(tmp, ck, conv):
    return ["convert", fifo(tmp / "p"), tmp / "out"], (str(tmp / "p"), "FIFO")


@case("config-missing")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").unlink()
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "missing")


@case("config-not-json")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").write_text("{nope")
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "does not parse")


@case("config-nested-too-deep")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").write_text("[" * 200_000 + "]" * 200_000)
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "nested too deeply")


@case("config-is-a-directory")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").unlink()
    (c / "config.json").mkdir()
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "is a directory")


@case("config-is-a-fifo")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").unlink()
    return ["convert", c, tmp / "out"], (str(fifo(c / "config.json")), "FIFO")


@case("config-top-level-array")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").write_text("[1, 2]")
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "not a JSON object")


@case("config-not-utf8")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").write_bytes(b'{"model_type": "\xff\xfe"}')
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "UTF-8")


@case("config-nan")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "config.json").write_text('{"rms_norm_eps": NaN}')
    return ["convert", c, tmp / "out"], (str(c / "config.json"), "NaN")


for _name, _mutate, _needle in [
    ("config-billion-layers", lambda d: d["text_config"].update(num_hidden_layers=10**9), "out of range"),
    ("config-float-hidden", lambda d: d["text_config"].update(hidden_size=64.0), "must be an integer"),
    ("config-bool-experts", lambda d: d["text_config"].update(num_experts=True), "must be an integer"),
    ("config-shared-expert-width-not-the-tensors", lambda d: d["text_config"].update(shared_expert_intermediate_size=128),
     "does not match its config"),
    ("config-negative-norm-eps", lambda d: d["text_config"].update(rms_norm_eps=-1), "rms_norm_eps = -1 is out of range"),
    ("config-string-norm-eps", lambda d: d["text_config"].update(rms_norm_eps="8"), "rms_norm_eps must be a number"),
    ("config-zero-rope-theta", lambda d: d["text_config"].update(rope_theta=0), "rope_theta = 0 is out of range"),
    ("config-zero-experts", lambda d: d["text_config"].update(num_experts=0), "out of range"),
    ("config-topk-over-experts", lambda d: d["text_config"].update(num_experts_per_tok=10**4), "exceeds"),
    ("config-negative-vocab", lambda d: d["text_config"].update(vocab_size=-5), "out of range"),
    ("config-huge-vision-depth", lambda d: d["vision_config"].update(depth=10**12), "out of range"),
    ("config-bits-string", lambda d: d["quantization"].update(bits="4"), "quantization.bits"),
    ("config-override-list", lambda d: d["quantization"].update({"x.gate": [8]}), "quantization.x.gate"),
    ("config-text-config-list", lambda d: d.update(text_config=[1]), "text_config"),
    ("config-bad-model-type", lambda d: d.update(model_type="llama"), "model_type"),
    ("config-tied-beside-a-head", lambda d: d["text_config"].update(tie_word_embeddings=True),
     "but tie_word_embeddings says the output head is the embedding"),
    ("config-no-quantization", lambda d: d.pop("quantization"), "quantization"),
    ("config-heads-not-multiple", lambda d: d["text_config"].update(num_key_value_heads=3), "not a multiple"),
    ("config-group-size-null", lambda d: d["quantization"].update(group_size=None), "quantization.group_size"),
    ("config-bits-null", lambda d: d["quantization"].update(bits=None), "quantization.bits"),
    ("config-group-size-float", lambda d: d["quantization"].update(group_size=64.0), "quantization.group_size"),
    ("config-group-size-list", lambda d: d["quantization"].update(group_size=[64]), "quantization.group_size"),
    ("config-group-size-object", lambda d: d["quantization"].update(group_size={}), "quantization.group_size"),
    ("config-group-size-bool", lambda d: d["quantization"].update(group_size=True), "quantization.group_size"),
    ("config-override-group-size-null",
     lambda d: d["quantization"]["language_model.model.layers.0.mlp.gate"].update(group_size=None),
     "quantization.language_model.model.layers.0.mlp.gate.group_size"),
]:
    def _build(tmp, ck, conv, m=_mutate, n=_needle):
        args, needles = config_case(m)(tmp, ck, conv)
        return args, needles + (n,)
    CASES[_name] = _build


@case("index-not-json")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "model.safetensors.index.json").write_text("{")
    return ["convert", c, tmp / "out"], (str(c / "model.safetensors.index.json"), "does not parse")


@case("index-shard-name-number")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "model.safetensors.index.json", lambda d: d["weight_map"].update({"x": 7}))
    return ["convert", c, tmp / "out"], (str(c / "model.safetensors.index.json"), "not a shard file name")


@case("index-shard-name-escapes")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "model.safetensors.index.json", lambda d: d["weight_map"].update({"x": "../../etc/passwd"}))
    return ["convert", c, tmp / "out"], (str(c / "model.safetensors.index.json"), "not a plain file name")


@case("index-total-size-float")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "model.safetensors.index.json", lambda d: d["metadata"].update(total_size=1.5))
    return ["convert", c, tmp / "out"], (str(c / "model.safetensors.index.json"), "total_size")


@case("index-no-weight-map")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "model.safetensors.index.json", lambda d: d.pop("weight_map"))
    return ["convert", c, tmp / "out"], (str(c / "model.safetensors.index.json"), "weight_map")


@case("index-names-missing-shard")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "model.safetensors.index.json", lambda d: d["weight_map"].update({"x": "model-x.safetensors"}))
    return ["convert", c, tmp / "out"], (str(c / "model-x.safetensors"), "missing shard")


@case("checkpoint-without-tokenizer")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    (c / "tokenizer.json").unlink()
    return ["convert", c, tmp / "out"], (str(c / "tokenizer.json"), "missing")


@case("index-names-absent-tensor")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    shard = shard_files(c)[1].name
    edit_json(c / "model.safetensors.index.json", lambda d: d["weight_map"].update({"ghost.weight": shard}))
    return ["convert", c, tmp / "out"], (str(c / shard), "ghost.weight")


@case("shard-truncated")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    p = shard_files(c)[2]
    p.write_bytes(p.read_bytes()[:-1000])
    return ["convert", c, tmp / "out"], (str(p), "truncated")


@case("shard-three-bytes")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    p = shard_files(c)[1]
    p.write_bytes(b"abc")
    return ["convert", c, tmp / "out"], (str(p), "too short")


@case("shard-header-length-huge")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    p = shard_files(c)[1]
    p.write_bytes(struct.pack("<Q", 1 << 62) + p.read_bytes()[8:])
    return ["convert", c, tmp / "out"], (str(p), "does not fit")


@case("shard-header-not-json")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    p = shard_files(c)[1]
    raw = p.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    p.write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    return ["convert", c, tmp / "out"], (str(p), "does not parse")


@case("shard-is-a-fifo")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    p = shard_files(c)[1]
    p.unlink()
    return ["convert", c, tmp / "out"], (str(fifo(p)), "FIFO")


for _name, _mutate, _needle in [
    ("header-float-offsets", lambda d: first_tensor(d).update(data_offsets=[0.0, float(first_tensor(d)["data_offsets"][1])]),
     "data_offsets must be two integers"),
    ("header-dim-2-pow-63", lambda d: first_tensor(d).update(shape=[2**63, 2]), "shape"),
    ("header-negative-dim", lambda d: first_tensor(d).update(shape=[-1, 4]), "shape"),
    ("header-bool-dim", lambda d: first_tensor(d).update(shape=[True]), "shape"),
    ("header-unknown-dtype", lambda d: first_tensor(d).update(dtype="F8_E4M3"), "unsupported dtype"),
    ("header-no-offsets", lambda d: first_tensor(d).pop("data_offsets"), "malformed"),
    ("header-span-mismatch", lambda d: first_tensor(d).update(shape=[1]), "spans"),
    ("header-metadata-not-strings", lambda d: d.update(__metadata__={"format": 1}), "__metadata__"),
    ("header-overlap", lambda d: overlap_two(d), "overlap"),
]:
    def _build(tmp, ck, conv, m=_mutate, n=_needle):
        c = copy(ck, tmp / "ck")
        p = edit_header(shard_files(c)[1], m)
        return ["convert", c, tmp / "out"], (str(p), n)
    CASES[_name] = _build


@case("tensor-in-two-shards")
def _(tmp, ck, conv):
    """A tensor copied into a second shard with other bytes: ambiguous, refused."""
    c = copy(ck, tmp / "ck")
    a, b = shard_files(c)[1], shard_files(c)[2]
    raw_a = a.read_bytes()
    (n,) = struct.unpack("<Q", raw_a[:8])
    doc_a = json.loads(raw_a[8:8 + n])
    name = next(k for k in doc_a if k != "__metadata__")
    t = doc_a[name]

    def add(doc: dict) -> None:
        end = max(v["data_offsets"][1] for k, v in doc.items() if k != "__metadata__")
        doc[name] = {**t, "data_offsets": [end, end + t["data_offsets"][1] - t["data_offsets"][0]]}

    edit_header(b, add)
    b.write_bytes(b.read_bytes() + b"\x01" * (t["data_offsets"][1] - t["data_offsets"][0]))
    return ["convert", c, tmp / "out"], (name, "also in")


def retype(ck: Path, suffix: str, was: str, now: str) -> tuple[Path, str]:
    """The first tensor whose name ends in `suffix` and whose dtype is `was` given dtype `now` (of the same width: its
    bytes stay whole) in its shard's header; returns the shard and the tensor's name."""
    for shard in shard_files(ck):
        raw = shard.read_bytes()
        doc = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        name = next((k for k, v in doc.items() if k.endswith(suffix) and "experts" not in k
                     and isinstance(v, dict) and v.get("dtype") == was), None)
        if name is not None:
            edit_header(shard, lambda d, n=name: d[n].update(dtype=now))
            return shard, name
    raise AssertionError(f"no {was} tensor ending in {suffix}")


for _name, _suffix, _was, _now, _needle in [
    ("tensor-norm-not-a-float", "input_layernorm.weight", "BF16", "I16", "I16, expected a float dtype"),
    ("tensor-quantized-weight-signed", "self_attn.q_proj.weight", "U32", "I32", "the config says U32"),
]:
    def _build(tmp, ck, conv, suffix=_suffix, was=_was, now=_now, n=_needle):
        c = copy(ck, tmp / "ck")
        _, name = retype(c, suffix, was, now)
        return ["convert", c, tmp / "out"], (str(c / "config.json"), name, n)
    CASES[_name] = _build


@case("expert-scales-and-biases-of-two-dtypes")
def _(tmp, ck, conv):
    """Layer 0's gate_proj scales given another float dtype of the same width than the biases beside them: the
    biases are named, and why (not as if the config implied another dtype)."""
    c = copy(ck, tmp / "ck")
    for shard in shard_files(c):
        raw = shard.read_bytes()
        doc = json.loads(raw[8:8 + struct.unpack("<Q", raw[:8])[0]])
        name = next((k for k in doc if k.endswith("layers.0.mlp.switch_mlp.gate_proj.scales")), None)
        if name is not None:
            edit_header(shard, lambda d, n=name: d[n].update(dtype="F16"))
            return ["convert", c, tmp / "out"], (name.replace(".scales", ".biases") + " is BF16, but " + name + " is F16",
                                                 "share one dtype")
    raise AssertionError("no layer 0 gate_proj scales")


@case("convert-a-conversion")
def _(tmp, ck, conv):
    return ["convert", conv, tmp / "out"], (str(conv), "is a streamoe conversion (manifest.json), not a checkpoint")


@case("plan-a-checkpoint-directory")
def _(tmp, ck, conv):
    return ["plan", ck], (str(ck / "manifest.json"), "is a checkpoint, not a converted streamoe model",
                          str(ck / "config.json"))


# ---------------------------------------------------------------------------------------------- convert: the output

@case("force-onto-the-source")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    return ["convert", c, c, "--force"], (str(c), "is the source checkpoint")


@case("force-onto-a-parent-of-the-source")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "deep" / "ck")
    return ["convert", c, tmp / "deep", "--force"], (str(tmp / "deep"), "above it")


@case("force-onto-a-user-directory")
def _(tmp, ck, conv):
    (tmp / "home").mkdir()
    (tmp / "home" / "thesis.tex").write_text("years of work")
    return ["convert", ck, tmp / "home", "--force"], (str(tmp / "home"), "not a streamoe conversion")


@case("force-onto-a-conversion-holding-user-files")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    (c / "NOTES.md").write_text("my notes")
    (c / "runs").mkdir()
    (c / "runs" / "run1.jsonl").write_text("{}")
    return ["convert", ck, c, "--force"], (str(c), "NOTES.md, runs/run1.jsonl", "never other files")


@case("force-onto-a-fake-manifest")
def _(tmp, ck, conv):
    (tmp / "d").mkdir()
    (tmp / "d" / "manifest.json").write_text('{"format": "other"}')
    return ["convert", ck, tmp / "d", "--force"], (str(tmp / "d"), "not a streamoe conversion")


@case("out-is-a-file")
def _(tmp, ck, conv):
    (tmp / "out").write_text("x")
    return ["convert", ck, tmp / "out", "--force"], (str(tmp / "out"), "not a directory")


@case("out-parent-is-a-file")
def _(tmp, ck, conv):
    (tmp / "f").write_text("x")
    return ["convert", ck, tmp / "f" / "out"], (str(tmp / "f"), "not a directory")


@case("out-not-empty-no-force")
def _(tmp, ck, conv):
    (tmp / "out").mkdir()
    (tmp / "out" / "x").write_text("x")
    return ["convert", ck, tmp / "out"], (str(tmp / "out"), "not empty")


@case("out-is-a-conversion-no-force")
def _(tmp, ck, conv):
    return ["convert", ck, copy(conv, tmp / "conv")], (str(tmp / "conv"), "--force")


@case("out-partial-is-the-users")
def _(tmp, ck, conv):
    (tmp / ".out.partial").mkdir()
    (tmp / ".out.partial" / "notes.txt").write_text("mine")
    return ["convert", ck, tmp / "out"], (str(tmp / ".out.partial"), "not made by streamoe")


@case("out-on-read-only-fs")
def _(tmp, ck, conv):
    if not os.path.isdir("/sys") or not os.statvfs("/sys").f_flag & os.ST_RDONLY:
        pytest.skip("no read-only file system (/sys) to aim at")
    target = Path("/sys/streamoe-out")
    return ["convert", ck, target], (str(target), "read-only")


@case("experts-empty")
def _(tmp, ck, conv):
    return ["convert", ck, tmp / "out", "--experts", ""], ("--experts",)


@case("experts-unknown")
def _(tmp, ck, conv):
    return ["convert", ck, tmp / "out", "--experts", "q4,q5"], ("--experts", "q5")


@case("synth-shard-mb-nan")
def _(tmp, ck, conv):
    return ["synth", tmp / "s", "--shard-mb", "nan"], ("--shard-mb", "finite")


@case("synth-negative-seed")
def _(tmp, ck, conv):
    return ["synth", tmp / "s", "--seed", "-1"], ("--seed",)


# ---------------------------------------------------------------------------------------------- validate / manifests

@case("validate-missing")
def _(tmp, ck, conv):
    return ["validate", tmp / "none"], (str(tmp / "none"), "missing")


@case("validate-source-is-another-model")
def _(tmp, ck, conv):
    c = copy(ck, tmp / "ck")
    edit_json(c / "config.json", lambda d: d["text_config"].update(rms_norm_eps=0.5))
    return ["validate", conv, "--source", c], (str(c / "config.json"), "configs differ")


@case("validate-samples-zero")
def _(tmp, ck, conv):
    return ["validate", conv, "--samples", "0"], ("--samples",)


@case("validate-samples-without-source")
def _(tmp, ck, conv):
    return ["validate", conv, "--samples", "3"], ("--samples counts the experts compared with --source",)


@case("manifest-not-json")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    (c / "manifest.json").write_text("[1,")
    return ["validate", c], (str(c / "manifest.json"), "does not parse")


@case("manifest-nested-too-deep")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    (c / "manifest.json").write_text('{"config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    return ["validate", c], (str(c / "manifest.json"), "nested too deeply")


@case("manifest-is-a-fifo")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    (c / "manifest.json").unlink()
    return ["validate", c], (str(fifo(c / "manifest.json")), "FIFO")


for _name, _mutate, _needle in [
    ("manifest-version-2", lambda d: d.update(version=2), "schema"),
    ("manifest-path-outside", lambda d: d["files"][0].update(path="../../etc/passwd"), "schema"),
    ("manifest-billion-layers", lambda d: d["model"].update(num_layers=10**9), "out of range"),
    ("manifest-config-billion-layers", lambda d: d["config"]["text_config"].update(num_hidden_layers=10**9), "out of range"),
    ("manifest-topk-over-experts", lambda d: d["model"].update(top_k=10**4), "exceeds"),
    ("manifest-blob-offset-past-end", lambda d: nonexpert(d)[0].update(offset=4096 * 10**6), "past the end"),
    ("manifest-blob-nbytes-wrong", lambda d: nonexpert(d)[0].update(nbytes=nonexpert(d)[0]["nbytes"] + 2), "needs"),
    ("manifest-blob-dim-huge", lambda d: nonexpert(d)[0].update(shape=[2**63, 2**63]), "shape"),
    ("manifest-blob-overlap", lambda d: nonexpert(d)[1].update(offset=nonexpert(d)[0]["offset"]), "overlap"),
    ("manifest-blob-duplicate", lambda d: nonexpert(d).append(dict(nonexpert(d)[0])), "twice"),
    ("manifest-file-size-huge", lambda d: d["blobs"]["nonexpert"]["file"].update(size=2**62), "out of range"),
    ("manifest-bad-group", lambda d: d["experts"]["q4"].update(group_size=128), "does not pack"),
    ("manifest-vision-file-layer", lambda d: d["blobs"]["vision"]["file"].update(layer=1), "blobs.vision.file"),
    ("manifest-vision-file-extra-key", lambda d: d["blobs"]["vision"]["file"].update(x=1), "blobs/vision/file"),
    ("manifest-side-file-layer", lambda d: d["files"][0].update(layer=0), "files[0]"),
]:
    def _build(tmp, ck, conv, m=_mutate, n=_needle):
        args, needles = manifest_case(m)(tmp, ck, conv)
        return args, needles + (n,)
    CASES[_name] = _build


def _router_bits(d: dict) -> None:
    next(t for t in nonexpert(d) if t["name"].endswith("mlp.gate.weight")).update(bits=4)


def _drop_tensor(d: dict) -> None:
    d["blobs"]["nonexpert"]["tensors"] = [t for t in nonexpert(d) if not t["name"].endswith("layers.0.input_layernorm.weight")]


def _config_not_integer(d: dict) -> None:
    d["config"]["text_config"]["full_attention_interval"] = 7  # read where the tensors are checked


@case("validate-manifest-config-wrong")
def _(tmp, ck, conv):
    args, needles = manifest_case(_config_not_integer)(tmp, ck, conv)
    return args, needles + ("full_attention_interval 7",)


@case("run-manifest-config-wrong")
def _(tmp, ck, conv):
    args, needles = manifest_case(_config_not_integer, "run")(tmp, ck, conv)
    return args, needles + ("full_attention_interval 7",)


@case("validate-router-bits-wrong")
def _(tmp, ck, conv):
    args, needles = manifest_case(_router_bits)(tmp, ck, conv)
    return args, needles + ("mlp.gate.weight", "8 bits")


@case("validate-needed-tensor-missing")
def _(tmp, ck, conv):
    args, needles = manifest_case(_drop_tensor)(tmp, ck, conv)
    return args, needles + ("input_layernorm.weight", "missing")


@case("run-needed-tensor-missing")
def _(tmp, ck, conv):
    args, needles = manifest_case(_drop_tensor, "run")(tmp, ck, conv)
    return args, needles + ("input_layernorm.weight", "missing")


@case("run-router-bits-wrong")
def _(tmp, ck, conv):
    args, needles = manifest_case(_router_bits, "run")(tmp, ck, conv)
    return args, needles + ("8 bits",)


@case("run-truncated-nonexpert")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    p = c / "nonexpert.bin"
    os.truncate(p, p.stat().st_size // 2)
    return run_args(c), (str(p), "truncated")


@case("validate-truncated-nonexpert")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    p = c / "nonexpert.bin"
    os.truncate(p, p.stat().st_size // 2)
    return ["validate", c], (str(p), "manifest says")


@case("run-layer-file-is-a-directory")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    p = c / "experts" / "q4" / "layer-00.bin"
    p.unlink()
    p.mkdir()
    return run_args(c), (str(p), "is a directory")


# ---------------------------------------------------------------------------------------------- run: options and side files

RUN, SERVE = ("run", "-p", "hi"), ("serve", "--port", "0")  # a command and what it needs besides the option
for _cmd, _name, _opts, _needle in [
    (RUN, "cap-nan", ["--cap", "nan"], "--cap"),
    (RUN, "cap-inf", ["--cap", "inf"], "--cap"),
    (RUN, "cap-negative", ["--cap", "-1"], "--cap"),
    (RUN, "temp-nan", ["--temp", "nan"], "--temp"),
    (RUN, "top-p-nan", ["--top-p", "nan"], "--top-p"),
    (RUN, "min-p-over-one", ["--min-p", "1.5"], "--min-p"),
    (RUN, "presence-penalty-out-of-range", ["--presence-penalty", "3"], "--presence-penalty"),
    (RUN, "repetition-penalty-zero", ["--repetition-penalty", "0"], "--repetition-penalty"),
    (RUN, "ctx-zero", ["--ctx", "0"], "--ctx"),
    (RUN, "prefetch-waste-nan", ["--prefetch-waste", "nan"], "--prefetch-waste"),
    (RUN, "prefetch-waste-over-one", ["--prefetch-waste", "1.5"], "--prefetch-waste"),
    (RUN, "prompt-not-utf8", ["--prompt", os.fsdecode(b"caf\xe9")], "--prompt"),
    (SERVE, "serve-prompt-cache-nan", ["--prompt-cache-mib", "nan"], "--prompt-cache-mib"),
    (SERVE, "serve-max-body-inf", ["--max-body-mib", "inf"], "--max-body-mib"),
    (SERVE, "serve-max-image-nan", ["--max-image-mib", "nan"], "--max-image-mib"),
    (SERVE, "serve-head-timeout-nan", ["--head-timeout", "nan"], "--head-timeout"),
    (SERVE, "serve-body-timeout-inf", ["--body-timeout", "inf"], "--body-timeout"),
    (SERVE, "serve-idle-timeout-nan", ["--idle-timeout", "nan"], "--idle-timeout"),
    (SERVE, "serve-sse-keepalive-nan", ["--sse-keepalive", "nan"], "--sse-keepalive"),
    (SERVE, "serve-prompt-cache-huge", ["--prompt-cache-mib", "1e300"], "--prompt-cache-mib"),
    (SERVE, "serve-api-key-empty", ["--api-key", ""], "--api-key"),  # not "no key": the key meant was unset
    (SERVE, "serve-api-key-with-a-space", ["--api-key", "my key"], "--api-key"),
]:
    def _build(tmp, ck, conv, c=_cmd, o=_opts, n=_needle):
        return [c[0], conv, *c[1:], *o], (n,)
    CASES[_name] = _build


@case("plan-bare-config-of-8-bit-experts")
def _(tmp, ck, conv):
    config = json.loads((ck / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        if key in config:
            config[key]["bits"] = 8  # an export convert refuses: its plan would be of another model's sizes
    (tmp / "config.json").write_text(json.dumps(config))
    return ["plan", tmp / "config.json", "--cap", "1"], (str(tmp / "config.json"), "unsupported expert quantization (8-bit)")


@case("plan-more-ranks-than-experts")
def _(tmp, ck, conv):
    return ["plan", conv, "--cap", "1", "--ranks", "9"], ("9 ranks for 8 experts", "at most 8")


@case("run-stats-where-no-file-can-be")
def _(tmp, ck, conv):  # /proc takes no new file: said before the run, not after the answer
    return run_args(conv, "--stats", "/proc/streamoe-stats.jsonl"), ("/proc/streamoe-stats.jsonl",
                                                                    "cannot write the telemetry file")


@case("run-stats-name-too-long-for-its-temporary")
def _(tmp, ck, conv):  # a legal name whose temporary beside it is not
    name = tmp / ("a" * 250)
    return run_args(conv, "--stats", name), (str(name), "file name too long")


@case("run-raw-with-a-system-message")
def _(tmp, ck, conv):
    return run_args(conv, "--raw", "--system", "be brief"), ("--system needs the chat template",)


@case("run-raw-empty-prompt-file")
def _(tmp, ck, conv):
    (tmp / "empty.txt").write_text("")
    return ["run", conv, "--cap", "1", "--raw", "-f", tmp / "empty.txt", "-n", "1"], (
        str(tmp / "empty.txt"), "the prompt is empty, and --raw feeds it as it is")


@case("run-empty-image-path")
def _(tmp, ck, conv):
    return run_args(conv, "--image", ""), ("--image", "is empty (an unset variable?)")


@case("run-dot-image-path")
def _(tmp, ck, conv):
    return run_args(conv, "--image", "."), ("--image needs an image file, not an empty path or '.'",)


@case("run-raw-empty-prompt")
def _(tmp, ck, conv):
    return ["run", conv, "--cap", "1", "--raw", "-p", "", "-n", "1"], ("--prompt: the prompt is empty",)


@case("run-one-file-for-two-outputs")
def _(tmp, ck, conv):
    return run_args(conv, "--stats", tmp / "out", "--save-session", tmp / "out"), (
        str(tmp / "out"), "both --stats and --save-session")


@case("run-stats-over-the-prompt-file")
def _(tmp, ck, conv):
    (tmp / "prompt.txt").write_text("hi")
    return ["run", conv, "--cap", "1", "-f", tmp / "prompt.txt", "-q", "--stats", tmp / "prompt.txt"], (
        str(tmp / "prompt.txt"), "is the prompt file")


@case("run-logits-over-the-loaded-session")
def _(tmp, ck, conv):
    (tmp / "s.zst").write_bytes(b"not read: refused before")
    return run_args(conv, "--load-session", tmp / "s.zst", "--logits-out", tmp / "s.zst"), (
        str(tmp / "s.zst"), "is the session loaded")


@case("run-stats-inside-the-model")
def _(tmp, ck, conv):
    return run_args(conv, "--stats", conv / "tokenizer.json"), (str(conv / "tokenizer.json"), "inside the model directory")


@case("plan-more-than-the-machine")
def _(tmp, ck, conv):
    return ["plan", conv, "--cap", "1e6", "--ctx", "100000000"], ("this machine has",)


@case("run-more-than-the-machine")
def _(tmp, ck, conv):
    return ["run", conv, "--cap", "1e6", "--ctx", "100000000", "-p", "hi"], ("this machine has",)


@case("stats-into-missing-directory")
def _(tmp, ck, conv):
    return run_args(conv, "--stats", tmp / "no" / "s.jsonl"), (str(tmp / "no" / "s.jsonl"), "does not exist")


@case("logits-out-is-a-directory")
def _(tmp, ck, conv):
    (tmp / "d").mkdir()
    return run_args(conv, "--logits-out", tmp / "d"), (str(tmp / "d"), "is a directory")


@case("save-session-parent-is-a-file")
def _(tmp, ck, conv):
    (tmp / "f").write_text("x")
    return run_args(conv, "--save-session", tmp / "f" / "s.zst"), (str(tmp / "f" / "s.zst"), "not a directory")


@case("save-session-is-a-fifo")
def _(tmp, ck, conv):
    return run_args(conv, "--save-session", fifo(tmp / "p")), (str(tmp / "p"), "FIFO")


@case("load-session-fifo")
def _(tmp, ck, conv):
    return run_args(conv, "--load-session", fifo(tmp / "p")), (str(tmp / "p"), "FIFO")


@case("load-session-missing")
def _(tmp, ck, conv):
    return run_args(conv, "--load-session", tmp / "s.zst"), (str(tmp / "s.zst"), "missing")


@case("load-session-not-zstd")
def _(tmp, ck, conv):
    (tmp / "s.zst").write_bytes(b"hello, not a session")
    return run_args(conv, "--load-session", tmp / "s.zst"), (str(tmp / "s.zst"), "not a zstandard frame")


@case("load-session-100MiB-header-in-3KB")
def _(tmp, ck, conv):
    """The issue's cap breaker: a tiny frame whose container declares a 100 MiB header."""
    buf = io.BytesIO()
    with zstandard.ZstdCompressor(level=19, write_checksum=True).stream_writer(buf, closefd=False) as w:
        w.write(struct.pack("<Q", 100 << 20))
        for _ in range(100):
            w.write(bytes(1 << 20))
    (tmp / "s.zst").write_bytes(buf.getvalue())
    assert (tmp / "s.zst").stat().st_size < 16_000
    return run_args(conv, "--load-session", tmp / "s.zst"), (str(tmp / "s.zst"), "header length")


@case("load-session-tokens-not-int")
def _(tmp, ck, conv):
    return run_args(conv, "--load-session", session_file(tmp / "s.zst", {"tokens": "many"})), (str(tmp / "s.zst"), "tokens")


@case("load-session-extra-not-object")
def _(tmp, ck, conv):
    return run_args(conv, "--load-session", session_file(tmp / "s.zst", {"extra": [1]})), (str(tmp / "s.zst"), "extra")


@case("load-session-version-bool")
def _(tmp, ck, conv):
    p = tmp / "s.zst"
    session_file(p, {})
    raw = zstandard.ZstdDecompressor().decompress(p.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8:8 + n])
    meta = json.loads(head["__metadata__"]["streamoe_session"])
    meta["version"] = True
    head["__metadata__"]["streamoe_session"] = json.dumps(meta)
    h = json.dumps(head).encode()
    p.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(struct.pack("<Q", len(h)) + h + raw[8 + n:]))
    return run_args(conv, "--load-session", p), (str(p), "version")


def _side_file(name: str, content: bytes, needle: str) -> Case:
    def build(tmp, ck, conv):
        c = copy(conv, tmp / "conv")
        (c / name).write_bytes(content)
        return run_args(c), (str(c / name), needle)
    return build


CASES["chat-template-syntax-error"] = _side_file("chat_template.jinja", b"{% if %}", "chat template does not parse")
CASES["chat-template-not-utf8"] = _side_file("chat_template.jinja", b"\xff\xfe{{ x }}", "UTF-8")
CASES["chat-template-raises"] = _side_file("chat_template.jinja", b"{{ raise_exception('no') }}", "fails to render")
CASES["generation-config-not-json"] = _side_file("generation_config.json", b"{eos", "does not parse")
CASES["preprocessor-config-not-json"] = _side_file("preprocessor_config.json", b"[[[", "does not parse")
CASES["preprocessor-config-bad-values"] = _side_file("preprocessor_config.json", b'{"image_std": [0, 0, 0]}',
                                                     "preprocessor values")


@case("tokenizer-is-a-fifo")
def _(tmp, ck, conv):
    c = copy(conv, tmp / "conv")
    (c / "tokenizer.json").unlink()
    return run_args(c), (str(fifo(c / "tokenizer.json")), "FIFO")


@case("prompt-file-is-a-fifo")
def _(tmp, ck, conv):
    return ["run", conv, "--cap", "1", "-f", fifo(tmp / "p")], (str(tmp / "p"), "a pipe that gave nothing")


@case("prompt-file-not-utf8")
def _(tmp, ck, conv):
    (tmp / "p.txt").write_bytes(b"caf\xe9")
    return ["run", conv, "--cap", "1", "-f", tmp / "p.txt"], (str(tmp / "p.txt"), "not UTF-8 text (byte 3)")


@case("prompt-and-prompt-file")
def _(tmp, ck, conv):
    (tmp / "p.txt").write_text("hi")
    return ["run", conv, "--cap", "1", "-f", tmp / "p.txt", "-p", "hi"], ("not both",)


@case("json-schema-not-an-object")
def _(tmp, ck, conv):
    return run_args(conv, "--json-schema", "[1, 2]"), ("--json-schema", "is not a JSON object")


@case("json-schema-file-not-json")
def _(tmp, ck, conv):
    (tmp / "s.json").write_text("{nope")
    return run_args(conv, "--json-schema", tmp / "s.json"), (str(tmp / "s.json"), "does not parse as JSON")


@case("json-schema-does-not-compile")
def _(tmp, ck, conv):
    return run_args(conv, "--json-schema", '{"type": "no-such-type"}'), ("--json-schema", "does not compile")


@case("image-is-a-fifo")
def _(tmp, ck, conv):
    return ["run", conv, "--cap", "1", "-p", "hi", "--image", fifo(tmp / "p")], (str(tmp / "p"),)


def _bare_config(mutate: Callable[[dict], object]) -> Case:
    def build(tmp, ck, conv):
        p = tmp / "config.json"
        p.write_text((ck / "config.json").read_text())
        edit_json(p, mutate)
        return ["plan", p], (str(p),)
    return build


for _name, _mutate, _needle in [
    ("plan-bare-billion-layers", lambda d: d["text_config"].update(num_hidden_layers=10**9), "out of range"),
    ("plan-bare-zero-experts", lambda d: d["text_config"].update(num_experts=0), "out of range"),
    ("plan-bare-string-hidden", lambda d: d["text_config"].update(hidden_size="big"), "must be an integer"),
    ("plan-bare-null-group-size", lambda d: d["quantization"].update(group_size=None), "quantization.group_size"),
]:
    def _build(tmp, ck, conv, m=_mutate, n=_needle):
        args, needles = _bare_config(m)(tmp, ck, conv)
        return args, needles + (n,)
    CASES[_name] = _build


# ---------------------------------------------------------------------------------------------- the test

def test_an_empty_api_key_variable_is_refused_not_read_as_no_key(tiny_conv: Path) -> None:
    """STREAMOE_API_KEY set but empty (`export STREAMOE_API_KEY=$KEY` with KEY unset): refused in one line, where
    click alone reads it as unset and the server would answer every client without a key."""
    p = cli("serve", tiny_conv, "--port", "0", env={**os.environ, "STREAMOE_API_KEY": ""}, timeout=120)
    assert p.returncode == 2
    one_error_line(p, "--api-key", "is empty")


def test_a_closed_stdout_is_said_and_a_closed_stdin_reads_as_empty(tiny_conv: Path) -> None:
    """Started with stdout closed (`>&-`): one line and exit 2, not a result lost without a word (plan) or an
    internal error (run); with stdin closed (`<&-`), `--chat` reads it as an empty input and ends quietly."""
    import shlex
    import subprocess
    import sys

    def shell(args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "-c", f"{shlex.quote(sys.executable)} -m streamoe.cli {args}"],
                              capture_output=True, text=True, timeout=120)

    conv = shlex.quote(str(tiny_conv))
    for args in (f"plan {conv} --cap 1 >&-", f"run {conv} --cap 1 -n 2 -p hi >&-"):
        p = shell(args)
        assert p.returncode == 2, (args, p.stderr)
        one_error_line(p, "stdout is closed")
    p = shell(f"run {conv} --cap 1 -n 2 --chat -q <&-")
    assert p.returncode == 0 and "error" not in p.stderr, p.stderr


def test_catalogue_is_large_enough():
    assert len(CASES) >= 60, len(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(name: str, tiny_ckpt: Path, tiny_conv: Path, tmp_path: Path) -> None:
    scratch = tmp_path / "case"
    scratch.mkdir()
    args, needles = CASES[name](scratch, tiny_ckpt, tiny_conv)
    before, ck_before, conv_before = tree(scratch), tree(tiny_ckpt), tree(tiny_conv)
    p = cli(*args, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr)
    one_error_line(p, *needles)
    assert tree(scratch) == before, "a failed command wrote or deleted something"
    assert tree(tiny_ckpt) == ck_before and tree(tiny_conv) == conv_before


def test_streamoe_alone_prints_its_help_whole() -> None:
    """`streamoe` with no command: its usage and commands as click lays them out (exit 2, as click's), not folded
    into one error line."""
    p = cli()
    assert p.returncode == 2 and p.stderr.startswith("Usage: streamoe") and "\nCommands:\n" in p.stderr, p.stderr
    assert "error" not in p.stderr and "Traceback" not in p.stderr


def test_help_and_version_to_a_full_stdout_are_one_line() -> None:
    """`--help` and `--version` written to a stdout that refuses them (/dev/full): one line naming stdout, exit 2,
    no traceback."""
    import subprocess
    import sys

    for args in (["--version"], ["run", "--help"]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-m", "streamoe.cli", *args], stdout=full, stderr=subprocess.PIPE,
                               text=True, timeout=60)
        assert p.returncode == 2, (args, p.stderr)
        one_error_line(p, "stdout", "no space left on device")
