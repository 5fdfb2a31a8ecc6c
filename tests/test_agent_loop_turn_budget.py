"""The turn budget: a finish in the last allowed turn counts, and the recipe's turn and token sizes fit each other.

verl 0.9.1's ``ToolAgentLoop`` ends the episode at ``multi_turn.max_assistant_turns`` right after the last
generation, before it parses that generation's tool calls; the recipe's loop reads a ``finish`` there itself.
"""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from nemo_gym_browser.judge import BinaryJudge
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.in_process_loop import CONFIG_DIR, build_loop, compose_trainer_config, make_row
from nemo_gym_browser.preflight import Context, check_turn_budget, episode_token_budget
from nemo_gym_browser.settings import JudgeConfig
from nemo_gym_browser.testing import fake_judge as fj

SAMPLING = {"temperature": 1.0}
ANSWER = {"answer_equals": "ALPHA-42"}
# observe, click About, finish: the finish is the third generation.
WALK = sp.walk_and_finish("About", "ALPHA-42")


def turn_limited_config(turns: int, **extra: int):
    overrides = [f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}"]
    overrides += [f"actor_rollout_ref.rollout.multi_turn.{key}={value}" for key, value in extra.items()]
    return compose_trainer_config(overrides=overrides)


def loop_for(server, tokenizer, tools, config, script=WALK, **settings):
    policy = sp.ScriptedPolicy(tokenizer, script)
    loop = build_loop(
        policy,
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=config,
        environment={"server_urls": [server.url]},
        resample_backoff_s=0,
        **settings,
    )
    return loop, policy


async def test_a_finish_in_the_last_allowed_turn_reaches_the_verifier(server, tokenizer, tools):
    loop, policy = loop_for(server, tokenizer, tools, turn_limited_config(3))

    output = await loop.run(SAMPLING, **make_row(task="Report the secret code", verifier_metadata=ANSWER))

    assert policy.calls == 3
    assert server.events(server.session_ids[0]) == ["seed", "observe", "click", "finish", "verify", "close"]
    assert output.reward_score == 1.0 and output.extra_fields["env_invalid"] is False
    # No tool turn follows the last generation: the response ends on the model's own finish call.
    text = tokenizer.decode(output.response_ids)
    assert output.response_mask[-1] == 1 and text.endswith("</tool_call><|im_end|>")


async def test_a_finish_in_the_last_allowed_turn_reaches_the_judge(server, tokenizer, tools):
    async with fj.FakeJudgeServer() as judge_server:
        judge_server.script(fj.verdict(True))
        judge = {"base_url": judge_server.base_url, "model": "fake-judge", "max_attempts": 1, "backoff_s": 0}
        loop, _ = loop_for(server, tokenizer, tools, turn_limited_config(3), judge=judge)
        try:
            output = await loop.run(SAMPLING, **make_row(task="What is the secret code?", verifier_metadata=None))
        finally:
            await BinaryJudge.shared(JudgeConfig.from_mapping(judge)).close()

    (request,) = judge_server.chat_requests
    assert request.data_block("final_answer") == "ALPHA-42"
    assert output.reward_score == 1.0 and output.extra_fields["reward_source"] == "judge"


async def test_a_browser_action_in_the_last_allowed_turn_is_not_run_since_no_one_would_read_its_page(
    server, tokenizer, tools
):
    script = sp.steps(sp.observe(), sp.click_matching("About"))
    loop, policy = loop_for(server, tokenizer, tools, turn_limited_config(2), script=script)

    output = await loop.run(SAMPLING, **make_row(task="Open About", verifier_metadata=ANSWER))

    assert policy.calls == 2
    assert server.events(server.session_ids[0]) == ["seed", "observe", "verify", "close"]
    assert output.reward_score == 0.0 and output.extra_fields["env_invalid"] is False


async def test_a_finish_cut_by_the_response_length_does_not_count(server, tokenizer, tools):
    # The last generation overflows the response budget: the sample would not hold the whole call.
    long_thought = "thinking " * 400
    script = sp.steps(sp.observe(), sp.say(long_thought + sp.browser("finish", answer="ALPHA-42")))
    config = compose_trainer_config(
        response_length=1200, overrides=["actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2"]
    )
    loop, _ = loop_for(server, tokenizer, tools, config, script=script)

    output = await loop.run(SAMPLING, **make_row(task="Report the code", verifier_metadata=ANSWER))

    assert "finish" not in server.events(server.session_ids[0])
    assert output.reward_score == 0.0


# ----- the recipe's sizes -------------------------------------------------------------------------------------


def compose_recipe(*overrides: str):
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            return compose(
                config_name="webvoyager_grpo", overrides=["nemo_gym_browser.environment.server_urls=[x]", *overrides]
            )
    finally:
        GlobalHydra.instance().clear()


@pytest.fixture(scope="module")
def recipe_config():
    return compose_recipe()


def test_every_turn_of_the_recipes_budget_fits_its_response_length(recipe_config):
    rollout = recipe_config.actor_rollout_ref.rollout
    episode = episode_token_budget(rollout.multi_turn.max_assistant_turns, rollout.multi_turn.max_tool_response_length)

    assert episode == 26705  # 10 x 200 + 9 x (8192 / 3.0 + 14): the sum the trainer config's comment shows
    assert episode <= recipe_config.data.max_response_length
    assert rollout.response_length == recipe_config.data.max_response_length
    assert rollout.prompt_length == recipe_config.data.max_prompt_length


def test_the_preflight_warns_when_more_turns_than_the_response_length_holds_naming_both_fixes():
    config = compose_recipe("actor_rollout_ref.rollout.multi_turn.max_assistant_turns=12")
    message = check_turn_budget(Context(config, probe_judge=False))
    assert message.startswith("WARNING: 12 assistant turns can reach 32595 tokens")
    assert "MAX_ASSISTANT_TURNS to at most 10" in message and "MAX_RESPONSE_LENGTH to at least 32595" in message
    assert not check_turn_budget(Context(compose_recipe(), probe_judge=False)).startswith("WARNING")


def test_the_agent_loop_keeps_observations_as_long_as_the_budget_assumes(recipe_config):
    from omegaconf import OmegaConf

    from nemo_gym_browser.local.in_process_loop import AGENT_LOOP_YAML
    from nemo_gym_browser.settings import resolve_settings

    (entry,) = OmegaConf.load(AGENT_LOOP_YAML)
    shipped = {key: value for key, value in entry.items() if key not in ("name", "_target_")}
    settings = resolve_settings({**shipped, "environment": {"server_urls": ["http://127.0.0.1:1"]}})
    assert (
        settings.max_tool_response_length == recipe_config.actor_rollout_ref.rollout.multi_turn.max_tool_response_length
    )


def test_a_whole_episode_fits_the_token_budgets_of_the_actor_and_the_log_prob_passes(recipe_config):
    sequence = recipe_config.data.max_prompt_length + recipe_config.data.max_response_length
    assert recipe_config.actor_rollout_ref.actor.ppo_max_token_len_per_gpu >= sequence
    assert recipe_config.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu >= sequence
    assert recipe_config.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu >= sequence
