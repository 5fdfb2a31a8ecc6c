"""The CPU trainer backend: the ``cpu`` platform and the ``hfcpu`` rollout server, against real verl 0.9.1 classes.

The server runs a tiny seeded Qwen2 (``toy.save_random_policy``); every expectation is computed independently, from
full forward passes of the same weights loaded with plain transformers (no cache, no sampling code shared with the
server). Ray is used only where the behaviour is Ray's: the actor, verl's client and router, ``ray.cancel``. The
``cpu`` platform is checked in a fresh interpreter, because verl picks its platform once per process; this process
(which imports the backend without selecting it) shows that importing alone selects and patches nothing.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from verl.workers.config import RolloutConfig

from nemo_gym_browser.local.chat_tokenizer import IM_END, build_chat_tokenizer
from nemo_gym_browser.local.cpu_backend import (
    FORCE_ENV,
    PLUGIN_MODULE,
    ROLLOUT_NAME,
    cpu_env,
    cpu_overrides,
)
from nemo_gym_browser.local.cpu_backend import plugin as _plugin  # noqa: F401  (registers cpu and hfcpu)
from nemo_gym_browser.local.cpu_backend.main_ppo_cpu import toy_overrides
from nemo_gym_browser.local.cpu_backend.platform import PlatformCPU
from nemo_gym_browser.local.cpu_backend.rollout import (
    HFCpuReplica,
    HFCpuServerAdapter,
    server_actor_name,
    start_server_actor,
)
from nemo_gym_browser.local.cpu_backend.sampling import UnsupportedSamplingParameter
from nemo_gym_browser.local.cpu_backend.server import HFCpuServer, server_settings
from nemo_gym_browser.local.cpu_backend.toy import save_random_policy

PROMPT = [5, 6, 7, 8, 9, 10]
# Long enough that an uncancelled generation would run for tens of seconds, short of the 65536-token context.
LONG = {"max_tokens": 40000, "ignore_eos": True, "temperature": 1.0}
# Generous for a loaded 2-core machine; an uncancelled LONG generation takes far longer.
CANCEL_BOUND_S = 3.0
CALL_TIMEOUT_S = 60.0


def rollout_config(**overrides) -> RolloutConfig:
    settings = {
        "name": ROLLOUT_NAME,
        "prompt_length": 64,
        "response_length": 48,
        "tensor_model_parallel_size": 1,
        "dtype": "float32",
        "load_format": "auto",
    }
    settings.update(overrides)
    return RolloutConfig(**settings)


def model_config(path: Path) -> dict:
    return {"path": str(path), "override_config": {"attn_implementation": "sdpa"}}


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """A server sets its process's torch thread count (under Ray, its own process); restore the test process's."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    return save_random_policy(tmp_path_factory.mktemp("policy"), seed=0)


@pytest.fixture(scope="module")
def other_policy_dir(tmp_path_factory) -> Path:
    return save_random_policy(tmp_path_factory.mktemp("other_policy"), seed=1)


@pytest.fixture(scope="module")
def reference(policy_dir) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture
def server(policy_dir) -> HFCpuServer:
    return HFCpuServer(rollout_config(), model_config(policy_dir))


def next_token_logits(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Row i: the logits that chose ``response[i]`` (one uncached forward pass over prompt and response)."""
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(response)]


def greedy_reference(model: torch.nn.Module, prompt: list[int], steps: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(steps):
        with torch.inference_mode():
            tokens.append(int(model(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


async def generate(server: HFCpuServer, params: dict, request_id: str = "r", prompt: list[int] = PROMPT):
    return await asyncio.wait_for(server.generate(prompt, params, request_id), CALL_TIMEOUT_S)


# ----- sampling, budgets and stops


async def test_greedy_generation_is_the_models_argmax_and_repeats_exactly(server, reference):
    first = await generate(server, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    second = await generate(server, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    assert first.token_ids == greedy_reference(reference, PROMPT, 12)
    assert second.token_ids == first.token_ids
    assert first.stop_reason == "completed"


async def test_max_tokens_bounds_the_response_and_the_default_budget_is_vllms(server):
    bounded = await generate(server, {"max_tokens": 5, "ignore_eos": True})
    assert len(bounded.token_ids) == 5
    assert bounded.stop_reason == "completed"  # vLLM's server in verl reports a spent budget as completed
    # Without max_tokens: min(response_length, prompt_length + response_length - len(prompt)) = min(48, 112 - 100).
    long_prompt = list(range(3, 103))
    default = await generate(server, {"ignore_eos": True}, prompt=long_prompt)
    assert len(default.token_ids) == 12


def latest_new_token(tokens: list[int]) -> tuple[int, int]:
    """The token whose first appearance comes latest, and that position (a stop token that cuts the most)."""
    token = max(set(tokens), key=tokens.index)
    return token, tokens.index(token)


async def test_generation_stops_at_an_end_of_sequence_id_from_the_generation_config(policy_dir, reference, tmp_path):
    free_run = greedy_reference(reference, PROMPT, 12)
    # It becomes an extra EOS id in the generation config, as Qwen's lists several.
    stop_token, stop_at = latest_new_token(free_run)
    folder = tmp_path / "two_eos"
    folder.mkdir()
    for item in policy_dir.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    generation = json.loads((folder / "generation_config.json").read_text())
    generation["eos_token_id"] = [build_chat_tokenizer().convert_tokens_to_ids(IM_END), stop_token]
    (folder / "generation_config.json").write_text(json.dumps(generation))
    server = HFCpuServer(rollout_config(), model_config(folder))

    stopped = await generate(server, {"temperature": 0, "max_tokens": 12, "logprobs": True})
    assert stopped.token_ids == free_run[: stop_at + 1]
    assert stopped.stop_reason == "completed"
    assert len(stopped.log_probs) == len(stopped.token_ids)
    ignoring = await generate(server, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    assert ignoring.token_ids == free_run


async def test_stop_token_ids_stop_the_generation_even_when_eos_is_ignored(server, reference):
    free_run = greedy_reference(reference, PROMPT, 12)
    stop_token, stop_at = latest_new_token(free_run)
    params = {"temperature": 0, "max_tokens": 12, "ignore_eos": True, "stop_token_ids": [stop_token]}
    out = await generate(server, params)
    assert out.token_ids == free_run[: stop_at + 1]
    assert out.stop_reason == "completed"


def _expected_log_probs(logits: torch.Tensor, tokens: list[int], temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits if temperature == 0 else logits / temperature
    if top_k > 0:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return torch.log_softmax(scaled, dim=-1).gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)


@pytest.mark.parametrize(
    ("temperature", "top_k"),
    [(1.0, -1), (0.7, -1), (1.0, 5), (0.0, -1)],
    ids=["t1", "t0.7", "top_k5", "greedy"],
)
async def test_log_probs_are_the_sampling_distributions_log_softmax_at_the_chosen_tokens(
    server, reference, temperature, top_k
):
    out = await generate(
        server, {"temperature": temperature, "top_k": top_k, "max_tokens": 16, "ignore_eos": True, "logprobs": True}
    )
    logits = next_token_logits(reference, PROMPT, out.token_ids)
    expected = _expected_log_probs(logits, out.token_ids, temperature, top_k)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)


async def test_raw_logprobs_mode_returns_the_models_unscaled_log_probs(policy_dir, reference):
    server = HFCpuServer(rollout_config(logprobs_mode="raw_logprobs"), model_config(policy_dir))
    out = await generate(server, {"temperature": 0.5, "max_tokens": 8, "ignore_eos": True, "logprobs": True})
    expected = _expected_log_probs(next_token_logits(reference, PROMPT, out.token_ids), out.token_ids, 1.0, -1)
    assert torch.allclose(torch.tensor(out.log_probs), expected, atol=1e-4)


async def test_log_probs_are_left_out_unless_asked(server):
    out = await generate(server, {"max_tokens": 3})
    assert out.log_probs is None


async def test_top_k_one_samples_exactly_the_greedy_sequence(server):
    greedy = await generate(server, {"temperature": 0, "max_tokens": 12, "ignore_eos": True})
    top1 = await generate(server, {"temperature": 1.3, "top_k": 1, "max_tokens": 12, "ignore_eos": True})
    assert top1.token_ids == greedy.token_ids


async def test_sampled_tokens_stay_inside_top_k_and_inside_the_top_p_nucleus(server, reference):
    top_k = await generate(server, {"top_k": 3, "max_tokens": 32, "ignore_eos": True})
    logits = next_token_logits(reference, PROMPT, top_k.token_ids)
    allowed = torch.topk(logits, 3, dim=-1).indices
    assert all(token in allowed[i].tolist() for i, token in enumerate(top_k.token_ids))

    top_p = await generate(server, {"top_p": 0.3, "max_tokens": 32, "ignore_eos": True})
    probs = torch.softmax(next_token_logits(reference, PROMPT, top_p.token_ids), dim=-1)
    for i, token in enumerate(top_p.token_ids):
        ranked = torch.sort(probs[i], descending=True)
        nucleus_size = int((ranked.values.cumsum(0) < 0.3).sum()) + 1
        assert token in ranked.indices[:nucleus_size].tolist()


async def test_repetition_penalty_scales_the_logits_of_every_prompt_and_response_token(server, reference):
    penalty, steps = 3.0, 12
    expected: list[int] = []
    for _ in range(steps):
        logits = next_token_logits(reference, PROMPT, [*expected, 0])[-1].clone()  # the row picking the next token
        seen = torch.tensor(sorted(set(PROMPT) | set(expected)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
        expected.append(int(logits.argmax()))
    assert expected != greedy_reference(reference, PROMPT, steps)  # the penalty matters for this model

    params = {"temperature": 0, "repetition_penalty": penalty, "max_tokens": steps, "ignore_eos": True}
    out = await generate(server, params)
    assert out.token_ids == expected


async def test_a_request_seed_makes_sampling_reproducible_and_different_seeds_differ(server):
    params = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
    first = await generate(server, {**params, "seed": 7})
    again = await generate(server, {**params, "seed": 7})
    other = await generate(server, {**params, "seed": 8})
    assert first.token_ids == again.token_ids
    assert other.token_ids != first.token_ids


@pytest.mark.parametrize(
    "params",
    [{"stop": ["\n"]}, {"min_tokens": 4}, {"top_p": 0.0}, {"temperature": -1}],
    ids=["stop", "min_tokens", "top_p0", "negative_temperature"],
)
async def test_sampling_parameters_it_cannot_honour_are_refused(server, params):
    with pytest.raises(UnsupportedSamplingParameter):
        await generate(server, params)


async def test_every_output_reports_the_weight_version_in_extra_fields(server):
    await server.set_global_steps(4)
    out = await generate(server, {"max_tokens": 2})
    assert out.extra_fields["global_steps"] == 4


# ----- weights


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


async def test_update_weights_replaces_the_model_and_records_the_step(server, other_policy_dir):
    before = await generate(server, {"temperature": 0, "max_tokens": 10, "ignore_eos": True})
    other = AutoModelForCausalLM.from_pretrained(other_policy_dir, dtype=torch.float32).eval()
    summary = await server.update_weights(other.state_dict(), global_steps=3)
    after = await generate(server, {"temperature": 0, "max_tokens": 10, "ignore_eos": True})
    assert after.token_ids == greedy_reference(other, PROMPT, 10)
    assert after.token_ids != before.token_ids
    assert after.extra_fields["global_steps"] == 3
    assert summary["global_steps"] == 3


async def test_update_weights_refuses_unknown_names_and_missing_untied_parameters(server, other_policy_dir):
    weights = _state_dict(other_policy_dir)
    with pytest.raises(KeyError, match="no parameter"):
        await server.update_weights({**weights, "model.layers.9.mlp.up_proj.weight": torch.zeros(1)})
    missing = {name: value for name, value in weights.items() if "layers.0.mlp" not in name}
    with pytest.raises(KeyError, match="lacks"):
        await server.update_weights(missing)


# ----- cancellation and aborts


async def _started(server: HFCpuServer, request_id: str, params: dict = LONG) -> asyncio.Task:
    task = asyncio.create_task(server.generate(PROMPT, params, request_id))
    await asyncio.sleep(0.3)  # well into decoding: the prefill of six tokens takes milliseconds
    assert not task.done()
    return task


async def test_cancelling_a_long_generation_stops_it_promptly_and_frees_the_model(server):
    long = await _started(server, "long")
    began = time.monotonic()
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(long, CANCEL_BOUND_S)
    assert time.monotonic() - began < CANCEL_BOUND_S
    # One decode thread: this only finishes quickly if the cancelled decode really stopped.
    began = time.monotonic()
    nxt = await asyncio.wait_for(server.generate(PROMPT, {"max_tokens": 4, "ignore_eos": True}, "next"), CANCEL_BOUND_S)
    assert len(nxt.token_ids) == 4
    assert time.monotonic() - began < CANCEL_BOUND_S


async def test_abort_all_requests_returns_partial_outputs_and_holds_new_requests_until_resume(server):
    long = await _started(server, "long")
    result = await asyncio.wait_for(server.abort_all_requests(), CANCEL_BOUND_S)
    aborted = await asyncio.wait_for(long, CANCEL_BOUND_S)
    assert result == {"aborted_count": 1, "request_ids": ["long"]}
    assert aborted.stop_reason == "aborted"
    assert 0 < len(aborted.token_ids) < LONG["max_tokens"]

    held = asyncio.create_task(server.generate(PROMPT, {"max_tokens": 2}, "held"))
    await asyncio.sleep(0.3)
    assert not held.done()
    await server.resume_generation()
    released = await asyncio.wait_for(held, CANCEL_BOUND_S)
    assert released.stop_reason == "completed"


async def test_abort_all_requests_with_reject_answers_new_requests_aborted_at_once(server):
    await server.abort_all_requests(reject_request=True)
    refused = await asyncio.wait_for(server.generate(PROMPT, {"max_tokens": 2}, "late"), CANCEL_BOUND_S)
    assert (refused.token_ids, refused.stop_reason) == ([], "aborted")
    await server.resume_generation()
    assert (await generate(server, {"max_tokens": 2})).stop_reason == "completed"


async def test_abort_request_stops_that_request_only(server):
    long = await _started(server, "long")
    queued = asyncio.create_task(server.generate(PROMPT, {"max_tokens": 3, "ignore_eos": True}, "queued"))
    assert await server.abort_request("long") == {"aborted": True, "request_id": "long"}
    assert (await asyncio.wait_for(long, CANCEL_BOUND_S)).stop_reason == "aborted"
    finished = await asyncio.wait_for(queued, CANCEL_BOUND_S)
    assert (len(finished.token_ids), finished.stop_reason) == (3, "completed")
    assert (await server.abort_request("unknown"))["aborted"] is False


# ----- batching and per-request sampling streams


def distinct_prompts(count: int, seed: int = 0) -> list[list[int]]:
    """``count`` different prompts of 3 to 40 tokens (ragged, so the batch pads)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 700) for _ in range(rng.randrange(3, 41))] for _ in range(count)]


async def generate_all(server: HFCpuServer, prompts: list[list[int]], params: dict, ids: list[str] | None = None):
    """All prompts sent at once, each answer in the order of ``prompts``."""
    ids = ids or [f"req-{index}" for index in range(len(prompts))]
    calls = (server.generate(prompt, params, request_id) for prompt, request_id in zip(prompts, ids, strict=True))
    return await asyncio.wait_for(asyncio.gather(*calls), CALL_TIMEOUT_S)


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
async def test_a_request_gets_the_same_tokens_alone_as_among_fifteen_concurrent_others(policy_dir, temperature):
    prompts = distinct_prompts(16)
    params = {"temperature": temperature, "max_tokens": 24, "ignore_eos": True, "logprobs": True}
    alone = HFCpuServer(rollout_config(), model_config(policy_dir))
    singles = [await generate(alone, params, prompt=prompt) for prompt in prompts]
    together = await generate_all(HFCpuServer(rollout_config(), model_config(policy_dir)), prompts, params)

    assert [out.token_ids for out in together] == [out.token_ids for out in singles]
    for batched, single in zip(together, singles, strict=True):
        assert torch.allclose(torch.tensor(batched.log_probs), torch.tensor(single.log_probs), atol=1e-4)


async def test_a_batch_decodes_what_the_model_predicts_for_each_prompt(server, reference):
    prompts = distinct_prompts(6, seed=1)
    outputs = await generate_all(server, prompts, {"temperature": 0, "max_tokens": 10, "ignore_eos": True})
    assert [out.token_ids for out in outputs] == [greedy_reference(reference, prompt, 10) for prompt in prompts]


async def test_two_fresh_servers_with_the_same_seed_sample_the_same_tokens_whatever_the_arrival_order(policy_dir):
    prompts = distinct_prompts(12, seed=2)
    params = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    first = await generate_all(HFCpuServer(rollout_config(seed=3), model_config(policy_dir)), prompts, params)
    order = list(range(len(prompts)))
    random.Random(0).shuffle(order)
    shuffled = await generate_all(
        HFCpuServer(rollout_config(seed=3), model_config(policy_dir)), [prompts[i] for i in order], params
    )
    other_seed = await generate_all(HFCpuServer(rollout_config(seed=4), model_config(policy_dir)), prompts, params)

    assert [shuffled[order.index(i)].token_ids for i in range(len(prompts))] == [out.token_ids for out in first]
    assert [out.token_ids for out in other_seed] != [out.token_ids for out in first]


async def test_with_full_determinism_identical_prompts_are_told_apart_by_their_request_ids(policy_dir):
    prompts = [PROMPT] * 8
    ids = [f"det-{priority}" for priority in range(8)]
    params = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    config = rollout_config(full_determinism=True)
    first = await generate_all(HFCpuServer(config, model_config(policy_dir)), prompts, params, ids)
    reversed_ = await generate_all(HFCpuServer(config, model_config(policy_dir)), prompts, params, ids[::-1])

    by_id = {request_id: out.token_ids for request_id, out in zip(ids[::-1], reversed_, strict=True)}
    assert [by_id[request_id] for request_id in ids] == [out.token_ids for out in first]
    assert len({tuple(out.token_ids) for out in first}) == 8


async def test_with_full_determinism_and_one_request_id_for_all_a_group_still_draws_distinct_streams(policy_dir):
    # verl's V1 trainer passes no priority: every request of a group is "det-0", with the same first prompt.
    prompts = [PROMPT] * 8
    params = {"temperature": 1.0, "max_tokens": 16, "ignore_eos": True}
    config = rollout_config(full_determinism=True)
    first = await generate_all(HFCpuServer(config, model_config(policy_dir)), prompts, params, ["det-0"] * 8)
    again = await generate_all(HFCpuServer(config, model_config(policy_dir)), prompts, params, ["det-0"] * 8)

    assert len({tuple(out.token_ids) for out in first}) == 8
    assert sorted(out.token_ids for out in again) == sorted(out.token_ids for out in first)


async def test_the_same_prompt_sent_again_samples_a_fresh_stream(server):
    params = {"temperature": 1.0, "max_tokens": 24, "ignore_eos": True}
    first, second = await generate_all(server, [PROMPT, PROMPT], params)
    third = await generate(server, params)
    assert len({tuple(first.token_ids), tuple(second.token_ids), tuple(third.token_ids)}) == 3


async def test_aborting_one_request_of_a_batch_leaves_the_others_intact(policy_dir):
    prompts = distinct_prompts(4, seed=3)
    params = {"temperature": 1.0, "max_tokens": 200, "ignore_eos": True}
    expected = await generate_all(HFCpuServer(rollout_config(), model_config(policy_dir)), prompts, params)
    server = HFCpuServer(rollout_config(), model_config(policy_dir))
    long = await _started(server, "long")
    others = asyncio.create_task(generate_all(server, prompts, params))
    await asyncio.sleep(0.05)
    assert (await server.abort_request("long"))["aborted"] is True

    assert (await asyncio.wait_for(long, CANCEL_BOUND_S)).stop_reason == "aborted"
    finished = await others
    assert [out.token_ids for out in finished] == [out.token_ids for out in expected]
    assert {out.stop_reason for out in finished} == {"completed"}


async def test_a_weight_update_waits_for_the_batch_in_flight_and_no_response_mixes_two_versions(
    server, reference, other_policy_dir
):
    prompts = distinct_prompts(4, seed=4)
    params = {"temperature": 0, "max_tokens": 128, "ignore_eos": True}
    in_flight = asyncio.create_task(generate_all(server, prompts, params))
    await asyncio.sleep(0.05)
    assert not in_flight.done()
    other = AutoModelForCausalLM.from_pretrained(other_policy_dir, dtype=torch.float32).eval()
    update = asyncio.create_task(server.update_weights(other.state_dict(), global_steps=5))
    await asyncio.sleep(0)
    later = asyncio.create_task(generate(server, params, prompt=prompts[0]))
    await asyncio.wait_for(update, CALL_TIMEOUT_S)

    old = await in_flight
    assert [out.token_ids for out in old] == [greedy_reference(reference, prompt, 128) for prompt in prompts]
    assert {out.extra_fields["global_steps"] for out in old} == {None}
    new = await later
    assert new.token_ids == greedy_reference(other, prompts[0], 128)
    assert new.extra_fields["global_steps"] == 5


# ----- through Ray, as verl's agent loop calls it


@pytest.fixture(scope="module")
def trainer_config(policy_dir):
    from nemo_gym_browser.local.in_process_loop import compose_trainer_config

    config = compose_trainer_config(
        prompt_length=64,
        response_length=48,
        overrides=[f"actor_rollout_ref.model.path={policy_dir}", "actor_rollout_ref.rollout.dtype=float32"],
    )
    config.actor_rollout_ref.rollout.name = ROLLOUT_NAME
    config.actor_rollout_ref.rollout.load_format = "auto"
    config.actor_rollout_ref.model.override_config = {"attn_implementation": "sdpa"}
    return config


@pytest.fixture(scope="module")
def ray_server(tq, trainer_config):
    """The server as a named Ray actor, and verl's own router and client in front of it."""
    import ray
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    name = server_actor_name(0)
    handle = start_server_actor(rollout_config(), trainer_config.actor_rollout_ref.model, replica_rank=0, name=name)
    ray.get(handle.describe.remote(), timeout=120)
    client = LLMServerClient(config=trainer_config, load_balancer_handle=get_router_handle(servers={name: handle}))
    yield handle, client
    ray.kill(handle)


async def test_verls_client_generates_through_the_ray_actor_and_reads_the_weight_version(
    ray_server, trainer_config, other_policy_dir, monkeypatch
):
    _, client = ray_server
    monkeypatch.setenv("RANK", "0")
    adapter = HFCpuServerAdapter(
        config=trainer_config.actor_rollout_ref.rollout,
        model_config=trainer_config.actor_rollout_ref.model,
        device_mesh=None,
    )
    other = AutoModelForCausalLM.from_pretrained(other_policy_dir, dtype=torch.float32).eval()
    await asyncio.wait_for(adapter.update_weights(iter(other.state_dict().items()), global_steps=7), CALL_TIMEOUT_S)

    out = await asyncio.wait_for(
        client.generate(
            "req", prompt_ids=PROMPT, sampling_params={"temperature": 0, "max_tokens": 8, "ignore_eos": True}
        ),
        CALL_TIMEOUT_S,
    )
    assert out.token_ids == greedy_reference(other, PROMPT, 8)
    assert (out.extra_fields["global_steps"], out.extra_fields["min_global_steps"]) == (7, 7)


async def test_ray_cancel_of_a_generate_call_stops_the_decode_and_the_next_request_runs(ray_server):
    import ray

    handle, client = ray_server
    ref = handle.generate.remote(prompt_ids=PROMPT, sampling_params=LONG, request_id="long")
    await asyncio.sleep(1.0)
    ray.cancel(ref)
    with pytest.raises((ray.exceptions.TaskCancelledError, asyncio.CancelledError)):
        await asyncio.wait_for(ref, CANCEL_BOUND_S)
    began = time.monotonic()
    out = await asyncio.wait_for(
        client.generate("next", prompt_ids=PROMPT, sampling_params={"max_tokens": 4, "ignore_eos": True}),
        CALL_TIMEOUT_S,
    )
    assert len(out.token_ids) == 4
    assert time.monotonic() - began < CANCEL_BOUND_S


async def test_a_generation_the_recipes_loop_cuts_is_stopped_on_the_server(ray_server):
    from nemo_gym_browser.agent_attempt.rollout_cancel import generate_within, track_rollout_requests

    _, client = ray_server
    assert track_rollout_requests(client)
    with pytest.raises(TimeoutError):
        await generate_within(client.generate("cut", prompt_ids=PROMPT, sampling_params=LONG), 1.0, "cut")
    began = time.monotonic()
    out = await asyncio.wait_for(
        client.generate("next", prompt_ids=PROMPT, sampling_params={"max_tokens": 4, "ignore_eos": True}),
        CALL_TIMEOUT_S,
    )
    assert len(out.token_ids) == 4
    assert time.monotonic() - began < CANCEL_BOUND_S


# ----- registration, selection and configuration


def test_the_thread_count_comes_from_engine_kwargs_and_a_misspelt_key_is_refused():
    assert server_settings(rollout_config()).num_threads == 1
    assert server_settings(rollout_config(engine_kwargs={ROLLOUT_NAME: {"num_threads": 2}})).num_threads == 2
    with pytest.raises(ValueError, match="num_thread"):
        server_settings(rollout_config(engine_kwargs={ROLLOUT_NAME: {"num_thread": 2}}))


@pytest.mark.parametrize("value", [0, -1, 1.5, "2"])
def test_the_batch_size_comes_from_engine_kwargs_and_must_be_a_positive_integer(value):
    assert server_settings(rollout_config()).max_batch_size == 64
    assert server_settings(rollout_config(engine_kwargs={ROLLOUT_NAME: {"max_batch_size": 1}})).max_batch_size == 1
    with pytest.raises(ValueError, match="max_batch_size"):
        server_settings(rollout_config(engine_kwargs={ROLLOUT_NAME: {"max_batch_size": value}}))


def test_hfcpu_is_registered_with_both_of_verls_rollout_registries():
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class

    assert get_rollout_replica_class(ROLLOUT_NAME) is HFCpuReplica
    assert get_rollout_class(ROLLOUT_NAME, "async") is HFCpuServerAdapter


def test_the_hfcpu_replica_refuses_a_process_that_is_not_on_the_cpu_platform(trainer_config):
    from verl.utils.device import get_device_name

    assert get_device_name() != "cpu"  # this test process runs verl's default platform
    with pytest.raises(RuntimeError, match="VERL_PLATFORM=cpu"):
        HFCpuReplica(
            replica_rank=0,
            config=trainer_config.actor_rollout_ref.rollout,
            model_config=trainer_config.actor_rollout_ref.model,
        )


def test_the_cpu_platform_refuses_a_host_with_cuda_unless_forced(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.delenv(FORCE_ENV, raising=False)
    with pytest.raises(RuntimeError, match=FORCE_ENV):
        PlatformCPU()
    monkeypatch.setenv(FORCE_ENV, "1")
    assert PlatformCPU().device_name == "cpu"


def test_the_cpu_overrides_and_the_toy_run_compose_into_verls_trainer_config(tmp_path):
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from nemo_gym_browser.local.in_process_loop import VERL_CONFIG_DIR

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
            config = compose(config_name="ppo_trainer", overrides=[*cpu_overrides(), *toy_overrides(tmp_path)])
    finally:
        GlobalHydra.instance().clear()
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.name, rollout.engine_kwargs.hfcpu.num_threads, config.trainer.device) == (ROLLOUT_NAME, 1, "cpu")
    # The actor and the reference compute in the rollout's dtype.
    assert rollout.dtype == "float32"
    assert config.actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert config.actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype == "fp32"
    assert cpu_env()["VERL_USE_EXTERNAL_MODULES"] == PLUGIN_MODULE


_PROBE = textwrap.dedent(
    """
    import json, os, socket
    import torch
    import verl  # imports VERL_USE_EXTERNAL_MODULES
    import verl.utils.distributed as distributed
    import verl.utils.fsdp_utils as fsdp_utils
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.utils.device import get_device_name, get_nccl_backend, get_torch_device

    facts = {
        "registered": "cpu" in PlatformRegistry.registered_names(),
        "device_name": get_device_name(),
        "backend": get_nccl_backend(),
        "offload_policy_pins": fsdp_utils.CPUOffloadPolicy().pin_memory,
    }
    if get_device_name() == "cpu":
        device = get_torch_device()
        facts["memory"] = [device.memory_allocated(), device.max_memory_allocated()]
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        try:  # verl's own function, without the workaround
            distributed.initialize_global_process_group_ray.__wrapped__(timeout_second=30)
        except ValueError as exc:
            facts["unpatched_backend_error"] = str(exc).split(".")[0]
        from verl.workers import engine_workers  # binds the name as verl's workers do
        engine_workers.initialize_global_process_group_ray(timeout_second=30)
        total = torch.ones(3)
        torch.distributed.all_reduce(total)
        facts["all_reduce"] = total.tolist()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchPolicy
        from verl.workers.engine.fsdp import transformer_impl
        mesh = init_device_mesh("cpu", (1,))
        try:
            fsdp_utils.fully_shard(torch.nn.Linear(4, 4), mesh=mesh, offload_policy=TorchPolicy(pin_memory=True))
        except RuntimeError as exc:
            facts["pinned_offload_error"] = str(exc)
        module = torch.nn.Linear(4, 4)
        fsdp_utils.fully_shard(module, mesh=mesh, offload_policy=transformer_impl.CPUOffloadPolicy(pin_memory=True))
        facts["offloaded_forward"] = list(module(torch.ones(2, 4)).shape)
        torch.distributed.destroy_process_group()
    print("FACTS " + json.dumps(facts))
    """
)


@pytest.fixture(scope="module")
def cpu_platform_facts(tmp_path_factory) -> dict:
    """The probe's facts from a fresh interpreter with the backend's environment (verl picks a platform once)."""
    env = {**os.environ, **cpu_env(), "VERL_PLATFORM": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        cwd=tmp_path_factory.mktemp("probe"),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(next(line for line in done.stdout.splitlines() if line.startswith("FACTS "))[6:])


def test_the_cpu_platform_is_selected_by_verl_platform_cpu(cpu_platform_facts):
    assert cpu_platform_facts["registered"]
    assert (cpu_platform_facts["device_name"], cpu_platform_facts["backend"]) == ("cpu", "gloo")
    allocated, peak = cpu_platform_facts["memory"]
    assert 0 < allocated <= peak


def test_the_cpu_platform_is_registered_but_never_chosen_or_patched_without_verl_platform_cpu():
    import verl.utils.fsdp_utils as fsdp_utils
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.plugin.platform.platform_manager import PlatformRegistry
    from verl.utils.device import get_device_name

    assert "VERL_PLATFORM" not in os.environ  # this test process imported the plugin without selecting cpu
    assert PlatformRegistry.get("cpu") is PlatformCPU
    assert PlatformCPU().is_platform_available(use_smi_check=True) is False  # verl's auto-detection skips it
    assert get_device_name() != "cpu"
    assert fsdp_utils.CPUOffloadPolicy is CPUOffloadPolicy


def test_verls_cpu_blockers_are_real_and_the_workarounds_let_gloo_and_fsdp2_offload_run(cpu_platform_facts):
    assert cpu_platform_facts["unpatched_backend_error"].startswith("Duplicate device type cpu")
    # pinned memory needs an accelerator: CPU torch says so, a CUDA build of torch on a machine without a GPU (what a
    # default pip installs) names the missing driver
    pinned = cpu_platform_facts["pinned_offload_error"]
    assert "accelerator" in pinned or "NVIDIA driver" in pinned, pinned
    assert cpu_platform_facts["offload_policy_pins"] is False
    assert cpu_platform_facts["all_reduce"] == [1.0, 1.0, 1.0]
    assert cpu_platform_facts["offloaded_forward"] == [2, 4]
