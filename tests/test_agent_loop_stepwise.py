"""Step-wise mode of BrowserToolAgentLoop: one sample per policy step over a bounded prompt, on verl 0.9.1's real
prompt builder and tool path, a scripted policy and the in-process environment server.

Loops are built from ``configs/agent_loop.yaml`` as verl's ``AgentLoopWorker`` builds them and called with the
keyword arguments verl's V1 worker passes (``uid``, ``session_id``, ``global_steps``).
"""

from __future__ import annotations

import pytest
from hydra.errors import InstantiationException
from omegaconf import OmegaConf

from nemo_gym_browser.agent_attempt.stepwise import LEGACY_STEPWISE_MESSAGE, STEP_HISTORY_HEADER
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, make_row
from nemo_gym_browser.settings import BrowserLoopSettings, resolve_settings
from nemo_gym_browser.testing import fake_judge as fj
from nemo_gym_browser.testing import stepwise_policy as swp
from nemo_gym_browser.trainer_side.episode_metrics import episode_metrics

SAMPLING = {"temperature": 1.0, "logprobs": True}
ABOUT = {"url_contains": "about.html"}
V1_KWARGS = {"uid": "u1", "session_id": 0, "global_steps": 3}
STEPWISE = {"enabled": True, "history_observations": 1, "history_steps": 10}
FAST_ENV = {"call_timeout_s": 2.0, "seed_timeout_s": 2.0, "verify_timeout_s": 2.0, "close_timeout_s": 2.0}
WALK = swp.steps(sp.observe(), sp.click_matching("About"), sp.finish("ALPHA-42"))


@pytest.fixture
def run(server, tokenizer, tools, stepwise_trainer_config):
    async def run(script=WALK, *, stepwise=STEPWISE, row=None, config=None, **settings):
        settings.setdefault("resample_backoff_s", 0)
        policy = sp.ScriptedPolicy(tokenizer, script)
        loop = build_loop(
            policy,
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=config if config is not None else stepwise_trainer_config,
            environment={"server_urls": [server.url], **FAST_ENV},
            stepwise=stepwise,
            **settings,
        )
        row = row if row is not None else make_row(task="Open the About page", verifier_metadata=ABOUT)
        return await loop.run(SAMPLING, **row, **V1_KWARGS), policy

    return run


def text(tokenizer, ids) -> str:
    return tokenizer.decode(ids)


async def test_each_policy_step_is_its_own_sample_carrying_the_episodes_reward_and_flags(run, server, tokenizer):
    outputs, policy = await run()

    assert isinstance(outputs, list) and len(outputs) == 3 == policy.calls
    (session,) = server.session_ids
    assert server.events(session) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert [o.reward_score for o in outputs] == [1.0, 1.0, 1.0]
    for number, output in enumerate(outputs, start=1):
        assert output.extra_fields["env_invalid"] is False and output.extra_fields["reward_source"] == "verify"
        assert (output.extra_fields["env_step"], output.extra_fields["env_steps"]) == (number, 3)
        assert output.extra_fields["max_global_steps"] == policy.global_steps  # the server's weight version
        assert output.response_mask == [1] * len(output.response_ids)  # the step's own generation, all trained
        assert len(output.response_logprobs) == len(output.response_ids)
    # the responses are the three generations, each ending on the model's own end of turn
    responses = [text(tokenizer, o.response_ids) for o in outputs]
    assert '"action": "observe"' in responses[0] and '"action": "click"' in responses[1]
    assert '"action": "finish"' in responses[2] and all(r.endswith("<|im_end|>") for r in responses)


async def test_a_step_prompt_holds_the_task_a_line_per_earlier_step_and_only_the_latest_observation(run, tokenizer):
    outputs, _ = await run()
    first, second, third = (text(tokenizer, o.prompt_ids) for o in outputs)

    assert "Open the About page" in first and STEP_HISTORY_HEADER.format(steps=0) not in first
    assert STEP_HISTORY_HEADER.format(steps=1) in second and "[1] a: About" in second  # the index page, whole
    assert STEP_HISTORY_HEADER.format(steps=2) in third and "Open the About page" in third
    assert "Step 1: observe() -> ok" in third  # the first step, one line
    assert "Secret code: ALPHA-42" in third  # the About page the click returned, whole
    assert "[1] a: About" not in third  # the index page's observation is gone


async def test_the_prompt_stays_bounded_however_long_the_episode_runs(run, tokenizer):
    outputs, _ = await run(
        swp.walk(14, "ALPHA-42"),
        stepwise={**STEPWISE, "history_steps": 3},
        row=make_row(task="Walk", verifier_metadata=ABOUT),
    )

    assert len(outputs) == 14 and outputs[-1].reward_score == 1.0
    lengths = [len(o.prompt_ids) for o in outputs]
    # from step 5 on the history holds 3 lines and one observation: the prompt no longer grows with the episode
    assert max(lengths[4:]) - min(lengths[4:]) < 0.25 * min(lengths[4:]), lengths
    assert "(steps 1-" in text(tokenizer, outputs[-1].prompt_ids)


@pytest.mark.parametrize("stepwise", [STEPWISE, {"enabled": False}], ids=["stepwise", "one-sample"])
async def test_a_finish_on_any_step_ends_the_episode_and_its_answer_reaches_verify(run, server, stepwise):
    early = swp.steps(sp.observe(), sp.click_matching("About"), sp.finish("ALPHA-42"), sp.observe(), sp.observe())
    result, policy = await run(early, stepwise=stepwise)

    final = result[-1] if isinstance(result, list) else result
    assert policy.calls == 3 and final.reward_score == 1.0 and final.extra_fields["reward_source"] == "verify"
    assert server.events(server.session_ids[0])[-3:] == ["finish", "verify", "close"]


@pytest.mark.parametrize("stepwise", [STEPWISE, {"enabled": False}], ids=["stepwise", "one-sample"])
async def test_a_finish_in_the_last_allowed_turn_still_reaches_verify(run, server, stepwise):
    config = compose_trainer_config(overrides=["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"])
    result, policy = await run(WALK, stepwise=stepwise, config=config)

    final = result[-1] if isinstance(result, list) else result
    assert policy.calls == 3 and final.reward_score == 1.0
    assert server.events(server.session_ids[0]) == ["seed", "observe", "click", "finish", "verify", "close"]


@pytest.mark.parametrize("stepwise", [STEPWISE, {"enabled": False}], ids=["stepwise", "one-sample"])
async def test_the_last_steps_answer_reaches_the_judge_when_the_task_has_no_verifier(run, stepwise):
    async with fj.FakeJudgeServer() as judge_server:
        judge_server.script(fj.verdict(True))
        judge = {"base_url": judge_server.base_url, "model": "fake-judge", "max_attempts": 1, "backoff_s": 0}
        row = make_row(task="What is the secret code?", verifier_metadata=None, reference_answer="ALPHA-42")
        result, _ = await run(WALK, stepwise=stepwise, row=row, judge=judge)
        (request,) = judge_server.chat_requests

    final = result[-1] if isinstance(result, list) else result
    assert final.reward_score == 1.0 and final.extra_fields["reward_source"] == "judge"
    assert "ALPHA-42" in str(request)


async def test_an_infrastructure_failure_invalidates_every_step_and_the_resample_returns_only_its_own_steps(
    run, server
):
    server.inject("browser_click", Fault.status(503), on_call=1)  # the first attempt loses its second step
    outputs, policy = await run(resume={"max_per_episode": 0})  # re-run, not resumed (resumes: test_resume.py)

    assert len(outputs) == 3 and policy.calls == 2 + 3
    assert [o.extra_fields["env_attempts"] for o in outputs] == [2, 2, 2]
    assert [o.reward_score for o in outputs] == [1.0, 1.0, 1.0]
    assert outputs[0].extra_fields["env_failed_attempt_kinds"] == ["server_error"]
    assert server.open_sessions == 0

    server.inject("browser_click", Fault.status(503))  # every attempt fails at its second step
    outputs, _ = await run(max_attempts=2)
    assert len(outputs) == 2  # the final attempt's steps: observe, then the click the server failed
    for output in outputs:
        assert output.extra_fields["env_invalid"] is True and output.extra_fields["env_failure_kind"] == "server_error"
        assert output.reward_score == 0.0 and set(output.response_mask) == {0}
    assert server.open_sessions == 0


async def test_the_deadline_ends_a_stepwise_episode_scored_as_it_stands(run, server):
    # Twenty observes take 2 s of browser time, twice the deadline; the first step starts well inside it even on a
    # loaded machine.
    server.set_latency(0.1, "browser_observe")
    outputs, _ = await run(
        swp.walk(40, "x"), episode_deadline_s=1.0, row=make_row(task="Walk", verifier_metadata=ABOUT)
    )

    assert 1 <= len(outputs) < 40
    assert all(o.extra_fields["deadline_hit"] is True and o.extra_fields["env_invalid"] is False for o in outputs)
    assert server.open_sessions == 0


def stepwise_loop(tokenizer, tools, server, trainer_config):
    """A step-wise loop on the fake server, built (and so checked) under ``trainer_config``."""
    return build_loop(
        sp.ScriptedPolicy(tokenizer, WALK),
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=trainer_config,
        environment={"server_urls": [server.url]},
        stepwise=STEPWISE,
    )


async def test_stepwise_mode_is_refused_under_the_legacy_trainer(tokenizer, tools, server, stepwise_trainer_config):
    legacy = compose_trainer_config(overrides=["trainer.use_v1=false"])
    with pytest.raises(InstantiationException, match="only verl's V1 trainer"):  # hydra wraps the ValueError
        stepwise_loop(tokenizer, tools, server, legacy)
    loop = stepwise_loop(tokenizer, tools, server, stepwise_trainer_config)
    with pytest.raises(RuntimeError) as raised:  # called the legacy worker's way (no session_id)
        await loop.run(SAMPLING, **make_row(task="Open the About page", verifier_metadata=ABOUT))
    assert str(raised.value) == LEGACY_STEPWISE_MESSAGE
    assert server.session_ids == ()  # refused before any session opened


def test_stepwise_mode_without_a_turn_limit_is_refused_because_nothing_else_would_end_an_episode(
    tokenizer, tools, server
):
    unbounded = compose_trainer_config()  # verl's default: no max_assistant_turns
    assert unbounded.actor_rollout_ref.rollout.multi_turn.max_assistant_turns is None
    with pytest.raises(
        InstantiationException, match=r"needs actor_rollout_ref\.rollout\.multi_turn\.max_assistant_turns"
    ):
        stepwise_loop(tokenizer, tools, server, unbounded)


def test_stepwise_settings_are_read_from_the_loop_config_and_checked():
    base = {"environment": {"server_urls": ["http://127.0.0.1:1"]}}
    assert BrowserLoopSettings.from_mapping(base).stepwise.enabled is False
    settings = BrowserLoopSettings.from_mapping({**base, "stepwise": {"enabled": True, "history_observations": 2}})
    assert settings.stepwise.enabled and settings.stepwise.history_observations == 2
    with pytest.raises(
        ValueError, match=r"stepwise\.history: unknown key; allowed here: enabled, history_observations"
    ):
        BrowserLoopSettings.from_mapping({**base, "stepwise": {"history": 2}})
    with pytest.raises(ValueError, match="history_observations"):
        BrowserLoopSettings.from_mapping({**base, "stepwise": {"history_observations": 0}})
    yaml_entry = OmegaConf.load(compose_trainer_config().actor_rollout_ref.rollout.agent.agent_loop_config_path)[0]
    shipped = {key: value for key, value in yaml_entry.items() if key not in ("name", "_target_")}
    stepwise = resolve_settings({**shipped, **base}).stepwise
    assert (stepwise.enabled, stepwise.history_observations, stepwise.history_steps) == (False, 1, 10)


async def test_episode_metrics_count_episodes_not_step_samples(run, server):
    long, _ = await run(swp.walk(6, "ALPHA-42"), row=make_row(task="Walk", verifier_metadata=ABOUT))
    server.inject("browser_click", Fault.status(503))
    broken, _ = await run(max_attempts=1)

    rows = [o.extra_fields for o in [*long, *broken]]
    assert len(rows) == 6 + 2
    metrics = episode_metrics(rows)
    assert metrics["env/samples"] == 2
    assert metrics["env/invalid_count"] == 1 and metrics["env/invalid_rate"] == 0.5
    assert metrics["env/step_samples"] == 8
    assert metrics["env/steps/mean"] == 4 and metrics["env/steps/max"] == 6
