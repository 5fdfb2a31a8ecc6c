"""The tiny policy's model and tokenizer: a small Qwen2 causal LM made from a config, nothing downloaded.

:func:`policy_tokenizer` is the in-process tokenizer of :mod:`nemo_gym_browser.local.chat_tokenizer` (hermes tool-call
chat template) with its vocabulary trained on the Corner Shop's prompts, pages and tool calls too, so an item name is
one token and an episode costs about half the tokens. :func:`build_model` makes a ``Qwen2ForCausalLM`` of the shape
:class:`ModelSpec` names, seeded: the same seed gives the same initial weights. CPU only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from . import shop_tasks
from .chat_tokenizer import build_chat_tokenizer
from .shop_scripts import DONE_ANSWER, call

# The loop renders observations of up to 8192 characters; the shop's are ~150-350, so episodes stay short.
PROMPT_LENGTH = 2048
RESPONSE_LENGTH = 4096
VOCABULARY_SUITES = ("lookup", "deal")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of the policy (a Qwen2 decoder; ``hidden_size`` must be a multiple of ``num_heads``)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 8192
    # The spread of the initial weights. transformers' 0.02 leaves a model this small on a long plateau before it
    # learns to point at anything in its context; 0.1 escapes it (measured on the deal suite, see the README).
    initializer_range: float = 0.02


def corpus_lines() -> list[str]:
    """Text shaped like the shop's traffic, for the tokenizer's vocabulary: prompts, observations, tool calls."""
    from ..task_lists.task_rows import SYSTEM_PROMPT_BROWSER, USER_PROMPT

    lines = SYSTEM_PROMPT_BROWSER.splitlines()
    # The text the shipped policies' vocabulary was trained on: a suite added since (aisle) is written in its words,
    # and must not change it (the tokenizer is rebuilt from this corpus, not read from a policy folder).
    for record in (r for suite in VOCABULARY_SUITES for r in shop_tasks.task_records(suite=suite)):
        lines.append(USER_PROMPT.format(question=record["ques"], site=record["web_name"], url=record["web"]))
    site = shop_tasks.in_process_site()
    for url in site.urls:
        page = site.page(url)
        lines += [f"URL: {url}", f"TITLE: {page.title}", "ELEMENTS:"]
        lines += [f"  [{i}] {element.tag}: {element.name}" for i, element in enumerate(page.elements)]
        lines += ["TEXT:", "  " + " ".join(page.text.split())]
    for board in shop_tasks.deal_boards()[:24]:
        page = site.page(shop_tasks.page_url(board.file))
        lines += [f"  [{i}] {element.tag}: {element.name}" for i, element in enumerate(page.elements)]
        lines += ["TEXT:", "  " + " ".join(page.text.split())]
    for i in range(10):
        lines += [call("click", element_id=i), f"  [{i}] a: Home"]
    for item in shop_tasks.items():
        lines.append(call("type", element_id=6, text=item.slug))
        lines.append(call("finish", answer=f" {item.price}"))
        lines.append(call("finish", answer=f" {item.name}"))
    lines += [call("observe"), call("finish", answer=DONE_ANSWER)]
    return lines


def policy_tokenizer() -> PreTrainedTokenizerFast:
    return build_chat_tokenizer(extra_corpus=corpus_lines())


def build_model(tokenizer: PreTrainedTokenizerFast, spec: ModelSpec, seed: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def parameter_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
