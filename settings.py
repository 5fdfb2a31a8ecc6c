"""Every setting an operator tunes, in one place: typed models whose fields carry their default and description.

Contract: the ``nemo_gym_browser`` settings tree, :class:`BrowserLoopSettings` and its sections
:class:`EnvironmentConfig`, :class:`UrlPolicy`, :class:`StepwiseSettings` and :class:`JudgeConfig`;
:func:`resolve_settings` (the agent-loop YAML kwargs overridden key by key by the trainer config section
``nemo_gym_browser``, parsed once per distinct configuration per process); where each setting is set
(:data:`CONFIG_ENV_SETTINGS`) and the settings one layer gives and a later one replaces (:func:`setting_conflicts`);
the drop switch (:func:`drop_invalid_enabled`). Models are frozen (hashable): process-wide clients and judges are
keyed on them. ``docs/configuration.md`` is generated from them by :mod:`~nemo_gym_browser.settings_reference`
(``python -m nemo_gym_browser.settings --reference``).

Errors: a wrong setting raises :class:`SettingsError` (a ``ValueError``; :class:`JudgeConfigError` for the judge)
when the settings are built, naming every wrong key by its full path and, for an unknown key, the keys allowed there.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, Self, get_args

from omegaconf import DictConfig, ListConfig, OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .gym_contract.url_safety import validate_allow_entry

# The trainer-config section whose keys override the agent-loop YAML kwargs.
TRAINER_CONFIG_SECTION = "nemo_gym_browser"
DROP_INVALID_ENV = "NEMO_GYM_BROWSER_DROP_INVALID"
RECIPE_DIR = Path(__file__).resolve().parent
# Below this much evidence the judge's prompt cannot hold a page and an answer side by side.
MIN_EVIDENCE_BUDGET_CHARS = 4000


class SettingsError(ValueError):
    """A setting is wrong (unknown key, bad value, missing). Raised when the settings are built, never retried."""


class JudgeConfigError(SettingsError):
    """The judge is misconfigured (a typo, a bad value, a missing API-key variable)."""


class Settings(BaseModel):
    """A frozen settings model: unknown keys raise, every field has a description.

    Build from configuration with :meth:`from_mapping` (errors name each key by its full path); keyword
    construction raises pydantic's ``ValidationError`` (also a ``ValueError``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    section: ClassVar[str]  # the key path of this model under the trainer config, e.g. nemo_gym_browser.stepwise
    error_type: ClassVar[type[SettingsError]] = SettingsError

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> Self:
        """Build from a plain mapping (a YAML block, a hydra ``DictConfig``); wrong keys raise :attr:`error_type`."""
        values = plain_config(values)
        if not isinstance(values, Mapping):
            raise cls.error_type(f"{cls.section}: expected a mapping of settings, got {type(values).__name__}")
        try:
            return cls.model_validate(dict(values))
        except ValidationError as exc:
            raise cls.error_type(explain(exc, cls)) from None


def explain(exc: ValidationError, model: type[Settings]) -> str:
    """One line per wrong key, each named by its full path (``nemo_gym_browser.environment.call_timeout``)."""
    lines = []
    for error in exc.errors(include_url=False):
        loc = tuple(str(part) for part in error["loc"])
        key = ".".join((model.section, *loc))
        if error["type"] == "extra_forbidden":
            owner = _model_at(model, loc[:-1])
            allowed = ", ".join(owner.model_fields) if owner is not None else "none"
            lines.append(f"{key}: unknown key; allowed here: {allowed}")
        elif error["type"] == "missing":
            lines.append(f"{key}: missing (required)")
        else:
            message = error["msg"].removeprefix("Value error, ")
            value = error.get("input")
            # Numbers only: a string could be a URL with credentials in it.
            got = f" (got {value!r})" if isinstance(value, int | float | bool) or value is None else ""
            lines.append(f"{key}: {message}{got}")
    return "invalid settings:\n  " + "\n  ".join(lines) if len(lines) > 1 else lines[0]


def _model_at(model: type[BaseModel], path: tuple[str, ...]) -> type[BaseModel] | None:
    for part in path:
        field = model.model_fields.get(part)
        nested = _settings_model(field.annotation) if field is not None else None
        if nested is None:
            return None
        model = nested
    return model


def _settings_model(annotation: Any) -> type[Settings] | None:
    """The settings model an annotation holds (``JudgeConfig | None`` -> ``JudgeConfig``), if any."""
    for candidate in (annotation, *get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Settings):
            return candidate
    return None


def plain_config(value: Any) -> Any:
    """``value`` with OmegaConf containers (hydra configs) turned into plain dicts and lists."""
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


# ----- the sections -------------------------------------------------------------------------------------------


class EnvironmentConfig(Settings):
    """Where the NeMo Gym environment servers are and how long each kind of call may take (seconds)."""

    section: ClassVar[str] = f"{TRAINER_CONFIG_SECTION}.environment"

    server_urls: tuple[str, ...] = Field(
        description="One or more NeMo Gym interactive_browser servers: a list or a comma-separated string."
    )
    call_timeout_s: float = Field(
        120.0, gt=0, description="One browser action, page load included; a call past it is an infrastructure failure."
    )
    seed_timeout_s: float = Field(120.0, gt=0, description="Opening the browser on the task's start page.")
    verify_timeout_s: float = Field(60.0, gt=0, description="Grading the episode (/verify).")
    close_timeout_s: float = Field(
        15.0,
        gt=0,
        description="One try of closing the session; a close that times out or answers 5xx is tried again, for up "
        "to 3 times this in all (the server has no TTL: a close given up on leaves its browser open).",
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="Opening a TCP connection to a server.")
    max_answer_bytes: int = Field(
        16 * 1024 * 1024,
        ge=1024,
        description="Largest answer body read from a server (after decompression); a larger one is an "
        "infrastructure failure. Answers are a few KB: an observation holds at most max_elements names and 2000 "
        "characters of page text.",
    )
    transient_retries: int = Field(
        2, description="Retries of an idempotent call after a transport error that came before any answer."
    )
    retry_backoff_s: float = Field(0.25, description="Wait before such a retry.")
    max_sessions_per_server: int = Field(
        64, ge=1, description="Concurrent browsers per server (each a Chromium process tree), across the whole run."
    )
    server_cooldown_s: float = Field(
        10.0, description="How long a server that stopped answering stays out of rotation."
    )
    taskset: str = Field("nemo_gym_browser", description="The taskset a row without one is seeded with.")
    placement: Literal["auto", "process", "ray"] = Field(
        "auto",
        description="Who counts sessions per server: ray (one count for the whole run), process (this process only), "
        "auto (ray when the process is connected to Ray).",
    )
    lease_ttl_s: float = Field(
        60.0, gt=0, description="A process silent this long is taken for dead: its browsers are closed for it."
    )

    @field_validator("server_urls", mode="before")
    @classmethod
    def _split_urls(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = value.split(",")
        urls = tuple(str(url).strip().rstrip("/") for url in value or () if str(url).strip())
        if not urls:
            raise ValueError("at least one server URL is required")
        return urls


class UrlPolicy(Settings):
    """Which URLs the policy may open beyond public web pages (the task's start page is always allowed)."""

    section: ClassVar[str] = f"{TRAINER_CONFIG_SECTION}.url_policy"

    allow_private_networks: bool = Field(
        False, description="true: only the scheme rule applies (a fully trusted, isolated setup)."
    )
    allowlist: tuple[str, ...] = Field(
        (),
        description='Also allowed: host names, "*.suffix" wildcards, host:port, scheme://host[:port], CIDR networks.',
    )
    resolve_hostnames: bool = Field(
        True,
        description="Resolve host names here and refuse those with a non-public address; false: only literal "
        "addresses are checked.",
    )
    dns_timeout_s: float = Field(5.0, gt=0, description="Time allowed for resolving one host name.")

    @field_validator("allowlist", mode="before")
    @classmethod
    def _entries(cls, value: Any) -> tuple[str, ...]:
        entries = (value,) if isinstance(value, str) else tuple(value or ())
        for entry in entries:
            validate_allow_entry(entry)  # a typo raises at start-up, not at the first navigation
        return entries


# How an episode becomes samples, as tools and benchmarks name it: one per episode (stepwise.enabled false, verl's
# default) or one per policy step (stepwise.enabled true).
SAMPLE_MODES = ("trajectory", "stepwise")


class StepwiseSettings(Settings):
    """Step-wise samples, one per policy step over a bounded prompt (V1 trainer only); off by default."""

    section: ClassVar[str] = f"{TRAINER_CONFIG_SECTION}.stepwise"

    enabled: bool = Field(False, description="One sample per policy step instead of one per episode.")
    history_observations: int = Field(
        1, ge=1, description="Latest steps shown whole (the model's turn and the observation it read)."
    )
    history_steps: int = Field(
        10, ge=0, description="Earlier steps shown as one line each (action, arguments, result, page), newest kept."
    )


class ResumeSettings(Settings):
    """Resuming an attempt whose session failed under a browser call or verify: a new session, the policy's calls so
    far replayed and checked against the pages it read, the same sample continued. 0 resumes: re-run at once."""

    section: ClassVar[str] = f"{TRAINER_CONFIG_SECTION}.resume"

    max_per_episode: int = Field(
        4, ge=0, description="Resumes per attempt; past them a failure re-runs the rollout (max_attempts)."
    )
    max_per_call: int = Field(
        2, ge=0, description="Resumes for one failing call; past them the attempt fails and the rollout is re-run."
    )


class JudgeConfig(Settings):
    """The binary LLM judge for tasks without verifier_metadata: any OpenAI-compatible chat-completions endpoint."""

    section: ClassVar[str] = f"{TRAINER_CONFIG_SECTION}.judge"
    error_type: ClassVar[type[SettingsError]] = JudgeConfigError

    base_url: str = Field(
        description="OpenAI-compatible root that every rollout worker reaches, e.g. http://judge-node:8001/v1 "
        "(requests go to {base_url}/chat/completions)."
    )
    model: str = Field(min_length=1, description="The model name the endpoint serves (vLLM: --served-model-name).")
    api_key_env: str | None = Field(
        None, description="NAME of the environment variable holding the API key; null sends no key."
    )
    temperature: float = Field(0.0, ge=0, description="Sampling temperature of the judge.")
    max_tokens: int = Field(
        1024,
        ge=1,
        description="Room for a short justification and the verdict line (and a reasoning model's thinking).",
    )
    timeout_s: float = Field(60.0, gt=0, description="Per request, connect to last byte.")
    connect_timeout_s: float = Field(10.0, gt=0, description="Opening a connection to the endpoint.")
    max_attempts: int = Field(
        3, ge=1, description="Requests per verdict, the first one included; then the verdict is unusable."
    )
    backoff_s: float = Field(
        1.0, ge=0, description="Wait before the second attempt, doubling after (jittered); a 429 waits for Retry-After."
    )
    backoff_max_s: float = Field(30.0, ge=0, description="Cap for the backoff and for a server's Retry-After.")
    max_concurrency: int = Field(16, ge=1, description="Simultaneous judge requests per worker process.")
    evidence_budget_chars: int = Field(
        16000,
        ge=MIN_EVIDENCE_BUDGET_CHARS,
        description="All evidence text in one prompt together; the page keeps its end.",
    )
    max_trajectory_steps: int = Field(8, ge=1, description="Last trajectory steps shown to the judge.")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value

    @field_validator("api_key_env", mode="before")
    @classmethod
    def _no_key(cls, value: Any) -> Any:
        return None if value in ("", "null") else value


# ----- the agent loop -----------------------------------------------------------------------------------------


class BrowserLoopSettings(Settings):
    """Everything an operator tunes about browser episodes (the trainer config's ``nemo_gym_browser`` section)."""

    section: ClassVar[str] = TRAINER_CONFIG_SECTION

    environment: EnvironmentConfig = Field(description="The environment servers and their timeouts.")
    episode_deadline_s: float = Field(
        1800.0,
        gt=0,
        description="Environment time per attempt (time inside the model's generate not counted); reaching it ends "
        "the episode, scored as it stands (deadline_hit, a policy outcome).",
    )
    session_hold_limit_s: float = Field(
        3600.0,
        description="Wall clock an attempt may hold its browser, generation included; past it the attempt is an "
        "infrastructure timeout, resampled. At least episode_deadline_s + environment.call_timeout_s, and above the "
        "longest time the trainer holds generation.",
    )
    max_attempts: int = Field(
        3,
        ge=1,
        description="An infrastructure failure that cannot be resumed re-runs the rollout in a new session, up to "
        "this many times.",
    )
    resample_backoff_s: float = Field(
        1.0, ge=0, description="Wait before the second attempt; doubles per further attempt (at most 30 s)."
    )
    drop_invalid: bool | None = Field(
        None,
        description=f"null: follow {DROP_INVALID_ENV}; true/false: override it. Drops rollouts still invalid after "
        "their attempts (V1 trainer only).",
    )
    token_builder_model_type: str | None = Field(
        None,
        description="The Hugging Face model_type whose turn boundaries verl's token builder follows when it joins "
        "the model's turns and the tool responses (verl picks the builder by the model's exact model_type and falls "
        "back to a generic one for a type it does not know). null: the model's own. Set it for a checkpoint whose "
        "model_type is not its chat template's family, e.g. 'qwen2' for a converted copy of a Qwen2 model: the "
        "generic builder drops the newline after each <|im_end|>, and the policy sees contexts it was not trained on.",
    )
    train_on_failures: bool = Field(
        False,
        description="true: a rollout failed by the infrastructure is trained on as a policy zero, as without this "
        "recipe (comparison runs only).",
    )
    url_policy: UrlPolicy = Field(default_factory=UrlPolicy, description="Which URLs policy navigations may open.")
    judge: JudgeConfig | None = Field(
        None,
        description="Scores tasks without verifier_metadata: a mapping of the judge settings below (a Slurm run: "
        "JUDGE_* in config.env); null: no judge.",
    )
    max_tool_response_length: int | None = Field(
        8192,
        description="Characters of a tool answer the model reads; overrides multi_turn.max_tool_response_length, "
        "whose 256 would cut a browser observation (up to ~7000 characters) to its first lines. null: verl's value.",
    )
    trajectory_dir: str | None = Field(
        None, description="A folder: one JSONL record per rollout (python -m nemo_gym_browser.trajectories); null: off."
    )
    stepwise: StepwiseSettings = Field(default_factory=StepwiseSettings, description="Step-wise samples.")
    resume: ResumeSettings = Field(
        default_factory=ResumeSettings, description="Resuming after an infrastructure failure instead of re-running."
    )

    @model_validator(mode="before")
    @classmethod
    def _needs_servers(cls, values: Any) -> Any:
        environment = values.get("environment") if isinstance(values, Mapping) else None
        if isinstance(environment, EnvironmentConfig):
            return values
        if isinstance(environment, Mapping) and environment.get("server_urls"):
            return values
        raise ValueError(
            f"no environment server: set {TRAINER_CONFIG_SECTION}.environment.server_urls (submit_webvoyager.sh "
            "sets it from config.env; without it, on the command line: "
            f"{TRAINER_CONFIG_SECTION}.environment.server_urls=[...])"
        )

    @model_validator(mode="after")
    def _hold_covers_deadline(self) -> BrowserLoopSettings:
        # Environment time alone may legitimately reach the deadline plus one call in flight; a hold limit below
        # that would turn a policy's deadline into an infrastructure timeout.
        least_hold = self.episode_deadline_s + self.environment.call_timeout_s
        if self.session_hold_limit_s < least_hold:
            raise ValueError(
                f"session_hold_limit_s={self.session_hold_limit_s:g} must be at least episode_deadline_s + "
                f"environment.call_timeout_s = {least_hold:g} (and above the longest time the trainer holds generation)"
            )
        return self


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


@functools.lru_cache(maxsize=64)
def _settings_from_json(text: str) -> BrowserLoopSettings:
    return BrowserLoopSettings.from_mapping(json.loads(text))


def resolve_settings(loop_kwargs: Mapping[str, Any], trainer_config: Any = None) -> BrowserLoopSettings:
    """The loop's settings: YAML kwargs, then the trainer config's ``nemo_gym_browser`` section on top."""
    merged = {key: plain_config(value) for key, value in loop_kwargs.items()}
    section = trainer_config.get(TRAINER_CONFIG_SECTION) if trainer_config is not None else None
    if section:
        merged = _deep_merge(merged, plain_config(section))
    # Parsed once per distinct configuration per process: a loop object is built for every sample.
    return _settings_from_json(json.dumps(merged, sort_keys=True, default=str))


def drop_invalid_enabled(setting: bool | None) -> bool:
    """The drop switch: the ``drop_invalid`` setting when given, else ``NEMO_GYM_BROWSER_DROP_INVALID``."""
    if setting is not None:
        return bool(setting)
    return os.environ.get(DROP_INVALID_ENV, "").strip().lower() in ("1", "true", "yes", "on")


# ----- one place per setting ---------------------------------------------------------------------------------

AGENT_LOOP_YAML_NAME = "configs/agent_loop.yaml"
TRAINER_YAML_NAME = "configs/webvoyager_grpo.yaml"
_ABSENT = object()


def judge_variable(key: str) -> str:
    """The ``config.env`` variable of the judge setting ``key`` (``timeout_s`` -> ``JUDGE_TIMEOUT_S``)."""
    return f"JUDGE_{key.upper()}"


@dataclass(frozen=True)
class ConfigEnvSetting:
    """A ``nemo_gym_browser`` setting that ``submit_webvoyager.sh`` passes from ``config.env`` on every run."""

    setting: str  # its path under the nemo_gym_browser section
    variable: str
    note: str = ""


# What config.env sets: the script passes these on every run, so they win over configs/webvoyager_grpo.yaml. A test
# compares this list with the script's overrides.
CONFIG_ENV_SETTINGS = (
    ConfigEnvSetting(
        "environment.server_urls",
        "ENV_SERVER_URLS",
        "empty: `ENV_SERVERS_PER_NODE` servers started on every node, on 127.0.0.1 from port `ENV_BASE_PORT`",
    ),
    ConfigEnvSetting("environment.max_sessions_per_server", "ENV_MAX_SESSIONS_PER_SERVER"),
    ConfigEnvSetting("episode_deadline_s", "EPISODE_DEADLINE_S"),
    ConfigEnvSetting("session_hold_limit_s", "SESSION_HOLD_LIMIT_S"),
    ConfigEnvSetting("max_attempts", "MAX_ATTEMPTS"),
    ConfigEnvSetting("stepwise.enabled", "SAMPLE_MODE", "`trajectory`: false (a sample per episode), `stepwise`: true"),
    *(
        ConfigEnvSetting(
            f"judge.{key}",
            judge_variable(key),
            "required when `JUDGE_ENABLE=1`" if field.is_required() else "empty: the default above",
        )
        for key, field in JudgeConfig.model_fields.items()
    ),
)


def _leaves(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty mappings are leaves."""
    leaves: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping) and value:
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves


def _at(values: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(values, Mapping) or part not in values:
            return _ABSENT
        values = values[part]
    return values


def _same(a: Any, b: Any) -> bool:
    normal = [list(value) if isinstance(value, tuple) else value for value in (a, b)]
    return normal[0] == normal[1]


def _shipped_value(path: str) -> Any:
    """What ``configs/webvoyager_grpo.yaml`` ships for ``path``: the model's default (a test keeps them equal), or
    ``???`` for a required setting; ``_ABSENT`` for no setting."""
    *parents, name = path.split(".")
    model = _model_at(BrowserLoopSettings, tuple(parents))
    field = model.model_fields.get(name) if model is not None else None
    if field is None:
        return _ABSENT
    if field.is_required():
        return "???"
    return field.get_default(call_default_factory=True)


def _shown(value: Any) -> str:
    # Numbers and switches only: a string could be a URL with credentials in it.
    return json.dumps(value) if isinstance(value, int | float | bool) or value is None else "another value"


def setting_conflicts(
    loop_kwargs: Mapping[str, Any], trainer_file_section: Mapping[str, Any], composed_section: Mapping[str, Any]
) -> list[str]:
    """Settings one layer gives and a later one silently replaces, each naming both places.

    ``loop_kwargs`` are the agent-loop YAML's kwargs, ``trainer_file_section`` the ``nemo_gym_browser`` section of
    ``configs/webvoyager_grpo.yaml`` as written, ``composed_section`` the same section of the composed trainer config
    (config.env and command-line overrides applied). Two cases: a key of the agent-loop YAML that the trainer
    config sets to another value (the section overrides the YAML key by key), and a key of the trainer YAML changed
    from what it ships that config.env replaces on every run (the value the user edited never reaches the run).
    """
    owned = {item.setting: item.variable for item in CONFIG_ENV_SETTINGS}
    section = TRAINER_CONFIG_SECTION
    conflicts = []
    for path, given in _leaves(loop_kwargs).items():
        final = _at(composed_section, path)
        if final is _ABSENT or _same(given, final):
            continue
        places = [f"config.env ({owned[path]})"] if path in owned else []
        if _same(_at(trainer_file_section, path), final):
            places.append(TRAINER_YAML_NAME)
        where = " or ".join(places or ["a command-line override"])
        conflicts.append(
            f"{section}.{path}: {AGENT_LOOP_YAML_NAME} sets {_shown(given)}, but {where} sets {_shown(final)}, which "
            f"wins (the trainer config's {section} section overrides the agent-loop YAML key by key): set it there "
            f"and keep {AGENT_LOOP_YAML_NAME} to name and _target_"
        )
    for path, written in _leaves(trainer_file_section).items():
        shipped = _shipped_value(path)
        final = _at(composed_section, path)
        if path not in owned or _same(written, shipped) or written is None or final is _ABSENT or _same(written, final):
            continue
        back = f" (and put the file back to {_shown(shipped)})" if shipped != "???" else ""
        conflicts.append(
            f"{section}.{path}: {TRAINER_YAML_NAME} sets {_shown(written)}, but config.env ({owned[path]}) or a "
            f"command-line override sets {_shown(final)}, which wins: set {owned[path]} in config.env instead{back}"
        )
    return conflicts


if __name__ == "__main__":  # runs as __main__, so this is no import of settings by itself: the reference's CLI
    from .settings_reference import main

    raise SystemExit(main())
