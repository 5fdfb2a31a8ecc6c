"""verl's sampling parameters, read and applied one token at a time, with vLLM's semantics.

Contract: :func:`parse_sampling_params` turns the dict verl's agent loops hand ``generate`` into a frozen
:class:`SamplingSpec`; :func:`choose_token` is one decoding step in vLLM's order (repetition penalty, then greedy at
temperature 0, else temperature, top-k, top-p, sample). A token's log-prob is taken from the distribution it was
sampled from (verl's ``processed_logprobs``), so rollout and actor agree exactly with top-k and top-p off;
``raw_logprobs`` works too.

Errors: any other key raises :class:`UnsupportedSamplingParameter` (vLLM would honour it; ignoring it would train
on another distribution), and vLLM's ``*_logits`` modes are refused. Details:
``docs/rehearsal-and-cpu-training.md#the-cpu-backend-in-detail``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "LOGPROBS_MODES",
    "SUPPORTED_KEYS",
    "SamplingSpec",
    "UnsupportedSamplingParameter",
    "choose_token",
    "parse_sampling_params",
]

# vLLM treats temperatures below this as greedy decoding.
GREEDY_EPSILON = 1e-5
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
SUPPORTED_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "max_tokens",
        "max_new_tokens",
        "logprobs",
        "repetition_penalty",
        "ignore_eos",
        "seed",
        "stop_token_ids",
    }
)


class UnsupportedSamplingParameter(ValueError):
    """A sampling parameter the ``hfcpu`` rollout cannot honour, or a value out of range."""


@dataclass(frozen=True)
class SamplingSpec:
    """One request's decoding settings, validated."""

    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    ignore_eos: bool = False  # end-of-sequence ids do not stop; stop_token_ids still do (as vLLM)
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def parse_sampling_params(
    params: Mapping[str, Any],
    *,
    default_max_tokens: int,
    max_possible_tokens: int,
    repetition_penalty: float = 1.0,
    ignore_eos: bool = False,
) -> SamplingSpec:
    """Validate ``params`` into a :class:`SamplingSpec` as vLLM's server in verl does.

    ``max_tokens`` (or ``max_new_tokens``) falls back to ``default_max_tokens`` and is clamped to
    ``[1, max_possible_tokens]``; ``repetition_penalty`` and ``ignore_eos`` fall back to the rollout config's.
    """
    unknown = sorted(set(params) - SUPPORTED_KEYS)
    if unknown:
        raise UnsupportedSamplingParameter(
            f"the hfcpu rollout cannot honour sampling parameter(s) {unknown}; it supports {sorted(SUPPORTED_KEYS)}"
        )
    if max_possible_tokens < 1:
        raise UnsupportedSamplingParameter("the prompt leaves no room to generate within the model's context length")
    if params.get("max_tokens") is not None:
        max_tokens = int(params["max_tokens"])
    elif params.get("max_new_tokens") is not None:
        max_tokens = int(params["max_new_tokens"])
    else:
        max_tokens = default_max_tokens
    temperature = float(params.get("temperature", 1.0))
    top_k = int(params.get("top_k", -1))
    top_p = float(params.get("top_p", 1.0))
    penalty = float(params.get("repetition_penalty", repetition_penalty))
    seed = params.get("seed")
    if temperature < 0:
        raise UnsupportedSamplingParameter(f"temperature must be >= 0, got {temperature}")
    if top_k < -1:
        raise UnsupportedSamplingParameter(f"top_k must be -1 (off), 0 (off) or positive, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise UnsupportedSamplingParameter(f"top_p must be in (0, 1], got {top_p}")
    if penalty <= 0:
        raise UnsupportedSamplingParameter(f"repetition_penalty must be > 0, got {penalty}")
    return SamplingSpec(
        max_tokens=max(1, min(max_tokens, max_possible_tokens)),
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        repetition_penalty=penalty,
        # verl passes a bool; vLLM also takes a count of top alternatives, of which TokenOutput carries none.
        logprobs=bool(params.get("logprobs", False)),
        ignore_eos=bool(params.get("ignore_eos", ignore_eos)),
        seed=None if seed is None else int(seed),
        stop_token_ids=frozenset(int(token) for token in params.get("stop_token_ids") or ()),
    )


def _apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    # vLLM/CTRL: a seen token's positive logit is divided by the penalty, a negative one multiplied.
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def _apply_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) what top-k and then top-p drop, as vLLM's ``apply_top_k_top_p``."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth_largest = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(logits, descending=False)
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= 1.0 - top_p
        drop[-1] = False  # the most likely token always stays
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def choose_token(
    logits: torch.Tensor,
    spec: SamplingSpec,
    *,
    seen: torch.Tensor | None,
    generator: torch.Generator,
    logprobs_mode: str = "processed_logprobs",
) -> tuple[int, float]:
    """One decoding step over a 1-D ``logits`` row: the chosen token id and its log-prob (see the module docstring).

    ``seen`` is a boolean mask over the vocabulary of the prompt and output tokens so far (only read when the
    repetition penalty is not 1).
    """
    raw = logits.float()
    processed = raw
    if spec.repetition_penalty != 1.0 and seen is not None:
        processed = _apply_repetition_penalty(processed, seen, spec.repetition_penalty)
    if spec.greedy:
        token = int(torch.argmax(processed))
    else:
        processed = _apply_top_k_top_p(processed / spec.temperature, spec.top_k, spec.top_p)
        token = int(torch.multinomial(processed.softmax(dim=-1), 1, generator=generator))
    reference = raw if logprobs_mode == "raw_logprobs" else processed
    return token, float(torch.log_softmax(reference, dim=-1)[token])
