"""Write the non-weight files of the HF checkpoint (runs here; needs transformers + mlx-vlm).

    python examples/train_tiny/hf_meta.py DIR [--data examples/train_tiny/data]

DIR gets: config.json, generation_config.json, preprocessor_config.json,
video_preprocessor_config.json, and, through mlx-vlm's torch-free Qwen3VLProcessor,
tokenizer.json, tokenizer_config.json, chat_template.jinja,
processor_config.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import common  # noqa: E402


def write_meta(dst: Path, data_dir: Path) -> None:
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import (
        Qwen3VLImageProcessor,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    dst.mkdir(parents=True, exist_ok=True)
    template = (HERE / "chat_template.jinja").read_text()

    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_file(str(data_dir / "tokenizer.json")),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        errors="replace",
        add_prefix_space=False,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
            "audio_token": "<|audio_pad|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )
    tok.chat_template = template
    pp = common.preprocessor_config()
    image_proc = Qwen3VLImageProcessor(
        patch_size=common.PATCH, temporal_patch_size=common.TEMPORAL_PATCH, merge_size=common.MERGE,
        min_pixels=common.MIN_PIXELS, max_pixels=common.MAX_PIXELS,
    )
    video_proc = Qwen3VLVideoProcessor(
        patch_size=common.PATCH, temporal_patch_size=common.TEMPORAL_PATCH, merge_size=common.MERGE,
        min_pixels=common.MIN_PIXELS, max_pixels=MAX_VIDEO_PIXELS,
    )
    proc = Qwen3VLProcessor(image_processor=image_proc, tokenizer=tok, video_processor=video_proc,
                            chat_template=template)
    proc.save_pretrained(str(dst))

    # The tokenizer class the real Qwen3.5/3.6 files name; transformers 5.x builds the
    # same pipeline (NFC, the Qwen split regex, byte-level BPE) from tokenizer.json.
    tc_path = dst / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "Qwen3_5Tokenizer"
    tc["processor_class"] = "Qwen3VLProcessor"
    tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n")
    (dst / "chat_template.jinja").write_text(template)

    (dst / "config.json").write_text(json.dumps(common.hf_config(), indent=2) + "\n")
    (dst / "generation_config.json").write_text(json.dumps(common.generation_config(), indent=2) + "\n")
    (dst / "preprocessor_config.json").write_text(json.dumps(pp, indent=2) + "\n")
    video = dict(pp)
    video.pop("image_processor_type")
    video.update({"video_processor_type": "Qwen3VLVideoProcessor", "fps": 2, "min_frames": 4, "max_frames": 768,
                  "size": {"longest_edge": MAX_VIDEO_PIXELS, "shortest_edge": common.MIN_PIXELS}})
    (dst / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2) + "\n")


MAX_VIDEO_PIXELS = 256 * 256 * 2 * 8


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dst")
    ap.add_argument("--data", default=str(HERE / "data"))
    args = ap.parse_args()
    write_meta(Path(args.dst), Path(args.data))
    print("wrote", sorted(p.name for p in Path(args.dst).iterdir()))


if __name__ == "__main__":
    main()
