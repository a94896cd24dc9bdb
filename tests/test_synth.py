"""`streamoe synth`: structure against the reference layout, real files loaded by the peers (mlx-lm, mlx-vlm)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from streamoe.cli import main
from streamoe.convert.synth import (
    assign_shards,
    layout,
    make_config,
    synth,
    write_checkpoint,
)
from streamoe.formats.export import specs, tensor_table
from streamoe.formats.safetensors import read_header

from .conftest import TINY_VISION_CONFIG

# the tensor table of the real export (every tensor of mlx-community/Qwen3.6-35B-A3B-4bit), recorded in the
# project's shared folder beside the checkout, not in the repository
REFERENCE = Path("/work/shared/reference/qwen3.6-35b-a3b-4bit.layout.jsonl")
if not REFERENCE.exists():  # a checkout next to shared/
    REFERENCE = Path(__file__).resolve().parents[2] / "shared/reference/qwen3.6-35b-a3b-4bit.layout.jsonl"
FULL_TOTAL = 20_401_929_952
TINY_TOTAL = 1_212_224
VISION_FILES = {"config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.jinja", "generation_config.json", "preprocessor_config.json"}

# the tiny faithful text config (mlx-lm and mlx-vlm load it), verbatim
TINY_TEXT_CONFIG = {
    "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
    "bos_token_id": 512, "dtype": "bfloat16", "eos_token_id": 512,
    "full_attention_interval": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention",
                    "linear_attention", "linear_attention", "linear_attention", "full_attention"],
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 32, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_value_head_dim": 32, "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_only_layers": [], "model_type": "qwen3_5_moe_text",
    "moe_intermediate_size": 64, "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 2, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 8,
    "num_key_value_heads": 1, "output_router_logits": False, "pad_token_id": None,
    "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [3, 3, 2],
                        "partial_rotary_factor": 0.25, "rope_theta": 10000000, "rope_type": "default"},
    "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 64, "use_cache": True,
    "vocab_size": 576,
}


def make(out: Path, size: str = "tiny", **kw) -> Path:
    args = {"variant": "qwen3.6", "text_only": False, "seed": 0, "shard_bytes": None, "dry_run": False}
    args.update(kw)
    synth(out, size=size, **args)
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("synth") / "tiny")


@pytest.fixture(scope="module")
def tiny35(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("synth") / "tiny35", variant="qwen3.5")


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("synth") / "tiny-text", text_only=True)


def load_index(ckpt: Path) -> dict:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def headers(ckpt: Path) -> dict[str, dict]:
    """Every tensor of the checkpoint, read from the shard headers the index names."""
    out = {}
    for file in sorted(set(load_index(ckpt)["weight_map"].values())):
        h = read_header(ckpt / file)
        assert h.metadata == {"format": "mlx"}
        for name, t in h.tensors.items():
            out[name] = {"dtype": t.dtype, "shape": list(t.shape), "nbytes": t.nbytes, "file": file}
    return out


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    return (raw.astype(np.uint32) << 16).view(np.float32)


def tensor_values(ckpt: Path, name: str) -> np.ndarray:
    file = load_index(ckpt)["weight_map"][name]
    t = read_header(ckpt / file).tensors[name]
    with open(ckpt / file, "rb") as f:
        f.seek(t.offset)
        raw = f.read(t.nbytes)
    if t.dtype == "BF16":
        return bf16_to_f32(np.frombuffer(raw, np.uint16)).reshape(t.shape)
    return np.frombuffer(raw, {"F32": np.float32, "U32": np.uint32}[t.dtype]).reshape(t.shape)


# ------------------------------------------------------------------------------------ full size (dry run)


def test_full_dry_run_equals_reference_layout(tmp_path):
    lines = [json.loads(line) for line in REFERENCE.read_text().splitlines()]
    head, ref = lines[0], {r["name"]: r for r in lines[1:]}
    out = tmp_path / "full"
    result = CliRunner().invoke(main, ["synth", str(out), "--size", "full", "--dry-run"])
    assert result.exit_code == 0, result.output
    assert not out.exists()
    rows = result.stdout.strip().splitlines()
    total = rows.pop().split("\t")
    assert total[0] == "total" and int(total[1]) == FULL_TOTAL == head["total_size"]
    mine = {}
    for row in rows:
        name, dtype, shape, nbytes, file = row.split("\t")
        mine[name] = {"name": name, "dtype": dtype, "shape": json.loads(shape), "nbytes": int(nbytes), "file": file}
    assert len(mine) == len(rows) == head["n_tensors"] == 2090
    assert mine == ref
    assert sum(r["nbytes"] for r in mine.values()) == FULL_TOTAL
    config = make_config("full")
    assert config["quantization"] == head["quantization"]
    assert list(config["quantization"]) == list(head["quantization"])  # same override order
    assert sum(isinstance(v, dict) for v in config["quantization"].values()) == 80


def test_full_helpers_and_variants():
    config = make_config("full")
    table = tensor_table(config)
    assert table[0][0] == "vision_tower.patch_embed.proj.weight" and table[-1][0] == "language_model.lm_head.biases"
    files = assign_shards(table)
    assert [f for f, _ in files] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert [len(e) for _, e in files] == [716, 498, 504, 372]
    # Qwen3.5 export: 4-bit routers, F32 A_log -> the recorded 20,391,405,152 bytes
    q35 = {s.name: s for s in specs(make_config("full", "qwen3.5"))}
    assert sum(s.nbytes for s in q35.values()) == 20_391_405_152
    assert q35["language_model.model.layers.0.mlp.gate.weight"].shape == (256, 256)
    assert q35["language_model.model.layers.0.linear_attn.A_log"].dtype == "F32"
    text = make_config("full", text_only=True)
    assert "vision_config" not in text and not any(n.startswith("vision_tower") for n, _, _ in tensor_table(text))
    assert sum(1 for _ in tensor_table(text)) == 1757
    # small: expert tensors of MiB, the same structure
    small = {s.name: s for s in specs(make_config("small"))}
    experts = [s for n, s in small.items() if n.startswith("language_model.model.layers.0.mlp.switch_mlp.")]
    assert sum(s.nbytes for s in experts) == 64 * 110_592
    assert len(small) == 390


# ------------------------------------------------------------------------------------ tiny on disk


def test_tiny_files_config_index(tiny):
    assert {p.name for p in tiny.iterdir()} == VISION_FILES | {"model.safetensors"}
    raw = (tiny / "config.json").read_text()
    assert raw.startswith('{\n    "architectures": [')  # json.dump(indent=4)
    config = json.loads(raw, object_pairs_hook=dict)
    assert list(config) == sorted(config)
    assert config == make_config("tiny")
    assert config["quantization"] == config["quantization_config"]
    overrides = {k: v for k, v in config["quantization"].items() if isinstance(v, dict)}
    assert len(overrides) == 16 and all(v == {"group_size": 64, "bits": 8} for v in overrides.values())
    assert {k.rsplit(".", 1)[0].split(".mlp")[0] for k in overrides} == {
        f"language_model.model.layers.{i}" for i in range(8)}
    assert config["text_config"] == TINY_TEXT_CONFIG
    assert list(config["text_config"]) == list(TINY_TEXT_CONFIG)
    assert config["vision_config"] == TINY_VISION_CONFIG
    assert (config["eos_token_id"], config["image_token_id"], config["video_token_id"],
            config["vision_start_token_id"], config["vision_end_token_id"]) == ([514, 512], 524, 525, 521, 522)

    index = load_index(tiny)
    assert index["metadata"] == {"total_size": TINY_TOTAL}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    assert (tiny / "model.safetensors.index.json").read_text().startswith('{\n    "metadata"')
    tensors = headers(tiny)
    assert len(tensors) == 390 == len(index["weight_map"])
    assert {n: t["file"] for n, t in tensors.items()} == index["weight_map"]
    table = tensor_table(config)
    assert {n: (d, list(s)) for n, d, s in table} == {n: (t["dtype"], t["shape"]) for n, t in tensors.items()}
    assert sum(t["nbytes"] for t in tensors.values()) == TINY_TOTAL
    for name, t in tensors.items():
        if name.endswith((".scales", ".biases")) or name.startswith("vision_tower."):
            assert t["dtype"] == "BF16", name
        if name.endswith(".weight") and name.rsplit(".", 1)[0] + ".scales" in tensors:
            assert t["dtype"] == "U32", name
    assert tensors["language_model.model.layers.0.linear_attn.A_log"]["dtype"] == "BF16"
    assert tensors["language_model.model.layers.0.mlp.gate.weight"]["shape"] == [8, 16]  # 8-bit
    assert tensors["language_model.model.layers.0.linear_attn.conv1d.weight"]["shape"] == [256, 4, 1]  # 2*key_dim + value_dim


def test_tiny_values_are_sane(tiny):
    norm = tensor_values(tiny, "language_model.model.layers.0.input_layernorm.weight")
    assert abs(norm.mean() - 1) < 0.02
    gated = tensor_values(tiny, "language_model.model.layers.0.linear_attn.norm.weight")
    assert abs(gated.mean() - 1) < 0.02
    a_log = tensor_values(tiny, "language_model.model.layers.0.linear_attn.A_log")
    assert (a_log >= -0.01).all() and (a_log <= np.log(16) + 0.02).all()
    ln_bias = tensor_values(tiny, "vision_tower.blocks.0.norm1.bias")
    assert abs(ln_bias).max() < 0.1
    scales = tensor_values(tiny, "language_model.model.layers.0.mlp.switch_mlp.up_proj.scales")
    assert (scales < 0).any() and (scales > 0).any()  # a real mx.quantize: negative scales occur


def test_tokenizer_files(tiny):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    expect = {"<|endoftext|>": 512, "<|im_start|>": 513, "<|im_end|>": 514, "<|vision_start|>": 521,
              "<|vision_end|>": 522, "<|image_pad|>": 524, "<|video_pad|>": 525, "<think>": 536,
              "</think>": 537, "<|audio_pad|>": 544}
    assert {k: tok.token_to_id(k) for k in expect} == expect
    assert tok.get_vocab_size() == 545
    text = "def f(x):\n    return x + 1  # héllo"
    ids = tok.encode(text).ids
    assert max(ids) < 512 and tok.decode(ids) == text
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == 513
    gen = json.loads((tiny / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [514, 512] and gen["top_k"] == 20 and gen["top_p"] == 0.95
    tc = json.loads((tiny / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>"
    assert tc["added_tokens_decoder"]["536"]["content"] == "<think>"
    assert tc["added_tokens_decoder"]["536"]["special"] is False
    pre = json.loads((tiny / "preprocessor_config.json").read_text())
    assert (pre["patch_size"], pre["temporal_patch_size"], pre["merge_size"]) == (16, 2, 2)
    assert pre["image_mean"] == pre["image_std"] == [0.5, 0.5, 0.5]


def test_chat_template_with_jinja2(tiny):
    import jinja2

    template = jinja2.Environment().from_string((tiny / "chat_template.jinja").read_text())
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    on = template.render(messages=msgs, add_generation_prompt=True)
    assert on == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"
                  "<|vision_start|><|image_pad|><|vision_end|>What is it?<|im_end|>\n"
                  "<|im_start|>assistant\n<think>\n")
    off = template.render(messages=msgs, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    history = msgs + [{"role": "assistant", "content": "<think>\nhm\n</think>\n\nA cat."},
                      {"role": "user", "content": "Sure?"}]
    assert "<|im_start|>assistant\nA cat.<|im_end|>\n<|im_start|>user\nSure?" in template.render(messages=history)


# ------------------------------------------------------------------------------------ shards


def test_small_shards_straddle_layers(tmp_path):
    cap = int(0.1 * (1 << 20))
    out = tmp_path / "sharded"
    result = CliRunner().invoke(main, ["synth", str(out), "--size", "tiny", "--shard-mb", "0.1"])
    assert result.exit_code == 0, result.output
    index = load_index(out)
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(files) > 5 and all(re.fullmatch(rf"model-\d{{5}}-of-{len(files):05d}\.safetensors", f) for f in files)
    # mlx-vlm's make_shards: the first tensor (patch embed, 192 KiB) exceeds the cap -> an empty first shard
    assert (out / files[0]).stat().st_size == 41 and files[0] not in index["weight_map"].values()
    assert read_header(out / files[0]).tensors == {}
    tensors = headers(out)
    assert {n: t["file"] for n, t in tensors.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == TINY_TOTAL
    by_file = defaultdict(list)
    for t in tensors.values():
        by_file[t["file"]].append(t["nbytes"])
    assert all(sum(v) <= cap or len(v) == 1 for v in by_file.values())
    layer_files = defaultdict(set)
    for name, t in tensors.items():
        m = re.match(r"language_model\.model\.layers\.(\d+)\.", name)
        if m:
            layer_files[int(m.group(1))].add(t["file"])
    assert any(len(f) > 1 for f in layer_files.values())
    # same bytes as the single-shard checkpoint, whatever the split
    single = make(tmp_path / "single")
    for name in ("language_model.model.layers.3.self_attn.q_proj.weight", "vision_tower.pos_embed.weight"):
        assert np.array_equal(tensor_values(out, name), tensor_values(single, name))


def test_text_only_shards_have_no_empty_file(tmp_path):
    config = make_config("tiny", text_only=True)
    shards = assign_shards(specs(config), 1000, leading_empty=False)
    assert all(entries for _, entries in shards)
    rows = layout(config, 1000)
    assert rows[0]["file"] == shards[0][0]


# ------------------------------------------------------------------------------------ peers load it


def test_tiny_loads_in_mlx_lm(tiny):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load(str(tiny))
    lm = model.language_model.model
    assert lm.layers[0].mlp.gate.bits == 8 and lm.layers[0].mlp.switch_mlp.gate_proj.bits == 4
    assert abs(lm.layers[0].input_layernorm.weight.astype(mx.float32).mean().item() - 1) < 0.02  # not re-shifted
    names = [k for k, _ in tree_flatten(model.parameters())]  # mlx-lm drops the vision tower
    assert names == [n for n, _, _ in tensor_table(make_config("tiny")) if n.startswith("language_model.")]
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True,
                                           tokenize=False)
    ids = tokenizer.encode(prompt)
    assert ids[0] == 513 and ids[-2:] == [536, 198]  # <think>\n
    cache = make_prompt_cache(model)
    logits = model(mx.array([ids]), cache=cache)
    nxt = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
    mx.eval(logits, nxt)
    assert logits.shape == (1, len(ids), 576)
    assert mx.isfinite(logits).all().item() and mx.isfinite(nxt).all().item()
    from tokenizers import Tokenizer

    text = "import os\nprint(os.getcwd())  # ünïcode"
    assert tokenizer.encode(text) == Tokenizer.from_file(str(tiny / "tokenizer.json")).encode(text).ids
    assert set(tokenizer.eos_token_ids) == {514, 512}


def test_tiny_loads_in_mlx_vlm_with_vision(tiny):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import load_model

    model = load_model(tiny)
    # module order (vision tower first) is exactly the flatten order the export shards by
    assert [k for k, _ in tree_flatten(model.parameters())] == [n for n, _, _ in tensor_table(make_config("tiny"))]
    assert model.language_model.model.layers[0].mlp.shared_expert_gate.bits == 8
    pixels = mx.array(np.random.default_rng(0).standard_normal((16, 3 * 2 * 16 * 16)).astype(np.float32))
    out = model.vision_tower(pixels.astype(mx.bfloat16), mx.array([[1, 4, 4]]))
    hidden = out[0] if isinstance(out, (tuple, list)) else out
    mx.eval(hidden)
    assert hidden.shape == (4, 64) and mx.isfinite(hidden).all().item()


def test_qwen35_variant(tiny35):
    import mlx.core as mx
    from mlx_lm.utils import load_model

    config = json.loads((tiny35 / "config.json").read_text())
    assert config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert config["quantization"] == config["quantization_config"]
    tensors = headers(tiny35)
    assert tensors["language_model.model.layers.0.mlp.gate.weight"]["shape"] == [8, 8]  # 4-bit
    assert tensors["language_model.model.layers.0.mlp.shared_expert_gate.weight"]["shape"] == [1, 8]
    assert all(t["dtype"] == "F32" for n, t in tensors.items() if n.endswith("A_log"))
    assert load_index(tiny35)["metadata"]["total_size"] == sum(t["nbytes"] for t in tensors.values())
    model, _ = load_model(tiny35)
    assert model.language_model.model.layers[0].mlp.gate.bits == 4
    logits = model(mx.array([[1, 2, 3, 4, 5]]))
    assert mx.isfinite(logits).all().item()


def test_text_only(tiny_text):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm import load

    names = {p.name for p in tiny_text.iterdir()}
    assert names == VISION_FILES - {"preprocessor_config.json"} | {"model.safetensors"}
    config = json.loads((tiny_text / "config.json").read_text())
    assert "vision_config" not in config and config["model_type"] == "qwen3_5_moe"
    assert config["image_token_id"] == 524 and list(config) == sorted(config)
    assert config["text_config"]["rope_parameters"] == {"mrope_interleaved": True, "mrope_section": [3, 3, 2],
                                                        "partial_rotary_factor": 0.25, "rope_theta": 10000000,
                                                        "type": "default"}
    index = load_index(tiny_text)
    assert not any(n.startswith("vision_tower") for n in index["weight_map"])
    assert len(index["weight_map"]) == 357 and set(index["metadata"]) == {"total_size", "total_parameters"}
    model, tokenizer = load(str(tiny_text))
    assert [k for k, _ in tree_flatten(model.parameters())] == [
        n for n, _, _ in tensor_table(make_config("tiny", text_only=True))]
    logits = model(mx.array([tokenizer.encode("hello world")]))
    assert mx.isfinite(logits).all().item()


def test_streaming_code_path_is_sane(tmp_path):
    """The random-code path `full` uses, on the tiny shapes: loads, finite, dequantized std ≈ 0.02."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    out = tmp_path / "codes"
    out.mkdir()
    write_checkpoint(out, make_config("tiny"), seed=3, exact=False)
    assert load_index(out)["metadata"]["total_size"] == TINY_TOTAL
    model, _ = load_model(out)
    sw = model.language_model.model.layers[1].mlp.switch_mlp.down_proj
    w = mx.dequantize(sw.weight, sw.scales, sw.biases, group_size=64, bits=4).astype(mx.float32)
    assert abs(w.mean().item()) < 0.002 and 0.016 < w.std().item() < 0.024
    assert mx.isfinite(model(mx.array([[5, 6, 7, 8]]))).all().item()


# ------------------------------------------------------------------------------------ seeds and errors


def test_reproducible_from_seed(tiny, tmp_path):
    again = make(tmp_path / "again")
    other = make(tmp_path / "other", seed=1)
    for p in tiny.iterdir():
        assert (again / p.name).read_bytes() == p.read_bytes(), p.name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "config.json").read_bytes() == (tiny / "config.json").read_bytes()


def test_existing_output_is_refused(tmp_path):
    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = CliRunner().invoke(main, ["synth", str(out), "--size", "tiny"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and str(out) in lines[0] and "not empty" in lines[0]
    assert "Traceback" not in result.output and (out / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no temporary left behind

    # the real console entry point: one line, exit 2, no traceback
    proc = subprocess.run([sys.executable, "-m", "streamoe.cli", "synth", str(out)], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and str(out) in proc.stderr and "Traceback" not in proc.stderr


def test_unwritable_and_odd_outputs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for out, words in ((blocker, "not a directory"), (blocker / "sub", "is a regular file, not a directory")):
        result = CliRunner().invoke(main, ["synth", str(out)])
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and str(out) in lines[0] and words in lines[0]
    result = CliRunner().invoke(main, ["synth", str(tmp_path / "x"), "--shard-mb", "0"])
    assert result.exit_code == 2 and "--shard-mb" in result.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert CliRunner().invoke(main, ["synth", str(empty)]).exit_code == 0  # an empty directory is fine
    assert (empty / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]


def test_small_for_caching(small_ckpt):
    """The session's small checkpoint (what the runtime tests stream from): its table, and mlx-lm loads it."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    out = small_ckpt
    tensors = headers(out)
    assert len(tensors) == 390
    up = tensors["language_model.model.layers.5.mlp.switch_mlp.up_proj.weight"]
    assert up["shape"] == [64, 256, 32] and up["nbytes"] == 2 << 20
    experts = sum(t["nbytes"] for n, t in tensors.items() if ".switch_mlp." in n)
    assert experts == 8 * 64 * 110_592  # 56.6 MB of routed experts
    config = json.loads((out / "config.json").read_text())
    t = config["text_config"]
    assert t["head_dim"] * t["partial_rotary_factor"] / 2 == sum(t["rope_parameters"]["mrope_section"])
    assert config["vision_config"]["out_hidden_size"] == t["hidden_size"] == 256
    model, _ = load_model(out)
    logits = model(mx.array([[1, 2, 3, 500, 514]]))
    assert logits.shape == (1, 5, 576) and mx.isfinite(logits).all().item()


def test_tiny_answers_an_image_question_in_mlx_vlm(tiny):
    """The whole mlx-vlm path: processor from our tokenizer/preprocessor files, template, image tokens."""
    import mlx.core as mx
    from mlx_vlm import generate, load
    from mlx_vlm.prompt_utils import apply_chat_template
    from PIL import Image

    model, processor = load(str(tiny))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8))
    prompt = apply_chat_template(processor, model.config, "What is this?", num_images=1)
    assert "<|vision_start|><|image_pad|><|vision_end|>" in prompt
    mx.random.seed(0)  # mlx-vlm samples with the global random state: fix it, so the run does not depend on test order
    result = generate(model, processor, prompt, [image], max_tokens=3, verbose=False, temperature=0.0)
    # the one <|image_pad|> of the template expanded into one token per merged 2x2 patch group
    assert result.prompt_tokens > len(processor.tokenizer.encode(prompt)) + 1
    assert result.generation_tokens == 3


def test_stale_temporaries_of_killed_runs_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".ckpt.synth-{int(dead.stdout)}.tmp"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    make(tmp_path / "ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


@pytest.mark.parametrize("mode", ["affine", "mxfp4"])
def test_a_specs_spread_is_the_drawn_weights(mode):
    """Both draws of a quantized module (tiny/small: `mx.quantize` of normals; full: random codes and scales) give a
    dequantized weight of the spread its Spec names: about 0.02 by default (full MXFP4: 0.03), and residual_std's
    smaller spreads in proportion (an eighth here)."""
    import mlx.core as mx

    from streamoe.convert.synth import _ExactQuantizer, _fast_quant_bytes
    from streamoe.formats.export import INIT_STD, Spec

    bits, group, rows, cols = 4, (32 if mode == "mxfp4" else 64), 256, 512

    def dequantized(std: float, exact: bool) -> np.ndarray:
        parts = [Spec("m.weight", "U32", (rows, cols * bits // 32), "qweight", bits, mode, group, std),
                 Spec("m.scales", "U8" if mode == "mxfp4" else "BF16", (rows, cols // group), "scales", bits, mode,
                      group, std)]
        if mode == "affine":
            parts.append(Spec("m.biases", "BF16", (rows, cols // group), "biases", bits, mode, group, std))
        quantizer = _ExactQuantizer(seed=5)
        raw = [quantizer.bytes_for(s) if exact else b"".join(_fast_quant_bytes(s, 5)) for s in parts]
        w = mx.array(np.frombuffer(raw[0], "<u4").reshape(parts[0].shape))
        if mode == "mxfp4":
            scales = mx.array(np.frombuffer(raw[1], np.uint8).reshape(parts[1].shape))
            out = mx.dequantize(w, scales, group_size=group, bits=bits, mode="mxfp4")
        else:
            scales, biases = (mx.array(np.frombuffer(r, "<u2").reshape(parts[1].shape)).view(mx.bfloat16)
                              for r in raw[1:])
            out = mx.dequantize(w, scales, biases, group_size=group, bits=bits)
        return np.array(out.astype(mx.float32))

    for exact in (True, False):
        base, small = dequantized(INIT_STD, exact), dequantized(INIT_STD / 8, exact)
        assert base.shape == (rows, cols) and abs(float(base.mean())) < 0.002
        assert (0.018 if exact or mode == "affine" else 0.027) < base.std() < (0.022 if exact or mode == "affine" else 0.035)
        assert small.std() / base.std() == pytest.approx(1 / 8, rel=0.03), (exact, small.std(), base.std())


def test_plain_attention_families_draw_their_residual_projections_smaller():
    """qwen3_moe, gpt_oss and Mixtral draw o_proj and the experts' down_proj (and their biases) at residual_std, every
    other tensor at 0.02; Qwen3.6, whose gates spread its picks as drawn, keeps 0.02 everywhere."""
    from streamoe.formats.config import ModelArgs
    from streamoe.formats.export import INIT_STD, residual_std

    for family in ("qwen3_moe", "gpt_oss", "mixtral"):
        config = make_config("small", text_only=True, family=family)
        a = ModelArgs.from_config(config)
        std = {s.name: s.std for s in specs(config)}
        o = next(n for n in std if n.endswith("layers.0.self_attn.o_proj.weight"))
        down = next(n for n in std if n.endswith("down_proj.weight") and ".layers.0." in n)
        assert std[o] == residual_std(a, a.num_attention_heads * a.head_dim) < INIT_STD / 4, family
        assert std[down] == residual_std(a, a.moe_intermediate_size) < INIT_STD / 4, family
        assert std[o.replace(".weight", ".scales")] == std[o]
        assert {v for n, v in std.items() if "o_proj" not in n and "down_proj" not in n} == {INIT_STD}, family
    assert {s.std for s in specs(make_config("small", text_only=True))} == {INIT_STD}



@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_synth_ended_by_a_signal_leaves_nothing_behind(tmp_path, sig):
    """SIGTERM or SIGHUP while `synth` writes (a service stopped, a terminal closed): its temporary directory is
    removed as for Ctrl-C, one line says why it ended, and the exit status is 128 + the signal's number."""
    import os
    import signal
    import time

    out = tmp_path / "sg"
    # small-vocab: 133 MB, seconds of writing after its temporary appears, so the signal always finds it at work
    p = subprocess.Popen([sys.executable, "-m", "streamoe.cli", "synth", str(out), "--size", "small-vocab"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".sg.synth-*.tmp")) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    p.send_signal(getattr(signal, sig))
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + getattr(signal, sig), (p.returncode, err)
    assert err.rstrip().endswith(f"streamoe: terminated ({sig})") and "Traceback" not in err
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_synth_into_a_link_writes_where_it_points_and_a_second_run_waits_for_none(tmp_path):
    """OUT a link to an empty directory: the checkpoint lands where the link points and the link stays (as convert
    does), its free space weighed there; while another synth writes OUT (its lock held), a second fails at once in
    one line, before writing anything."""
    from streamoe.formats.files import exclusive_lock

    from .conftest import cli, one_error_line

    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to("target")
    p = cli("synth", tmp_path / "link", "--size", "tiny", check=True)
    assert (tmp_path / "link").is_symlink() and (tmp_path / "target" / "config.json").is_file()
    assert "OUT is a link" in p.stderr and p.stdout == f"{tmp_path / 'link'}\n"  # what it wrote, as convert says it
    with exclusive_lock(tmp_path / ".busy.lock", tmp_path / "busy", "this OUT"):
        p = cli("synth", tmp_path / "busy", "--size", "tiny")
    assert p.returncode == 2 and not (tmp_path / "busy").exists()
    one_error_line(p, str(tmp_path / "busy"), "another streamoe command is writing")
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]


def test_a_signal_that_lands_where_python_drops_exceptions_still_ends_the_command(tmp_path):
    """SIGTERM handled inside a weakref callback (as the import system's are: where it once landed, mid-`synth`),
    whose exceptions Python drops: it is delivered again, so the command ends as signalled (one line, 128 + 15),
    not run on to exit 0."""
    script = tmp_path / "cmd.py"
    script.write_text(
        "import os, signal, time, weakref\n"
        "from streamoe.cli import user_errors\n"
        "class Thing: pass\n"
        "@user_errors\n"
        "def command():\n"
        "    t = Thing()\n"
        "    ref = weakref.ref(t, lambda r: os.kill(os.getpid(), signal.SIGTERM))\n"
        "    del t\n"
        "    for _ in range(100):\n"
        "        time.sleep(0.01)\n"
        "    print('ran to its end')\n"
        "command()\n")
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 143 and p.stdout == "", (p.returncode, p.stdout, p.stderr)
    assert p.stderr == "streamoe: terminated (SIGTERM)\n", p.stderr
