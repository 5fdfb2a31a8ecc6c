"""The agent loop against the real nemo-gym 0.7.0 ``interactive_browser`` server and Chromium, on 127.0.0.1.

A scripted policy drives verl's real ``ToolAgentLoop`` machinery (through ``BrowserToolAgentLoop``) over our
local test site to reward 1.0; a second real server killed in the middle of an episode yields a rollout that is
resumed (or resampled) on the healthy server; neither server keeps a browser open afterwards.
"""

from __future__ import annotations

import asyncio

import pytest

from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.launch_environment import LocalEnvironment
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, load_tools, make_row

pytestmark = pytest.mark.integration

# Real page loads and a real browser: generous but bounded.
ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 60.0, "verify_timeout_s": 30.0, "close_timeout_s": 15.0}
WALK = sp.walk_and_finish("About", "founded in 1999")


def loop_for(tokenizer, script, server_urls, **settings):
    return build_loop(
        sp.ScriptedPolicy(tokenizer, script),
        tokenizer=tokenizer,
        tools=load_tools(),
        trainer_config=compose_trainer_config(),
        environment={"server_urls": server_urls, **ENVIRONMENT, "server_cooldown_s": 300.0},
        resample_backoff_s=0.2,
        **settings,
    )


def about_task(local_site) -> dict:
    return make_row(
        task="Open the About page of the test site and report when it was founded.",
        initial_url=local_site.page("index.html"),
        verifier_metadata={"url_contains": "about.html"},
    )


async def test_a_scripted_policy_drives_the_real_server_through_the_loop_to_reward_one(
    real_environment, local_site, tokenizer
):
    loop = loop_for(tokenizer, WALK, [real_environment.url])
    try:
        output = await loop.run({}, **about_task(local_site))
    finally:
        await close_shared_clients()

    assert output.reward_score == 1.0
    assert output.extra_fields["env_invalid"] is False and output.extra_fields["env_attempts"] == 1
    assert output.extra_fields["reward_source"] == "verify"
    text = tokenizer.decode(output.response_ids)
    assert "TITLE: About the Test Site" in text and "founded in 1999" in text
    assert (await asyncio.to_thread(real_environment.wait_for_idle)).idle


async def test_a_server_killed_mid_episode_yields_a_rollout_resumed_or_resampled_on_a_healthy_server(
    real_environment, local_site, tokenizer
):
    doomed = await asyncio.to_thread(LocalEnvironment(backend=real_environment.backend).start)
    killed = asyncio.Event()

    def think(view: sp.PolicyView):
        # The first attempt's second turn (after its first observation) waits until the server is dead.
        return killed.wait() if view.turn == 1 and not killed.is_set() else 0.0

    loop = loop_for(tokenizer, WALK, [doomed.url, real_environment.url])
    policy = loop.server_manager
    policy.think_time_s = think
    task = asyncio.create_task(loop.run({}, **about_task(local_site)))
    try:
        for _ in range(600):  # the first observation has come back once the policy is asked for turn 1
            await asyncio.sleep(0.05)
            if policy.calls >= 2:
                break
        assert policy.calls >= 2 and not task.done()
        await asyncio.to_thread(doomed.stop)
        killed.set()
        output = await asyncio.wait_for(task, timeout=120)
    finally:
        if not task.done():
            task.cancel()
        await asyncio.to_thread(doomed.stop)
        await close_shared_clients()

    resumed, failed = output.extra_fields["env_resumed_kinds"], output.extra_fields["env_failed_attempt_kinds"]
    # The killed server failed the call in flight. The episode was resumed in a new session on the healthy server,
    # or, when every new session it tried still went to the dead one (each then fails at its seed and takes it out of
    # rotation), its attempt failed and the rollout was run again there.
    assert resumed + failed and set(resumed + failed) == {"unreachable"}
    assert len(resumed) <= 1 and len(failed) <= 2
    assert output.extra_fields["env_attempts"] == 1 + len(failed)
    assert output.extra_fields["env_invalid"] is False
    assert output.reward_score == 1.0 and output.extra_fields["reward_source"] == "verify"
    assert (await asyncio.to_thread(real_environment.wait_for_idle)).idle
