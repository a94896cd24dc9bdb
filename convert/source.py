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
from ..formats.config import FAMILIES, quant_for, text_config
from ..formats.errors import StreamoeError, fail
from ..formats.limits import MAX_FILE_BYTES, MAX_TENSORS, check_config_sizes, check_int
from ..formats.record import PARTS, PROJS, RecordLayout
from ..formats.safetensors import Header, TensorInfo, read_header

SUPPORTED_MODEL_TYPES = set(FAMILIES)
EXPERT_RE = re.compile(r"^(?P<prefix>(?:language_model\.)?model\.layers\.)(?P<layer>\d+)\.mlp\.switch_mlp\."
                       r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|scales|biases)$")


def read_json(path: Path) -> dict:
    """A JSON object from a checkpoint side file (bounded, special files refused, one error each)."""
    return fsio.read_json(path, path.name)


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

    def expert_keys(self) -> tuple[str, dict[int, dict[tuple[str, str], TensorInfo]]]:
        """The expert prefix and, per layer, the nine stacked expert tensors."""
        layers: dict[int, dict[tuple[str, str], TensorInfo]] = {}
        prefixes = set()
        for name, t in self.tensors.items():
            m = EXPERT_RE.match(name)
            if m:
                prefixes.add(m["prefix"])
                layers.setdefault(int(m["layer"]), {})[(m["proj"], m["part"])] = t
        if len(prefixes) != 1:
            raise fail(self.root / "model.safetensors.index.json", "no routed-expert tensors (switch_mlp) found" if not prefixes
                       else f"expert tensors under several prefixes {sorted(prefixes)}")
        return prefixes.pop(), layers

    def layer_layout(self) -> RecordLayout:
        """The 4-bit record layout the config implies; every expert tensor is checked against it."""
        tc = self.text
        hidden, inter, n_exp = tc["hidden_size"], tc["moe_intermediate_size"], tc["num_experts"]
        prefix, layers = self.expert_keys()
        bits_group = quant_for(self.quant, f"{prefix}0.mlp.switch_mlp.gate_proj")
        if bits_group is None or bits_group[0] != 4:
            raise fail(self.root / "config.json", f"unsupported expert quantization {bits_group}: streamoe needs 4-bit source experts")
        sample = layers[min(layers)].get(("gate_proj", "scales"))
        if sample is None:
            raise fail(self.root / "model.safetensors.index.json", f"tensor {prefix}{min(layers)}.mlp.switch_mlp.gate_proj.scales is missing")
        try:
            lay = RecordLayout.make(hidden, inter, 4, bits_group[1], sample.dtype)
        except (ValueError, StreamoeError) as e:
            raise fail(self.root / "config.json", f"expert dims do not pack: {e}") from None
        n_layers = tc["num_hidden_layers"]
        if sorted(layers) != list(range(n_layers)):
            raise fail(self.root / "model.safetensors.index.json",
                       f"expert tensors for layers {sorted(layers)[:3]}... but config has {n_layers} layers")
        for li, ts in layers.items():
            for proj in PROJS:
                for part in PARTS:
                    t = ts.get((proj, part))
                    name = f"{prefix}{li}.mlp.switch_mlp.{proj}.{part}"
                    if t is None:
                        raise fail(self.root / "model.safetensors.index.json", f"tensor {name} is missing")
                    seg = lay.segment(proj, part)
                    want = (n_exp, *seg.shape)
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
        raise fail(root / "config.json", f"unsupported model_type {str(mt)[:40]!r} (supported: {', '.join(sorted(SUPPORTED_MODEL_TYPES))})")
    q = config.get("quantization")
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        raise fail(root / "config.json", "no quantization block: streamoe converts quantized (4-bit) exports")
    if q.get("mode", "affine") != "affine":
        raise fail(root / "config.json", f"unsupported quantization mode {q.get('mode')!r} (only affine)")
    tc = text_config(config)
    for key in ("hidden_size", "num_hidden_layers", "num_experts", "num_experts_per_tok", "moe_intermediate_size"):
        if not isinstance(tc.get(key), int):
            raise fail(root / "config.json", f"text config lacks integer {key!r}")

    index_path = root / "model.safetensors.index.json"
    if os.path.lexists(index_path):
        wm, total = read_index(index_path)
    elif os.path.lexists(root / "model.safetensors"):
        wm, total = None, 0
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
