"""Resume against the real nemo-gym 0.7.0 ``interactive_browser`` server and Chromium, in both sample modes: the
session lost under the policy's second browser call (the fault proxy strips its cookie, so the server no longer knows
it) is repaired in a new session, and the episode ends with the policy's tokens it would have had without the fault.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.gym_contract.session_ids import parse_session_id
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.faults.proxy import FaultProxy
from nemo_gym_browser.local.in_process_loop import build_loop, make_row

pytestmark = pytest.mark.integration

# Real page loads and a real browser: generous but bounded.
ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 60.0, "verify_timeout_s": 30.0, "close_timeout_s": 15.0}
WALK = sp.walk_and_finish("About", "founded in 1999")


def lose_the_second_call():
    """A proxy rule: the first session's second browser call finds its session gone; nothing else is touched."""
    calls = 0
    lock = threading.Lock()

    def rule(request):
        nonlocal calls
        if not request.endpoint.startswith("browser_") or request.endpoint == "browser_finish":
            return None
        with lock:
            calls += 1
            return Fault.lose_session() if calls == 2 else None

    return rule


@pytest.mark.parametrize("mode", ["trajectory", "stepwise"])
async def test_a_session_lost_under_the_second_call_ends_with_the_samples_of_an_unbroken_episode(
    real_environment, local_site, tokenizer, tools, trainer_config, stepwise_trainer_config, mode
):
    row = make_row(
        task="Open the About page of the test site and report when it was founded.",
        initial_url=local_site.page("index.html"),
        verifier_metadata={"url_contains": "about.html"},
    )
    v1 = {"uid": "u", "session_id": 0, "global_steps": 1}

    async def episode(url: str):
        policy = sp.ScriptedPolicy(tokenizer, WALK)
        loop = build_loop(
            policy,
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=stepwise_trainer_config if mode == "stepwise" else trainer_config,
            environment={"server_urls": [url], **ENVIRONMENT},
            stepwise={"enabled": mode == "stepwise"},
            resample_backoff_s=0.2,
        )
        try:
            outputs = await loop.run({"temperature": 1.0, "logprobs": True}, **row, **v1)
        finally:
            await close_shared_clients()
        outputs = outputs if isinstance(outputs, list) else [outputs]
        # What the policy generated, sample by sample, and the reward. The observations between its turns are not
        # compared: nemo-gym 0.7.0 answers a click with the page as it stands when the click returns, which may be
        # before or after the navigation the click started, in any session (a clean one too).
        generated = [
            ([t for t, m in zip(o.response_ids, o.response_mask, strict=True) if m], o.reward_score) for o in outputs
        ]
        return generated, outputs, policy

    clean, _, clean_policy = await episode(real_environment.url)
    async with FaultProxy(real_environment.url, upstream_timeout_s=60) as proxy:
        proxy.set_rule(lose_the_second_call())
        resumed, outputs, policy = await episode(proxy.url)

    shown = "\n---\n".join(tokenizer.decode(sample[0]) for sample in [*clean, *resumed])
    assert resumed == clean and clean[-1][1] == 1.0, shown  # the policy's same tokens in as many samples, same reward
    assert policy.calls == clean_policy.calls  # the model was never asked again
    fields = outputs[-1].extra_fields
    assert fields["env_resumed_kinds"] == ["session_lost"] and fields["env_attempts"] == 1
    assert fields["env_failed_attempt_kinds"] == [] and fields["env_invalid"] is False
    faulted = [entry for entry in proxy.log if entry.fault]
    assert [(e.request.endpoint, parse_session_id(e.request.session_id)[1]) for e in faulted] == [("browser_click", 1)]
    sessions = {entry.request.session_id for entry in proxy.log if entry.request.session_id}
    assert len(sessions) == 2  # the lost one and the one it was resumed in, both attempt 1
    assert (await asyncio.to_thread(real_environment.wait_for_idle)).idle
