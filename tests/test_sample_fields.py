"""Every sample the loop returns carries the optional fields of a generated one (``sample_fields``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from omegaconf import OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

from nemo_gym_browser.agent_attempt import sample_fields
from nemo_gym_browser.agent_attempt.sample_fields import OptionalFields, complete_optional_fields
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer


def output(response: list[int], logprobs: list[float] | None = None, routed=None) -> AgentLoopOutput:
    return AgentLoopOutput(
        prompt_ids=[1, 2, 3],
        response_ids=response,
        response_mask=[1] * len(response),
        response_logprobs=logprobs,
        routed_experts=routed,
        metrics=AgentLoopMetrics(),
    )


def fields(**rollout) -> OptionalFields:
    return OptionalFields(OmegaConf.create(rollout))


@pytest.fixture(autouse=True)
def no_shape_seen(monkeypatch):
    monkeypatch.setattr(sample_fields, "_routed_shape_seen", None)


def test_an_empty_response_gets_one_masked_token_and_its_log_prob():
    sample = output([])
    complete_optional_fields(sample, fields(calculate_log_probs=True), build_chat_tokenizer())
    assert len(sample.response_ids) == 1 and sample.response_mask == [0] and sample.response_logprobs == [0.0]


@pytest.mark.parametrize(
    ("logprobs", "expected"),
    [(None, [0.0, 0.0, 0.0]), ([-0.5], [-0.5, 0.0, 0.0]), ([-1.0, -2.0, -3.0, -4.0], [-1.0, -2.0, -3.0])],
)
def test_log_probs_are_one_per_response_token_when_the_run_asks_for_them(logprobs, expected):
    sample = output([7, 8, 9], logprobs)
    complete_optional_fields(sample, fields(calculate_log_probs=True), build_chat_tokenizer())
    assert sample.response_logprobs == expected


def test_log_probs_are_absent_when_the_run_does_not_ask_for_them():
    sample = output([7, 8], [-0.1, -0.2])
    complete_optional_fields(sample, fields(calculate_log_probs=False), build_chat_tokenizer())
    assert sample.response_logprobs is None and "rollout_log_probs" not in sample.as_dict()


def test_routed_experts_of_a_sample_never_generated_take_the_shape_of_the_last_generated_one(tmp_path):
    replay = fields(enable_rollout_routing_replay=True)
    generated = output([7, 8], routed=np.ones((5, 4, 2), dtype=np.int16))
    placeholder = output([])

    complete_optional_fields(generated, replay, build_chat_tokenizer())
    complete_optional_fields(placeholder, replay, build_chat_tokenizer())

    assert placeholder.routed_experts.shape == (4, 4, 2) and not placeholder.routed_experts.any()


def test_routed_experts_before_any_generation_take_the_models_config(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "qwen3_moe", "num_hidden_layers": 6, "num_experts_per_tok": 8})
    )
    replay = OptionalFields(OmegaConf.create({"enable_rollout_routing_replay": True}), str(tmp_path))
    placeholder = output([])
    complete_optional_fields(placeholder, replay, build_chat_tokenizer())
    assert placeholder.routed_experts.shape == (4, 6, 8)
    assert placeholder.as_dict()["routed_experts"].shape == (4, 6, 8)  # what the V1 trainer stores
