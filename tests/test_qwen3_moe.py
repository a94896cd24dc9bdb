"""The Qwen3-MoE family (`qwen3_moe`, Qwen3-30B-A3B): synth -> convert -> validate, plan from its bare config.json,
greedy tokens against mlx-lm float32, logits bit-identical across caps, and its bad inputs."""

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
from streamoe.formats.errors import StreamoeError
from streamoe.formats.export import tensor_table
from streamoe.formats.manifest import load_manifest

from .conftest import LOGIT_ATOL, RUNTIME, cli, one_error_line
from .test_runtime import (
    PROMPTS,
    assert_logits_across_caps,
    compiled_step_bits,
    teacher_forced,
    teacher_forced_at_slots,
)

FULL_TOTAL = 17_174_622_208  # the real export's tensors: 48 layers of 128 experts, vocab 151,936, every module 4-bit
FULL_TENSORS = 1351
EXPERT_RECORD = 2_654_208  # one expert, q4: 3 x (786,432 + 2 x 49,152)


def make(out: Path, size: str = "tiny", variant: str = "qwen3", seed: int = 0) -> Path:
    synth(out, size=size, variant=variant, text_only=False, seed=seed, shard_bytes=None, dry_run=False,
          family="qwen3_moe")
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("q3") / "tiny")


@pytest.fixture(scope="module")
def conv(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("q3conv") / "tiny"
    convert(ckpt, out, formats=["q4", "q3"], progress=False)
    return out


# ------------------------------------------------------------------------------------ facts, export, plan


def test_full_export_table():
    """`--size full` is the real table: names in mlx-lm's module order, 4-bit everywhere, 5 GiB shards."""
    config = make_config("full", family="qwen3_moe")
    a = ModelArgs.from_config(config)
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (48, 2048, 32, 4, 128)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.vocab_size) == (128, 8, 768, 151936)
    assert a.n_full_attention == 48 and a.shared_expert_intermediate_size == 0 and a.rope_theta == 1e6
    assert a.prefix == "" and a.expert_quant(47) == (4, 64) and a.eos_token_ids == (151645,)
    rows = layout(config)
    assert len(rows) == FULL_TENSORS and sum(r["nbytes"] for r in rows) == FULL_TOTAL
    files = sorted({r["file"] for r in rows})
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    for f in files:
        assert sum(r["nbytes"] for r in rows if r["file"] == f) <= 5 << 30
    by_name = {r["name"]: r for r in rows}
    assert rows[0]["name"] == "model.embed_tokens.weight" and rows[-1]["name"] == "lm_head.biases"
    assert by_name["model.layers.0.self_attn.q_proj.weight"]["shape"] == [4096, 256]
    assert by_name["model.layers.0.self_attn.k_norm.weight"] == {
        "name": "model.layers.0.self_attn.k_norm.weight", "dtype": "BF16", "shape": [128], "nbytes": 256,
        "file": "model-00001-of-00004.safetensors"}
    assert by_name["model.layers.47.mlp.switch_mlp.down_proj.weight"]["shape"] == [128, 2048, 96]
    assert by_name["model.layers.0.mlp.gate.weight"]["shape"] == [128, 256]  # a 4-bit router
    experts = sum(r["nbytes"] for r in rows if ".switch_mlp." in r["name"])
    assert experts == 48 * 128 * EXPERT_RECORD
    # per layer: the attention's 4 projections and 2 head norms, 2 norms, the router, the 9 expert tensors
    patterns = {re.sub(r"\.\d+\.", ".N.", r["name"]) for r in rows}
    assert len(patterns) == 12 + 2 + 2 + 3 + 9 + 3 + 1 + 3
    gate8 = {n: s for n, _, s in tensor_table(make_config("full", "qwen3-gate8", family="qwen3_moe"))}
    assert gate8["model.layers.5.mlp.gate.weight"] == (128, 512)


def test_full_dry_run_prints_the_table():
    p = cli("synth", "/nonexistent/never-written", "--family", "qwen3_moe", "--size", "full", "--dry-run", check=True)
    lines = p.stdout.splitlines()
    assert lines[-1] == f"total\t{FULL_TOTAL}\t{FULL_TENSORS} tensors\t4 shard files"
    assert lines[0] == "model.embed_tokens.weight\tU32\t[151936,256]\t155582464\tmodel-00001-of-00004.safetensors"
    assert not Path("/nonexistent/never-written").exists()


def test_plan_from_the_bare_config_of_the_real_model(tmp_path):
    """48 attention layers of KV (4 heads x 128 at float32: 196,608 B a token), no linear-attention state."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config("full", family="qwen3_moe")))
    p = cli("plan", cfg, "--cap", "4", "--ctx", "4096", "--runtime-mib", "100", "--json", check=True)
    plan = json.loads(p.stdout)
    assert plan["stride"] == EXPERT_RECORD and plan["n_layers"] == 48 and plan["n_experts"] == 128
    assert plan["accounts"]["kv cache"] == 48 * 2 * 4 * 128 * 4 * 4096
    assert plan["accounts"]["linear state"] == 0
    assert plan["accounts"]["prefill staging"] == 128 * plan["slot"] and plan["hot_slots"] > 300
    assert plan["kv_formats"]["float32"]["token_bytes"] == 196_608 and plan["native_ctx"] == 40960


def test_a_context_past_the_models_own_is_allowed_with_a_note(conv):
    """--ctx past max_position_embeddings (40,960 here) plans and runs, as in llama.cpp, with one note on stderr
    (plan prints it in the plan); at the model's own context there is none."""
    args = ["--cap", "4", "--runtime-mib", "100"]
    note = "--ctx 41,000 is past the model's own context of 40,960 tokens"
    assert note in cli("plan", conv, *args, "--ctx", "41000", check=True).stdout
    assert "past the model's own" not in cli("plan", conv, *args, "--ctx", "40960", check=True).stdout
    p = cli("run", conv, *args, "--ctx", "41000", "-p", "hi", "-n", "2", "-q", "--raw", check=True)
    assert p.stderr.splitlines() == [f"streamoe: note: {note}: positions beyond it were never trained, and answers there may degrade"]


# ------------------------------------------------------------------------------------ synth, convert, validate


def test_tiny_is_what_mlx_lm_loads(ckpt):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(ckpt)
    assert type(model).__module__ == "mlx_lm.models.qwen3_moe"
    assert [k for k, _ in tree_flatten(model.parameters())] == [n for n, _, _ in tensor_table(config)]
    assert model.model.layers[0].mlp.gate.bits == 4 and model.model.layers[0].mlp.switch_mlp.down_proj.bits == 4
    files = {p.name for p in ckpt.iterdir()}
    assert files == {"config.json", "model.safetensors", "model.safetensors.index.json", "tokenizer.json",
                     "tokenizer_config.json", "generation_config.json"}
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    assert set(index["metadata"]) == {"total_size", "total_parameters"}


def test_chat_template_thinks_as_qwen3(conv):
    """Qwen3's template: the generation prompt leaves `<think>` to the model; thinking off is an empty block."""
    from streamoe.runtime.text import TextIO

    text = TextIO(conv, load_manifest(conv).config)
    msgs = [{"role": "user", "content": "hi"}]
    assert text.chat_prompt(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert text.chat_prompt(msgs, think=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = text.encode(text.chat_prompt(msgs))
    assert ids[0] == 513 and ids.count(513) == 2 and ids.count(514) == 1 and ids[-1] == 198  # ...assistant\n
    assert text.stop_ids >= {514}
    assert text.encode("<think></think>") == [536, 537]  # the 26 added tokens of Qwen2's tokenizer, from 512


def test_convert_and_validate(ckpt, conv):
    m = load_manifest(conv)
    assert m.model["expert_prefix"] == "model.layers." and m.doc["source"]["model_type"] == "qwen3_moe"
    assert set(m.expert_formats()) == {"q4", "q3"}
    names = {t.name for t in m.blob("nonexpert")[1]}
    assert "lm_head.weight" in names and "model.layers.3.self_attn.q_norm.weight" in names
    assert not any(".switch_mlp." in n for n in names) and m.blob("vision") is None
    report = validate(conv, source=ckpt, samples=4)
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]
    assert {c["name"] for c in report["checks"]} >= {"source-experts-q4", "source-experts-q3", "source-nonexpert"}


# ------------------------------------------------------------------------------------ runtime


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_mlx_lm(ckpt, conv, prompt):
    """Teacher-forced greedy decode against mlx-lm's qwen3_moe in float32, every expert resident."""
    ref, ours, worst = teacher_forced(ckpt, conv, prompt, 24)
    assert ours == ref and worst < LOGIT_ATOL


def test_greedy_tokens_equal_mlx_lm_with_8_bit_routers_at_a_cap(tmp_path):
    """The export as today's mlx-lm converter writes it (8-bit `mlp.gate`), streamed through 4 hot slots."""
    ck = make(tmp_path / "ckpt", variant="qwen3-gate8", seed=3)
    out = tmp_path / "conv"
    convert(ck, out, progress=False)
    ref, ours, worst = teacher_forced_at_slots(ck, out, PROMPTS[2], 4)
    assert ours == ref and worst < LOGIT_ATOL


def test_a_compiled_decode_step_is_the_step_built_op_by_op(conv, monkeypatch):
    """Each layer's one-token call compiled (attention's projections, then its output, norm and router) gives the
    bits of the step built op by op."""
    on, off = compiled_step_bits(conv, monkeypatch, None)
    assert on == off


@pytest.mark.parametrize("kv", ["auto", "q8"])
def test_logits_bit_identical_across_caps(conv, kv):
    """Prefill and decode logits are the same bits with every expert resident and with 0 or 3 hot slots (of 32),
    whatever the tier and the guesses: the caps stream differently, the math never changes."""
    assert_logits_across_caps(conv, 32, kv=kv)


def test_resident_pipelined_generate_equals_a_capped_run(conv):
    """A resident run queues each step before its token is read and takes back one queued past a stop token; its
    tokens, logits and the KV state left for the next turn equal a capped run's."""
    from streamoe.runtime.engine import Engine, Options, plan_for
    from streamoe.runtime.sampling import Sampler

    results = []
    for slots in (None, 3):
        base = plan_for(conv, Options(cap_gib=64, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
        cap = 64.0 if slots is None else (base.fixed + slots * base.slot_bytes + 1) / 2**30
        eng = Engine(conv, Options(cap_gib=cap, ctx=256, prefill_chunk=16, runtime_bytes=RUNTIME))
        assert eng.experts.resident == (slots is None)
        out = [(t, np.array(lg).tobytes()) for t, lg in eng.generate(eng.text.encode(PROMPTS[0]), 12, Sampler())]
        after = np.array(eng.prefill(eng.text.encode(PROMPTS[1])).astype(mx.float32)).tobytes()
        results.append((out, eng.offset, after))
        eng.close()
    assert results[0] == results[1] and len(results[0][0]) >= 1


# ------------------------------------------------------------------------------------ bad input


def test_bad_variant_and_family(tmp_path):
    one_error_line(cli("synth", tmp_path / "x", "--family", "qwen3_moe", "--variant", "qwen3.6"),
                   "unknown variant 'qwen3.6' for qwen3_moe")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(("change", "needle"), [
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
     "rope_scaling type 'yarn' is not supported"),
    ({"mlp_only_layers": [1]}, "dense MLP layers"),
    ({"use_sliding_window": True}, "use_sliding_window = true is not supported"),
    ({"model_type": "deepseek_v3"}, "unsupported model_type 'deepseek_v3'"),
])
def test_configs_it_cannot_run_are_refused(tmp_path, change, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**make_config("full", family="qwen3_moe"), **change}))
    one_error_line(cli("plan", cfg, "--cap", "4"), str(cfg), needle)


def test_a_checkpoint_missing_a_head_norm_is_named(ckpt, tmp_path):
    """An export whose index and shards lack a tensor the config implies: convert names it before writing anything."""
    import shutil

    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.self_attn.k_norm.weight"]
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(StreamoeError, match="does not match its config: tensor model.layers.2.self_attn.k_norm.weight "
                                             "is missing"):
        convert(bad, tmp_path / "conv", progress=False)
    assert not (tmp_path / "conv").exists()


def test_a_grammar_waits_for_the_reasoning_the_model_opens(conv):
    """Qwen3's template leaves `<think>` to the model: a structured output or a strict tool's grammar starts where the
    model's reasoning closes if it opens one (its first token), as vLLM starts it, else at once. The reasoning runs
    free (here a `<tool_call>` inside it, which armed the call grammar and left only a stop after it), the JSON
    follows the close."""
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.serve.openai_api import Limits, parse_chat
    from streamoe.runtime.serve.worker import EngineWorker, ServeOptions

    eng = Engine(conv, Options(cap_gib=8, ctx=2048, runtime_bytes=RUNTIME))
    w = EngineWorker(eng, ServeOptions("t"))
    tok = eng.text.tokenizer
    think, close, call = (tok.token_to_id(t) for t in ("<think>", "</think>", "<tool_call>"))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
    try:
        for body, opens in (({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}, True),
                            ({"tools": [{"type": "function", "function": {"name": "get", "strict": True, "parameters": schema}}],
                              "parallel_tool_calls": False}, True),
                            ({"response_format": {"type": "json_object"}}, False)):
            req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "temperature": 0, **body}, Limits())
            c = w.prepare(req).constraint
            first = c.allowed()
            if not opens:  # the model did not open it: the grammar holds from the first token
                assert c.opener == think and first.tolist()[think] and first.tolist()[tok.encode("{").ids[0]]
                c.advance(tok.encode("{").ids[0])
                assert c.active and not c.allowed().tolist()[think]
                continue
            assert first is None or first.tolist()[think]
            c.advance(think)  # the model opens its reasoning: nothing holds it, a call's opening included
            for t in (tok.encode("so").ids[0], call, tok.encode("x").ids[0]):
                assert c.allowed() is None
                c.advance(t)
            c.advance(close)
            if "response_format" in body:  # the JSON from the close on
                assert c.active and c.allowed().tolist()[tok.encode("{").ids[0]] and not c.allowed().tolist()[think]
    finally:
        eng.close()


@pytest.mark.parametrize("temp", ["0", "1"])
def test_run_json_schema_holds_an_answer_that_does_not_open_its_reasoning(conv, temp):
    """`run --json-schema` with thinking on, where the template leaves `<think>` to the model: an answer that opens
    with anything else is JSON from its first token (it waited for a `</think>` the model never writes, and ended
    "in its thinking" with no JSON)."""
    import jsonschema

    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
              "additionalProperties": False}
    p = cli("run", conv, "--cap", "8", "--temp", temp, "--seed", "3", "-n", "60", "-q", "-p", "Give JSON:",
            "--json-schema", json.dumps(schema), "--runtime-mib", RUNTIME >> 20, check=True)
    jsonschema.validate(json.loads(p.stdout), schema)


def test_a_thinking_budget_holds_the_reasoning_the_model_opens(conv):
    """Anthropic's budget_tokens on Qwen3 (its template leaves `<think>` to the model): counted from the model's own
    `<think>`, then `</think>` forced, as where the prompt opens the reasoning (it was dropped without a word); an
    answer that opens with anything else reasons not, and nothing is forced."""
    from streamoe.runtime.constrain import ThinkingBudget
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.serve import anthropic_api
    from streamoe.runtime.serve.worker import EngineWorker, ServeOptions

    eng = Engine(conv, Options(cap_gib=8, ctx=4096, runtime_bytes=RUNTIME))
    w = EngineWorker(eng, ServeOptions("t"))
    tok = eng.text.tokenizer
    think, close, vocab = tok.token_to_id("<think>"), tok.token_to_id("</think>"), eng.args.vocab_size
    try:
        body = {"model": "t", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        b = w.prepare(anthropic_api.parse(body, w.so)).constraint
        assert isinstance(b, ThinkingBudget) and b.opener == think and b.budget == 1024
    finally:
        eng.close()
    word = tok.encode("so").ids[0]
    opened = ThinkingBudget([close], 2, vocab, opener=think)
    for t in (think, word, word):
        assert not opened.forcing
        opened.advance(t)
    assert opened.forcing and opened.allowed().tolist().index(True) == close
    plain = ThinkingBudget([close], 0, vocab, opener=think)  # a budget of 0: nothing before the first token
    assert not plain.forcing and plain.allowed() is None
    plain.advance(word)
    assert plain.closed and not plain.forcing
