"""Tasks without verifier_metadata are scored by the judge: success 1.0, failure 0.0, unusable is infrastructure."""

from __future__ import annotations

import logging

import pytest

from nemo_gym_browser.judge import BinaryJudge
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.in_process_loop import build_loop, make_row
from nemo_gym_browser.settings import JudgeConfig
from nemo_gym_browser.testing import fake_judge as fj

SAMPLING = {"temperature": 1.0}
OPEN_ENDED = make_row(
    task="What is the secret code on the About page?", verifier_metadata=None, reference_answer="ALPHA-42"
)
WALK = sp.walk_and_finish("About", "The code is ALPHA-42")


@pytest.fixture
def env(server):
    return server


@pytest.fixture
async def judge_server():
    async with fj.FakeJudgeServer() as fake:
        yield fake


@pytest.fixture
async def rollout(env, judge_server, tokenizer, tools, trainer_config):
    judges = []

    async def run(script=WALK, *, row=OPEN_ENDED, judge=None, **settings):
        judge = {
            "base_url": judge_server.base_url,
            "model": "fake-judge",
            "max_attempts": 1,
            "backoff_s": 0,
            **(judge or {}),
        }
        judges.append(BinaryJudge.shared(JudgeConfig.from_mapping(judge)))
        loop = build_loop(
            sp.ScriptedPolicy(tokenizer, script),
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=trainer_config,
            environment={"server_urls": [env.url]},
            judge=judge,
            resample_backoff_s=0,
            **settings,
        )
        return await loop.run(SAMPLING, **row)

    yield run
    for judge in judges:
        await judge.close()


async def test_a_judge_success_scores_one_and_the_judge_saw_the_answer_and_the_graded_page(rollout, env, judge_server):
    judge_server.script(fj.verdict(True))

    output = await rollout()

    assert output.reward_score == 1.0
    assert output.extra_fields["reward_source"] == "judge" and output.extra_fields["env_invalid"] is False
    (request,) = judge_server.chat_requests
    assert request.data_block("final_answer") == "The code is ALPHA-42"
    assert "Secret code: ALPHA-42" in request.data_block("page_text")
    assert request.data_block("page_url").endswith("site/about.html")
    assert request.data_block("reference_answer") == "ALPHA-42"
    assert "click" in request.data_block("steps")
    # No /verify for an open-ended task; the session was released by its close.
    assert env.events(env.session_ids[0]) == ["seed", "observe", "click", "finish", "close"]
    assert env.open_sessions == 0


async def test_a_judge_failure_is_a_valid_zero(rollout, judge_server):
    judge_server.script(fj.verdict(False))

    output = await rollout()

    assert output.reward_score == 0.0
    assert output.extra_fields["reward_source"] == "judge" and output.extra_fields["env_invalid"] is False


async def test_an_answer_that_leaves_the_judge_without_a_verdict_is_a_valid_zero_not_masked(rollout, judge_server):
    judge_server.default = fj.on_policy_text(fj.refusal())  # the judge answers the task alone, not this answer

    output = await rollout(judge={"max_attempts": 2})

    assert output.reward_score == 0.0 and output.extra_fields["reward_source"] == "judge"
    assert output.extra_fields["env_invalid"] is False and output.extra_fields["env_failure_kind"] is None
    assert set(output.response_mask) != {0}  # in the loss


async def test_an_unusable_verdict_is_judged_again_on_the_same_evidence_without_a_new_episode(
    rollout, env, judge_server
):
    judge_server.script(fj.hedge(), fj.verdict(True))

    output = await rollout(max_attempts=3, judge={"max_attempts": 2})

    assert output.reward_score == 1.0 and output.extra_fields["reward_source"] == "judge"
    assert output.extra_fields["env_attempts"] == 1 and output.extra_fields["env_failed_attempt_kinds"] == []
    assert len(env.session_ids) == 1 and env.calls("seed_session") == 1
    assert len(judge_server.chat_requests) == 2


@pytest.mark.parametrize("down_for", [3, 5], ids=["judge-back-after-one-episode", "judge-down-longer"])
async def test_a_judge_that_stays_down_costs_one_episode_and_the_trajectory_is_kept_flagged(
    rollout, env, judge_server, down_for
):
    # Down for all 3 requests of the judge's own retries: a new episode would have scored on the 4th request.
    judge_server.script(*[fj.http_error(503)] * down_for, fj.verdict(True))

    output = await rollout(max_attempts=3, judge={"max_attempts": 3})

    assert env.calls("seed_session") == 1 and len(env.session_ids) == 1 and env.open_sessions == 0
    assert len(judge_server.chat_requests) == 3
    assert output.extra_fields["env_invalid"] is True
    assert output.extra_fields["env_failure_kind"] == "judge_unusable"
    assert output.extra_fields["env_attempts"] == 1
    assert output.extra_fields["env_failed_attempt_kinds"] == ["judge_unusable"]
    assert "503" in output.extra_fields["env_failure_reason"]
    assert output.extra_fields["reward_source"] is None and output.reward_score == 0.0
    # The trajectory stays whole (the model's own tokens), out of the loss and the baseline.
    assert len(output.response_mask) > 1 and set(output.response_mask) == {0}


async def test_a_judge_that_never_gives_a_usable_verdict_leaves_the_sample_invalid_not_zero(rollout, judge_server):
    judge_server.default = fj.both_tokens()  # on the task alone too: the judge, not the policy's text, is at fault
    judge_server.script(fj.http_error(500))

    output = await rollout(max_attempts=2, judge={"max_attempts": 2})

    assert output.extra_fields["env_invalid"] is True
    assert output.extra_fields["env_failure_kind"] == "judge_unusable"
    assert output.extra_fields["reward_source"] is None
    assert set(output.response_mask) == {0}


async def test_a_task_with_verifier_metadata_is_verified_even_when_a_judge_is_configured(rollout, env, judge_server):
    output = await rollout(row=make_row(task="Open About", verifier_metadata={"url_contains": "about.html"}))

    assert output.extra_fields["reward_source"] == "verify" and output.reward_score == 1.0
    assert judge_server.chat_requests == []


async def test_an_open_ended_task_without_a_configured_judge_is_flagged_judge_unusable_without_an_episode(
    env, tokenizer, tools, trainer_config, caplog
):
    policy = sp.ScriptedPolicy(tokenizer, WALK)
    outputs = []
    with caplog.at_level(logging.WARNING, logger="nemo_gym_browser.browser_agent_loop"):
        for index in range(3):
            loop = build_loop(
                policy,
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=trainer_config,
                environment={"server_urls": [env.url]},
            )
            outputs.append(await loop.run(SAMPLING, **{**OPEN_ENDED, "index": index}, global_steps=4))

    for output in outputs:
        assert output.extra_fields["env_invalid"] is True
        assert output.extra_fields["env_failure_kind"] == "judge_unusable"
        assert "no judge is configured" in output.extra_fields["env_failure_reason"]
        assert output.extra_fields["reward_source"] is None and output.reward_score == 0.0
        assert output.extra_fields["env_attempts"] == 0
        assert output.response_mask == [0]
        assert output.extra_fields["min_global_steps"] == 4
    # No browser and no model call is spent on an episode nothing can score.
    assert env.calls() == 0 and policy.calls == 0
    said = [r.getMessage() for r in caplog.records if "no judge is configured" in r.getMessage()]
    assert len(said) == 1
