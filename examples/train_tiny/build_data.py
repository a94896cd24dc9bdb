"""Build the text corpus and the tokenizer (runs here, on the CPU).

    python examples/train_tiny/build_data.py [--out examples/train_tiny/data]

Writes into OUT:
  tokenizer.json       byte-level BPE (4032 tokens) + the 33 Qwen added tokens (ids 4032..4064)
  train_ids.npy        uint16 token ids of the training files, each file followed by <|endoftext|>
  heldout_ids.npy      the same for the held-out files (about 5 % of files, chosen by path hash)
  corpus.json          python version, file list with sizes and sha256, split, token counts
  check_tokens.json    a few strings and their ids (train.py asserts its tokenizer agrees)

The corpus is the standard library source of the interpreter that runs this script
(test suites included; encodings tables, pydoc_data and files over 200 kB excluded).  Another Python version gives a
slightly different corpus, so the ids are shipped to the GPU machine as files.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE
from tokenizers.trainers import BpeTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402


def build_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, continuing_subword_prefix="", end_of_word_suffix="",
                        fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(common.PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=common.BASE_VOCAB, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    if tok.get_vocab_size() != common.BASE_VOCAB:
        raise SystemExit(f"BPE trained to {tok.get_vocab_size()} tokens, expected {common.BASE_VOCAB}")
    for content, special in common.ADDED_TOKENS:
        at = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([at])
        else:
            tok.add_tokens([at])
    for content, _ in common.ADDED_TOKENS:
        assert tok.token_to_id(content) == common.TOKEN_ID[content], content
    return tok


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "data"))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    files = common.stdlib_files()
    records = []
    train_texts, held_texts = [], []
    for rel, path in files:
        raw = path.read_bytes()
        text = raw.decode("utf-8", errors="replace")
        held = common.is_heldout(rel)
        (held_texts if held else train_texts).append(text)
        records.append({"path": rel, "bytes": len(raw), "sha256": hashlib.sha256(raw).hexdigest(),
                        "split": "heldout" if held else "train"})
    print(f"{len(files)} files: {len(train_texts)} train ({sum(map(len, train_texts)) / 1e6:.2f} M chars), "
          f"{len(held_texts)} held-out ({sum(map(len, held_texts)) / 1e6:.2f} M chars)")

    tok = build_tokenizer(train_texts)
    print(f"tokenizer trained in {time.time() - t0:.1f} s, {tok.get_vocab_size()} tokens")
    tok.save(str(out / "tokenizer.json"))

    def encode(texts: list[str]) -> np.ndarray:
        ids: list[int] = []
        for enc in tok.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(common.ENDOFTEXT)
        arr = np.asarray(ids, dtype=np.uint16)
        assert int(arr.max()) < common.VOCAB_SIZE
        return arr

    train_ids = encode(train_texts)
    held_ids = encode(held_texts)
    np.save(out / "train_ids.npy", train_ids)
    np.save(out / "heldout_ids.npy", held_ids)
    chars = sum(map(len, train_texts))
    print(f"train {len(train_ids)} tokens ({chars / len(train_ids):.2f} chars/token), held-out {len(held_ids)} tokens")

    checks = {}
    for q in ["What color is the shape?", "How many shapes are there?"]:
        for think in (False, True):
            s = common.render_image_prompt(q, think)
            checks[s] = tok.encode(s, add_special_tokens=False).ids
            a = common.render_answer("red", think)
            checks[a] = tok.encode(a, add_special_tokens=False).ids
    checks["def main():\n    return 0\n"] = tok.encode("def main():\n    return 0\n").ids
    (out / "check_tokens.json").write_text(json.dumps(checks, indent=1))

    (out / "corpus.json").write_text(json.dumps({
        "python": sys.version,
        "stdlib": str(Path(files[0][1]).parents[len(Path(files[0][0]).parts) - 1]),
        "excluded_dirs": sorted(common.EXCLUDED_DIRS),
        "max_file_bytes": common.MAX_FILE_BYTES,
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "train_tokens": int(len(train_ids)),
        "heldout_tokens": int(len(held_ids)),
        "train_chars": chars,
        "files": records,
    }, indent=1))
    print(f"done in {time.time() - t0:.1f} s -> {out}")


if __name__ == "__main__":
    main()
