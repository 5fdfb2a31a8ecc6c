"""The loop against verl 0.9.1's real rollout-server clients over Ray: generation paused by the trainer, cut requests.

verl's ``LLMServerClient`` and ``FullyAsyncLLMServerClient`` (the colocate_async / separate_async client) talk to a
rollout server through verl's own load-balancer actor (``get_router_handle``). The server here is a Ray actor that
keeps the contract those clients use from verl's vLLM server: ``generate(prompt_ids, sampling_params, request_id,
...) -> TokenOutput``; while the trainer pauses generation, a request in flight answers ``stop_reason="aborted"``
with no tokens and new requests are parked until generation resumes (``abort_all_requests`` /
``resume_generation``); a cancelled ``generate`` is a request the server stops decoding. Its tokens come from the
scripted policy.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import ray
from verl.workers.rollout.llm_server import FullyAsyncLLMServerClient, LLMServerClient
from verl.workers.rollout.router import get_router_handle

from nemo_gym_browser.agent_attempt.rollout_cancel import generate_within, track_rollout_requests
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.in_process_loop import build_loop, make_row
from nemo_gym_browser.testing.private_ray import private_ray

SAMPLING = {"temperature": 1.0, "logprobs": False}
ABOUT = {"url_contains": "about.html"}


@ray.remote
class PausableRolloutServer:
    """A rollout server that the trainer pauses for ``pause_s`` seconds when request number ``pause_at`` (1-based)
    arrives: with ``abort_in_flight`` that request is in flight and answers aborted (colocate_async's
    ``on_sample_end``); without, the pause began just before it and it is parked (or queued) until the resume."""

    def __init__(self) -> None:
        from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer

        self.policy = sp.ScriptedPolicy(build_chat_tokenizer(), sp.walk_and_finish("About", "ALPHA-42"))
        self.configure()

    def configure(self, *, pause_at: int = 0, pause_s: float = 0.0, abort_in_flight: bool = True) -> None:
        """Start afresh (one actor serves the module: building it imports verl, which takes seconds)."""
        self.pause_at, self.pause_s, self.abort_in_flight = pause_at, pause_s, abort_in_flight
        self.requests = 0
        self.events: list[str] = []
        self.resumed = asyncio.Event()
        self.resumed.set()

    async def _pause_for_training(self) -> None:
        self.resumed.clear()
        self.events.append("paused")
        await asyncio.sleep(self.pause_s)
        self.resumed.set()
        self.events.append("resumed")

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        from verl.workers.rollout.replica import TokenOutput

        self.requests += 1
        number = self.requests
        self.events.append(f"start {number}")
        try:
            if number == self.pause_at:
                asyncio.get_running_loop().create_task(self._pause_for_training())
                await asyncio.sleep(0)
                if self.abort_in_flight:
                    self.events.append(f"aborted {number}")
                    return TokenOutput(token_ids=[], stop_reason="aborted", extra_fields={"global_steps": 0})
            await self.resumed.wait()  # parked while generation is paused
            output = await self.policy.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
            self.events.append(f"finished {number}")
            return output
        except asyncio.CancelledError:
            self.events.append(f"cancelled {number}")
            raise

    async def log(self) -> list[str]:
        return list(self.events)


@pytest.fixture(scope="module")
def rollout_stack(local_ray):
    """The rollout server actor and verl's load-balancer actor in front of it, built and answering (each takes
    seconds to start: a test's short timeouts must not run while they do)."""
    actor = PausableRolloutServer.remote()
    balancer = get_router_handle(servers={"rollout-0": actor})
    ray.get([actor.log.remote(), balancer.get_all_servers.remote()], timeout=120)
    yield actor, balancer
    ray.kill(balancer)
    ray.kill(actor)


@pytest.fixture
async def rollout_server(rollout_stack):
    actor, _ = rollout_stack

    async def configure(**settings):
        await actor.configure.remote(**settings)
        return actor

    return configure


@pytest.fixture
def verl_client(rollout_stack, trainer_config):
    _, balancer = rollout_stack
    return lambda client_cls: client_cls(config=trainer_config, load_balancer_handle=balancer)


@pytest.fixture(scope="module")
def local_ray():
    """A private Ray instance on 127.0.0.1 for this module."""
    with private_ray():
        yield


async def server_log(server, *, until: str | None = None, timeout_s: float = 20.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        log = await server.log.remote()
        if until is None or until in log or time.monotonic() > deadline:
            return log
        await asyncio.sleep(0.05)


async def test_a_training_phase_pausing_generation_far_past_the_deadline_is_not_a_policy_outcome(
    rollout_server, verl_client, server, tokenizer, tools, trainer_config
):
    # The deadline holds the episode's own browser time with room to spare on a loaded machine; the pause is far
    # past it.
    rollout_server = await rollout_server(pause_at=2, pause_s=5.0)
    client = verl_client(FullyAsyncLLMServerClient)
    loop = build_loop(
        client,
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=trainer_config,
        environment={"server_urls": [server.url]},
        episode_deadline_s=2.0,
    )

    output = await loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT))

    log = await server_log(rollout_server)
    # verl's client met the pause (an aborted request), waited it out and resubmitted: 2.5x the deadline.
    assert log[:4] == ["start 1", "finished 1", "start 2", "paused"] and "aborted 2" in log and "resumed" in log
    assert output.extra_fields["deadline_hit"] is False and output.extra_fields["env_invalid"] is False
    assert output.reward_score == 1.0
    assert server.events(server.session_ids[0]) == ["seed", "observe", "click", "finish", "verify", "close"]


HOLD_LIMIT_S = 5.0


async def test_a_generation_cut_at_the_hold_limit_is_cancelled_on_the_rollout_server(
    rollout_server, verl_client, server, tokenizer, tools, trainer_config
):
    rollout_server = await rollout_server(pause_at=2, pause_s=60.0, abort_in_flight=False)
    client = verl_client(LLMServerClient)
    loop = build_loop(
        client,
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=trainer_config,
        # Seconds: on a loaded machine the first generation and the observe must fit in the deadline and hold limit.
        environment={"server_urls": [server.url], "call_timeout_s": 2.0},
        episode_deadline_s=2.0,
        session_hold_limit_s=HOLD_LIMIT_S,
        max_attempts=1,
    )

    started = time.monotonic()
    output = await loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT))

    assert time.monotonic() - started < HOLD_LIMIT_S + 4.0  # the pause (60 s) is far past it
    assert output.extra_fields["env_invalid"] is True and output.extra_fields["env_failure_kind"] == "timeout"
    assert output.extra_fields["deadline_hit"] is False
    log = await server_log(rollout_server, until="cancelled 2")
    # Request 2 (parked by the pause) was cancelled on the server: it will not decode once generation resumes.
    assert log[:4] == ["start 1", "finished 1", "start 2", "paused"] and "cancelled 2" in log
    assert server.open_sessions == 0


# How long each request is awaited before it is given up: seconds, so that on a loaded machine it has reached the
# rollout server (and been parked by the pause) by then.
PARKED_S = 2.0


async def test_cancelling_the_awaiting_task_alone_leaves_the_request_running_on_the_rollout_server(
    rollout_server, verl_client, tokenizer
):
    # What verl 0.9.1's client does on its own when the task awaiting it is cancelled (Ray does not cancel the
    # actor task of an awaited ObjectRef), against what the loop's generate_within does.
    prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    rollout_server = await rollout_server(pause_at=1, pause_s=60.0, abort_in_flight=False)
    plain = verl_client(LLMServerClient)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(plain.generate("a", prompt_ids=prompt, sampling_params={}), PARKED_S)

    tracked = verl_client(LLMServerClient)
    assert track_rollout_requests(tracked)  # what BrowserToolAgentLoop does to the worker's client
    with pytest.raises(asyncio.TimeoutError):
        await generate_within(tracked.generate("b", prompt_ids=prompt, sampling_params={}), PARKED_S, "test")

    log = await server_log(rollout_server, until="cancelled 2")
    assert "cancelled 2" in log  # the loop's request: stopped on the server
    assert "cancelled 1" not in log  # the plain client's: still parked, to decode for nobody once generation resumes
