"""The recipe's YAML configs, the loop's settings, the tool interface and the tool-call parser, against verl 0.9.1."""

from __future__ import annotations

import functools
import inspect
import json
import logging

import pytest
import yaml
from hydra.utils import get_class
from omegaconf import OmegaConf
from submit_fixtures import compose_recipe, script_overrides
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.experimental.agent_loop.tool_parser import HermesToolParser, ToolParser
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

from nemo_gym_browser import preflight
from nemo_gym_browser.agent_attempt.browser_tool import AGENT_LOOP_NAME, BrowserTool, default_tool_schema
from nemo_gym_browser.agent_attempt.episode import EpisodeSpec
from nemo_gym_browser.agent_attempt.tool_parser import LenientHermesToolParser
from nemo_gym_browser.browser_agent_loop import BrowserToolAgentLoop, running_under_v1_trainer
from nemo_gym_browser.gym_contract.browser_calls import parse_tool_call
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.in_process_loop import (
    AGENT_LOOP_YAML,
    build_loop,
    compose_trainer_config,
    load_tools,
    make_row,
)
from nemo_gym_browser.settings import JudgeConfig, resolve_settings

URLS = {"server_urls": ["http://127.0.0.1:1"]}  # never contacted: these tests only build loops


@functools.lru_cache(maxsize=1)
def base_config():
    return compose_trainer_config()


def make_loop(tokenizer, tools, trainer_config=None, **settings):
    settings.setdefault("environment", URLS)
    trainer_config = trainer_config if trainer_config is not None else base_config()
    return build_loop(
        sp.ScriptedPolicy(tokenizer, sp.say("")),
        tokenizer=tokenizer,
        tools=tools,
        trainer_config=trainer_config,
        **settings,
    )


# ----- configs ------------------------------------------------------------------------------------------------


def test_the_agent_loop_yaml_registers_the_browser_loop_under_its_contract_name():
    entries = OmegaConf.load(AGENT_LOOP_YAML)

    assert OmegaConf.is_list(entries)  # verl's agent_loop_config_path takes a YAML list
    (entry,) = [e for e in entries if e.name == AGENT_LOOP_NAME]
    assert get_class(entry._target_) is BrowserToolAgentLoop


def test_the_tool_configs_load_through_verl_as_one_browser_tool_or_nemo_gyms_five_tools():
    single = load_tools()
    native = load_tools(native=True)

    assert [t.name for t in single] == ["browser"]
    assert [t.name for t in native] == [
        "browser_observe", "browser_navigate", "browser_click", "browser_type", "browser_finish"
    ]  # fmt: skip
    for tool in [*single, *native]:
        assert isinstance(tool, BrowserTool)
        # The YAML and the code describe the same interface.
        assert tool.tool_schema == default_tool_schema(tool.name)


def test_the_class_paths_users_write_in_configs_keep_naming_the_loop_and_the_tool():
    # Tool configs in the wild name the tool by its first home; the loop module re-exports it for them.
    assert get_class("nemo_gym_browser.browser_agent_loop.BrowserTool") is BrowserTool
    assert get_class("nemo_gym_browser.browser_agent_loop.BrowserToolAgentLoop") is BrowserToolAgentLoop
    for name in ("browser_tool.yaml", "browser_native_tools.yaml"):
        for entry in OmegaConf.load(AGENT_LOOP_YAML.parent / name).tools:
            assert get_class(entry.class_name) is BrowserTool


def test_a_browser_tool_with_a_foreign_name_is_a_config_error():
    with pytest.raises(ValueError, match="cannot be named 'search'"):
        BrowserTool({"type": "native", "name": "search"})


async def test_the_browser_tool_outside_its_loop_says_which_agent_loop_it_needs():
    tool = BrowserTool({"type": "native"})
    instance, _ = await tool.create(create_kwargs={})

    with pytest.raises(RuntimeError, match=AGENT_LOOP_NAME):
        await tool.execute(instance, {"action": "observe"}, agent_data=object())


# ----- settings -----------------------------------------------------------------------------------------------


def test_the_trainer_config_section_overrides_the_yaml_settings_key_by_key(tokenizer, tools):
    config = compose_trainer_config(
        overrides=[
            "+nemo_gym_browser.episode_deadline_s=42",
            "+nemo_gym_browser.environment.call_timeout_s=7",
            "+nemo_gym_browser.environment.server_urls='http://127.0.0.1:2,http://127.0.0.1:3'",
            "+nemo_gym_browser.url_policy.allowlist=['*.corp.example']",
        ]
    )

    loop = make_loop(tokenizer, tools, config)

    settings = loop.settings
    assert settings.episode_deadline_s == 42
    assert settings.environment.call_timeout_s == 7
    assert settings.environment.server_urls == ("http://127.0.0.1:2", "http://127.0.0.1:3")
    assert settings.environment.seed_timeout_s == 120  # the model's default, untouched
    assert settings.max_attempts == 3 and settings.url_policy.allowlist == ("*.corp.example",)


def test_the_agent_loop_yaml_raises_verls_256_character_observation_cut(tokenizer, tools):
    loop = make_loop(tokenizer, tools)

    assert compose_trainer_config().actor_rollout_ref.rollout.multi_turn.max_tool_response_length == 256
    assert loop.max_tool_response_length == 8192


def test_keeping_verls_observation_cut_is_warned_about(tokenizer, tools, caplog):
    with caplog.at_level(logging.WARNING, logger="nemo_gym_browser.browser_agent_loop"):
        loop = make_loop(tokenizer, tools, max_tool_response_length=None)

    assert loop.max_tool_response_length == 256
    assert any("max_tool_response_length=256" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"episode_deadline": 5}, r"nemo_gym_browser\.episode_deadline: unknown key; allowed here: environment, "),
        ({"environment": {"server_urls": None}}, "no environment server"),
        ({"environment": {**URLS, "call_timeout": 3}}, r"nemo_gym_browser\.environment\.call_timeout: unknown key"),
        ({"url_policy": {"allow_private": True}}, r"url_policy\.allow_private: unknown key.*allow_private_networks"),
        ({"max_attempts": 0}, r"nemo_gym_browser\.max_attempts: Input should be greater than or equal to 1"),
        ({"judge": {"base_url": "http://127.0.0.1:1/v1"}}, r"nemo_gym_browser\.judge\.model: missing"),
    ],
)
def test_a_wrong_setting_raises_when_the_loop_is_built(tokenizer, tools, settings, message):
    with pytest.raises(Exception, match=message):
        make_loop(tokenizer, tools, **settings)


def test_a_loop_without_browser_tools_refuses_to_start(tokenizer):
    with pytest.raises(Exception, match="found no BrowserTool"):  # hydra wraps it in InstantiationException
        make_loop(tokenizer, [])


def test_the_judge_setting_is_a_mapping_of_the_judges_keys_and_a_file_path_is_refused(tokenizer, tools):
    loop = make_loop(tokenizer, tools, judge={"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_attempts": 2})

    assert loop.settings.judge == JudgeConfig(base_url="http://127.0.0.1:1/v1", model="m", max_attempts=2)
    with pytest.raises(Exception, match=r"nemo_gym_browser\.judge: Input should be a valid dictionary"):
        make_loop(tokenizer, tools, judge="configs/judge.yaml")


# ----- one place per setting: the preflight's check of the layers ---------------------------------------------


def layered_config(tmp_path, loop_settings: dict, **config_env: str):
    """The recipe composed as submit_webvoyager.sh composes it, from a config.env with ``config_env`` and an
    agent-loop YAML whose entry carries ``loop_settings``."""
    (shipped,) = yaml.safe_load(AGENT_LOOP_YAML.read_text())
    agent_loop = tmp_path / "agent_loop.yaml"
    agent_loop.write_text(yaml.safe_dump([{**shipped, **loop_settings}]))
    values = {"MODEL_PATH": "m", "JUDGE_ENABLE": "0", **config_env}
    env_file = tmp_path / "config.env"
    env_file.write_text("".join(f"{key}={value}\n" for key, value in values.items()))
    path_override = f"actor_rollout_ref.rollout.agent.agent_loop_config_path={agent_loop}"
    return compose_recipe(script_overrides(env_file, path_override))


def setting_layers(config, trainer_yaml=preflight.TRAINER_YAML) -> tuple[bool, str]:
    try:
        return True, preflight.check_setting_layers(preflight.Context(config, False), trainer_yaml)
    except preflight.CheckFailed as exc:
        return False, str(exc)


def test_the_shipped_configs_pass_the_preflights_one_place_per_setting_check(tmp_path):
    ok, detail = setting_layers(layered_config(tmp_path, {}))

    assert ok, detail
    assert detail == "each setting comes from one place (the agent-loop YAML holds only name and _target_)"


def test_step_wise_mode_switched_on_in_the_agent_loop_yaml_is_refused_where_the_trainer_config_switches_it_off(
    tmp_path,
):
    config = layered_config(tmp_path, {"stepwise": {"enabled": True}})
    assert resolve_settings({"stepwise": {"enabled": True}}, config).stepwise.enabled is False  # what the loop gets

    ok, detail = setting_layers(config)

    assert not ok
    assert detail.startswith(
        "nemo_gym_browser.stepwise.enabled: configs/agent_loop.yaml sets true, but config.env (SAMPLE_MODE) or "
        "configs/webvoyager_grpo.yaml sets false, which wins"
    )
    agreed = layered_config(tmp_path, {"stepwise": {"enabled": True}}, SAMPLE_MODE="stepwise")
    assert setting_layers(agreed) == (True, "1 setting(s) in the agent-loop YAML, none replaced by the trainer config")


def test_a_trainer_yaml_value_that_config_env_replaces_is_refused_naming_both_places(tmp_path):
    trainer_yaml = tmp_path / "webvoyager_grpo.yaml"
    trainer_yaml.write_text(
        preflight.TRAINER_YAML.read_text().replace("\n  max_attempts: 3\n", "\n  max_attempts: 5\n")
    )

    ok, detail = setting_layers(layered_config(tmp_path, {}), trainer_yaml)

    assert not ok
    assert detail == (
        "nemo_gym_browser.max_attempts: configs/webvoyager_grpo.yaml sets 5, but config.env (MAX_ATTEMPTS) or a "
        "command-line override sets 3, which wins: set MAX_ATTEMPTS in config.env instead (and put the file back to 3)"
    )
    assert setting_layers(layered_config(tmp_path, {}, MAX_ATTEMPTS="5"), trainer_yaml)[0]


# ----- which trainer is calling -------------------------------------------------------------------------------


def test_only_the_v1_worker_passes_session_id_to_agent_loops():
    # The trainer detection rests on this difference in verl 0.9.1's two workers.
    assert "session_id=i" in inspect.getsource(AgentLoopWorkerTQ._run_prompt)
    assert "session_id" not in inspect.getsource(AgentLoopWorker.generate_sequences)
    assert "session_id" not in inspect.getsource(AgentLoopWorker._run_agent_loop)

    assert running_under_v1_trainer({"uid": "u", "session_id": 0, "global_steps": 3, "raw_prompt": []})
    assert not running_under_v1_trainer({"uid": "u", "index": 0, "raw_prompt": [], "tools_kwargs": {}})


# ----- the row and the tool calls -----------------------------------------------------------------------------


def test_the_episode_is_read_from_any_browser_tools_create_kwargs():
    row = make_row(task="t", task_id="abc", initial_url="https://example.org/", verifier_metadata={"final_url": "x"})
    natives_only = {name: kw for name, kw in row["tools_kwargs"].items() if name != "browser"}

    spec = EpisodeSpec.from_tools_kwargs(natives_only)

    assert (spec.task_id, spec.initial_url, spec.verifier_metadata, spec.question) == (
        "abc", "https://example.org/", {"final_url": "x"}, "t"
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"nemo_gym_browser\.dataset"):
        EpisodeSpec.from_tools_kwargs({"browser": {"create_kwargs": {}}})


@pytest.mark.parametrize(
    ("tool", "arguments", "expected"),
    [
        ("browser", {"action": "observe"}, ("browser_observe", {})),
        ("browser", {"action": " Click ", "element_id": "3"}, ("browser_click", {"element_id": 3})),
        (
            "browser",
            {"action": "type", "element_id": 2.0, "text": "hi"},
            ("browser_type", {"element_id": 2, "text": "hi"}),
        ),
        ("browser", json.dumps({"action": "finish", "answer": 42}), ("browser_finish", {"answer": "42"})),
        (
            "browser",
            {"action": "navigate", "url": " https://a.example/ "},
            ("browser_navigate", {"url": "https://a.example/"}),
        ),
        ("browser_click", {"elementId": 1}, ("browser_click", {"elementId": 1})),  # natives go verbatim
        ("browser", {"action": "click", "element_id": True}, "click needs an element_id"),
        ("browser", {"action": "click", "element_id": -1}, "click needs an element_id"),
        ("browser", {"action": "type", "element_id": 1}, "type needs a text"),
        ("browser", {"action": "navigate"}, "navigate needs a url"),
        ("browser", {"action": "finish"}, "finish needs an answer"),
        ("browser", {"url": "x"}, "unknown action None"),
        ("browser", "not json", "must be a JSON object"),
        ("browser", [1, 2], "must be a JSON object"),
    ],
)
def test_tool_calls_become_environment_actions_or_policy_errors(tool, arguments, expected):
    assert parse_tool_call(tool, arguments) == expected or expected in parse_tool_call(tool, arguments)


async def test_the_lenient_parser_keeps_malformed_calls_so_verl_can_answer_them(tokenizer):
    text = (
        'I will look.<tool_call>\n{"name": "browser", "arguments": {"action": "observe"}}\n</tool_call>'
        '<tool_call>\n{"name": "browser", "arguments": {action: click}}\n</tool_call>'
        '<tool_call>\n{"name": "browser", "arguments": "{\\"action\\": \\"observe\\"}"}\n</tool_call>'
        "<tool_call>\nno json at all\n</tool_call><|im_end|>"
    )
    ids = tokenizer.encode(text, add_special_tokens=False)

    content, calls = await LenientHermesToolParser(tokenizer).extract_tool_calls(ids)
    _, upstream_calls = await HermesToolParser(tokenizer).extract_tool_calls(ids)

    assert content == "I will look.<|im_end|>"
    assert [(c.name, c.arguments) for c in calls] == [
        ("browser", '{"action": "observe"}'),
        ("browser", '{"name": "browser", "arguments": {action: click}}'),
        ("browser", '{"action": "observe"}'),
        ("", "no json at all"),
    ]
    assert len(upstream_calls) == 2  # upstream silently drops the two malformed blocks
    assert upstream_calls[0] == calls[0]


async def test_a_hermes_loop_answers_a_malformed_call_and_other_formats_keep_verls_parser(tokenizer, tools):
    malformed = tokenizer.encode(
        '<tool_call>\n{"name": "browser", "arguments": {action: click}}\n</tool_call><|im_end|>',
        add_special_tokens=False,
    )
    hermes = make_loop(tokenizer, tools)
    other_format = compose_trainer_config(overrides=["actor_rollout_ref.rollout.multi_turn.format=qwen3_coder"])
    qwen3_coder = make_loop(tokenizer, tools, trainer_config=other_format)

    _, calls = await hermes.tool_parser.extract_tool_calls(malformed)
    _, upstream_calls = await HermesToolParser(tokenizer).extract_tool_calls(malformed)
    assert [call.name for call in calls] == ["browser"] and upstream_calls == []  # kept, so verl answers it
    assert type(qwen3_coder.tool_parser) is type(ToolParser.get_tool_parser("qwen3_coder", tokenizer))


def test_the_token_builder_follows_the_chat_family_setting_over_the_model_type(tokenizer, tools, monkeypatch):
    """verl picks the builder that joins turns and tool responses by the model's exact model_type; a converted
    checkpoint (the widened deal policy is a Granite with a Qwen2 chat template) names the family by the setting."""
    from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder

    from nemo_gym_browser.local import in_process_loop

    def builder_class(model_type: str) -> type:
        return type(create_continuous_token_builder(tokenizer, hf_model_type=model_type))

    assert builder_class("granite") is not builder_class("qwen2")  # what the setting is for
    monkeypatch.setattr(in_process_loop, "HF_MODEL_TYPE", "granite")
    assert type(make_loop(tokenizer, tools).continuous_token_builder) is builder_class("granite")
    named = make_loop(tokenizer, tools, token_builder_model_type="qwen2")
    assert type(named.continuous_token_builder) is builder_class("qwen2")
    assert named.settings.token_builder_model_type == "qwen2"
