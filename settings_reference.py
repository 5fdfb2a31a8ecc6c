"""The configuration reference, ``docs/configuration.md``: generated from the settings models of
:mod:`~nemo_gym_browser.settings` and from :data:`ENVIRONMENT_VARIABLES`, every ``NEMO_GYM_BROWSER_*`` variable
the recipe, its scripts or its tests read (a test compares that list with the code).

Command line: ``python -m nemo_gym_browser.settings --reference [--output FILE]`` prints or writes the reference;
``--check`` exits 1 when ``docs/configuration.md`` is out of date (``python -m nemo_gym_browser.settings_reference``
is the same command).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

from pydantic_core import PydanticUndefined

from .settings import (
    AGENT_LOOP_YAML_NAME,
    CONFIG_ENV_SETTINGS,
    DROP_INVALID_ENV,
    RECIPE_DIR,
    TRAINER_CONFIG_SECTION,
    TRAINER_YAML_NAME,
    BrowserLoopSettings,
    EnvironmentConfig,
    JudgeConfig,
    ResumeSettings,
    Settings,
    StepwiseSettings,
    UrlPolicy,
)
from .trainer_side.wiring import ADVANTAGE_LOG_ENV, PATCHES_ENV

REFERENCE_PATH = RECIPE_DIR / "docs" / "configuration.md"


# ----- environment variables ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvironmentVariable:
    """A variable the recipe, its scripts or its tests read from the process environment."""

    name: str
    read_by: str
    meaning: str


# Every NEMO_GYM_BROWSER_* variable anything in the recipe reads; a test compares this list with the code and scripts.
RUN_SWITCHES = (
    EnvironmentVariable(
        DROP_INVALID_ENV,
        "the agent loop, preflight",
        "`1`: a rollout still invalid after its attempts is dropped from the batch (V1 trainer only); off by "
        "default. The setting `drop_invalid` overrides it when not null.",
    ),
    EnvironmentVariable(
        PATCHES_ENV,
        "`patches.py`, `plugin.py`, `sitecustomize.py`",
        "`0`: the trainer wiring is not installed in this process (the escape hatch a `PatchError` names); the "
        "package stays importable.",
    ),
    EnvironmentVariable(
        ADVANTAGE_LOG_ENV,
        "the V1 trainer's advantage wrapper",
        "A JSONL path: one line per advantage computation with every sample's group, flag, score and advantage "
        "(read by `python -m nemo_gym_browser.trajectories --advantages`).",
    ),
)
LOCAL_VARIABLES = (
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_CPU_BACKEND_FORCE",
        "`local/cpu_backend/`",
        "`1`: the CPU test backend starts on a host where CUDA is available (debugging the backend, never training).",
    ),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_URL", "the command after `launch_environment.py --`", "The environment server's URL."
    ),
    EnvironmentVariable("NEMO_GYM_BROWSER_VENV", "`scripts/setup.sh`", "Where the recipe's venv goes (`.venv`)."),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_VLLM_VENV", "`scripts/setup_vllm.sh`", "Where the vLLM CPU venv goes (`.venv-vllm`)."
    ),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_RUN_ID",
        "`submit_webvoyager.sh`",
        "The run's name, its log folder under `LOG_DIR` (default `slurm<job id>-<date>-<pid>`); exported to the run.",
    ),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_PROCESS_MARK",
        "`submit_webvoyager.sh`",
        "Set by the script on every process of a run, so that its stop and leak checks find them; not for users.",
    ),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_STEP_MARK",
        "`submit_webvoyager.sh`",
        "Set by the script on each Slurm step's processes, so that the step stops what it started; not for users.",
    ),
)
TEST_VARIABLES = (
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_REQUIRE_VLLM", "`tests/test_vllm_cpu.py`", "`1`: a missing `.venv-vllm` fails the tier."
    ),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_TEST_BACKEND",
        "the integration tier",
        "The real server's browser backend: `remote_cdp` (default) or `local_playwright`.",
    ),
    EnvironmentVariable("NEMO_GYM_BROWSER_GYM_VENV", "the integration tier", "Another nemo-gym venv (`.venv-gym`)."),
    EnvironmentVariable(
        "NEMO_GYM_BROWSER_TEST_POLICY_DIR",
        "the integration tier",
        "A folder that keeps the tiny policy between test sessions (built there once).",
    ),
)
ENVIRONMENT_VARIABLES = (*RUN_SWITCHES, *LOCAL_VARIABLES, *TEST_VARIABLES)


def _variables_table(title: str, intro: str, variables: tuple[EnvironmentVariable, ...]) -> list[str]:
    lines = [
        f"### {title}",
        "",
        *([intro, ""] if intro else []),
        "| variable | read by | meaning |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{v.name}` | {v.read_by} | {v.meaning} |" for v in variables]
    return [*lines, ""]


def _environment_section() -> list[str]:
    return [
        "## Environment variables",
        "",
        "Every `NEMO_GYM_BROWSER_*` variable the recipe, its scripts or its tests read (a test compares this list "
        "with the code). The Slurm job's own variables (`MODEL_PATH`, `JUDGE_*`, `ENV_*`, ...) are described in "
        "`config.env.example`.",
        "",
        *_variables_table(
            "Switches of a training run",
            "Export them before `ray start` on every node (the submit script does for the drop switch): Ray workers "
            "inherit the raylet's environment, not the shell's.",
            RUN_SWITCHES,
        ),
        *_variables_table("Local runs and scripts", "", LOCAL_VARIABLES),
        *_variables_table("Tests", "", TEST_VARIABLES),
    ]


# ----- the configuration reference ----------------------------------------------------------------------------

REFERENCE_HEADER = f"""# Configuration reference

Generated from the settings models in `settings.py` by `python -m nemo_gym_browser.settings --reference
--output docs/configuration.md`; a test fails when this file and the models disagree. Edit the models, not this file.

Every key below is a setting of the agent loop `nemo_gym_browser_agent`, in the trainer config's section
`{TRAINER_CONFIG_SECTION}`. Set each in one place ([which place wins](#which-place-wins)): on a Slurm run, `config.env`
for the keys it has a variable for; else the `{TRAINER_CONFIG_SECTION}` section of `{TRAINER_YAML_NAME}`; for one
run, the command line, e.g. `{TRAINER_CONFIG_SECTION}.stepwise.history_steps=5` (with a leading `+` for a key that
section does not list). The trainer config travels to the Ray workers; shell variables may not. An unknown key or a
bad value stops the run when the settings are built, naming the key. The drop switch also follows the environment
variable `{DROP_INVALID_ENV}=1` when `drop_invalid` is null.
"""


def _type_name(annotation: Any) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " \\| ".join(f"`{value}`" for value in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type_name(arg) for arg in get_args(annotation))
    if origin is tuple:
        return f"list of {_type_name(get_args(annotation)[0])}"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, Settings):
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def _bounds_text(field: Any) -> str:
    """`` > 0``, `` >= 1`` ... from the field's numeric constraints."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    bounds = [
        f"{sign} {getattr(item, name)}"
        for item in field.metadata
        for name, sign in signs.items()
        if getattr(item, name, None) is not None
    ]
    return "".join(f", {bound}" for bound in bounds)


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, Settings):
        return "see below"
    if value is PydanticUndefined:
        return "required"
    return f"`{json.dumps(list(value) if isinstance(value, tuple) else value)}`"


def _section_table(model: type[Settings]) -> list[str]:
    lines = [
        f"## `{model.section}`",
        "",
        (model.__doc__ or "").strip().splitlines()[0].replace("``", "`"),
        "",
        "| key | type | default | description |",
        "| --- | --- | --- | --- |",
    ]
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        kind = _type_name(field.annotation) + _bounds_text(field)
        lines.append(f"| `{name}` | {kind} | {_default_text(field)} | {description} |")
    return [*lines, ""]


def _layers_section() -> list[str]:
    lines = [
        "## Which place wins",
        "",
        "Each layer overrides the one before it, key by key:",
        "",
        "| | layer | what belongs there |",
        "| --- | --- | --- |",
        "| 1 | `settings.py` | the defaults in the tables above |",
        f"| 2 | `{AGENT_LOOP_YAML_NAME}` | verl's registry entry, `name` and `_target_`, only. Other keys there are "
        "settings too, but a later layer that sets the same key wins: the preflight refuses one that the trainer "
        "config sets to another value, naming both files |",
        f"| 3 | `{TRAINER_YAML_NAME}`, section `{TRAINER_CONFIG_SECTION}` | the recipe's settings, at their defaults: "
        "edit one here unless the table below gives it a `config.env` variable |",
        "| 4 | `config.env`, through `submit_webvoyager.sh` | the settings below, passed on every run: the preflight "
        "refuses a value changed in layer 3 that one of them replaces, naming both places |",
        "| 5 | the command line, after `submit_webvoyager.sh`'s own flags | one run's overrides, which win over all |",
        "",
        "| setting | `config.env` variable | note |",
        "| --- | --- | --- |",
    ]
    for item in CONFIG_ENV_SETTINGS:
        lines.append(f"| `{TRAINER_CONFIG_SECTION}.{item.setting}` | `{item.variable}` | {item.note} |")
    return [
        *lines,
        "",
        f"With `JUDGE_ENABLE=0` the script passes no judge (`judge` stays null). `drop_invalid` (null) follows "
        f"`{DROP_INVALID_ENV}`, which `config.env` sets and the script exports to every node. verl's own keys follow "
        f"the same order from layer 3 on: what `bash submit_webvoyager.sh --print-overrides` lists comes from "
        f"`config.env` and wins over `{TRAINER_YAML_NAME}` (e.g. `TRAIN_BATCH_SIZE` over `data.train_batch_size`).",
        "",
    ]


def configuration_reference() -> str:
    """The Markdown text of ``docs/configuration.md``: one table per settings section."""
    lines = [REFERENCE_HEADER]
    for model in (BrowserLoopSettings, EnvironmentConfig, UrlPolicy, StepwiseSettings, ResumeSettings, JudgeConfig):
        lines.extend(_section_table(model))
    lines.extend(_layers_section())
    lines.extend(_environment_section())
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.settings",
        description="The recipe's settings. Examples:\n"
        "  python -m nemo_gym_browser.settings --reference\n"
        "  python -m nemo_gym_browser.settings --reference --output docs/configuration.md\n"
        "  python -m nemo_gym_browser.settings --check",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--reference", action="store_true", help="print the configuration reference (Markdown)")
    action.add_argument("--check", action="store_true", help=f"exit 1 when {REFERENCE_PATH.name} is out of date")
    parser.add_argument("--output", type=Path, help="with --reference: write it to this file instead")
    args = parser.parse_args(argv)
    text = configuration_reference()
    if args.check:
        current = REFERENCE_PATH.read_text(encoding="utf-8") if REFERENCE_PATH.exists() else ""
        if current != text:
            print(
                f"{REFERENCE_PATH} is out of date: run python -m nemo_gym_browser.settings --reference --output "
                f"{REFERENCE_PATH}",
                file=sys.stderr,
            )
            return 1
        return 0
    if args.output is not None:
        args.output.write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
