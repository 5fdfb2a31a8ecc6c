"""The settings models are the one place each knob's default lives: the shipped YAML and the reference agree."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nemo_gym_browser import settings as st
from nemo_gym_browser import settings_reference as ref
from nemo_gym_browser.settings import (
    BrowserLoopSettings,
    EnvironmentConfig,
    JudgeConfig,
    JudgeConfigError,
    Settings,
    StepwiseSettings,
    UrlPolicy,
)

RECIPE = Path(st.__file__).resolve().parent
MODELS = (BrowserLoopSettings, EnvironmentConfig, UrlPolicy, StepwiseSettings, JudgeConfig)


def disagreements(model: type[Settings], values: dict[str, Any], where: str) -> list[str]:
    """Keys of ``values`` whose value is not the model's default (required fields must be null or ``???``)."""
    found = []
    for key, value in values.items():
        field = model.model_fields.get(key)
        if field is None:
            found.append(f"{where}.{key}: not a setting")
            continue
        nested = st._settings_model(field.annotation)
        if nested is not None and isinstance(value, dict):
            found.extend(disagreements(nested, value, f"{where}.{key}"))
        elif field.is_required():
            if value not in (None, "???"):
                found.append(f"{where}.{key}: required, so it has no default, but the file gives {value!r}")
        else:
            default = field.get_default(call_default_factory=True)
            default = list(default) if isinstance(default, tuple) else default
            if value != default or (type(value) is bool and not isinstance(default, bool)):
                found.append(f"{where}.{key}: the file says {value!r}, the model's default is {default!r}")
    return found


def test_the_agent_loop_yaml_holds_only_verls_registry_entry():
    # Its settings would be overridden by the trainer config's section: they live there (one place per setting).
    (entry,) = yaml.safe_load((RECIPE / "configs" / "agent_loop.yaml").read_text())

    assert sorted(entry) == ["_target_", "name"]


@pytest.mark.parametrize("name", ["agent_loop.yaml", "webvoyager_grpo.yaml"])
def test_the_yaml_files_set_values_without_a_second_copy_of_their_descriptions(name):
    text = (RECIPE / "configs" / name).read_text()
    if name == "webvoyager_grpo.yaml":
        text = text[text.index("\nnemo_gym_browser:") :]  # the recipe's own section; verl's keys are not ours
    described = [line for line in text.splitlines() if re.match(r"\s*[\w.]+:[^#]*#", line)]

    assert described == [], "describe a setting in settings.py (docs/configuration.md is generated from it)"


def test_every_value_in_the_trainer_configs_section_is_the_models_default():
    section = yaml.safe_load((RECIPE / "configs" / "webvoyager_grpo.yaml").read_text())["nemo_gym_browser"]

    assert disagreements(BrowserLoopSettings, section, "webvoyager_grpo.yaml nemo_gym_browser") == []


def test_a_yaml_value_that_disagrees_with_the_model_is_reported():
    assert disagreements(EnvironmentConfig, {"call_timeout_s": 60}, "x") == [
        "x.call_timeout_s: the file says 60, the model's default is 120.0"
    ]
    assert disagreements(BrowserLoopSettings, {"stepwise": {"history_step": 3}}, "x") == [
        "x.stepwise.history_step: not a setting"
    ]
    assert disagreements(BrowserLoopSettings, {"stepwise": {"enabled": True}}, "x") == [
        "x.stepwise.enabled: the file says True, the model's default is False"
    ]  # the check reaches the nested sections


def test_every_setting_has_a_description():
    missing = [f"{m.section}.{name}" for m in MODELS for name, f in m.model_fields.items() if not f.description]
    assert missing == []


def test_the_configuration_reference_is_the_one_the_models_generate():
    # Regenerate with: python -m nemo_gym_browser.settings --reference --output docs/configuration.md
    assert (RECIPE / "docs" / "configuration.md").read_text(encoding="utf-8") == ref.configuration_reference()


def test_the_reference_has_a_row_for_every_setting_with_its_default():
    text = ref.configuration_reference()
    for model in MODELS:
        assert f"## `{model.section}`" in text
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.section}.{name}"
    assert "| `call_timeout_s` | float, > 0 | `120.0` |" in text
    assert "| `server_urls` | list of str | required |" in text


def test_the_reference_cli_writes_the_file_and_check_reports_a_stale_one(tmp_path, monkeypatch, capsys):
    written = tmp_path / "configuration.md"
    assert ref.main(["--reference", "--output", str(written)]) == 0
    assert written.read_text(encoding="utf-8") == ref.configuration_reference()

    monkeypatch.setattr(ref, "REFERENCE_PATH", written)
    assert ref.main(["--check"]) == 0
    written.write_text("stale\n", encoding="utf-8")
    assert ref.main(["--check"]) == 1
    assert "out of date" in capsys.readouterr().err


def test_python_dash_m_settings_still_runs_the_reference_command_line():
    result = subprocess.run(
        [sys.executable, "-m", "nemo_gym_browser.settings", "--check"], capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stderr) == (0, "")


def test_a_typo_in_a_judge_setting_names_the_key_and_the_keys_allowed_there():
    with pytest.raises(JudgeConfigError, match=r"judge\.max_atempts: unknown key; allowed here: base_url, model, "):
        JudgeConfig.from_mapping({"base_url": "http://127.0.0.1:1/v1", "model": "m", "max_atempts": 5})


def test_several_wrong_keys_are_reported_together_each_by_its_path():
    with pytest.raises(ValueError) as raised:
        BrowserLoopSettings.from_mapping(
            {
                "environment": {"server_urls": "http://127.0.0.1:1", "call_timeout_s": 0},
                "stepwise": {"history_steps": -1},
            }
        )
    message = str(raised.value)
    assert "nemo_gym_browser.environment.call_timeout_s: Input should be greater than 0 (got 0)" in message
    assert "nemo_gym_browser.stepwise.history_steps: Input should be greater than or equal to 0 (got -1)" in message


VARIABLE = re.compile(r"\bNEMO_GYM_BROWSER_[A-Z][A-Z0-9_]*[A-Z0-9]\b")
NOT_SOURCE = {"docs", "build", "bench"}


def variables_read_anywhere() -> dict[str, str]:
    """Every ``NEMO_GYM_BROWSER_*`` name in the recipe's code, scripts and tests -> one file naming it."""
    found: dict[str, str] = {}
    paths = [*RECIPE.rglob("*.py"), *RECIPE.rglob("*.sh"), RECIPE / "config.env.example", RECIPE / ".ci" / "run"]
    for path in paths:
        parts = path.relative_to(RECIPE).parts
        if parts[0].startswith(".venv") or parts[0] in NOT_SOURCE or parts[0].endswith(".egg-info"):
            continue
        if path.is_file():
            for name in VARIABLE.findall(path.read_text(encoding="utf-8")):
                found.setdefault(name, str(path.relative_to(RECIPE)))
    return found


def test_every_environment_variable_the_code_reads_is_in_the_reference_and_no_other():
    read = variables_read_anywhere()
    listed = {variable.name for variable in ref.ENVIRONMENT_VARIABLES}
    text = ref.configuration_reference()

    assert {name: where for name, where in read.items() if name not in listed} == {}
    assert sorted(listed - set(read)) == []
    assert all(f"| `{name}` |" in text for name in listed)
    assert len(read) >= 12 and "NEMO_GYM_BROWSER_PATCHES" in read  # the scan does reach the code


# ----- one place per setting ----------------------------------------------------------------------------------

SHIPPED_SECTION = yaml.safe_load((RECIPE / "configs" / "webvoyager_grpo.yaml").read_text())["nemo_gym_browser"]
SERVERS = {"server_urls": ["http://127.0.0.1:8100"], "max_sessions_per_server": 64}


def composed(**changes: Any) -> dict[str, Any]:
    """The section as a run composes it: the shipped one, the script's server list, then ``changes`` on top."""
    return st._deep_merge({**SHIPPED_SECTION, "environment": SERVERS}, changes)


def test_an_agent_loop_yaml_key_the_trainer_config_sets_otherwise_is_refused_naming_both_places():
    (conflict,) = st.setting_conflicts({"stepwise": {"enabled": True}}, SHIPPED_SECTION, composed())

    assert conflict.startswith("nemo_gym_browser.stepwise.enabled: configs/agent_loop.yaml sets true, but ")
    assert "config.env (SAMPLE_MODE) or configs/webvoyager_grpo.yaml sets false, which wins" in conflict
    assert "keep configs/agent_loop.yaml to name and _target_" in conflict


def test_an_agent_loop_yaml_key_the_trainer_config_agrees_with_or_does_not_set_stands():
    kwargs = {"stepwise": {"enabled": False}, "resample_backoff_s": 2.0, "url_policy": {"allowlist": ["*.corp"]}}

    assert st.setting_conflicts(kwargs, SHIPPED_SECTION, composed()) == []


def test_an_agent_loop_yaml_key_replaced_from_the_command_line_names_the_command_line():
    kwargs, replaced = {"trajectory_dir": "/data/mine"}, composed(trajectory_dir="/data/theirs")
    (conflict,) = st.setting_conflicts(kwargs, SHIPPED_SECTION, replaced)

    assert "configs/agent_loop.yaml sets another value, but a command-line override sets another value" in conflict
    assert "/data/" not in conflict  # text values are never shown (a URL may carry a password)


def test_a_trainer_yaml_value_changed_from_its_default_that_config_env_replaces_is_refused_naming_both_places():
    edited = st._deep_merge(SHIPPED_SECTION, {"max_attempts": 5})

    (conflict,) = st.setting_conflicts({}, edited, composed(max_attempts=3))

    assert conflict == (
        "nemo_gym_browser.max_attempts: configs/webvoyager_grpo.yaml sets 5, but config.env (MAX_ATTEMPTS) or a "
        "command-line override sets 3, which wins: set MAX_ATTEMPTS in config.env instead (and put the file back to 3)"
    )
    assert st.setting_conflicts({}, edited, composed(max_attempts=5)) == []  # both places agree


def test_config_env_over_the_trainer_yamls_defaults_and_the_command_line_over_its_other_keys_stand():
    assert st.setting_conflicts({}, SHIPPED_SECTION, composed(max_attempts=5, stepwise={"enabled": True})) == []
    edited = st._deep_merge(SHIPPED_SECTION, {"stepwise": {"history_steps": 4}})  # no config.env variable sets it
    assert st.setting_conflicts({}, edited, composed(stepwise={"history_steps": 6})) == []


def test_the_shipped_configs_give_no_setting_twice():
    (entry,) = yaml.safe_load((RECIPE / "configs" / "agent_loop.yaml").read_text())
    kwargs = {key: value for key, value in entry.items() if key not in ("name", "_target_")}

    assert st.setting_conflicts(kwargs, SHIPPED_SECTION, composed()) == []


def print_overrides(tmp_path: Path, settings: dict[str, str]) -> list[str]:
    config_env = tmp_path / "config.env"
    config_env.write_text("".join(f"{key}={value}\n" for key, value in settings.items()))
    result = subprocess.run(
        ["bash", str(RECIPE / "submit_webvoyager.sh"), "--config", str(config_env), "--print-overrides"],
        capture_output=True,
        text=True,
        timeout=60,
        env={key: value for key, value in os.environ.items() if not key.startswith("SLURM_")},
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_the_config_env_settings_in_the_reference_are_those_the_submit_script_passes(tmp_path):
    judge = {st.judge_variable(key): "1" for key in JudgeConfig.model_fields}
    judge |= {"JUDGE_BASE_URL": "http://judge.test:1/v1", "JUDGE_MODEL": "m", "JUDGE_API_KEY_ENV": "K"}
    overrides = print_overrides(tmp_path, {"MODEL_PATH": "m", **judge})

    passed = set()
    for line in overrides:
        key, _, value = line.lstrip("+").partition("=")
        if key == "nemo_gym_browser.judge":
            passed |= {f"judge.{item.split(':', 1)[0]}" for item in value.strip("{}").split(",")}
        elif key.startswith("nemo_gym_browser."):
            passed.add(key.removeprefix("nemo_gym_browser."))
    assert passed == {item.setting for item in st.CONFIG_ENV_SETTINGS}
    example = (RECIPE / "config.env.example").read_text()
    assert all(f"\n{item.variable}=" in example for item in st.CONFIG_ENV_SETTINGS)
    assert "| `nemo_gym_browser.stepwise.enabled` | `SAMPLE_MODE` |" in ref.configuration_reference()


@pytest.mark.parametrize(("mode", "enabled"), [("trajectory", "false"), ("stepwise", "true")])
def test_sample_mode_in_config_env_sets_the_step_wise_switch(tmp_path, mode, enabled):
    overrides = print_overrides(tmp_path, {"MODEL_PATH": "m", "JUDGE_ENABLE": "0", "SAMPLE_MODE": mode})

    assert f"nemo_gym_browser.stepwise.enabled={enabled}" in overrides
