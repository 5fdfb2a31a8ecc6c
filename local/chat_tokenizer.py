"""A real ``transformers.PreTrainedTokenizerFast`` built in-process, for tests and benchmarks without a model hub.

What it is
    A byte-level BPE (``tokenizers``) trained in a few milliseconds on a small built-in corpus of chat, tool-call
    and browser-observation text, so that typical tool traffic costs roughly one token per three or four
    characters instead of one per byte. Special tokens follow the ChatML/hermes convention that verl's ``hermes``
    tool parser and its Qwen Continuous-Token builder expect: ``<|endoftext|>`` (padding), ``<|im_start|>``,
    ``<|im_end|>`` (end of turn, the EOS), and the added (non-special) tokens ``<tool_call>``, ``</tool_call>``,
    ``<tool_response>``, ``</tool_response>``, which survive ``decode(skip_special_tokens=True)`` as in Qwen.

The chat template
    Renders ``tools`` into the system turn, an assistant's ``tool_calls`` as ``<tool_call>{json}</tool_call>``
    blocks, and consecutive ``role: tool`` messages as one user turn of ``<tool_response>`` blocks. It is
    append-only: rendering a conversation is a token prefix of rendering that conversation plus more turns,
    which is what verl's Continuous-Token builder checks.

Guarantees
    Deterministic (same corpus and settings, same vocabulary and ids), no network, no files unless
    :func:`save_tokenizer_and_config` is asked to write a model folder.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, IM_END)
ADDED_TOKENS = (TOOL_CALL_START, TOOL_CALL_END, TOOL_RESPONSE_START, TOOL_RESPONSE_END)

# transformers' Qwen2 pre-tokenizer split: digits one by one, words with one leading non-letter, punctuation runs.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Small enough to train instantly, large enough that observations are not one token per byte.
VOCAB_SIZE = 2048

# Written with explicit '\n' outputs: transformers renders chat templates with trim_blocks/lstrip_blocks, which
# would otherwise swallow the newlines that follow block tags.
CHAT_TEMPLATE = (
    "{%- if messages and messages[0].role == 'system' -%}"
    "{%- set system_text = messages[0].content -%}{%- set turns = messages[1:] -%}"
    "{%- else -%}{%- set system_text = none -%}{%- set turns = messages -%}{%- endif -%}"
    "{%- if tools or system_text is not none -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{{- system_text if system_text is not none else 'You are an assistant that can use tools.' -}}"
    "{%- if tools -%}"
    '{{- \'\\n\\n## Tools\\nTo use a tool, write one JSON object with the keys "name" and "arguments" between '
    "<tool_call> and </tool_call>.\\nThe tools you can use:' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- if message.role == 'tool' -%}"
    "{%- if loop.first or turns[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user\\n' -}}{%- endif -%}"
    "{{- '<tool_response>\\n' + message.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or turns[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{%- elif message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (message.content or '') -}}"
    "{%- for call in message.tool_calls or [] -%}"
    "{%- if message.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' + (call.function.name | tojson) + ', \"arguments\": ' -}}"
    "{%- if call.function.arguments is string -%}{{- call.function.arguments -}}"
    "{%- else -%}{{- call.function.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

# Text shaped like the traffic of a browser rollout: prompts, tool calls, observations, page text.
_CORPUS_LINES = (
    "You are a web agent. Use the browser tool to solve the task, then call finish with your answer.",
    "Task: find the opening hours of the library on the example site and report them.",
    '{"name": "browser", "arguments": {"action": "observe"}}',
    '{"name": "browser", "arguments": {"action": "click", "element_id": 3}}',
    '{"name": "browser", "arguments": {"action": "navigate", "url": "https://www.example.com/about.html"}}',
    '{"name": "browser", "arguments": {"action": "type", "element_id": 7, "text": "weather in Paris"}}',
    '{"name": "browser", "arguments": {"action": "finish", "answer": "The answer is 42."}}',
    '{"name": "browser_observe", "arguments": {}}',
    '{"name": "browser_click", "arguments": {"element_id": 12}}',
    '{"name": "browser_navigate", "arguments": {"url": "http://127.0.0.1:8080/site/index.html"}}',
    '{"name": "browser_type", "arguments": {"element_id": 2, "text": "hello world"}}',
    '{"name": "browser_finish", "arguments": {"answer": "done"}}',
    '{"type": "function", "function": {"name": "browser", "description": "Act in a web browser.", '
    '"parameters": {"type": "object", "properties": {"action": {"type": "string", "enum": ["observe", '
    '"navigate", "click", "type", "finish"]}, "url": {"type": "string"}, "element_id": {"type": "integer"}, '
    '"text": {"type": "string"}, "answer": {"type": "string"}}, "required": ["action"]}}}',
    "URL: https://www.example.com/index.html",
    "TITLE: Example Domain - Home",
    "ELEMENTS:",
    "  [0] a: Home",
    "  [1] a: About us",
    "  [2] input: Search",
    "  [3] button: Submit",
    "  [4] a: Contact",
    "  [5] textarea: Message",
    "  [6] select: Country",
    "TEXT: Welcome to the example site. This page is used for testing the browser environment. "
    "Our library is open Monday to Friday from 9 am to 5 pm. Read more about us on the About page.",
    "Error: element_id 99 not in last observation; call browser_observe first",
    "Navigation refused: the address is on a private network. Only public http and https pages may be opened.",
    "The quick brown fox jumps over the lazy dog. 0123456789 !?.,;:()[]{}<>'\"/\\|-_=+*&^%$#@~`",
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n",
    "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n",
    "</tool_response><|im_end|>\n<|im_start|>assistant\nI am done.<|im_end|>\n",
)


def _corpus(extra: tuple[str, ...] = ()) -> list[str]:
    lines = [*_CORPUS_LINES, *extra]
    # Repeat so that the frequent pieces of tool traffic win merges over one-off words.
    return lines * 8


@functools.lru_cache(maxsize=4)
def _tokenizer_json(extra_corpus: tuple[str, ...] = (), vocab_size: int = VOCAB_SIZE) -> str:
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    # Exactly the normalizer and pre-tokenizer transformers' Qwen2 tokenizer rebuilds when AutoTokenizer loads a
    # folder whose config says qwen2 (as verl does): trained with any other, the tokenizer a model was trained with
    # and the one it is served with would split the same text differently (e.g. "127" vs "1","2","7").
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(SPECIAL_TOKENS),
    )
    tokenizer.train_from_iterator(_corpus(extra_corpus), trainer=trainer)
    return tokenizer.to_str()


def build_chat_tokenizer(extra_corpus: Sequence[str] = (), vocab_size: int = VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """A fresh tokenizer (cheap: the trained vocabulary is cached per process, the object is not shared).

    ``extra_corpus`` (more lines to train the vocabulary on, e.g. the pages and prompts of one task suite, so that
    its words are single tokens) and ``vocab_size`` (an upper bound) change the vocabulary; the defaults give the
    one every test uses.
    """
    backend = Tokenizer.from_str(_tokenizer_json(tuple(extra_corpus), vocab_size))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START],
        padding_side="left",
        model_max_length=1 << 20,
    )
    tokenizer.add_tokens(list(ADDED_TOKENS), special_tokens=False)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tokenizer_and_config(directory: str | Path, *, hidden_size: int = 16) -> Path:
    """Write a model folder (tokenizer files plus a tiny Qwen2 ``config.json``) that verl's ``HFModelConfig`` loads.

    Nothing is downloaded: the config describes a two-layer toy model that is never instantiated by the tests;
    verl reads it only for the model family (``model_type: qwen2``) and the architecture name.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = build_chat_tokenizer()
    tokenizer.save_pretrained(directory)
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": len(tokenizer),
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "max_position_embeddings": 1 << 16,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids(IM_END),
        "pad_token_id": tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
