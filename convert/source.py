"""The input: an mlx-community MoE checkpoint directory, read through its index and shard headers.

Every fact comes from the files (config, quantization block, safetensors headers), never from
assumptions; every problem becomes one `StreamoeError` naming the file.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..formats import files as fsio
from ..formats.config import EXPERTS_MODULE, FAMILIES, ModelArgs, expert_keys, text_config
from ..formats.errors import StreamoeError, fail
from ..formats.limits import MAX_FILE_BYTES, MAX_TENSORS, check_config_sizes, check_int
from ..formats.record import MXFP4_SCALE, PROJS, RecordLayout
from ..formats.safetensors import Header, TensorInfo, read_header

SUPPORTED_MODEL_TYPES = set(FAMILIES)


def expert_re(model_type: str) -> re.Pattern:
    """A routed-expert tensor's name in a `model_type` export: (prefix, layer, proj, part)."""
    module = re.escape(EXPERTS_MODULE[model_type])
    return re.compile(rf"^(?P<prefix>(?:language_model\.)?model\.layers\.)(?P<layer>\d+)\.{module}\."
                      r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|scales|biases|bias)$")


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint side file (bounded, special files refused, one error each)."""
    return fsio.read_json(path, path.name)


def source_expert_quant(args: ModelArgs, config: Path) -> tuple[int, int]:
    """(bits, group size) of a checkpoint's routed experts as its config gives them, where streamoe converts them:
    4-bit (affine or MXFP4); otherwise one line naming the config (convert, and plan from a bare config.json)."""
    try:
        bits, group = args.expert_quant(0)
    except StreamoeError as e:
        raise fail(config, f"unsupported expert quantization: {e}") from None
    if bits != 4:
        raise fail(config, f"unsupported expert quantization ({bits}-bit): streamoe needs 4-bit source experts")
    return bits, group


@dataclass
class Checkpoint:
    root: Path
    config: dict
    tensors: dict[str, TensorInfo]
    shards: list[Header]
    total_size: int

    @property
    def text(self) -> dict:
        return text_config(self.config)

    @property
    def quant(self) -> dict:
        return self.config["quantization"]

    @property
    def args(self) -> ModelArgs:
        return ModelArgs.from_config(self.config, self.root / "config.json")

    def expert_keys(self) -> tuple[str, dict[int, dict[tuple[str, str], TensorInfo]]]:
        """The expert prefix and, per layer, the stacked expert tensors (nine for 4-bit affine experts)."""
        layers: dict[int, dict[tuple[str, str], TensorInfo]] = {}
        prefixes = set()
        pattern = expert_re(self.args.model_type)
        for name, t in self.tensors.items():
            m = pattern.match(name)
            if m:
                prefixes.add(m["prefix"])
                layers.setdefault(int(m["layer"]), {})[(m["proj"], m["part"])] = t
        if len(prefixes) != 1:
            raise fail(self.root / "model.safetensors.index.json",
                       f"no routed-expert tensors ({EXPERTS_MODULE[self.args.model_type]}) found" if not prefixes
                       else f"expert tensors under several prefixes {sorted(prefixes)}")
        return prefixes.pop(), layers

    def layer_layout(self) -> RecordLayout:
        """The record layout of the source's experts as the config implies it (4-bit affine, or MXFP4; with the
        experts' biases where the family has them); every expert tensor is checked against it."""
        a = self.args
        hidden, inter, n_exp = a.hidden_size, a.moe_intermediate_size, a.num_experts
        prefix, layers = self.expert_keys()
        module = EXPERTS_MODULE[a.model_type]
        bits, group = source_expert_quant(a, self.root / "config.json")
        mode = a.expert_mode(0)
        first = min(layers)

        def sample(part: str) -> TensorInfo:
            t = layers[first].get(("gate_proj", part))
            if t is None:
                raise fail(self.root / "model.safetensors.index.json", f"tensor {prefix}{first}.{module}.gate_proj.{part} is missing")
            return t

        scale_dtype = sample("scales").dtype
        if mode == "mxfp4" and scale_dtype != MXFP4_SCALE:
            raise fail(sample("scales").file, f"tensor {sample('scales').name} is {scale_dtype}; MXFP4 scales are {MXFP4_SCALE}")
        bias_dtype = sample("bias").dtype if a.expert_bias else None
        try:
            lay = RecordLayout.make(hidden, inter, bits, group, scale_dtype, mode, bias_dtype)
        except (ValueError, KeyError, StreamoeError) as e:
            raise fail(self.root / "config.json", f"expert dims do not pack: {e}") from None
        n_layers = a.num_hidden_layers
        if sorted(layers) != list(range(n_layers)):
            raise fail(self.root / "model.safetensors.index.json",
                       f"expert tensors for layers {sorted(layers)[:3]}... but config has {n_layers} layers")
        for li, ts in layers.items():
            extra = sorted(set(ts) - {(s.proj, s.part) for s in lay.segments})
            if extra:
                raise fail(ts[extra[0]].file, f"tensor {prefix}{li}.{module}.{'.'.join(extra[0])} is not part of a "
                                              f"{mode} expert record of {a.model_type}")
            for proj in PROJS:
                for part in lay.parts:
                    t = ts.get((proj, part))
                    name = f"{prefix}{li}.{module}.{proj}.{part}"
                    if t is None:
                        raise fail(self.root / "model.safetensors.index.json", f"tensor {name} is missing")
                    seg = lay.segment(proj, part)
                    want = (n_exp, *seg.shape)
                    if t.shape == want and t.dtype != seg.dtype and seg.dtype == scale_dtype and part != "scales":
                        raise fail(t.file, f"tensor {name} is {t.dtype}, but {sample('scales').name} is {scale_dtype}: "
                                           "an expert record's float parts share one dtype")
                    if t.shape != want or t.dtype != seg.dtype:
                        raise fail(t.file, f"tensor {name} is {t.dtype}{list(t.shape)} but the config implies {seg.dtype}{list(want)}")
        return lay


def read_index(path: Path) -> tuple[dict[str, str], int]:
    """The index's weight_map (tensor name -> shard file name) and total_size, types checked."""
    index = read_json(path)
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise fail(path, "has no weight_map")
    if len(wm) > MAX_TENSORS:
        raise fail(path, f"weight_map names {len(wm)} tensors (at most {MAX_TENSORS})")
    bad = next((k for k, v in wm.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise fail(path, f"weight_map entry {bad[:80]!r} is not a shard file name")
    meta = index.get("metadata") or {}
    if not isinstance(meta, dict):
        raise fail(path, "metadata is not a JSON object")
    total = check_int(meta.get("total_size", 0), 0, MAX_FILE_BYTES, "metadata.total_size", path)
    return wm, total


def check_unique(headers: dict[str, Header]) -> None:
    """A tensor stored in two shards is ambiguous (which bytes are the model?): refused, both files named."""
    seen: dict[str, Path] = {}
    for h in headers.values():
        for name in h.tensors:
            if name in seen:
                raise fail(h.path, f"tensor {name!r} is also in {seen[name].name}; a tensor must be in one shard")
            seen[name] = h.path


def open_checkpoint(root: str | Path) -> Checkpoint:
    root = Path(root)
    fsio.check_input_dir(root, "an mlx-community checkpoint directory")
    config = read_json(root / "config.json")
    check_config_sizes(config, root / "config.json")
    mt = config.get("model_type")
    if not isinstance(mt, str) or mt not in SUPPORTED_MODEL_TYPES:
        what = "has no model_type" if mt is None else f"unsupported model_type {str(mt)[:40]!r}"
        raise fail(root / "config.json", f"{what} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    q = config.get("quantization")
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        raise fail(root / "config.json", "no quantization block: streamoe converts quantized (4-bit) exports")
    tc = text_config(config)
    for key in ("hidden_size", "num_hidden_layers", "num_experts_per_tok", *expert_keys(config)):
        if not isinstance(tc.get(key), int):
            raise fail(root / "config.json", f"text config lacks integer {key!r}")
    ModelArgs.from_config(config, root / "config.json")  # every fact the conversion relies on, refused here if wrong

    if not os.path.lexists(root / "tokenizer.json"):  # the converted directory carries it: `run` reads nothing else
        raise fail(root / "tokenizer.json", "missing (a checkpoint must carry its tokenizer)")
    index_path = root / "model.safetensors.index.json"
    if os.path.lexists(index_path):
        wm, total = read_index(index_path)
    elif os.path.lexists(root / "model.safetensors"):
        wm, total = None, 0
    elif os.path.lexists(root / "manifest.json"):
        raise fail(root, "is a streamoe conversion (manifest.json), not a checkpoint: convert the checkpoint it was "
                         "made from")
    else:
        raise fail(root, "no model.safetensors.index.json and no model.safetensors")

    files = sorted(set(wm.values())) if wm else ["model.safetensors"]
    headers: dict[str, Header] = {}
    for fname in files:
        if "/" in fname or "\x00" in fname or fname.startswith("."):
            raise fail(index_path, f"shard name {fname!r} is not a plain file name")
        p = root / fname
        if not os.path.lexists(p):
            raise fail(p, "missing shard (named by the index)")
        headers[fname] = read_header(p)
    check_unique(headers)
    tensors: dict[str, TensorInfo] = {}
    if wm:
        for name, fname in wm.items():
            t = headers[fname].tensors.get(name)
            if t is None:
                raise fail(root / fname, f"tensor {name} named by the index is not in this shard")
            tensors[name] = t
    else:
        tensors = dict(headers["model.safetensors"].tensors)
        total = sum(t.nbytes for t in tensors.values())
    ckpt = Checkpoint(root, config, tensors, list(headers.values()), total)
    return ckpt
