"""Assemble the HF checkpoint and export it the way mlx-community does (runs here, CPU).

    python examples/train_tiny/export.py --weights DIR_FROM_GPU [--hf examples/train_tiny/hf_out]
                                         [--mlx models/tiny] [--bf16 /tmp/tiny-bf16]

1. HF dir = the safetensors shards + index + train_log.json that train.py wrote, plus
   the non-weight files of hf_meta.py (config, tokenizer, chat template, processor).
2. mlx_vlm.convert(quantize=True, q_group_size=64, q_bits=4): 4-bit affine, group 64,
   routers and shared-expert gates at 8 bits (the model's quant predicate), vision
   tower left bf16, shards + sorted index, config with quantization == quantization_config.
3. Optionally the same conversion without quantization (bf16), used by evaluate.py to
   compare with the reference logits the GPU run recorded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import hf_meta  # noqa: E402


def assemble_hf(weights: Path, hf: Path, data: Path) -> None:
    if hf.exists():
        shutil.rmtree(hf)
    hf.mkdir(parents=True)
    for p in sorted(weights.iterdir()):
        if p.suffix == ".safetensors" or p.name in ("model.safetensors.index.json", "train_log.json"):
            shutil.copyfile(p, hf / p.name)
    hf_meta.write_meta(hf, data)


#: Shard cap.  mlx-vlm starts a new shard when the next tensor would pass 5 GiB, which
#: splits the real 19 GiB export into 4 shards; the same rule with the cap scaled to
#: 4 MiB splits this ~14 MB export into 4 shards too, so tensors of one layer straddle
#: shard files here as they do there.
SHARD_CAP = 4 << 20


def _make_shards_capped(weights: dict, max_file_size_gb=None) -> list:
    shards, shard, size = [], {}, 0
    for k, v in weights.items():
        if size + v.nbytes > SHARD_CAP:  # the same rule as the real export, smaller cap
            shards.append(shard)
            shard, size = {}, 0
        shard[k] = v
        size += v.nbytes
    shards.append(shard)
    return shards


def convert(hf: Path, dst: Path, quantize: bool) -> None:
    import mlx_vlm.utils
    from mlx_vlm.convert import convert as vlm_convert

    mlx_vlm.utils.make_shards = _make_shards_capped
    with tempfile.TemporaryDirectory(dir=dst.parent) as tmp:
        out = Path(tmp) / "m"
        if quantize:
            vlm_convert(hf_path=str(hf), mlx_path=str(out), quantize=True, q_group_size=64, q_bits=4)
        else:
            vlm_convert(hf_path=str(hf), mlx_path=str(out), dtype="bfloat16")
        # keep a README written by hand (models/tiny/README.md) over the generated card
        readme = dst / "README.md"
        keep = readme.read_text() if readme.exists() and quantize else None
        if dst.exists():
            shutil.rmtree(dst)
        (out / "train_log.json").unlink(missing_ok=True)  # copied by the converter's *.json glob
        shutil.move(str(out), str(dst))
        if keep is not None:
            (dst / "README.md").write_text(keep)


def summarize(dst: Path) -> None:
    cfg = json.loads((dst / "config.json").read_text())
    q = cfg.get("quantization")
    if q is not None:
        over = {k: v for k, v in q.items() if isinstance(v, dict)}
        assert q == cfg["quantization_config"], "quantization != quantization_config"
        assert all(v == {"group_size": 64, "bits": 8} for v in over.values()), over
        assert len(over) == 2 * cfg["text_config"]["num_hidden_layers"], len(over)
        print(f"quantization: bits {q['bits']} group {q['group_size']} mode {q.get('mode')}, {len(over)} 8-bit overrides")
    idx = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    total = sum(p.stat().st_size for p in dst.iterdir() if p.is_file())
    print(f"{dst}: {len(idx['weight_map'])} tensors in {len(shards)} shard(s), total_size {idx['metadata']['total_size']:,} B,"
          f" directory {total:,} B")
    for p in sorted(dst.iterdir()):
        print(f"  {p.stat().st_size:>12,}  {p.name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", required=True, help="folder with the shards/index/train_log.json from train.py")
    ap.add_argument("--data", default=str(HERE / "data"))
    ap.add_argument("--hf", default=str(HERE / "hf_out"))
    ap.add_argument("--mlx", default=str(ROOT / "models" / "tiny"))
    ap.add_argument("--bf16", default=None, help="also write an unquantized bf16 MLX export here")
    args = ap.parse_args()
    hf, mlx = Path(args.hf), Path(args.mlx)
    assemble_hf(Path(args.weights), hf, Path(args.data))
    mlx.parent.mkdir(parents=True, exist_ok=True)
    convert(hf, mlx, quantize=True)
    summarize(mlx)
    if args.bf16:
        Path(args.bf16).parent.mkdir(parents=True, exist_ok=True)
        convert(hf, Path(args.bf16), quantize=False)
        summarize(Path(args.bf16))


if __name__ == "__main__":
    main()
