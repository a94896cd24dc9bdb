"""The Qwen3-Next family (`qwen3_next`: Qwen3-Next-80B-A3B, Qwen3-Coder-Next): its export table at full size, plan
from its bare config.json, synth -> convert -> validate, the fused Gated DeltaNet projections taken apart as mlx-lm
reads them, greedy tokens against mlx-lm float32 resident and at a cap, logits bit-identical across caps."""

from __future__ import annotations

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import layout, make_config, synth
from streamoe.convert.validate import validate
from streamoe.formats.config import ModelArgs
from streamoe.formats.export import tensor_table
from streamoe.formats.manifest import load_manifest

from .conftest import LOGIT_ATOL, cli, one_error_line, write_hf_checkpoint
from .test_runtime import (
    PROMPTS,
    assert_logits_across_caps,
    teacher_forced,
    teacher_forced_at_slots,
)

FULL_TOTAL = 44_844_060_160  # 48 layers of 512 experts top-10, vocab 151,936; routers and shared-expert gates 8-bit
FULL_TENSORS = 1891
EXPERT_RECORD = 1_769_472  # one expert, q4: 3 x (524,288 + 2 x 32,768)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qn") / "tiny"
    synth(out, size="tiny", variant=None, text_only=False, seed=0, shard_bytes=None, dry_run=False, family="qwen3_next")
    return out


@pytest.fixture(scope="module")
def conv(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("qnconv") / "tiny"
    convert(ckpt, out, formats=["q4", "q3"], progress=False)
    return out


def test_full_export_table():
    """`--size full` is Qwen3-Next-80B-A3B's table: three Gated DeltaNet layers to one of gated attention, each
    linear layer's input projections fused in two, 8-bit routers and shared-expert gates, 5 GiB shards."""
    config = make_config("full", family="qwen3_next")
    a = ModelArgs.from_config(config)
    assert (a.num_hidden_layers, a.n_full_attention, a.hidden_size, a.head_dim, a.rotary_dim) == (48, 12, 2048, 256, 64)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.vocab_size) == (512, 10, 512, 151936)
    assert a.prefix == "" and a.mrope_section == (32, 0, 0) and a.rope_theta == 1e7 and a.eos_token_ids == (151645, 151643)
    assert a.quant_params("model.layers.7.mlp.gate") == (8, 64) and a.expert_quant(47) == (4, 64)
    rows = layout(config)
    assert len(rows) == FULL_TENSORS and sum(r["nbytes"] for r in rows) == FULL_TOTAL
    assert len({r["file"] for r in rows}) == 9
    by_name = {r["name"]: r for r in rows}
    assert rows[0]["name"] == "model.embed_tokens.weight" and rows[-1]["name"] == "lm_head.biases"
    assert by_name["model.layers.0.linear_attn.in_proj_qkvz.weight"]["shape"] == [12288, 256]  # 2 x 2048 + 2 x 4096
    assert by_name["model.layers.0.linear_attn.in_proj_ba.weight"]["shape"] == [64, 256]
    assert by_name["model.layers.3.self_attn.q_proj.weight"]["shape"] == [8192, 256]  # query and its gate per head
    assert "model.layers.3.linear_attn.conv1d.weight" not in by_name
    assert sum(r["nbytes"] for r in rows if ".switch_mlp." in r["name"]) == 48 * 512 * EXPERT_RECORD
    patterns = {re.sub(r"\.\d+\.", ".N.", r["name"]) for r in rows}
    assert not any("in_proj_qkv." in p or "language_model" in p for p in patterns)


def test_plan_from_the_bare_config_of_the_real_model(tmp_path):
    """12 attention layers keep KV (2 heads x 256 at float32: 98,304 B a token), 36 keep Gated DeltaNet state;
    records of 1.69 MiB, and the 80B model plans hot slots inside 4 GiB."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config("full", family="qwen3_next")))
    plan = json.loads(cli("plan", cfg, "--cap", "4", "--ctx", "4096", "--runtime-mib", "100", "--json", check=True).stdout)
    assert plan["stride"] == EXPERT_RECORD and plan["n_layers"] == 48 and plan["n_experts"] == 512
    assert plan["accounts"]["kv cache"] == 12 * 2 * 2 * 256 * 4 * 4096
    assert plan["accounts"]["linear state"] > 0 and plan["native_ctx"] == 262144 and plan["hot_slots"] > 0


def test_tiny_is_what_mlx_lm_loads_and_converts(ckpt, conv):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(ckpt)
    assert type(model).__module__ == "mlx_lm.models.qwen3_next"
    assert [k for k, _ in tree_flatten(model.parameters())] == [n for n, _, _ in tensor_table(config)]
    m = load_manifest(conv)
    assert m.model["expert_prefix"] == "model.layers." and m.doc["source"]["model_type"] == "qwen3_next"
    names = {t.name for t in m.blob("nonexpert")[1]}
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names and m.blob("vision") is None
    report = validate(conv, source=ckpt, samples=4)
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]


def test_fused_projections_are_taken_apart_as_mlx_lm_reads_them(ckpt):
    """`qwen3_next.unfuse`'s rows give, for the same input, mlx-lm's q, k, v, z, b and a after its
    `fix_query_key_value_ordering`, to the bit, in every Gated DeltaNet layer (a row's output does not depend on its
    neighbours)."""
    from mlx_lm.utils import load_model

    from streamoe.runtime.models.qwen3_next import unfuse

    model, config = load_model(ckpt)
    model.set_dtype(mx.float32)
    linear = {i: layer.linear_attn for i, layer in enumerate(model.model.layers) if layer.is_linear}
    weights = {f"model.layers.{i}.linear_attn.{n}.{s}": getattr(getattr(gdn, n), s) for i, gdn in linear.items()
               for n in ("in_proj_qkvz", "in_proj_ba") for s in ("weight", "scales", "biases")}
    unfuse(ModelArgs.from_config(config), weights)
    assert len(linear) == 6 and not any("qkvz" in n or "_ba." in n for n in weights)
    x = mx.random.normal((1, 3, config["hidden_size"]), key=mx.random.key(1))
    for i, gdn in linear.items():
        q, k, v, z, b, a = gdn.fix_query_key_value_ordering(gdn.in_proj_qkvz(x), gdn.in_proj_ba(x))

        def out(name: str, i: int = i, fused=gdn.in_proj_qkvz) -> np.ndarray:
            w, s, bi = (weights[f"model.layers.{i}.linear_attn.{name}.{part}"] for part in ("weight", "scales", "biases"))
            return np.array(mx.quantized_matmul(x, w, s, bi, transpose=True, group_size=fused.group_size,
                                                bits=fused.bits))

        B, L = x.shape[:2]
        mixed = np.concatenate([np.array(t).reshape(B, L, -1) for t in (q, k, v)], axis=-1)
        assert np.array_equal(out("in_proj_qkv"), mixed), i
        assert np.array_equal(out("in_proj_z"), np.array(z).reshape(B, L, -1)), i
        assert np.array_equal(out("in_proj_b"), np.array(b)) and np.array_equal(out("in_proj_a"), np.array(a)), i


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_mlx_lm(ckpt, conv, prompt):
    """Teacher-forced greedy decode against mlx-lm's qwen3_next in float32, every expert resident."""
    ref, ours, worst = teacher_forced(ckpt, conv, prompt, 24)
    assert ours == ref and worst < LOGIT_ATOL


def test_greedy_tokens_equal_mlx_lm_at_a_cap(ckpt, conv):
    """Streamed through 3 hot slots of 64."""
    ref, ours, worst = teacher_forced_at_slots(ckpt, conv, PROMPTS[2], 3)
    assert ours == ref and worst < LOGIT_ATOL


def test_logits_bit_identical_across_caps(conv):
    """Prefill and decode logits are the same bits with every expert resident and with 0 or 3 hot slots (of 64),
    whatever the tier and the guesses."""
    assert_logits_across_caps(conv, 64)


def test_a_chat_answers_through_the_command(conv, tmp_path):
    """`streamoe run` on the converted model: the chat template's answer, text only (an image is refused in one line
    saying so)."""
    from PIL import Image

    p = cli("run", conv, "--cap", "1", "--ctx", "256", "--temp", "0", "-n", "6", "-p", "Hello", check=True)
    assert p.stdout.strip()
    Image.new("RGB", (32, 32), (255, 0, 0)).save(tmp_path / "red.png")
    one_error_line(cli("run", conv, "--cap", "1", "--ctx", "256", "-p", "hi", "--image", tmp_path / "red.png"),
                   str(conv / "manifest.json"), "no vision tower")


def hf_checkpoint(out: Path, tokenizer_from: Path, seed: int = 7) -> Path:
    """A tiny checkpoint in Qwen/Qwen3-Next-80B-A3B's own Hugging Face form: bf16 tensors, each expert's projections
    on their own (`mlp.experts.E.*`), zero-centred norms (the export holds 1 + w), `conv1d.weight` as [C, 1, K], and
    no quantization block: what mlx-lm's converter reads."""
    d = make_config("tiny", family="qwen3_next")
    cfg = {k: v for k, v in d.items() if k not in ("quantization", "quantization_config")}
    a = ModelArgs.from_config(d)
    H, E, inter, shared, V = a.hidden_size, a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size, a.vocab_size
    nq, nkv, hd, hv, conv = a.num_attention_heads, a.num_key_value_heads, a.head_dim, a.linear_num_value_heads, a.conv_dim
    rng = np.random.default_rng(seed)

    def bf16(shape, scale=0.02, mean=0.0):
        return mx.array(mean + scale * rng.standard_normal(shape, dtype=np.float32)).astype(mx.bfloat16)

    w = {"model.embed_tokens.weight": bf16((V, H)), "model.norm.weight": bf16((H,)), "lm_head.weight": bf16((V, H))}
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = bf16((H,))
        w[f"{p}.post_attention_layernorm.weight"] = bf16((H,))
        if a.is_linear(i):
            q = f"{p}.linear_attn"
            w[f"{q}.conv1d.weight"] = bf16((conv, 1, a.linear_conv_kernel_dim), 0.2)
            w[f"{q}.in_proj_qkvz.weight"] = bf16((conv + a.value_dim, H))
            w[f"{q}.in_proj_ba.weight"] = bf16((2 * hv, H))
            w[f"{q}.dt_bias"] = bf16((hv,), 0.5, 1.0)
            w[f"{q}.A_log"] = mx.log(mx.array(rng.uniform(1, 16, hv).astype(np.float32))).astype(mx.bfloat16)
            w[f"{q}.norm.weight"] = bf16((a.linear_value_head_dim,), mean=1.0)
            w[f"{q}.out_proj.weight"] = bf16((H, a.value_dim))
        else:
            q = f"{p}.self_attn"
            for name, shape in {"q_proj": (2 * nq * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
                                "o_proj": (H, nq * hd), "q_norm": (hd,), "k_norm": (hd,)}.items():
                w[f"{q}.{name}.weight"] = bf16(shape)
        m = f"{p}.mlp"
        w[f"{m}.gate.weight"] = bf16((E, H))
        for e in range(E):
            for name, shape in {"gate_proj": (inter, H), "up_proj": (inter, H), "down_proj": (H, inter)}.items():
                w[f"{m}.experts.{e}.{name}.weight"] = bf16(shape)
        for name, shape in {"gate_proj": (shared, H), "up_proj": (shared, H), "down_proj": (H, shared)}.items():
            w[f"{m}.shared_expert.{name}.weight"] = bf16(shape)
        w[f"{m}.shared_expert_gate.weight"] = bf16((1, H))
    return write_hf_checkpoint(out, w, cfg, tokenizer_from)


def test_mlx_lms_converter_writes_what_synth_writes_and_streamoe_runs_it(ckpt, tmp_path):
    """Qwen's own form through mlx-lm's converter (`-q`, 4-bit, its quant_predicate's 8-bit routers and shared-expert
    gates): the config (its quantization block entry for entry) and the tensor table are synth's; converted by
    streamoe, its greedy tokens equal mlx-lm's float32 ones on it, resident and at a cap of 3 hot slots."""
    from mlx_lm.convert import convert as mlx_lm_convert

    from streamoe.formats.safetensors import read_header

    exported = tmp_path / "mlx"
    mlx_lm_convert(str(hf_checkpoint(tmp_path / "hf", ckpt)), str(exported), quantize=True)
    config = json.loads((exported / "config.json").read_text())
    assert config == make_config("tiny", family="qwen3_next")
    header = read_header(exported / "model.safetensors")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in header.tensors.items()} == {
        n: (dt, shape) for n, dt, shape in tensor_table(config)}
    out = tmp_path / "conv"
    convert(exported, out, progress=False)
    for slots in (None, 3):
        ref, ours, worst = (teacher_forced(exported, out, PROMPTS[0], 24) if slots is None
                            else teacher_forced_at_slots(exported, out, PROMPTS[0], slots))
        assert ours == ref and worst < LOGIT_ATOL
