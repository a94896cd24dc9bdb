"""Tokenizer, chat template and generation/preprocessor configs for `streamoe synth`.

The real files (Qwen's 248,044-token byte-level BPE plus 33 added tokens) cannot be reproduced offline,
so synth ships a functionally equivalent set, with the real files' structure and special-token ids:

- `tokenizer.json`: a byte-level BPE with Qwen's normalizer (NFC), split regex and ByteLevel pre-tokenizer
  and decoder, trained in a fraction of a second on a few files of the Python standard library to
  `TRAINED_VOCAB` tokens (256 bytes + 256 merges). For the full-size model the base vocabulary is padded
  to 248,044 entries with filler tokens that no merge produces (so they never come out of encoding, but
  decode to readable text if a random model emits them), which puts the 33 added tokens at their real
  ids 248044…248076. Smaller sizes put them at `base + (real_id - 248044)`.
- `tokenizer_config.json`, `chat_template.jinja` (ChatML with images, tools and thinking on/off),
  `generation_config.json` (Qwen's sampling defaults), `preprocessor_config.json` (vision exports only).

Qwen3-MoE (`qwen3_moe`) has the older Qwen2 tokenizer: 151,643 base tokens, the first 26 of the added tokens
(through `</think>`, ids 151643…151668), Qwen2's split regex, and its chat template inside
tokenizer_config.json (as transformers 4.51 saved it) in Qwen3's form: the generation prompt leaves
`<think>` for the model to write, and `enable_thinking=False` gives it an empty think block instead.

gpt-oss (`gpt_oss`) has OpenAI's o200k "harmony" tokenizer: 199,998 base tokens, then the harmony special tokens
from `<|startoftext|>` (199998) through `<|call|>` (200012) at their real ids (reserved ones included, so every id
lands where the real one is; the real file goes on to 201,087 with reserved tokens no text produces), o200k's split
regex and no normalizer. Its chat template is a minimal harmony renderer (`HARMONY_CHAT_TEMPLATE`): a system
message with the reasoning effort and the valid channels, each message `<|start|>{role}<|message|>...<|end|>`,
an assistant's reasoning in the `analysis` channel and its answer in `final`, tool results as
`<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>...<|end|>`, and the generation prompt
`<|start|>assistant`; not the full harmony format (no developer instructions' tool namespaces, no `<|constrain|>`).

Mixtral (`mixtral`) has Llama's SentencePiece tokenizer as transformers converts it to tokenizer.json (`legacy`):
`<unk>`, `<s>`, `</s>` at ids 0-2, the byte-fallback tokens `<0x00>`..`<0xFF>` at 3-258, then BPE pieces over text
whose spaces are "▁" and which starts with one (the normalizer), no pre-tokenizer, a decoder that strips the first
space; trained here to SPM_TRAINED entries and padded to the vocabulary (32,000 at full size). Its template is the
published Mixtral-8x7B-Instruct-v0.1 one (`[INST] ... [/INST]`, answers closed by `</s>`), inside
tokenizer_config.json; generation_config.json says only the bos and eos ids, no sampling defaults.
"""

from __future__ import annotations

import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

REAL_BASE = 248044  # id of <|endoftext|> in the real tokenizer = size of its base BPE vocabulary
QWEN3_BASE = 151643  # the same for Qwen3 (Qwen2's tokenizer)
TRAINED_VOCAB = 512  # 256 byte tokens + 256 merges
MODEL_MAX_LENGTH = 262144

# The 33 added tokens of the real tokenizer.json, in real-id order (id = base + index); True = special.
ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
    ("<|audio_start|>", True),
    ("<|audio_end|>", True),
    ("<tts_pad>", True),
    ("<tts_text_bos>", True),
    ("<tts_text_eod>", True),
    ("<tts_text_bos_single>", True),
    ("<|audio_pad|>", True),
)
_INDEX = {content: i for i, (content, _) in enumerate(ADDED_TOKENS)}

HARMONY_BASE = 199998  # id of <|startoftext|> in o200k_harmony = size of its base BPE vocabulary
# o200k_harmony's special tokens from its first through <|call|>, in id order (id = base + index); all special.
HARMONY_TOKENS: tuple[tuple[str, bool], ...] = tuple((t, True) for t in (
    "<|startoftext|>", "<|endoftext|>", "<|reserved_200000|>", "<|reserved_200001|>", "<|return|>", "<|constrain|>",
    "<|reserved_200004|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|reserved_200009|>",
    "<|reserved_200010|>", "<|reserved_200011|>", "<|call|>",
))
_HARMONY_INDEX = {content: i for i, (content, _) in enumerate(HARMONY_TOKENS)}
# o200k's pre-tokenizer split (tiktoken's o200k_base pattern, as gpt-oss's tokenizer.json has it)
O200K_SPLIT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3.5's pre-tokenizer split, as in the real tokenizer.json (transformers models/qwen3_5/tokenization_qwen3_5.py).
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2's (and Qwen3's) split: letters without combining marks (transformers models/qwen2/tokenization_qwen2.py).
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Training text: a few stable, pure-Python stdlib modules (only their statistics matter).
CORPUS_FILES = ("textwrap.py", "string.py", "argparse.py", "json/decoder.py")


def token_id(content: str, base: int) -> int:
    """Id of an added token for a tokenizer whose base BPE vocabulary has `base` entries."""
    return base + _INDEX[content]


def harmony_id(content: str, base: int) -> int:
    """Id of a harmony special token for an o200k-style tokenizer whose base vocabulary has `base` entries."""
    return base + _HARMONY_INDEX[content]


def _corpus() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for name in CORPUS_FILES:
        try:
            texts.append((lib / name).read_text(encoding="utf-8"))
        except OSError:
            continue
    if not texts:  # no stdlib sources installed: fall back to this package's own sources
        texts = [p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parent.glob("*.py"))]
    return texts


def _trained(trainer_tok, size: int, filler: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocabulary, merges) a trained BPE tokenizer learnt, the vocabulary padded to `size` entries with `filler`
    pieces (numbered by id) that no merge produces."""
    trained = json.loads(trainer_tok.to_str())["model"]
    vocab: dict[str, int] = dict(trained["vocab"])
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in trained["merges"]]
    i = len(vocab)
    while len(vocab) < size:
        if filler.format(i) not in vocab:
            vocab[filler.format(i)] = len(vocab)
        i += 1
    return vocab, merges


def build_tokenizer(base: int, n_added: int = len(ADDED_TOKENS), split_pattern: str = SPLIT_PATTERN,
                    added: tuple[tuple[str, bool], ...] = ADDED_TOKENS, nfc: bool = True):
    """A byte-level BPE `tokenizers.Tokenizer` with `base` vocabulary entries followed by the first `n_added` of
    `added` (Qwen's: 33 for Qwen3.5/3.6, 26 for Qwen3; harmony's for gpt-oss); `nfc`: Qwen's NFC normalizer."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if base < TRAINED_VOCAB:
        raise ValueError(f"base vocabulary {base} is smaller than the {TRAINED_VOCAB} trained tokens")

    def pipeline(tok):
        if nfc:
            tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split_pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        return tok

    trainer_tok = pipeline(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(vocab_size=TRAINED_VOCAB, min_frequency=2, show_progress=False, special_tokens=[],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    trainer_tok.train_from_iterator(_corpus(), trainer)
    # padded to `base` (short corpora, and the real-id layout of `full`)
    vocab, merges = _trained(trainer_tok, base, "<|filler_{}|>")
    tok = pipeline(Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                        fuse_unk=False, byte_fallback=False)))
    for content, special in added[:n_added]:  # one at a time so ids follow the real order
        token = AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=special)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    for j, (content, _) in enumerate(added[:n_added]):
        assert tok.token_to_id(content) == base + j, content
    return tok


def chatml_template(title: str, media: bool, qwen3: bool) -> str:
    """The ChatML template of a synthetic checkpoint: Qwen3.5/3.6's (`media`: images and video placeholders; a
    generation prompt that opens `<think>`) or Qwen3's (`qwen3`: a past answer's empty thinking dropped but for
    the last turn's, and a generation prompt that leaves the thinking to the model)."""
    return (_CHATML.replace("@TITLE@", title).replace("@MEDIA@", _CHATML_MEDIA if media else "")
            .replace("@PAST@", " and (loop.last or reasoning)" if qwen3 else "")
            .replace("@OPEN@", "" if qwen3 else "    {%- else -%}\n        {{- '<think>\\n' -}}\n"))


_CHATML_MEDIA = r"""            {%- elif item.type == 'image' or 'image' in item or 'image_url' in item -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif item.type == 'video' or 'video' in item -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
"""
_CHATML = r"""{#- ChatML for the streamoe synthetic @TITLE@ -#}
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for item in content -%}
            {%- if item is string -%}
                {{- item -}}
@MEDIA@            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set first_is_system = messages | length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if first_is_system -%}
        {{- render_content(messages[0].content) + '\n\n' -}}
    {%- endif -%}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' -}}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        '\n</tool_call><|im_end|>\n' -}}
{%- elif first_is_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set ns.last_user = loop.index0 -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- if message.role == 'system' and loop.first -%}
    {%- elif message.role == 'user' or message.role == 'system' -%}
        {{- '<|im_start|>' + message.role + '\n' + render_content(message.content) + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set content = render_content(message.content) -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_user@PAST@ -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {%- if content or not loop.first -%}
                    {{- '\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- fn.arguments | tojson -}}
                {%- endif -%}
                {{- '}\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + render_content(message.content) + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
@OPEN@    {%- endif -%}
{%- endif -%}
"""
CHAT_TEMPLATE = chatml_template("checkpoints: images, video, tools, thinking on/off.", media=True, qwen3=False)
QWEN3_CHAT_TEMPLATE = chatml_template("Qwen3-MoE checkpoints: text, tools, Qwen3's thinking.", media=False, qwen3=True)


HARMONY_CHAT_TEMPLATE = r"""{#- A minimal harmony renderer for the streamoe synthetic gpt-oss checkpoints. -#}
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for item in content -%}
            {%- if item is string -%}
                {{- item -}}
            {%- elif 'text' in item -%}
                {{- item.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n' -}}
{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') + '\n\n' -}}
{{- '# Valid channels: analysis, commentary, final. Channel must be included for every message.' -}}
{%- if tools -%}
    {{- '\nCalls to these tools must go to the commentary channel: \'functions\'.' -}}
{%- endif -%}
{{- '<|end|>' -}}
{%- if tools or (messages | length > 0 and messages[0].role in ['system', 'developer']) -%}
    {{- '<|start|>developer<|message|>' -}}
    {%- if messages | length > 0 and messages[0].role in ['system', 'developer'] -%}
        {{- '# Instructions\n\n' + render_content(messages[0].content) -}}
    {%- endif -%}
    {%- if tools -%}
        {{- '\n\n# Tools\n\n## functions\n\n' -}}
        {%- for tool in tools -%}
            {{- (tool | tojson) + '\n' -}}
        {%- endfor -%}
    {%- endif -%}
    {{- '<|end|>' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and message.role in ['system', 'developer'] -%}
    {%- elif message.role == 'user' -%}
        {{- '<|start|>user<|message|>' + render_content(message.content) + '<|end|>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set thinking = message.thinking if message.thinking is string else (message.reasoning_content if message.reasoning_content is string else '') -%}
        {%- if thinking and loop.last -%}
            {{- '<|start|>assistant<|channel|>analysis<|message|>' + thinking + '<|end|>' -}}
        {%- endif -%}
        {%- if message.tool_calls -%}
            {%- for call in message.tool_calls -%}
                {%- set fn = call.function if call.function is defined else call -%}
                {{- '<|start|>assistant to=functions.' + fn.name + '<|channel|>commentary json<|message|>' -}}
                {%- if fn.arguments is string -%}
                    {{- fn.arguments -}}
                {%- else -%}
                    {{- fn.arguments | tojson -}}
                {%- endif -%}
                {{- '<|call|>' -}}
            {%- endfor -%}
        {%- else -%}
            {{- '<|start|>assistant<|channel|>final<|message|>' + render_content(message.content) + '<|end|>' -}}
        {%- endif -%}
    {%- elif message.role == 'tool' -%}
        {{- '<|start|>functions.' + (message.name if message.name is defined else 'tool') + ' to=assistant<|channel|>commentary<|message|>' -}}
        {{- render_content(message.content) + '<|end|>' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|start|>assistant' -}}
{%- endif -%}
"""


# Mixtral (`mixtral`): Llama's SentencePiece BPE as a tokenizer.json (transformers' conversion, `legacy`): <unk>, <s>
# and </s> at ids 0-2, the 256 byte-fallback tokens <0x00>..<0xFF> at 3-258, then pieces; a space is "▁" and every
# text is prefixed with one (the normalizer); no pre-tokenizer. The real vocabulary has 32,000 entries.
SPM_SPECIALS = ("<unk>", "<s>", "</s>")
SPM_TRAINED = 768  # specials, bytes and about 500 trained pieces
MIXTRAL_VOCAB = 32000
# Mixtral-8x7B-Instruct-v0.1's chat template (tokenizer_config.json), as published
MIXTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}"
)


def build_spm_tokenizer(vocab_size: int):
    """A Llama-style `tokenizers.Tokenizer` of `vocab_size` entries: SentencePiece BPE with byte fallback, trained
    on a few files of the Python standard library to SPM_TRAINED entries, padded with filler pieces no merge makes."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    if vocab_size < SPM_TRAINED:
        raise ValueError(f"vocabulary {vocab_size} is smaller than the {SPM_TRAINED} trained entries")
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    trainer_tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    trainer_tok.normalizer = normalizer
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="never")  # pieces in words
    trainer = trainers.BpeTrainer(vocab_size=SPM_TRAINED, min_frequency=2, show_progress=False,
                                  special_tokens=[*SPM_SPECIALS, *bytes_], limit_alphabet=100)
    trainer_tok.train_from_iterator([line for text in _corpus() for line in text.splitlines()], trainer)
    vocab, merges = _trained(trainer_tok, vocab_size, "<filler_{}>")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True,
                               dropout=None))
    tok.normalizer = normalizer
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1",
                                                       special_tokens=[("<s>", 1)])
    tok.add_special_tokens([AddedToken(t, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)
                            for t in SPM_SPECIALS])
    for j, t in enumerate(SPM_SPECIALS):
        assert tok.token_to_id(t) == j, t
    return tok


def mixtral_tokenizer_config() -> dict:
    """Mixtral-8x7B-Instruct-v0.1's tokenizer_config.json (its template inside, as transformers 4.36 saved it)."""
    decoder = {str(j): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                        "special": True} for j, t in enumerate(SPM_SPECIALS)}
    return {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder, "additional_special_tokens": [],
            "bos_token": "<s>", "chat_template": MIXTRAL_CHAT_TEMPLATE, "clean_up_tokenization_spaces": False,
            "eos_token": "</s>", "legacy": True, "model_max_length": 1000000000000000019884624838656, "pad_token": None,
            "sp_model_kwargs": {}, "spaces_between_special_tokens": False, "tokenizer_class": "LlamaTokenizer",
            "unk_token": "<unk>", "use_default_system_prompt": False}


@dataclass(frozen=True)
class TokenizerStyle:
    """What a family's tokenizer files look like (the real files' structure and special-token ids)."""

    n_added: int  # how many of ADDED_TOKENS follow the base vocabulary
    split_pattern: str
    chat_template: str
    template_in_config: bool  # the template inside tokenizer_config.json (transformers 4.x) instead of chat_template.jinja
    model_max_length: int
    temperature: float  # generation_config.json's default
    added: tuple[tuple[str, bool], ...] = ADDED_TOKENS  # the added tokens, in id order from the base vocabulary
    nfc: bool = True  # Qwen's NFC normalizer (o200k has none)


STYLES = {
    "qwen3_5_moe": TokenizerStyle(len(ADDED_TOKENS), SPLIT_PATTERN, CHAT_TEMPLATE, False, MODEL_MAX_LENGTH, 1.0),
    "qwen3_moe": TokenizerStyle(ADDED_TOKENS.index(("</think>", False)) + 1, QWEN2_SPLIT_PATTERN, QWEN3_CHAT_TEMPLATE,
                                True, 131072, 0.6),
    "qwen3_next": TokenizerStyle(ADDED_TOKENS.index(("</think>", False)) + 1, QWEN2_SPLIT_PATTERN, QWEN3_CHAT_TEMPLATE,
                                 False, 262144, 0.7),
    "gpt_oss": TokenizerStyle(len(HARMONY_TOKENS), O200K_SPLIT_PATTERN, HARMONY_CHAT_TEMPLATE, False, 1000000000000000019884624838656,
                              1.0, HARMONY_TOKENS, nfc=False),
}

def _dump(path: Path, obj: object, indent: int = 2) -> None:
    path.write_text(json.dumps(obj, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")


def tokenizer_config(base: int, vision: bool, style: TokenizerStyle = STYLES["qwen3_5_moe"]) -> dict:
    decoder = {}
    for j, (content, special) in enumerate(style.added[:style.n_added]):
        decoder[str(base + j)] = {
            "content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": special,
        }
    if style.added is HARMONY_TOKENS:  # transformers' PreTrainedTokenizerFast, as gpt-oss's tokenizer_config.json
        return {"added_tokens_decoder": decoder, "bos_token": "<|startoftext|>", "clean_up_tokenization_spaces": False,
                "eos_token": "<|return|>", "extra_special_tokens": {}, "model_input_names": ["input_ids", "attention_mask"],
                "model_max_length": style.model_max_length, "pad_token": "<|endoftext|>",
                "tokenizer_class": "PreTrainedTokenizerFast"}
    cfg: dict[str, object] = {
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": style.model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    if vision:
        cfg["processor_class"] = "Qwen3VLProcessor"
    if style.template_in_config:
        cfg["chat_template"] = style.chat_template
    return cfg


def harmony_generation_config(base: int, transformers_version: str) -> dict:
    """gpt-oss's generation_config.json: stops at <|return|>, <|endoftext|> and <|call|>; no sampling defaults."""
    return {
        "bos_token_id": harmony_id("<|startoftext|>", base),
        "do_sample": True,
        "eos_token_id": [harmony_id(t, base) for t in ("<|return|>", "<|endoftext|>", "<|call|>")],
        "pad_token_id": harmony_id("<|endoftext|>", base),
        "transformers_version": transformers_version,
    }


def generation_config(base: int, transformers_version: str, temperature: float = 1.0) -> dict:
    eot = token_id("<|endoftext|>", base)
    return {
        "bos_token_id": eot,
        "do_sample": True,
        "eos_token_id": [token_id("<|im_end|>", base), eot],
        "pad_token_id": eot,
        "temperature": temperature,
        "top_k": 20,
        "top_p": 0.95,
        "transformers_version": transformers_version,
    }


def preprocessor_config(vision_config: dict) -> dict:
    return {
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Qwen2VLImageProcessorFast",
        "image_std": [0.5, 0.5, 0.5],
        "merge_size": vision_config["spatial_merge_size"],
        "patch_size": vision_config["patch_size"],
        "processor_class": "Qwen3VLProcessor",
        "resample": 3,
        "rescale_factor": 1 / 255,
        "size": {"longest_edge": 16777216, "shortest_edge": 65536},
        "temporal_patch_size": vision_config["temporal_patch_size"],
    }


def write_tokenizer_files(out: Path, *, base: int, vision_config: dict | None, transformers_version: str,
                          family: str = "qwen3_5_moe") -> list[str]:
    """Write the tokenizer and its companions (in `family`'s style) into `out`; returns the file names written."""
    if family == "mixtral":  # `base`: the vocabulary's size (its specials come first)
        build_spm_tokenizer(base).save(str(out / "tokenizer.json"), pretty=True)
        _dump(out / "tokenizer_config.json", mixtral_tokenizer_config())
        _dump(out / "generation_config.json", {"_from_model_config": True, "bos_token_id": 1, "eos_token_id": 2,
                                               "transformers_version": transformers_version})
        return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]
    style = STYLES[family]
    tok = build_tokenizer(base, style.n_added, style.split_pattern, style.added, style.nfc)
    tok.save(str(out / "tokenizer.json"), pretty=True)
    _dump(out / "tokenizer_config.json", tokenizer_config(base, vision_config is not None, style))
    names = ["tokenizer.json", "tokenizer_config.json"]
    if not style.template_in_config:
        (out / "chat_template.jinja").write_text(style.chat_template, encoding="utf-8")
        names.append("chat_template.jinja")
    gen = (harmony_generation_config(base, transformers_version) if style.added is HARMONY_TOKENS
           else generation_config(base, transformers_version, style.temperature))
    _dump(out / "generation_config.json", gen)
    names.append("generation_config.json")
    if vision_config is not None:
        _dump(out / "preprocessor_config.json", preprocessor_config(vision_config))
        names.append("preprocessor_config.json")
    return names
