"""The gpt-oss family (`gpt_oss`, gpt-oss-20b as mlx-community's MXFP4 export): synth -> convert -> validate, plan
from its bare config.json, greedy tokens against mlx-lm float32 past the sliding window, logits bit-identical across
caps, and its bad inputs."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import layout, make_config, synth
from streamoe.convert.validate import validate
from streamoe.formats.config import ModelArgs
from streamoe.formats.export import tensor_table
from streamoe.formats.layout import source_layout
from streamoe.formats.manifest import load_manifest

from .conftest import LOGIT_ATOL, RUNTIME, cli, one_error_line, write_hf_checkpoint
from .test_runtime import (
    PROMPTS,
    assert_logits_across_caps,
    compiled_step_bits,
    reference,
    run_ahead_bits,
    teacher_forced,
    teacher_forced_at_slots,
)

FULL_TOTAL = 12_076_119_168  # gpt-oss-20b-MXFP4-Q8: MXFP4 experts, every other module 8-bit, vocab 201,088
FULL_TENSORS = 775
EXPERT_RECORD = 13_236_480  # one expert: 3 x (4,147,200 codes + 259,200 scales + 5,760 bias)
EXPERT_STRIDE = 13_238_272
WINDOW = 8  # the tiny config's sliding window: every prompt below is longer, or decodes past it


def make(out: Path, size: str = "tiny", variant: str = "mxfp4-q8", seed: int = 0) -> Path:
    synth(out, size=size, variant=variant, text_only=False, seed=seed, shard_bytes=None, dry_run=False,
          family="gpt_oss")
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("go") / "tiny")


@pytest.fixture(scope="module")
def conv(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("goconv") / "tiny"
    convert(ckpt, out, progress=False)  # no --experts: the format the checkpoint holds
    return out


# ------------------------------------------------------------------------------------ facts, export, plan


def test_full_export_table():
    """`--size full` is the real table: mlx-lm's module order, MXFP4 experts with biases, the rest 8-bit affine."""
    config = make_config("full", family="gpt_oss")
    a = ModelArgs.from_config(config)
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (24, 2880, 64, 8, 64)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.vocab_size) == (32, 4, 2880, 201088)
    assert a.layer_types == ("sliding_attention", "full_attention") * 12 and a.sliding_window == 128
    assert a.rope_theta == 150000 and a.yarn == (32.0, 4096.0, 32.0, 1.0, 1.0, 0.0)
    assert (a.swiglu_alpha, a.swiglu_limit) == (1.702, 7.0) and not a.tie_word_embeddings and a.eos_token_ids == (200002, 199999, 200012)
    assert a.expert_format == "mxfp4" and a.expert_mode(23) == "mxfp4" and a.expert_quant(0) == (4, 32)
    assert a.quant_params("model.layers.3.mlp.router") == (8, 64) and a.quant_params("lm_head") == (8, 64)
    assert a.n_kv_layers == 24 and a.n_full_attention == 12 and a.shared_expert_intermediate_size == 0
    lay = source_layout(a)
    assert (lay.raw_size, lay.stride, lay.mode, lay.bias_dtype) == (EXPERT_RECORD, EXPERT_STRIDE, "mxfp4", "BF16")
    assert [(s.proj, s.part, s.dtype, s.shape) for s in lay.segments[:3]] == [
        ("gate_proj", "weight", "U32", (2880, 360)), ("gate_proj", "scales", "U8", (2880, 90)),
        ("gate_proj", "bias", "BF16", (2880,))]
    rows = layout(config)
    assert len(rows) == FULL_TENSORS and sum(r["nbytes"] for r in rows) == FULL_TOTAL
    files = sorted({r["file"] for r in rows})
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in range(1, 4)]
    by_name = {r["name"]: r for r in rows}
    assert [r["name"] for r in rows[:5]] == ["model.embed_tokens.weight", "model.embed_tokens.scales",
                                             "model.embed_tokens.biases", "model.norm.weight", "model.layers.0.self_attn.sinks"]
    assert rows[-1]["name"] == "lm_head.biases"
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["shape"] == [4096, 720]  # 8-bit
    assert by_name["model.layers.0.self_attn.o_proj.bias"]["shape"] == [2880]
    assert by_name["model.layers.5.mlp.router.weight"]["shape"] == [32, 720]
    assert by_name["model.layers.23.mlp.experts.down_proj.scales"] == {
        "name": "model.layers.23.mlp.experts.down_proj.scales", "dtype": "U8", "shape": [32, 2880, 90],
        "nbytes": 8_294_400, "file": "model-00003-of-00003.safetensors"}
    experts = sum(r["nbytes"] for r in rows if ".mlp.experts." in r["name"])
    assert experts == 24 * 32 * EXPERT_RECORD
    # per layer: sinks, q/k/v/o (codes, scales, biases, bias), 3 x the experts' (codes, scales, bias), the router's 4,
    # 2 norms; then the embedding's 3, the final norm, lm_head's 3
    patterns = {re.sub(r"\.\d+\.", ".N.", r["name"]) for r in rows}
    assert len(patterns) == 1 + 16 + 9 + 4 + 2 + 3 + 1 + 3
    q4 = {n: s for n, _, s in tensor_table(make_config("full", "mxfp4-q4", family="gpt_oss"))}
    assert q4["model.layers.0.self_attn.q_proj.weight"] == (4096, 360) and q4["model.layers.0.mlp.router.weight"] == (32, 720)


def test_full_dry_run_prints_the_table():
    p = cli("synth", "/nonexistent/never-written", "--family", "gpt_oss", "--size", "full", "--dry-run", check=True)
    lines = p.stdout.splitlines()
    assert lines[-1] == f"total\t{FULL_TOTAL}\t{FULL_TENSORS} tensors\t3 shard files"
    assert lines[0] == "model.embed_tokens.weight\tU32\t[201088,720]\t579133440\tmodel-00001-of-00003.safetensors"
    assert not Path("/nonexistent/never-written").exists()


def test_plan_from_the_bare_config_of_the_real_model(tmp_path):
    """24 layers of KV, sliding ones included (8 heads x 64 at float32: 98,304 B a token); the MXFP4 record's slot
    holds its codes and uint8 scales as stored and its biases at float32."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config("full", family="gpt_oss")))
    p = cli("plan", cfg, "--cap", "5", "--ctx", "4096", "--runtime-mib", "100", "--json", check=True)
    plan = json.loads(p.stdout)
    assert plan["expert_format"] == "mxfp4" and plan["stride"] == EXPERT_STRIDE
    assert plan["slot"] == EXPERT_RECORD + 3 * 2880 * 2  # bf16 biases widened to float32
    assert plan["n_layers"] == 24 and plan["n_experts"] == 32
    assert plan["accounts"]["kv cache"] == 24 * 2 * 8 * 64 * 4 * 4096 and plan["accounts"]["linear state"] == 0
    assert plan["kv_formats"]["float32"]["token_bytes"] == 98_304 and plan["native_ctx"] == 131072
    assert plan["accounts"]["prefill staging"] == 32 * plan["slot"]
    # as a converted directory's plan: the records the disk reads into and their copies, 2 x top-4 + 4 guesses + 8 threads
    assert plan["accounts"]["read staging"] == 2 * 20 * EXPERT_STRIDE
    one_error_line(cli("plan", cfg, "--experts", "q4"), str(cfg), "expert format 'q4' cannot be made from mxfp4 experts")


# ------------------------------------------------------------------------------------ synth, convert, validate


def test_tiny_is_what_mlx_lm_loads(ckpt):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(ckpt)
    assert type(model).__module__ == "mlx_lm.models.gpt_oss"
    assert [k for k, _ in tree_flatten(model.parameters())] == [n for n, _, _ in tensor_table(config)]
    experts = model.model.layers[0].mlp.experts
    assert (experts.gate_proj.mode, experts.gate_proj.group_size, experts.down_proj.bias.shape) == ("mxfp4", 32, (8, 64))
    assert model.model.layers[0].mlp.router.bits == 8 and model.model.layers[1].self_attn.o_proj.bits == 8
    assert model.model.window_size == WINDOW and model.model.layer_types[:2] == ["sliding_attention", "full_attention"]
    files = {p.name for p in ckpt.iterdir()}
    assert files == {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json", "chat_template.jinja", "generation_config.json"}


def test_harmony_template_and_stop_tokens(conv):
    """The synthetic harmony tokenizer: its special tokens at base + their offset from <|startoftext|>, a harmony
    prompt ending in `<|start|>assistant`, and the stops generation_config names (<|return|>, <|endoftext|>,
    <|call|>)."""
    from streamoe.runtime.text import TextIO

    text = TextIO(conv, load_manifest(conv).config)
    prompt = text.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|start|>system<|message|>") and "Reasoning: medium" in prompt
    assert prompt.endswith("<|end|><|start|>user<|message|>hi<|end|><|start|>assistant")
    ids = text.encode(prompt)
    assert ids[0] == 520 and ids.count(520) == 3 and ids.count(521) == 2 and ids.count(522) == 2  # start, end, message
    assert text.encode("<|channel|>final<|message|>") == [519, *text.encode("final"), 522]
    assert text.stop_ids >= {516, 513, 526}
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "thinking": "greet"}]
    assert text.chat_text(reply, add_generation_prompt=False).endswith(
        "<|start|>assistant<|channel|>analysis<|message|>greet<|end|><|start|>assistant<|channel|>final<|message|>hello<|end|>")


def test_convert_and_validate(ckpt, conv):
    m = load_manifest(conv)
    assert m.model["expert_prefix"] == "model.layers." and m.doc["source"]["model_type"] == "gpt_oss"
    assert list(m.expert_formats()) == ["mxfp4"]
    e = m.doc["experts"]["mxfp4"]
    assert (e["mode"], e["bias_dtype"], e["bits"], e["group_size"], e["scale_dtype"]) == ("mxfp4", "BF16", 4, 32, "U8")
    assert [s["part"] for s in e["segments"]] == ["weight", "scales", "bias"] * 3
    assert e["raw_size"] == 3 * (64 * 8 * 4 + 64 * 2 + 64 * 2) and e["stride"] == 8192
    names = {t.name for t in m.blob("nonexpert")[1]}
    assert {"lm_head.weight", "model.layers.3.self_attn.sinks", "model.layers.0.mlp.router.bias"} <= names
    assert not any(".mlp.experts." in n for n in names)
    report = validate(conv, source=ckpt, samples=4)
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]
    assert {c["name"] for c in report["checks"]} >= {"source-experts-mxfp4", "source-nonexpert"}


def hf_checkpoint(out: Path, tokenizer_from: Path, seed: int = 7) -> Path:
    """A tiny checkpoint in openai/gpt-oss-20b's own Hugging Face form: bf16 tensors, the experts' gate and up
    interleaved row by row as `gate_up_proj`, MXFP4 as `_blocks` (16 bytes of codes per 32 values) and `_scales`,
    their biases as `_bias`, and `quantization_config` {"quant_method": "mxfp4"}: what mlx-lm's converter reads."""
    d = make_config("tiny", family="gpt_oss")
    cfg = {k: v for k, v in d.items() if k not in ("quantization", "quantization_config")}
    cfg["quantization_config"] = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
    a = ModelArgs.from_config(d)
    H, inter, E, V = a.hidden_size, a.moe_intermediate_size, a.num_experts, a.vocab_size
    nq, nkv, hd = a.num_attention_heads, a.num_key_value_heads, a.head_dim
    rng = np.random.default_rng(seed)

    def bf16(shape, scale=0.02, mean=0.0):
        return mx.array(mean + scale * rng.standard_normal(shape, dtype=np.float32)).astype(mx.bfloat16)

    w = {"model.embed_tokens.weight": bf16((V, H)), "model.norm.weight": bf16((H,), mean=1.0), "lm_head.weight": bf16((V, H))}
    for i in range(a.num_hidden_layers):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = bf16((H,), mean=1.0)
        w[f"{p}.post_attention_layernorm.weight"] = bf16((H,), mean=1.0)
        w[f"{p}.self_attn.sinks"] = bf16((nq,), 1.0)
        for name, (o, n) in {"q_proj": (nq * hd, H), "k_proj": (nkv * hd, H), "v_proj": (nkv * hd, H),
                             "o_proj": (H, nq * hd)}.items():
            w[f"{p}.self_attn.{name}.weight"], w[f"{p}.self_attn.{name}.bias"] = bf16((o, n)), bf16((o,))
        w[f"{p}.mlp.router.weight"], w[f"{p}.mlp.router.bias"] = bf16((E, H)), bf16((E,))
        for name, (o, n) in {"gate_up_proj": (2 * inter, H), "down_proj": (H, inter)}.items():
            codes, scales = mx.quantize(bf16((E, o, n)), group_size=32, bits=4, mode="mxfp4")
            w[f"{p}.mlp.experts.{name}_blocks"] = codes.view(mx.uint8).reshape(E, o, n // 32, 16)
            w[f"{p}.mlp.experts.{name}_scales"] = scales
            w[f"{p}.mlp.experts.{name}_bias"] = bf16((E, o))
    return write_hf_checkpoint(out, w, cfg, tokenizer_from)


def test_mlx_lms_converter_writes_what_synth_writes_and_streamoe_runs_it(ckpt, tmp_path):
    """openai/gpt-oss's own form through mlx-lm's converter (`-q --q-bits 8`, as gpt-oss-20b-MXFP4-Q8 was made):
    the config (its quantization block entry for entry) and the tensor table are synth's; converted by streamoe,
    its greedy tokens equal mlx-lm's float32 ones on it, past the sliding window, at a cap of 4 hot slots."""
    from mlx_lm.convert import convert as mlx_lm_convert

    from streamoe.formats.safetensors import read_header

    exported = tmp_path / "mlx"
    mlx_lm_convert(str(hf_checkpoint(tmp_path / "hf", ckpt)), str(exported), quantize=True, q_bits=8)
    config = json.loads((exported / "config.json").read_text())
    assert config == make_config("tiny", family="gpt_oss")
    header = read_header(exported / "model.safetensors")
    assert {n: (t.dtype, tuple(t.shape)) for n, t in header.tensors.items()} == {
        n: (dt, shape) for n, dt, shape in tensor_table(config)}
    index = json.loads((exported / "model.safetensors.index.json").read_text())
    assert index["metadata"] == json.loads((ckpt / "model.safetensors.index.json").read_text())["metadata"]
    out = tmp_path / "conv"
    convert(exported, out, progress=False)
    ref, ours, worst = teacher_forced_at_slots(exported, out, PROMPTS[0], 4)
    assert ours == ref and worst < LOGIT_ATOL


# ------------------------------------------------------------------------------------ runtime


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_mlx_lm(ckpt, conv, prompt):
    """Teacher-forced greedy decode against mlx-lm's gpt_oss in float32 (its rotating cache for the sliding layers),
    every expert resident; every run reaches past the 8-token window."""
    ref, ours, worst = teacher_forced(ckpt, conv, prompt, 24)
    assert ours == ref and worst < LOGIT_ATOL


def test_greedy_tokens_equal_mlx_lm_at_a_cap_with_4_bit_attention(tmp_path):
    """gpt-oss-20b-MXFP4-Q4's layout (4-bit attention and head, 8-bit routers), streamed through 4 hot slots."""
    ck = make(tmp_path / "ckpt", variant="mxfp4-q4", seed=3)
    out = tmp_path / "conv"
    convert(ck, out, progress=False)
    ref, ours, worst = teacher_forced_at_slots(ck, out, PROMPTS[2], 4)
    assert ours == ref and worst < LOGIT_ATOL


def test_the_window_and_the_sinks_change_the_logits(ckpt, conv):
    """What the greedy test rests on: mlx-lm's logits over a prompt past the window move when the window is lifted
    or the sinks are zeroed, by far more than ours differ from the real ones."""
    from streamoe.runtime.engine import Engine, Options

    eng = Engine(conv, Options(cap_gib=1.0, ctx=128, prefill_chunk=16, runtime_bytes=RUNTIME))
    ids = eng.text.encode(PROMPTS[2])
    assert len(ids) > 4 * WINDOW
    ours = np.array(eng.prefill(ids))
    eng.close()

    def ref_logits(edit=None) -> np.ndarray:
        model = reference(ckpt)
        if edit:
            edit(model)
        return np.array(model(mx.array([ids]))[0, -1])

    def no_window(model):
        model.model.window_size = 1 << 20

    def no_sinks(model):
        for layer in model.model.layers:
            layer.self_attn.sinks = mx.zeros_like(layer.self_attn.sinks)

    real = ref_logits()
    assert np.abs(ours - real).max() < LOGIT_ATOL
    for edit in (no_window, no_sinks):
        assert np.abs(ref_logits(edit) - real).max() > 100 * LOGIT_ATOL, edit.__name__


def test_a_compiled_decode_step_is_the_step_built_op_by_op(conv, monkeypatch):
    """Each layer's one-token call compiled (attention's projections, then its output, norm and router) gives the
    bits of the step built op by op."""
    on, off = compiled_step_bits(conv, monkeypatch, None)
    assert on == off


def test_decode_layers_run_ahead_of_their_picks_give_the_same_bits(conv, monkeypatch):
    """Decode layers run ahead of their picks, thrown away and rewound where one missed, over sliding-window and
    full layers with sinks and a q8 KV cache: the bits of each layer waiting for its picks, and of the resident run."""
    ahead, usual, resident = run_ahead_bits(conv, monkeypatch, 24, kv="q8")
    assert ahead == usual == resident


@pytest.mark.parametrize("kv", ["auto", "q8"])
def test_logits_bit_identical_across_caps(conv, kv):
    """Prefill and decode logits are the same bits with every expert resident and with 0 or 3 hot slots (of 32),
    whatever the tier and the guesses; q8 scores the sinks and the window on the codes."""
    assert_logits_across_caps(conv, 32, kv=kv)


def test_run_and_plan_default_to_the_one_format_there(conv):
    p = cli("run", conv, "--prompt", "def f(x):", "--raw", "--max-tokens", "4", "--temp", "0", "--cap", "1",
            "--ctx", "64", check=True)
    assert re.search(r"\[\d tokens, .* hit rate 100\.0%", p.stderr), p.stderr  # every expert fits in 1 GiB
    p = cli("plan", conv, "--cap", "1", "--ctx", "64", "--json", check=True)
    assert json.loads(p.stdout)["expert_format"] == "mxfp4"
    one_error_line(cli("plan", conv, "--experts", "q4", "--cap", "1"), "manifest.json", "has no q4 experts (has mxfp4)",
                   "q4 is not made from this model's experts, only mxfp4")


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("change", "needle"), [
    ({"swiglu_limit": 5.0}, "swiglu_limit 5.0 is not supported"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear' is not supported"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings = true is not supported for gpt_oss"),
    ({"layer_types": ["sliding_attention"] * 23 + ["linear_attention"]}, "layer_types must name 24 layers"),
    ({"sliding_window": None}, "sliding_window must be a positive integer"),
    ({"sliding_window": 0}, "sliding_window = 0 is out of range"),
    ({"quantization": {"group_size": 16, "bits": 4, "mode": "nvfp4"}}, "unsupported quantization mode 'nvfp4'"),
    ({"num_local_experts": 2}, "num_experts_per_tok = 4 exceeds num_local_experts = 2"),
])
def test_configs_it_cannot_run_are_refused(tmp_path, change, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**make_config("full", family="gpt_oss"), **change}))
    one_error_line(cli("plan", cfg, "--cap", "4"), str(cfg), needle)


def test_an_mxfp4_checkpoint_has_no_q3_and_names_a_missing_expert_bias(ckpt, tmp_path):
    one_error_line(cli("convert", ckpt, tmp_path / "o", "--experts", "q3"), "config.json",
                   "expert format q3 cannot be made from this checkpoint's mxfp4 experts")
    assert not (tmp_path / "o").exists()
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.1.mlp.experts.down_proj.bias"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    one_error_line(cli("convert", bad, tmp_path / "o"), "tensor model.layers.1.mlp.experts.down_proj.bias is missing")


def test_a_truncated_mxfp4_layer_file_is_named(conv, tmp_path):
    bad = tmp_path / "conv"
    shutil.copytree(conv, bad)
    layer = bad / "experts" / "mxfp4" / "layer-02.bin"
    layer.write_bytes(layer.read_bytes()[:-4096])
    one_error_line(cli("run", bad, "--prompt", "hi", "--max-tokens", "1", "--cap", "1", "--ctx", "64"), str(layer),
                   "truncated")


def test_no_think_is_refused_as_gpt_oss_always_reasons(conv):
    p = cli("run", conv, "--cap", "1", "-p", "hi", "-n", "2", "--no-think")
    one_error_line(p, "--no-think: gpt-oss always reasons")
