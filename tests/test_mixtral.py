"""The Mixtral family (`mixtral`, Mixtral-8x7B): synth -> convert -> validate, plan from its bare config.json, its
SentencePiece tokenizer and chat template against transformers, greedy tokens against mlx-lm float32, logits
bit-identical across caps, and the configs it refuses."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from streamoe.convert.convert import convert
from streamoe.convert.synth import layout, make_config, synth
from streamoe.convert.validate import validate
from streamoe.formats.config import ModelArgs
from streamoe.formats.export import tensor_table
from streamoe.formats.manifest import load_manifest

from .conftest import LOGIT_ATOL, REPO, RUNTIME, cli, one_error_line
from .test_runtime import (
    PROMPTS,
    assert_logits_across_caps,
    compiled_step_bits,
    teacher_forced,
    teacher_forced_at_slots,
)

FULL_TOTAL = 26_270_703_616  # 32 layers of 8 experts, vocab 32,000, every module 4-bit
FULL_TENSORS = 839
EXPERT_RECORD = 99_090_432  # one expert, q4: 3 x (29,360,128 + 2 x 1,835,008)


def make(out: Path, size: str = "tiny", seed: int = 0) -> Path:
    synth(out, size=size, variant=None, text_only=False, seed=seed, shard_bytes=None, dry_run=False, family="mixtral")
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make(tmp_path_factory.mktemp("mx") / "tiny")


@pytest.fixture(scope="module")
def conv(ckpt, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mxconv") / "tiny"
    convert(ckpt, out, formats=["q4", "q3"], progress=False)
    return out


# ------------------------------------------------------------------------------------ facts, export, plan


def test_full_export_table():
    """`--size full` is Mixtral-8x7B's table: names in mlx-lm's module order, 4-bit everywhere, 5 GiB shards."""
    config = make_config("full", family="mixtral")
    a = ModelArgs.from_config(config)
    assert (a.num_hidden_layers, a.hidden_size, a.num_attention_heads, a.num_key_value_heads, a.head_dim) == (32, 4096, 32, 8, 128)
    assert (a.num_experts, a.num_experts_per_tok, a.moe_intermediate_size, a.vocab_size) == (8, 2, 14336, 32000)
    assert a.n_full_attention == 32 and a.shared_expert_intermediate_size == 0 and a.rope_theta == 1e6
    assert a.prefix == "" and a.expert_quant(31) == (4, 64) and a.eos_token_ids == (2,)
    rows = layout(config)
    assert len(rows) == FULL_TENSORS and sum(r["nbytes"] for r in rows) == FULL_TOTAL
    files = sorted({r["file"] for r in rows})
    assert files == [f"model-0000{i}-of-00006.safetensors" for i in range(1, 7)]
    by_name = {r["name"]: r for r in rows}
    assert rows[0]["name"] == "model.embed_tokens.weight" and rows[-1]["name"] == "lm_head.biases"
    assert by_name["model.layers.0.self_attn.k_proj.weight"]["shape"] == [1024, 512]
    assert by_name["model.layers.31.block_sparse_moe.switch_mlp.down_proj.weight"]["shape"] == [8, 4096, 1792]
    assert by_name["model.layers.0.block_sparse_moe.gate.weight"]["shape"] == [8, 512]  # a 4-bit router
    experts = sum(r["nbytes"] for r in rows if ".switch_mlp." in r["name"])
    assert experts == 32 * 8 * EXPERT_RECORD
    # per layer: the attention's 4 projections, the router, the 9 expert tensors, 2 norms
    patterns = {re.sub(r"\.\d+\.", ".N.", r["name"]) for r in rows}
    assert len(patterns) == 12 + 3 + 9 + 2 + 3 + 1 + 3


def test_plan_from_the_bare_config_of_the_real_model(tmp_path):
    """32 attention layers of KV (8 heads x 128 at float32: 262,144 B a token), records of 94.5 MiB."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(make_config("full", family="mixtral")))
    p = cli("plan", cfg, "--cap", "8", "--ctx", "4096", "--runtime-mib", "100", "--json", check=True)
    plan = json.loads(p.stdout)
    assert plan["stride"] == EXPERT_RECORD and plan["n_layers"] == 32 and plan["n_experts"] == 8
    assert plan["accounts"]["kv cache"] == 32 * 2 * 8 * 128 * 4 * 4096
    assert plan["accounts"]["linear state"] == 0 and plan["native_ctx"] == 32768
    assert plan["kv_formats"]["float32"]["token_bytes"] == 262_144 and plan["hot_slots"] > 0


# ------------------------------------------------------------------------------------ synth, convert, validate


def test_tiny_is_what_mlx_lm_loads(ckpt):
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, config = load_model(ckpt)
    assert type(model).__module__ == "mlx_lm.models.mixtral"
    assert [k for k, _ in tree_flatten(model.parameters())] == [n for n, _, _ in tensor_table(config)]
    moe = model.model.layers[0].block_sparse_moe
    assert moe.gate.bits == 4 and moe.switch_mlp.down_proj.bits == 4
    assert {p.name for p in ckpt.iterdir()} == {"config.json", "model.safetensors", "model.safetensors.index.json",
                                                 "tokenizer.json", "tokenizer_config.json", "generation_config.json"}


def test_tokenizer_and_template_are_mixtrals(ckpt, conv):
    """Llama's SentencePiece layout (<unk> <s> </s> at 0-2, byte fallback); the [INST] template's ids equal
    transformers' apply_chat_template, and an answer's turn closes with </s>."""
    from transformers import AutoTokenizer

    from streamoe.runtime.text import Detokenizer, TextIO

    hf = AutoTokenizer.from_pretrained(ckpt)
    text = TextIO(conv, load_manifest(conv).config)
    assert [text.tokenizer.token_to_id(t) for t in ("<unk>", "<s>", "</s>", "<0x0A>")] == [0, 1, 2, 13]
    chats = [[{"role": "user", "content": "Hello there"}],
             [{"role": "user", "content": "Two  spaces\nand a line"}, {"role": "assistant", "content": " A reply."},
              {"role": "user", "content": "é, ünïcode and 中文?"}]]
    for msgs in chats:
        rendered = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert text.chat_ids(msgs) == hf(rendered, add_special_tokens=False)["input_ids"]
        assert text.decode(text.chat_ids(msgs)) == hf.decode(text.chat_ids(msgs))  # "<s> [INST] ...": Llama's decode
    assert text.stop_ids == {2} and text.turn_close() == "</s>"
    assert not text.template.takes_tools  # Mixtral-Instruct's template never reads `tools`
    qwen = TextIO(REPO / "models" / "tiny", json.loads((REPO / "models" / "tiny" / "config.json").read_text()))
    assert qwen.template.takes_tools
    # a raw prompt opens with the BOS tokenizer_config.json asks for, as transformers' encode gives it; Qwen has none
    assert text.encode_prompt("def f(x):") == [1, *text.encode("def f(x):")] == hf("def f(x):")["input_ids"]
    assert text.encode_prompt("<s>def") == text.encode("<s>def") and text.encode("<s>def")[0] == 1
    assert qwen.encode_prompt("def f(x):") == qwen.encode("def f(x):")
    assert text.chat_ids(chats[0])[:2] == [1, text.encode("[INST]")[0]]
    answer = text.encode("Hi, I am fine.\nAnd you?")  # what follows [/INST]: streamed as a whole decode gives it
    detok = Detokenizer(text)
    assert "".join(detok.add(t) for t in answer) == hf.decode(answer) == "Hi, I am fine.\nAnd you?"
    # byte tokens that form no character: decoded together they turn the "c" already written into U+FFFD; streamed,
    # the stray byte is left out and the text goes on
    ids = [text.tokenizer.token_to_id(t) for t in ("▁A", "<0x63>", "<0xBB>", "▁lines", "<0xC3>", "<0xA9>", "▁A")]
    assert text.decode(ids) == "A\ufffd\ufffd lines\u00e9 A"
    detok = Detokenizer(text)
    assert [detok.add(t) for t in ids] == ["A", "c", "", " lines", "", "\u00e9", " A"]
    # a continued text (a completion): the space SentencePiece writes before the answer's first word stays, and
    # inside a long run of byte tokens the answer starts at a whole character, never with stray bytes
    prompt, whole = text.encode("hello world"), text.encode("hello world par msg")
    detok = Detokenizer(text)  # an answer alone (a chat's): its first word without the space, as decoding it gives
    assert whole[:len(prompt)] == prompt and "".join(detok.add(t) for t in whole[len(prompt):]) == "par msg"
    detok = Detokenizer(text, context=prompt)
    assert "".join(detok.add(t) for t in whole[len(prompt):]) == " par msg"
    run = text.encode("x" + "👩\u200d👩\u200d👧" * 3 + "y")
    for cut in range(1, len(run)):
        detok = Detokenizer(text, context=run[:cut])
        got = "".join(detok.add(t) for t in run[cut:]) + detok.tail()
        assert text.decode(run).endswith(got) and got.endswith("y") and not got.startswith("\ufffd"), (cut, got)


def test_convert_and_validate(ckpt, conv):
    m = load_manifest(conv)
    assert m.model["expert_prefix"] == "model.layers." and m.doc["source"]["model_type"] == "mixtral"
    assert set(m.expert_formats()) == {"q4", "q3"}
    names = {t.name for t in m.blob("nonexpert")[1]}
    assert "lm_head.weight" in names and "model.layers.3.block_sparse_moe.gate.weight" in names
    assert not any(".switch_mlp." in n for n in names) and m.blob("vision") is None
    report = validate(conv, source=ckpt, samples=4)
    assert report["ok"], [c for c in report["checks"] if not c["ok"]]


# ------------------------------------------------------------------------------------ runtime


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_mlx_lm(ckpt, conv, prompt):
    """Teacher-forced greedy decode against mlx-lm's mixtral in float32, every expert resident."""
    ref, ours, worst = teacher_forced(ckpt, conv, prompt, 24)
    assert ours == ref and worst < LOGIT_ATOL


def test_greedy_tokens_equal_mlx_lm_at_a_cap(ckpt, conv):
    """Streamed through 3 hot slots of 32."""
    ref, ours, worst = teacher_forced_at_slots(ckpt, conv, PROMPTS[2], 3)
    assert ours == ref and worst < LOGIT_ATOL


def test_a_compiled_decode_step_is_the_step_built_op_by_op(conv, monkeypatch):
    """Each layer's one-token call compiled (attention's projections, then its output, norm and router) gives the
    bits of the step built op by op."""
    on, off = compiled_step_bits(conv, monkeypatch, None)
    assert on == off


@pytest.mark.parametrize("kv", ["auto", "q8"])
def test_logits_bit_identical_across_caps(conv, kv):
    """Prefill and decode logits are the same bits with every expert resident and with 0 or 3 hot slots (of 32),
    whatever the tier and the guesses."""
    assert_logits_across_caps(conv, 32, kv=kv)


# ------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(("change", "needle"), [
    ({"head_dim": 64}, "head_dim 64 is not supported for mixtral (mlx-lm computes with hidden_size / num_attention_heads = 128)"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling is not supported for mixtral"),
    ({"sliding_window": 4096}, "sliding_window is not supported for mixtral"),
    ({"rope_traditional": True}, "rope_traditional = true is not supported"),
    ({"num_local_experts": 0}, "num_local_experts = 0 is out of range"),
])
def test_configs_it_cannot_run_are_refused(tmp_path, change, needle):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**make_config("full", family="mixtral"), **change}))
    one_error_line(cli("plan", cfg, "--cap", "4"), str(cfg), needle)


# ------------------------------------------------------------------------------------ serving


def test_served_as_a_text_model_with_a_bounded_prompt_account(ckpt, conv, tmp_path):
    """`streamoe serve` on a text-only model needs no flag: answers equal the engine's, an image is a 400 naming why,
    and the plan's requests account bounds a prompt by the SentencePiece vocabulary (a space becomes the 3-byte
    "▁", which no normaliser check may take for a lossy one: an unbounded prompt account took 10.3 GiB)."""
    from openai import BadRequestError, OpenAI
    from tokenizers import Tokenizer, normalizers

    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.sampling import Sampler
    from streamoe.runtime.serve.worker import PromptBound, ServeOptions, requests_bytes
    from streamoe.runtime.text import Detokenizer, TextIO

    from .conftest import RUNTIME
    from .serve_util import start_server, stop_server

    text = TextIO(conv, load_manifest(conv).config)
    bound = PromptBound(text.tokenizer)
    assert bound.token_bytes is not None and bound.at_least("▁" * 10 + " x" * 30) >= 1
    sample = "Two  spaces, a tab\tand é ü 中文 " * 40
    assert len(text.encode(sample)) >= bound.at_least(sample) > 0
    assert requests_bytes(ServeOptions("t"), conv, 4096) < (1 << 30)
    shrinking = Tokenizer.from_str(text.tokenizer.to_str())
    shrinking.normalizer = normalizers.Sequence([normalizers.Replace("  ", " ")])  # may shorten a text: no bound
    assert PromptBound(shrinking).token_bytes is None

    msgs = [{"role": "user", "content": "Hello there"}]
    eng = Engine(conv, Options(cap_gib=1, ctx=512, runtime_bytes=RUNTIME))
    detok = Detokenizer(text)  # the pieces the server streams (a random model writes stray byte tokens)
    want = "".join(detok.add(t) for t, _ in eng.generate(text.chat_ids(msgs), 8, Sampler()))
    eng.close()
    served = start_server(conv, tmp_path / "serve.log", "--cap", "1", "--ctx", "512")
    try:
        client = OpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(text.chat_ids(msgs))
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
        with pytest.raises(BadRequestError, match="does not show tools to the model") as e:
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4, tools=tools)
        assert e.value.body["param"] == "tools"
        done = client.completions.create(model="tiny", prompt="def f(x):", max_tokens=2, temperature=0)
        assert done.usage.prompt_tokens == len(text.encode("def f(x):")) + 1  # the BOS first
        hidden = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, tools=tools,
                                                tool_choice="none")  # the tools hidden from the model: text as asked
        assert hidden.choices[0].message.content == want
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        with pytest.raises(BadRequestError, match="serves a text-only model"):
            client.chat.completions.create(model="tiny", max_tokens=4, messages=[
                {"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    finally:
        stop_server(served)


def test_a_chat_with_a_text_only_model(conv, tmp_path):
    """`run --chat` needs no flag on a text-only model; an `/image` line is refused in one line and the chat goes
    on; a saved session continues the conversation; a raw prompt opens with the BOS."""
    from streamoe.runtime.text import TextIO

    session = tmp_path / "chat.sess"
    p = cli("run", conv, "--chat", "--cap", "1", "--temp", "0", "-n", "4", "--save-session", session,
            input="Hello there\n/image picture.png\nAnd you?\n", check=True)
    assert "picture.png: this model is text-only (no vision tower) (not attached; the chat goes on)" in p.stderr
    assert p.stderr.count(" tokens, ") == 2 and "Traceback" not in p.stderr and session.is_file()
    p = cli("run", conv, "--cap", "1", "--temp", "0", "-n", "4", "--load-session", session, "-p", "More?", check=True)
    assert p.stderr.count(" tokens, ") == 1
    stats = tmp_path / "raw.jsonl"
    cli("run", conv, "--raw", "-p", "def f(x):", "--cap", "1", "--temp", "0", "-n", "2", "--stats", stats, check=True)
    prefill = json.loads(stats.read_text().splitlines()[0])
    text = TextIO(conv, load_manifest(conv).config)
    assert prefill["phase"] == "prefill" and prefill["n_tokens"] == 1 + len(text.encode("def f(x):"))  # <s> first


def test_a_thinking_budget_is_refused_by_a_model_that_cannot_close_its_reasoning(conv):
    """Mixtral has no `</think>`: a request asking it to reason (Anthropic's thinking with or without a budget, which
    was dropped, an effort) is a 400 naming its field."""
    from streamoe.runtime.engine import Engine, Options
    from streamoe.runtime.serve import anthropic_api, responses_api
    from streamoe.runtime.serve.openai_api import APIError, Limits, parse_chat
    from streamoe.runtime.serve.worker import EngineWorker, ServeOptions

    eng = Engine(conv, Options(cap_gib=8, ctx=4096, runtime_bytes=RUNTIME))
    w = EngineWorker(eng, ServeOptions("t"))
    try:
        body = {"model": "t", "max_tokens": 2048, "messages": [{"role": "user", "content": "hi"}],
                "thinking": {"type": "enabled", "budget_tokens": 1024}}
        with pytest.raises(APIError, match="'thinking': this model does not reason") as e:
            w.prepare(anthropic_api.parse(body, w.so))
        assert e.value.param == "thinking"
        # asked to reason in each API's own words: refused naming that field (they were taken and did nothing);
        # asked not to reason, or not asked, it answers
        msgs, m = [{"role": "user", "content": "hi"}], {"model": "t"}
        for parse, asks, field_ in (
                (lambda b: parse_chat(b, Limits()), {**m, "messages": msgs, "reasoning_effort": "low"}, "reasoning_effort"),
                (lambda b: responses_api.parse(b, w.so), {**m, "input": "hi", "reasoning": {"effort": "high"}},
                 "reasoning.effort"),
                (lambda b: anthropic_api.parse(b, w.so), {**m, "messages": msgs, "max_tokens": 8,
                                                          "thinking": {"type": "adaptive"}}, "thinking")):
            with pytest.raises(APIError, match="this model does not reason") as e:
                w.prepare(parse(asks))
            assert e.value.param == field_
        for req in (parse_chat({**m, "messages": msgs, "reasoning_effort": "none"}, Limits()),
                    responses_api.parse({**m, "input": "hi", "reasoning": {"effort": "minimal"}}, w.so),
                    anthropic_api.parse({**m, "messages": msgs, "max_tokens": 8, "thinking": {"type": "disabled"}}, w.so),
                    parse_chat({**m, "messages": msgs}, Limits())):
            assert w.prepare(req).ids
    finally:
        eng.close()


def test_no_think_is_refused_by_a_model_with_no_thinking_to_turn_off(conv):
    p = cli("run", conv, "--cap", "1", "-p", "hi", "-n", "2", "--no-think")
    one_error_line(p, "--no-think: this model's template has no thinking to turn off")
