"""The policy acting in a NeMo Gym browser through verl 0.9.1's ``ToolAgentLoop``, with bounded, resampled episodes.

What this module owns
    * :class:`BrowserTool` (a verl ``BaseTool``): a tool call becomes a browser action on the rollout's own
      session. One class serves the recipe's single ``browser`` tool (``action`` = observe / navigate / click /
      type / finish) and NeMo Gym's five native tools (``browser_observe`` ... ``browser_finish``); the tool
      name in the tool config decides which.
    * :class:`BrowserToolAgentLoop` (a verl ``ToolAgentLoop``, registered as ``nemo_gym_browser_agent`` through
      ``configs/agent_loop.yaml``): the lifetime of the episode, its deadline, its attempts, its score and the
      per-sample flags.

Lifetimes it guarantees
    verl creates and releases a tool instance around every single call and turns every tool exception into a
    chat message, so the browser session cannot belong to the tool. It belongs to the loop: one environment
    session per *attempt*, opened from the row's ``tools_kwargs`` (start URL, verifier metadata, task id) by
    ``async with``, hence closed whatever ends the attempt (success, failure, deadline, cancellation). The tool
    finds the attempt's :class:`BrowserEpisode` on verl's ``AgentData`` (attached when the attempt starts), never
    through ``request_id``, which verl makes ``det-<priority>`` under ``full_determinism``.

Who caused it decides (``../shared/notes/failure-handling.md``)
    * Infrastructure (an :class:`~nemo_gym_browser.environment.EnvironmentFailure`: seed failed, session lost,
      unreachable, 5xx, a call hung past its per-call timeout, the session held past its hold limit, verify could
      not grade, the judge gave no usable verdict): recorded on the episode the moment it happens, the attempt
      ends at once (no further model call), its session is closed, and the rollout is re-run from scratch in a new
      session, up to ``max_attempts``. Still failing after that: the sample is flagged ``env_invalid`` with its
      loss masked and reward 0 (kept out of the GRPO baseline by ``grpo_env_aware``), or dropped (``[]``) under
      the V1 trainer when the drop switch is on.
    * The judge is the exception to resampling: it already asks again on the same evidence (its own
      ``max_attempts``), and a new episode would only spend a browser session and a model trajectory on a judge
      that is down. A trajectory without a usable verdict is kept, flagged ``judge_unusable``, after one episode.
      A task without ``verifier_metadata`` when no judge is configured is flagged ``judge_unusable`` at once,
      with no episode (nothing could score it; logged once per process).
    * Policy (a legitimate outcome, scored as it stands): bad tool arguments, unknown actions, element ids not on
      the page, URLs it chose that fail to load or are refused, no answer, running out of turns or tokens, and
      the episode deadline. Invalidity is never inferred from a short or empty response.

Time: the deadline and the hold limit
    ``episode_deadline_s`` bounds the episode's *environment time*: wall time from the seeded session on, less
    the time spent inside the model's ``generate``. A trainer holding generation (colocate_async pauses it for a
    whole training phase; verl's ``FullyAsyncLLMServerClient`` waits the pause out inside ``generate``) or a
    request queued in the inference server therefore never spends it, and never becomes a policy zero. It is
    checked before each generation and around each browser call (a call in flight runs to its own timeout), so
    browser time is bounded by the deadline plus one call timeout; it never cuts a generation.
    ``session_hold_limit_s`` bounds what the attempt costs the environment server in wall time, generation
    included (a browser held open while the trainer pauses): past it the attempt fails as an infrastructure
    ``timeout`` and is resampled. It is the only bound that cuts a generation, and a cut generation is cancelled
    on the rollout server (``ray.cancel`` on the request, see :func:`track_rollout_requests`), never left to
    decode for nobody. A generation is otherwise bounded by ``response_length`` tokens.

The turn limit
    verl ends the episode at ``multi_turn.max_assistant_turns`` (or ``max_user_turns``) right after the last
    generation, before it parses that turn's tool calls. A ``finish`` there is run by the loop itself, so its
    answer reaches verify or the judge; other actions of that turn are not run (no one would read their page).

Step-wise mode (``stepwise.enabled``, default off; V1 trainer only)
    One sample per policy step instead of one per episode. Each step's prompt is rendered afresh with verl's
    prompt builder (the tool schemas as ``ToolAgentLoop`` renders them): the task (the row's system and user
    messages), one user message with a line per earlier step (action, arguments, result, page; the newest
    ``history_steps`` of them, older ones only counted) and the latest ``history_observations`` steps whole (the
    model's own turn and the tool results it read). Its response is that step's generation alone, so tokens per
    sample do not grow with the episode. Everything else is the default mode's code: the attempt, its session,
    deadline, hold limit, URL guard and resampling; tool calls through verl's ``_call_tool``; a ``finish`` after
    the turn limit; verify or the judge on the final answer. ``run`` returns the final attempt's step samples as a
    list, each carrying the episode's reward and flags (an invalid episode: every step masked) plus ``env_step`` /
    ``env_steps``. verl's V1 worker stores them as ``{uid}_{session}_{index}``; its GRPO (``grpo_env_aware``
    through ``patches.py``) compares each session's final step only, one per episode, and gives every step of
    the session that advantage, so long episodes weigh no more than short ones in the baseline. In the loss each
    step sample counts by its tokens (verl's ``loss_agg_mode``): a 30-step episode weighs about six times a
    5-step one, as it does in the default mode, where its single sample holds six times the policy tokens; the
    recipe does not rescale this. The legacy trainer takes one sample per prompt: step-wise mode is refused
    there (at construction, and in ``run`` when called without the V1 worker's ``session_id``).

Where the flags go
    ``AgentLoopOutput.extra_fields`` of the returned sample (of every step sample in step-wise mode), written at the
    end of ``run`` (never before the first generation, which would stop verl copying ``min/max_global_steps``):
    ``env_invalid``, ``env_failure_kind``, ``env_failure_reason``, ``env_attempts``, ``deadline_hit``,
    ``reward_source``, plus ``env_failed_attempt_kinds``, ``env_episode_wall_s``, ``env_refused_navigations``,
    ``env_browser_actions`` (calls that acted on the page, ``finish`` not counted: 0 for an answer given without
    browsing) for metrics (and ``env_step`` / ``env_steps`` in step-wise mode), and numeric copies under
    ``reward_extra_info`` (see :mod:`nemo_gym_browser.episode_metrics`).

Settings
    Constructor keyword arguments from the agent-loop YAML (``configs/agent_loop.yaml``), overridden key by key by
    the trainer config section ``nemo_gym_browser`` (e.g. ``+nemo_gym_browser.environment.server_urls=[...]`` on
    the ``main_ppo`` command line): both travel inside verl's config to the Ray workers, unlike shell variables.
    The one exception is the drop switch ``NEMO_GYM_BROWSER_DROP_INVALID=1``, named by the project contract; the
    ``drop_invalid`` setting, when set, takes precedence over it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import logging
import os
import re
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from omegaconf import DictConfig, ListConfig, OmegaConf
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, HermesToolParser
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from verl.utils.profiler import simple_timer
from verl.utils.ray_utils import get_event_loop

from . import dropped_rollouts, trajectories
from .environment import (
    BrowserSession,
    EnvironmentClient,
    EnvironmentConfig,
    EnvironmentFailure,
    FailureKind,
    ToolResult,
    parse_observation,
)
from .episode_metrics import reward_extra_info
from .judge import BinaryJudge, JudgeConfig, JudgeEvidence
from .url_safety import UrlGuard, UrlPolicy, UrlRefused, url_scheme

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

AGENT_LOOP_NAME = "nemo_gym_browser_agent"
DROP_INVALID_ENV = "NEMO_GYM_BROWSER_DROP_INVALID"
# The trainer-config section whose keys override the agent-loop YAML kwargs.
TRAINER_CONFIG_SECTION = "nemo_gym_browser"
# Where the attempt's episode hangs on verl's AgentData (verl itself adds private attributes there too).
EPISODE_ATTRIBUTE = "nemo_gym_browser_episode"

ACTIONS = ("observe", "navigate", "click", "type", "finish")
NATIVE_TOOL_ACTIONS = {f"browser_{action}": action for action in ACTIONS}
SINGLE_TOOL_NAME = "browser"
# Keyword arguments verl's AgentLoopWorker passes to every agent loop; anything else must be a setting of ours.
_VERL_LOOP_KWARGS = frozenset(
    {
        "trainer_config",
        "server_manager",
        "tokenizer",
        "processor",
        "dataset_cls",
        "data_config",
        "hf_model_type",
        "tools",
    }
)
# Below this many characters an observation (element list + page text) is visibly cut by verl's truncation.
_OBSERVATION_FLOOR_CHARS = 2048
# A resample waits this long before its second attempt, doubling per further attempt, at most the cap.
_BACKOFF_CAP_S = 30.0

DEADLINE_MESSAGE = "The time limit of this episode has been reached; no further browser actions are possible."
FINISHED_MESSAGE = "The task is already finished; no further browser actions are possible."
ABANDONED_MESSAGE = "The browser environment failed; this attempt is abandoned."
LEGACY_STEPWISE_MESSAGE = (
    "step-wise mode (stepwise.enabled: true) returns one sample per policy step, which only verl's V1 trainer "
    "accepts (trainer.use_v1=true); the legacy trainer needs exactly one sample per prompt. Use the V1 trainer or "
    "set stepwise.enabled=false"
)
UNBOUNDED_STEPWISE_MESSAGE = (
    "step-wise mode (stepwise.enabled: true) needs actor_rollout_ref.rollout.multi_turn.max_assistant_turns: each "
    "step's prompt is bounded, so the response length cannot end an episode and only the wall-clock deadline would"
)
# The first line of a step-wise prompt's history message (test policies read the step number from it).
STEP_HISTORY_HEADER = "Progress so far: {steps} step(s) taken in this episode."
NO_JUDGE_REASON = (
    "the task has no verifier_metadata and no judge is configured (JUDGE_ENABLE=0 / judge: null), so nothing can "
    "score it; no episode was run"
)

_CURRENT_EPISODE: contextvars.ContextVar[BrowserEpisode | None] = contextvars.ContextVar(
    "nemo_gym_browser_current_episode", default=None
)


# ----- settings -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepwiseSettings:
    """Step-wise samples (see "Step-wise mode" in the module docstring); off by default."""

    enabled: bool = False
    history_observations: int = 1  # latest steps shown whole (the model's turn and its tool results)
    history_steps: int = 10  # earlier steps shown as one line each, newest kept; older ones only counted

    def __post_init__(self) -> None:
        if self.history_observations < 1:
            raise ValueError("stepwise.history_observations must be at least 1 (the policy must see a page)")
        if self.history_steps < 0:
            raise ValueError("stepwise.history_steps must not be negative")


@dataclass(frozen=True)
class BrowserLoopSettings:
    """Everything an operator tunes about browser episodes (agent-loop YAML kwargs + ``nemo_gym_browser`` section)."""

    environment: EnvironmentConfig
    episode_deadline_s: float = 1800.0  # environment time per attempt (time inside the model's generate excluded)
    session_hold_limit_s: float = 3600.0  # wall clock an attempt may hold its browser, generation included
    max_attempts: int = 3  # attempts per rollout, the first one included
    resample_backoff_s: float = 1.0  # wait before the second attempt (doubles per further attempt)
    drop_invalid: bool | None = None  # None: read NEMO_GYM_BROWSER_DROP_INVALID
    # True: a rollout still failing after its attempts is scored 0 and trained on like a policy outcome, as an
    # integration without this recipe does. For comparison runs only (bench/learning_curve.py's stock arm).
    train_on_failures: bool = False
    url_policy: UrlPolicy = field(default_factory=UrlPolicy)
    judge: JudgeConfig | None = None  # scores tasks without verifier_metadata
    lenient_tool_call_parsing: bool = True  # a malformed <tool_call> becomes an error message, not a silent stop
    max_tool_response_length: int | None = None  # overrides multi_turn.max_tool_response_length when set
    trajectory_dir: str | None = None  # one JSONL record per rollout under this folder (trajectories.py); None: off
    call_timeout_grace_s: float = 5.0  # safety net above the environment's own per-call timeout
    stepwise: StepwiseSettings = field(default_factory=StepwiseSettings)

    def __post_init__(self) -> None:
        if self.episode_deadline_s <= 0:
            raise ValueError("episode_deadline_s must be positive")
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        if self.resample_backoff_s < 0 or self.call_timeout_grace_s < 0:
            raise ValueError("resample_backoff_s and call_timeout_grace_s must not be negative")
        # Environment time alone may legitimately reach the deadline plus one call in flight; a hold limit below
        # that would turn a policy's deadline into an infrastructure timeout.
        least_hold = self.episode_deadline_s + self.environment.call_timeout_s
        if self.session_hold_limit_s < least_hold:
            raise ValueError(
                f"session_hold_limit_s={self.session_hold_limit_s:g} must be at least episode_deadline_s + "
                f"environment.call_timeout_s = {least_hold:g} (and above the longest time the trainer holds generation)"
            )

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> BrowserLoopSettings:
        values = dict(values)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown nemo_gym_browser agent-loop settings {unknown}; known: {sorted(known)}")
        environment = values.pop("environment", None) or {}
        if not environment.get("server_urls"):
            raise ValueError(
                "no environment server: set environment.server_urls in the agent-loop config (configs/agent_loop.yaml) "
                f"or +{TRAINER_CONFIG_SECTION}.environment.server_urls=[...] on the command line"
            )
        policy = values.pop("url_policy", None) or {}
        policy_known = {f.name for f in fields(UrlPolicy)}
        if set(policy) - policy_known:
            raise ValueError(
                f"unknown url_policy keys {sorted(set(policy) - policy_known)}; known: {sorted(policy_known)}"
            )
        if "allowlist" in policy:
            policy["allowlist"] = tuple(policy["allowlist"] or ())
        stepwise = values.pop("stepwise", None) or {}
        stepwise_known = {f.name for f in fields(StepwiseSettings)}
        if set(stepwise) - stepwise_known:
            raise ValueError(
                f"unknown stepwise keys {sorted(set(stepwise) - stepwise_known)}; known: {sorted(stepwise_known)}"
            )
        judge = values.pop("judge", None)
        if isinstance(judge, str):
            judge = JudgeConfig.from_yaml(_recipe_path(judge))
        elif isinstance(judge, Mapping):
            judge = JudgeConfig.from_mapping(judge)
        return cls(
            environment=EnvironmentConfig.from_mapping(environment),
            url_policy=UrlPolicy(**policy),
            stepwise=StepwiseSettings(**stepwise),
            judge=judge,
            **values,
        )


def _recipe_path(path: str) -> str:
    """``path`` as given when it exists, else relative to the recipe folder (``configs/judge.yaml`` works anywhere)."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    candidate = os.path.join(os.path.dirname(os.path.abspath(__file__)), path)
    return candidate if os.path.exists(candidate) else path


def _plain(value: Any) -> Any:
    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


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
    merged = {key: _plain(value) for key, value in loop_kwargs.items()}
    section = trainer_config.get(TRAINER_CONFIG_SECTION) if trainer_config is not None else None
    if section:
        merged = _deep_merge(merged, _plain(section))
    # Parsed once per distinct configuration per process: a loop object is built for every sample.
    return _settings_from_json(json.dumps(merged, sort_keys=True, default=str))


def drop_invalid_enabled(setting: bool | None) -> bool:
    """The drop switch: the ``drop_invalid`` setting when given, else ``NEMO_GYM_BROWSER_DROP_INVALID``."""
    if setting is not None:
        return bool(setting)
    return os.environ.get(DROP_INVALID_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def running_under_v1_trainer(run_kwargs: Mapping[str, Any]) -> bool:
    """Whether verl's V1 trainer called ``run``.

    In verl 0.9.1 only ``AgentLoopWorkerTQ._run_prompt`` passes ``session_id`` (the index among the ``rollout.n``
    samples) next to the batch's ``global_steps``; the legacy ``AgentLoopWorker`` passes dataset columns only.
    """
    return "session_id" in run_kwargs and "global_steps" in run_kwargs


# ----- shared environment clients ----------------------------------------------------------------------------

# One client (one connection pool) per event loop and configuration: loops are built per sample, the pool is not.
_CLIENTS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[EnvironmentConfig, EnvironmentClient]] = (
    weakref.WeakKeyDictionary()
)


def shared_environment_client(config: EnvironmentConfig) -> EnvironmentClient:
    """The running event loop's client for ``config`` (created on first use)."""
    per_loop = _CLIENTS.setdefault(asyncio.get_running_loop(), {})
    client = per_loop.get(config)
    if client is None:
        client = per_loop[config] = EnvironmentClient(config)
    return client


async def close_shared_clients() -> None:
    """Close the running event loop's environment clients (tests, benchmarks, clean worker shutdown)."""
    per_loop = _CLIENTS.pop(asyncio.get_running_loop(), {})
    for client in per_loop.values():
        await client.close()


# ----- the task of one row ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EpisodeSpec:
    """What one row asks for, read from ``tools_kwargs[<tool>]["create_kwargs"]`` (written by ``dataset.py``)."""

    task_id: str
    initial_url: str | None
    verifier_metadata: dict[str, Any] | None
    question: str | None = None
    reference_answer: str | None = None
    taskset: str | None = None

    @classmethod
    def from_tools_kwargs(cls, tools_kwargs: Any) -> EpisodeSpec:
        tools_kwargs = _plain(tools_kwargs) or {}
        if not isinstance(tools_kwargs, Mapping):
            raise ValueError(f"tools_kwargs must be a mapping, got {type(tools_kwargs).__name__}")
        create = None
        for name in (SINGLE_TOOL_NAME, *NATIVE_TOOL_ACTIONS):
            entry = tools_kwargs.get(name)
            if isinstance(entry, Mapping) and isinstance(entry.get("create_kwargs"), Mapping):
                create = entry["create_kwargs"]
                break
        if create is None or not create.get("task_id"):
            raise ValueError(
                "the row has no tools_kwargs['browser']['create_kwargs'] with a task_id; "
                "build the dataset with nemo_gym_browser.dataset (data.custom_cls)"
            )
        task = create.get("task") or {}
        metadata = create.get("verifier_metadata") or None
        return cls(
            task_id=str(create["task_id"]),
            initial_url=create.get("initial_url") or None,
            verifier_metadata=dict(metadata) if metadata else None,
            question=task.get("question") or None,
            reference_answer=task.get("reference_answer") or None,
            taskset=create.get("taskset") or None,
        )


# ----- one attempt's live state -------------------------------------------------------------------------------


def parse_tool_call(tool_name: str, parameters: Any) -> tuple[str, dict[str, Any]] | str:
    """``(environment tool, arguments)`` for a call of ``tool_name``, or the policy error to show the model.

    The single ``browser`` tool is validated here (its schema is ours); native tools are forwarded verbatim so
    the server's own validation (422) speaks, as in NeMo Gym's evaluation.
    """
    if isinstance(parameters, str):
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError:
            return "the arguments must be a JSON object"
    if not isinstance(parameters, Mapping):
        return "the arguments must be a JSON object"
    if tool_name in NATIVE_TOOL_ACTIONS:
        return tool_name, dict(parameters)
    action = parameters.get("action")
    if not isinstance(action, str) or action.strip().lower() not in ACTIONS:
        return f"unknown action {action!r}; the browser tool's action is one of {', '.join(ACTIONS)}"
    action = action.strip().lower()
    arguments: dict[str, Any] = {}
    if action == "navigate":
        url = parameters.get("url")
        if not isinstance(url, str) or not url.strip():
            return "navigate needs a url (a string)"
        arguments["url"] = url.strip()
    if action in ("click", "type"):
        element_id = parameters.get("element_id")
        if isinstance(element_id, str) and element_id.strip().isdigit():
            element_id = int(element_id)
        if isinstance(element_id, float) and element_id.is_integer():
            element_id = int(element_id)
        if not isinstance(element_id, int) or isinstance(element_id, bool) or element_id < 0:
            return f"{action} needs an element_id (a number from the last observation's element list)"
        arguments["element_id"] = element_id
    if action == "type":
        text = parameters.get("text")
        if not isinstance(text, str):
            return "type needs a text (a string)"
        arguments["text"] = text
    if action == "finish":
        answer = parameters.get("answer")
        if answer is None:
            return "finish needs an answer (a string)"
        arguments["answer"] = answer if isinstance(answer, str) else json.dumps(answer, ensure_ascii=False)
    return f"browser_{action}", arguments


def render_result(result: ToolResult) -> str:
    """The text the model reads for one browser answer."""
    if result.error:
        return f"Error: {result.error}" + (f"\n{result.observation}" if result.observation else "")
    if result.done:
        return result.observation or "Finished: your answer was recorded."
    return result.observation or "(the browser returned no observation)"


class BrowserEpisode:
    """One attempt: its session, clocks, URL guard and what happened so far. Owned by the loop.

    Two clocks start when the session is seeded. The *environment* clock stops while the model generates
    (:meth:`model_time`): the deadline (``deadline_s``) is measured on it, so time the trainer takes (generation
    paused, a request queued in the inference server) never becomes a policy outcome. The *hold* clock never
    stops: past ``hold_limit_s`` the attempt has kept its browser too long, an infrastructure ``timeout``.
    """

    def __init__(
        self,
        *,
        session: BrowserSession,
        guard: UrlGuard,
        deadline_s: float,
        hold_limit_s: float,
        call_bound_s: float,
        label: str,
    ) -> None:
        self.session = session
        self.guard = guard
        self.deadline_s = deadline_s
        self.hold_limit_s = hold_limit_s
        self.call_bound_s = call_bound_s
        self.label = label
        self.started = time.monotonic()
        self.model_s = 0.0  # finished generations
        self._generating_since: float | None = None
        self.failure: EnvironmentFailure | None = None
        self.deadline_hit = False
        self.finished = False
        self.final_answer: str | None = None
        self.last_observation: str | None = None
        self.steps: list[str] = trajectories.StepLines()  # also notes when each step ended, for trajectories
        self.tool_calls = 0
        self.browser_actions = 0  # calls that act on the page (observe, navigate, click, type): not finish
        self.policy_errors = 0
        self.refused_navigations = 0
        self._page_changed = False

    @property
    def over(self) -> bool:
        """No further action or generation makes sense (infrastructure failed, deadline passed, task finished)."""
        return self.failure is not None or self.deadline_hit or self.finished

    def environment_s(self) -> float:
        """Seconds on the environment clock: held so far, less the time spent inside the model's generate."""
        now = time.monotonic()
        generating = now - self._generating_since if self._generating_since is not None else 0.0
        return now - self.started - self.model_s - generating

    def remaining(self) -> float:
        """Environment time left before the deadline."""
        return self.deadline_s - self.environment_s()

    def hold_remaining(self) -> float:
        """Wall-clock time left before the attempt has held its browser too long."""
        return self.hold_limit_s - (time.monotonic() - self.started)

    @contextlib.contextmanager
    def model_time(self) -> Iterator[None]:
        """Stop the environment clock while the model generates."""
        self._generating_since = time.monotonic()
        try:
            yield
        finally:
            self.model_s += time.monotonic() - self._generating_since
            self._generating_since = None

    def held_too_long(self, where: str) -> EnvironmentFailure:
        held = time.monotonic() - self.started
        return EnvironmentFailure(
            FailureKind.TIMEOUT,
            f"session {self.session.session_id} held open {held:.1f}s (session_hold_limit_s={self.hold_limit_s:g}) "
            f"at {where}; {self.model_s:.1f}s of it in the model's generate (paused or queued by the trainer)",
        )

    def fail(self, failure: EnvironmentFailure) -> None:
        if self.failure is None:
            self.failure = failure
            logger.warning("%s: infrastructure failure (%s): %s", self.label, failure.kind.value, failure.reason)

    def hit_deadline(self, where: str) -> None:
        if not self.deadline_hit:
            self.deadline_hit = True
            logger.info("%s: episode deadline reached during %s", self.label, where)

    def _closed_message(self) -> str:
        if self.failure is not None:
            return ABANDONED_MESSAGE
        return DEADLINE_MESSAGE if self.deadline_hit else FINISHED_MESSAGE

    async def act(self, tool_name: str, parameters: Any) -> str:
        """Run one tool call of the policy; return what the model reads. Never raises for environment outcomes."""
        if self.over:
            return self._closed_message()
        parsed = parse_tool_call(tool_name, parameters)
        if isinstance(parsed, str):
            self.policy_errors += 1
            self.steps.append(f"{tool_name}: invalid call ({parsed})")
            return f"Error: {parsed}"
        tool, arguments = parsed
        if self.remaining() <= 0:
            self.hit_deadline("a tool call")
            return DEADLINE_MESSAGE
        if self.hold_remaining() <= 0:
            self.fail(self.held_too_long(tool))
            return ABANDONED_MESSAGE
        if tool == "browser_navigate" and isinstance(arguments.get("url"), str):
            try:
                await self.guard.check(arguments["url"])
            except UrlRefused as refusal:
                self.refused_navigations += 1
                self.steps.append(f"navigate({arguments['url'][:80]!r}) -> refused")
                return f"Error: navigation refused: {refusal}"
        self.tool_calls += 1
        self.browser_actions += tool != "browser_finish"
        try:
            result = await self._bounded_call(tool, arguments)
        except EnvironmentFailure as failure:
            self.fail(failure)
            return ABANDONED_MESSAGE
        except Exception as exc:  # an unmapped error is still the environment's, never a policy zero
            logger.exception("%s: unexpected error from %s", self.label, tool)
            self.fail(EnvironmentFailure(FailureKind.SERVER_ERROR, f"{tool} raised {type(exc).__name__}: {exc}"))
            return ABANDONED_MESSAGE
        self._record(tool, arguments, result)
        if self.remaining() <= 0:  # the deadline passed while the call ran: the page stands as the call left it
            self.hit_deadline(tool)
            return DEADLINE_MESSAGE
        return render_result(result)

    async def _bounded_call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """One browser action, bounded by the per-call timeout only.

        A call still in flight when the episode deadline passes may finish within its own timeout (the caller then
        ends the episode at the deadline, scored as it stands); one that does not is a hung call, an infrastructure
        failure, whatever the deadline. So an episode lasts at most its deadline plus one per-call timeout, and a
        hang near the end of an episode is never turned into a policy zero.
        """
        try:
            return await asyncio.wait_for(self.session.call(tool, arguments), self.call_bound_s)
        except asyncio.TimeoutError:
            raise EnvironmentFailure(
                FailureKind.TIMEOUT, f"{tool} did not answer within {self.call_bound_s:g}s"
            ) from None

    def _record(self, tool: str, arguments: dict[str, Any], result: ToolResult) -> None:
        action = tool.removeprefix("browser_")
        shown = ", ".join(f"{k}={v!r}"[:80] for k, v in arguments.items())
        if result.error:
            self.policy_errors += 1
            self.steps.append(f"{action}({shown}) -> error: {result.error[:120]}")
        else:
            self.steps.append(f"{action}({shown}) -> ok")
        if result.observation:
            # The task's start page is honoured by the URL guard; for a relative start URL it is learnt from the
            # first observation made before the policy changed the page.
            if not self._page_changed and not self.guard.knows_start_page:
                start_url, _, _ = parse_observation(result.observation)
                if start_url:
                    self.guard.note_start_page(start_url)
            self.last_observation = result.observation
        if action in ("navigate", "click", "type"):
            self._page_changed = True
        if action == "finish" and not result.error and self.final_answer is None:
            self.final_answer = arguments.get("answer")
        if result.done:
            self.finished = True


def episode_of(agent_data: Any) -> BrowserEpisode | None:
    return getattr(agent_data, EPISODE_ATTRIBUTE, None)


# ----- the tool -----------------------------------------------------------------------------------------------


def _schema(name: str, description: str, properties: dict[str, Any], required: list[str]) -> OpenAIFunctionToolSchema:
    return OpenAIFunctionToolSchema.model_validate(
        {
            "type": "function",
            "function": {
                "name": name,
                "description": description,
                "parameters": {"type": "object", "properties": properties, "required": required},
            },
        }
    )


_ELEMENT_ID = {"type": "integer", "description": "An element id from the last observation's ELEMENTS list."}


def default_tool_schema(name: str) -> OpenAIFunctionToolSchema:
    """The schema the recipe's configs expose for ``name`` (``browser`` or one of the five native tools)."""
    if name == SINGLE_TOOL_NAME:
        return _schema(
            SINGLE_TOOL_NAME,
            "Act in a web browser. observe: read the current page (URL, title, numbered elements, text). "
            "navigate: open a url. click: click an element by id. type: type text into an element by id. "
            "finish: end the task with your answer.",
            {
                "action": {"type": "string", "enum": list(ACTIONS), "description": "What to do."},
                "url": {"type": "string", "description": "For navigate: an absolute http(s) URL."},
                "element_id": {
                    "type": "integer",
                    "description": "For click and type: an element id from the last observation's ELEMENTS list.",
                },
                "text": {"type": "string", "description": "For type: the text to enter."},
                "answer": {"type": "string", "description": "For finish: your final answer."},
            },
            ["action"],
        )
    natives = {
        "browser_observe": ("Read the current page: URL, title, numbered interactive elements and text.", {}, []),
        "browser_navigate": (
            "Open a URL in the browser.",
            {"url": {"type": "string", "description": "An absolute http(s) URL."}},
            ["url"],
        ),
        "browser_click": ("Click an element of the last observation.", {"element_id": _ELEMENT_ID}, ["element_id"]),
        "browser_type": (
            "Type text into an element of the last observation.",
            {"element_id": _ELEMENT_ID, "text": {"type": "string", "description": "The text to enter."}},
            ["element_id", "text"],
        ),
        "browser_finish": (
            "End the task with your final answer.",
            {"answer": {"type": "string", "description": "Your final answer."}},
            ["answer"],
        ),
    }
    if name not in natives:
        raise ValueError(f"no browser tool is named {name!r}; expected {SINGLE_TOOL_NAME!r} or one of {list(natives)}")
    description, properties, required = natives[name]
    return _schema(name, description, properties, required)


class BrowserTool(BaseTool):
    """A browser action on the rollout's own session (see the module docstring).

    Tool config (``configs/browser_tool.yaml``, ``configs/browser_native_tools.yaml``)::

        tools:
          - class_name: nemo_gym_browser.browser_agent_loop.BrowserTool
            config: {type: native, name: browser}     # name used when tool_schema is omitted
            tool_schema: {...}                         # optional; the schema's name decides the interface

    It only works inside :class:`BrowserToolAgentLoop`, which owns the session.
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None) -> None:
        name = (tool_schema.function.name if tool_schema else None) or (config or {}).get("name") or SINGLE_TOOL_NAME
        if name != SINGLE_TOOL_NAME and name not in NATIVE_TOOL_ACTIONS:
            raise ValueError(
                f"BrowserTool cannot be named {name!r}: use {SINGLE_TOOL_NAME!r} or one of {list(NATIVE_TOOL_ACTIONS)}"
            )
        super().__init__(config or {}, tool_schema or default_tool_schema(name))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        # Nothing per call: the session lives on the loop's episode, found through agent_data in execute.
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        episode = episode_of(kwargs.get("agent_data"))
        if episode is None:
            raise RuntimeError(
                f"the {self.name} tool has no browser session: it only runs inside BrowserToolAgentLoop "
                f"(agent_name {AGENT_LOOP_NAME!r}, registered by configs/agent_loop.yaml)"
            )
        return ToolResponse(text=await episode.act(self.name, parameters)), 0.0, {}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


# ----- tool-call parsing --------------------------------------------------------------------------------------


class LenientHermesToolParser(HermesToolParser):
    """verl's hermes parser, except that a malformed ``<tool_call>`` block is not silently dropped.

    Upstream drops a block whose JSON does not parse, so the episode simply ends and the model never learns why.
    Here such a block becomes a call whose arguments are the raw text: verl's own ``_call_tool`` then answers
    "Invalid JSON in arguments ..." (or "Unknown function ...") as a tool message, a policy error the model reads.
    Well-formed blocks parse exactly as upstream, except that arguments written as a JSON string are passed on
    verbatim (so a double-encoded object still reaches the tool as an object).
    """

    _name_in_text = re.compile(r'"name"\s*:\s*"([^"]*)"')

    async def extract_tool_calls(self, responses_ids: list[int], tools: Any = None) -> tuple[str, list[FunctionCall]]:
        loop = get_event_loop()
        text = await loop.run_in_executor(None, self.tokenizer.decode, responses_ids)
        if self.tool_call_start_token not in text or self.tool_call_end_token not in text:
            return text, []
        calls = []
        for block in self.tool_call_regex.findall(text):
            calls.append(self._call_from_block(block))
        return self.tool_call_regex.sub("", text), calls

    def _call_from_block(self, block: str) -> FunctionCall:
        try:
            payload = json.loads(block)
        except json.JSONDecodeError:
            payload = None
        if isinstance(payload, dict) and isinstance(payload.get("name"), str):
            arguments = payload.get("arguments", {})
            if not isinstance(arguments, str):
                arguments = json.dumps(arguments, ensure_ascii=False)
            return FunctionCall(name=payload["name"], arguments=arguments)
        guessed = self._name_in_text.search(block)
        return FunctionCall(name=guessed.group(1) if guessed else "", arguments=block.strip())


# ----- cancelling a cut generation on the rollout server ----------------------------------------------------

# The rollout-server requests (Ray ObjectRefs) of the generation running in this context.
_ROLLOUT_REQUESTS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar(
    "nemo_gym_browser_rollout_requests", default=None
)
_TRACKING_ATTRIBUTE = "_nemo_gym_browser_tracks_requests"


class _TrackedGenerate:
    """``server.generate`` of a rollout server's actor handle that notes each request it submits."""

    def __init__(self, method: Any) -> None:
        self._method = method

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        ref = self._method.remote(*args, **kwargs)
        requests = _ROLLOUT_REQUESTS.get()
        if requests is not None:
            requests.append(ref)
        return ref

    def __getattr__(self, name: str) -> Any:
        return getattr(self._method, name)


class _TrackedServer:
    """A rollout server's actor handle whose ``generate`` requests are noted; everything else passes through."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    @property
    def generate(self) -> _TrackedGenerate:
        return _TrackedGenerate(self._handle.generate)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)


def track_rollout_requests(client: Any) -> bool:
    """Let a cut generation be cancelled on the rollout server behind verl's ``LLMServerClient``.

    verl 0.9.1's client awaits ``server.generate.remote(...)`` on a Ray actor handle it gets from
    ``_acquire_server``, with a fresh vLLM request id per turn that it does not expose. Cancelling the task that
    awaits such a request does not cancel the actor's task (Ray: cancelling the future of an ObjectRef leaves
    the task running), so vLLM would decode a cut generation to its end for nobody, and a request parked while
    the trainer pauses generation would start once it resumes. The handle is wrapped, once per client object, so
    the loop learns each request's ObjectRef and can ``ray.cancel`` it (which cancels the server's ``generate``
    coroutine; vLLM aborts a request whose generator is cancelled). Returns whether the client is tracked.
    """
    acquire = getattr(client, "_acquire_server", None)
    if acquire is None:
        return False
    if getattr(client, _TRACKING_ATTRIBUTE, False):
        return True

    async def acquire_tracked(request_id: str, **extra: Any) -> tuple[str, Any]:
        server_id, handle = await acquire(request_id, **extra)
        return server_id, _TrackedServer(handle)

    client._acquire_server = acquire_tracked
    setattr(client, _TRACKING_ATTRIBUTE, True)
    return True


def _cancel_rollout_requests(requests: list[Any], label: str) -> None:
    if not requests:
        return
    import ray  # only reached with verl's Ray-backed client

    for ref in requests:
        try:
            ray.cancel(ref)
        except Exception as exc:  # a request already finished or its server gone: nothing left to stop
            logger.debug("%s: cancelling a rollout-server request failed: %r", label, exc)
    logger.info("%s: cancelled %d rollout-server request(s) of a cut generation", label, len(requests))


async def generate_within(generation: Awaitable[Any], timeout_s: float, label: str) -> Any:
    """Await ``generation`` for at most ``timeout_s``; a generation cut by the timeout or by cancellation is also
    cancelled on the rollout server (see :func:`track_rollout_requests`), never left running."""
    requests: list[Any] = []
    token = _ROLLOUT_REQUESTS.set(requests)  # asyncio.wait_for's task copies this context
    try:
        return await asyncio.wait_for(generation, timeout_s)
    except BaseException:
        _cancel_rollout_requests(requests, label)
        raise
    finally:
        _ROLLOUT_REQUESTS.reset(token)


# ----- the agent loop -----------------------------------------------------------------------------------------


@dataclass
class _StepRecord:
    """One policy step of a step-wise episode, as later steps' prompts show it."""

    assistant_text: str  # the model's turn, tool calls included, as it generated it
    results: list[str]  # the tool messages it read back
    summary: str  # the one line shown once the step has left the latest ``history_observations``


@dataclass
class _AttemptOutcome:
    outputs: list[AgentLoopOutput]  # one sample, or one per policy step in step-wise mode; [] if nothing ran
    failure: EnvironmentFailure | None
    reward: float = 0.0
    reward_source: str | None = None
    deadline_hit: bool = False
    refused_navigations: int = 0
    browser_actions: int = 0
    episode: BrowserEpisode | None = None  # the attempt's steps, for trajectories


class BrowserToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with one browser session per attempt, a deadline, resampling and flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # verl passes the registry entry whole, its name included
        settings_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key not in _VERL_LOOP_KWARGS}
        super().__init__(*args, **kwargs)
        self.settings = resolve_settings(settings_kwargs, self.config)
        if self.settings.max_tool_response_length is not None:
            self.max_tool_response_length = self.settings.max_tool_response_length
        if self.max_tool_response_length < _OBSERVATION_FLOOR_CHARS:
            _warn_once(
                "short-observations",
                "multi_turn.max_tool_response_length=%s characters cuts browser observations (up to ~5000 "
                "characters); set max_tool_response_length in configs/agent_loop.yaml or on the command line",
                self.max_tool_response_length,
            )
        if self.settings.lenient_tool_call_parsing and self.tool_parser_name == "hermes":
            self.tool_parser = LenientHermesToolParser(self.tokenizer)
        if not any(isinstance(tool, BrowserTool) for tool in self.tools.values()):
            raise ValueError(
                "BrowserToolAgentLoop found no BrowserTool: set actor_rollout_ref.rollout.multi_turn.tool_config_path "
                "to configs/browser_tool.yaml (or configs/browser_native_tools.yaml)"
            )
        if self.settings.stepwise.enabled and not bool(self.config.trainer.get("use_v1", False)):
            raise ValueError(LEGACY_STEPWISE_MESSAGE)
        if self.settings.stepwise.enabled and not self.max_assistant_turns:
            # a step-wise prompt stays bounded, so the response length never ends an episode: the turn limit must
            raise ValueError(UNBOUNDED_STEPWISE_MESSAGE)
        self._judge = BinaryJudge.shared(self.settings.judge) if self.settings.judge is not None else None
        if not track_rollout_requests(self.server_manager):
            _warn_once(
                "untracked-server-manager",
                "the server manager %s has no _acquire_server: a generation cut at session_hold_limit_s is cancelled "
                "in this process only",
                type(self.server_manager).__name__,
                level=logging.INFO,
            )

    # --- the rollout -------------------------------------------------------------------------------------------

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput | list[AgentLoopOutput]:
        spec = EpisodeSpec.from_tools_kwargs(kwargs.get("tools_kwargs"))
        under_v1 = running_under_v1_trainer(kwargs)
        stepwise = self.settings.stepwise.enabled
        if stepwise and not under_v1:
            raise RuntimeError(LEGACY_STEPWISE_MESSAGE)
        rollout_id = f"r{kwargs.get('index', 'x')}-{uuid.uuid4().hex[:16]}"
        started = time.monotonic()
        failed_kinds: list[str] = []
        timings = {"generate_sequences": 0.0, "tool_calls": 0.0}
        outcome = _AttemptOutcome(outputs=[], failure=None)
        attempt = 0
        unscorable = spec.verifier_metadata is None and self._judge is None
        if unscorable:
            # Nothing could score the episode: spend no browser and no model call on it (0 attempts).
            _warn_once(
                "no-judge",
                "task %s has no verifier_metadata and no judge is configured (JUDGE_ENABLE=0 / judge: null): such "
                "rollouts are flagged judge_unusable without an episode; set a judge or give every task "
                "verifier_metadata",
                spec.task_id,
            )
            outcome.failure = EnvironmentFailure(FailureKind.JUDGE_UNUSABLE, NO_JUDGE_REASON)
        for attempt in range(1, (0 if unscorable else self.settings.max_attempts) + 1):
            if attempt > 1 and self.settings.resample_backoff_s > 0:
                await asyncio.sleep(min(self.settings.resample_backoff_s * 2 ** (attempt - 2), _BACKOFF_CAP_S))
            outcome = await self._run_attempt(sampling_params, kwargs, spec, rollout_id, attempt)
            for step_output in outcome.outputs:
                for key in timings:
                    timings[key] += float(getattr(step_output.metrics, key, 0.0) or 0.0)
            if outcome.failure is None:
                break
            failed_kinds.append(outcome.failure.kind.value)
            # The judge was already asked again on the same evidence; a new episode would give it nothing new.
            final = attempt == self.settings.max_attempts or outcome.failure.kind is FailureKind.JUDGE_UNUSABLE
            logger.warning(
                "rollout %s task %s: attempt %d/%d failed (%s)%s",
                rollout_id,
                spec.task_id,
                attempt,
                self.settings.max_attempts,
                outcome.failure.kind.value,
                ", giving up" if final else ", resampling",
            )
            if final:
                break

        invalid = outcome.failure is not None
        if invalid and drop_invalid_enabled(self.settings.drop_invalid):
            if under_v1:
                logger.warning(
                    "rollout %s task %s: still invalid after %d attempts, dropped", rollout_id, spec.task_id, attempt
                )
                await dropped_rollouts.record(  # verl stores nothing for it: the step metrics count it from here
                    kwargs.get("uid"),
                    failure_kind=outcome.failure.kind.value,
                    attempts=attempt,
                    failed_attempt_kinds=failed_kinds,
                    episode_wall_s=time.monotonic() - started,
                    deadline_hit=outcome.deadline_hit,
                    refused_navigations=outcome.refused_navigations,
                    browser_actions=outcome.browser_actions,
                )
                return []
            _warn_legacy_drop()

        # Only the final attempt's samples are returned: an abandoned attempt's steps never reach the trainer.
        outputs = outcome.outputs or [await self._placeholder_output(kwargs)]
        flags = {
            "env_invalid": invalid,
            "env_failure_kind": outcome.failure.kind.value if invalid else None,
            "env_failure_reason": outcome.failure.reason if invalid else None,
            "env_attempts": attempt,
            "deadline_hit": outcome.deadline_hit,
            "reward_source": None if invalid else outcome.reward_source,
            "env_failed_attempt_kinds": failed_kinds,
            "env_episode_wall_s": round(time.monotonic() - started, 4),
            "env_refused_navigations": outcome.refused_navigations,
            "env_browser_actions": outcome.browser_actions,
        }
        for number, output in enumerate(outputs, start=1):
            if invalid and not self.settings.train_on_failures:
                # out of the loss, every step of the episode; the estimator drops the reward
                output.response_mask = [0] * len(output.response_mask)
            _ensure_response_token(output, self.tokenizer)
            output.reward_score = 0.0 if invalid else outcome.reward
            output.extra_fields.update(flags)
            if stepwise:  # the episode's flags on every step; metrics count the final step only
                output.extra_fields.update({"env_step": number, "env_steps": len(outputs)})
            output.extra_fields["reward_extra_info"] = reward_extra_info(flags)
            if "global_steps" in kwargs:  # the V1 trainer needs them even when the model was never called
                for key in ("min_global_steps", "max_global_steps"):
                    if output.extra_fields.get(key) is None:
                        output.extra_fields[key] = kwargs["global_steps"]
            final = number == len(outputs)
            output.metrics = AgentLoopMetrics(  # the episode's timings, once, on its final sample
                generate_sequences=timings["generate_sequences"] if final else 0.0,
                tool_calls=timings["tool_calls"] if final else 0.0,
                num_preempted=output.metrics.num_preempted if outcome.outputs else -1,
            )
        if self.settings.trajectory_dir:  # written after the flags, so the record shows what the trainer gets
            trajectories.write_episode(
                self.settings.trajectory_dir,
                episode_id=rollout_id,
                spec=spec,
                run_kwargs=kwargs,
                episode=outcome.episode,
                output=outputs[-1],  # the final sample (step-wise: the last step), with the episode's flags
                tokenizer=self.tokenizer,
            )
        return outputs if stepwise else outputs[0]

    async def _run_attempt(
        self,
        sampling_params: dict[str, Any],
        kwargs: dict[str, Any],
        spec: EpisodeSpec,
        rollout_id: str,
        attempt: int,
    ) -> _AttemptOutcome:
        client = shared_environment_client(self.settings.environment)
        label = f"rollout {rollout_id} attempt {attempt}"
        start_url = spec.initial_url if url_scheme(spec.initial_url or "") else None
        episode: BrowserEpisode | None = None
        outputs: list[AgentLoopOutput] = []
        outcome = _AttemptOutcome(outputs=[], failure=None)
        try:
            async with client.session(
                rollout_id=rollout_id,
                attempt=attempt,
                task_id=spec.task_id,
                initial_url=spec.initial_url,
                verifier_metadata=spec.verifier_metadata,
                taskset=spec.taskset,
            ) as session:
                episode = BrowserEpisode(
                    session=session,
                    guard=UrlGuard(self.settings.url_policy, start_url),
                    deadline_s=self.settings.episode_deadline_s,
                    hold_limit_s=self.settings.session_hold_limit_s,
                    call_bound_s=self.settings.environment.call_timeout_s + self.settings.call_timeout_grace_s,
                    label=label,
                )
                token = _CURRENT_EPISODE.set(episode)
                try:
                    if self.settings.stepwise.enabled:
                        outputs = await self._run_steps(sampling_params, kwargs, episode)
                    else:
                        outputs = [await ToolAgentLoop.run(self, sampling_params, **kwargs)]
                finally:
                    _CURRENT_EPISODE.reset(token)
                if episode.failure is None and spec.verifier_metadata:
                    try:
                        outcome.reward, outcome.reward_source = (await session.verify()).reward, "verify"
                    except EnvironmentFailure as failure:
                        episode.fail(failure)
        except EnvironmentFailure as failure:  # raised while opening the session: nothing ran
            logger.warning("%s: could not open a session (%s): %s", label, failure.kind.value, failure.reason)
            outcome.failure = failure
            return outcome
        assert episode is not None
        if episode.failure is None and not spec.verifier_metadata:
            await self._score_with_judge(episode, spec, rollout_id, outcome)
        outcome.outputs = outputs
        outcome.failure = episode.failure
        outcome.deadline_hit = episode.deadline_hit
        outcome.refused_navigations = episode.refused_navigations
        outcome.browser_actions = episode.browser_actions
        outcome.episode = episode
        return outcome

    # --- step-wise mode: one sample per policy step, over a bounded prompt ---------------------------------------

    async def _run_steps(
        self, sampling_params: dict[str, Any], kwargs: Mapping[str, Any], episode: BrowserEpisode
    ) -> list[AgentLoopOutput]:
        """The attempt as one sample per policy step (the episode's bounds and tool path are the default mode's).

        Each step's prompt is rendered afresh (:meth:`_step_messages`) with verl's own prompt builder, generated
        by the server manager under :meth:`_bounded_generation`, and its tool calls run through verl's
        ``_call_tool`` on an ``AgentData`` carrying the episode, exactly as in the default mode. The episode ends
        as there: a turn without a tool call, the episode over (finish, deadline, failure), or the turn limit
        (after whose last generation only a ``finish`` is run).
        """
        task_messages = list(kwargs["raw_prompt"])
        tools_kwargs = kwargs.get("tools_kwargs") or {}
        agent_data = AgentData(
            messages=task_messages,
            image_data=None,
            video_data=None,
            audio_data=None,
            mm_processor_kwargs=None,
            metrics={},
            request_id=self._make_request_id(int(kwargs.get("priority", 0) or 0), self.rollout_config.full_determinism),
            tools_kwargs=tools_kwargs,
        )
        setattr(agent_data, EPISODE_ATTRIBUTE, episode)
        if self.tool_parser.stop_token_ids:  # as verl's ToolAgentLoop: stop after each tool call
            stop_token_ids = list(set((sampling_params.get("stop_token_ids") or []) + self.tool_parser.stop_token_ids))
            sampling_params = {**sampling_params, "stop_token_ids": stop_token_ids}
        schemas = [tool.tool_schema for tool in self.tools.values()]
        history: list[_StepRecord] = []
        outputs: list[AgentLoopOutput] = []
        while not self.max_assistant_turns or len(outputs) < self.max_assistant_turns:
            prompt_ids = await self.ct_build_initial_tokens(
                self._step_messages(task_messages, history), tools=self.tool_schemas
            )
            timing: dict[str, float] = {}

            async def generate(prompt_ids: list[int] = prompt_ids, timing: dict[str, float] = timing) -> Any:
                with simple_timer("generate_sequences", timing):
                    return await self.server_manager.generate(
                        request_id=agent_data.request_id, prompt_ids=prompt_ids, sampling_params=sampling_params
                    )

            generated = await self._bounded_generation(episode, generate)
            if generated is None:
                break
            output = await self._step_output(prompt_ids, generated, timing)
            outputs.append(output)
            if self.max_assistant_turns and len(outputs) >= self.max_assistant_turns:
                await self._finish_only(output.response_ids, self.tools, episode)
                break
            _, calls = await self.tool_parser.extract_tool_calls(output.response_ids, schemas)
            if not calls:
                break
            steps_before = len(episode.steps)
            started = time.monotonic()
            responses = await asyncio.gather(
                *(self._call_tool(call, tools_kwargs, agent_data) for call in calls[: self.max_parallel_calls])
            )
            output.metrics = output.metrics.model_copy(update={"tool_calls": time.monotonic() - started})
            results = [response.text or "" for response, _reward, _extra in responses]
            history.append(
                _StepRecord(
                    assistant_text=self.tokenizer.decode(output.response_ids, skip_special_tokens=True).strip(),
                    results=results,
                    summary=_step_summary(episode.steps[steps_before:], calls, results),
                )
            )
            if episode.over:
                break
        return outputs

    def _step_messages(self, task_messages: list[dict[str, Any]], history: list[_StepRecord]) -> list[dict[str, Any]]:
        """One step's prompt: the task, one line per earlier step (at most ``history_steps``), then the latest
        ``history_observations`` steps whole (the model's turn and the tool results it read)."""
        if not history:
            return list(task_messages)
        settings = self.settings.stepwise
        recent = history[-settings.history_observations :]
        earlier = history[: len(history) - len(recent)]
        shown = earlier[len(earlier) - settings.history_steps :] if settings.history_steps else []
        lines = [STEP_HISTORY_HEADER.format(steps=len(history))]
        if len(earlier) > len(shown):
            lines.append(f"(steps 1-{len(earlier) - len(shown)} are not shown)")
        first = len(earlier) - len(shown) + 1
        lines.extend(f"Step {first + offset}: {record.summary}" for offset, record in enumerate(shown))
        lines.append(f"The latest {len(recent)} step(s) follow in full.")
        messages = [*task_messages, {"role": "user", "content": "\n".join(lines)}]
        for record in recent:
            messages.append({"role": "assistant", "content": record.assistant_text})
            messages.extend({"role": "tool", "content": result} for result in record.results)
        return messages

    async def _step_output(self, prompt_ids: list[int], generated: Any, timing: Mapping[str, float]) -> AgentLoopOutput:
        """One step's sample: its prompt and the generation, aligned by verl's token builder as in the default mode."""
        merged, mask, logprobs = await self.ct_merge_assistant_token(
            prompt_ids,
            generated.token_ids,
            [],
            [] if generated.log_probs else None,
            assistant_logprobs=generated.log_probs or None,
        )
        tokens = merged.token_ids
        response_ids = tokens[len(tokens) - len(mask) :] if mask else []
        return AgentLoopOutput(
            prompt_ids=tokens[: len(tokens) - len(mask)],
            response_ids=response_ids[: self.response_length],
            response_mask=mask[: self.response_length],
            response_logprobs=logprobs[: self.response_length] if logprobs else None,
            num_turns=2,
            metrics=AgentLoopMetrics(
                generate_sequences=timing.get("generate_sequences", 0.0),
                num_preempted=generated.num_preempted if generated.num_preempted is not None else -1,
            ),
            extra_fields=dict(generated.extra_fields or {}),
        )

    async def _score_with_judge(
        self, episode: BrowserEpisode, spec: EpisodeSpec, rollout_id: str, outcome: _AttemptOutcome
    ) -> None:
        """Judge after the session is closed (the judge reads the recorded page, not the browser)."""
        assert self._judge is not None
        page_url, page_title, page_text = parse_observation(episode.last_observation)
        verdict = await self._judge.judge(
            JudgeEvidence(
                task=spec.question or spec.task_id,
                final_answer=episode.final_answer,
                page_url=page_url,
                page_title=page_title,
                page_text=page_text,
                last_steps=tuple(episode.steps),
                reference_answer=spec.reference_answer,
                rollout_id=rollout_id,
            )
        )
        if not verdict.usable:
            episode.fail(
                EnvironmentFailure(FailureKind.JUDGE_UNUSABLE, f"the judge gave no usable verdict: {verdict.reason}")
            )
            return
        outcome.reward, outcome.reward_source = (1.0 if verdict.success else 0.0), "judge"

    async def _placeholder_output(self, kwargs: Mapping[str, Any]) -> AgentLoopOutput:
        """An output for a rollout whose every attempt failed before the model was called."""
        schemas = self.tool_schemas
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]), tools=schemas)
        return AgentLoopOutput(
            prompt_ids=prompt_ids,
            response_ids=[],
            response_mask=[],
            num_turns=1,
            metrics=AgentLoopMetrics(),
            extra_fields={"turn_scores": [], "tool_rewards": []},
        )

    # --- verl's state machine, bounded by the episode ----------------------------------------------------------

    async def _handle_pending_state(self, agent_data: AgentData, sampling_params: dict[str, Any]) -> AgentState:
        setattr(agent_data, EPISODE_ATTRIBUTE, _CURRENT_EPISODE.get())
        return await super()._handle_pending_state(agent_data, sampling_params)

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        episode = episode_of(agent_data)
        if episode is None:
            return await super()._handle_generating_state(agent_data, sampling_params, ignore_termination)
        state = await self._bounded_generation(
            episode,
            lambda: super(BrowserToolAgentLoop, self)._handle_generating_state(
                agent_data, sampling_params, ignore_termination
            ),
        )
        if state is None:
            return AgentState.TERMINATED
        if state is AgentState.TERMINATED and self._stopped_at_turn_limit(agent_data):
            tools = getattr(agent_data, "_active_tools", self.tools)
            await self._finish_only(agent_data.response_ids, tools, episode)
        return state

    async def _bounded_generation(self, episode: BrowserEpisode, generation: Callable[[], Awaitable[_T]]) -> _T | None:
        """``generation()`` within the episode's bounds; None when the episode ends instead (both modes use it).

        The deadline never cuts a generation (its time is the model's, or the trainer's while it holds it); it is
        checked before. Only the hold limit cuts one, and then the request is cancelled on the rollout server.
        """
        if episode.over:
            return None
        if episode.remaining() <= 0:
            episode.hit_deadline("generation")
            return None
        hold_left = episode.hold_remaining()
        if hold_left <= 0:
            episode.fail(episode.held_too_long("generation"))
            return None
        with episode.model_time():
            try:
                return await generate_within(generation(), hold_left, episode.label)
            except asyncio.TimeoutError:
                episode.fail(episode.held_too_long("generation"))
                return None

    def _stopped_at_turn_limit(self, agent_data: AgentData) -> bool:
        """verl ended the episode at its turn limit, before parsing the last turn's tool calls, with the whole
        turn inside the response (a turn cut at ``response_length`` is not in the sample, so it cannot count)."""
        if len(agent_data.response_mask) >= self.response_length:
            return False
        assistant_limit = bool(self.max_assistant_turns) and agent_data.assistant_turns >= self.max_assistant_turns
        user_limit = bool(self.max_user_turns) and agent_data.user_turns >= self.max_user_turns
        return assistant_limit or user_limit

    async def _finish_only(self, response_ids: list[int], tools: Mapping[str, Any], episode: BrowserEpisode) -> None:
        """Run a ``finish`` among the last turn's tool calls, so its answer reaches verify or the judge.

        Only a finish: another action's page would never be read. The calls verl would have run are the first
        ``max_parallel_calls``; no tool turn is added, so the response still ends on the model's own tokens.
        """
        schemas = [tool.tool_schema for tool in tools.values()]
        _, calls = await self.tool_parser.extract_tool_calls(response_ids, schemas)
        for call in calls[: self.max_parallel_calls]:
            if not isinstance(tools.get(call.name), BrowserTool):
                continue
            parsed = parse_tool_call(call.name, call.arguments)
            if isinstance(parsed, tuple) and parsed[0] == "browser_finish":
                logger.info("%s: finish in the last allowed turn, run after verl's turn limit", episode.label)
                await episode.act(call.name, call.arguments)

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        # verl rebinds (never mutates) these lists when it merges the tool turn, so references are a snapshot.
        before = (agent_data.prompt_ids, agent_data.response_mask, agent_data.response_logprobs)
        state = await super()._handle_processing_tools_state(agent_data)
        episode = episode_of(agent_data)
        if episode is not None and episode.over:
            # No generation follows: drop the last tool turn so the response ends on the model's own last token
            # (where verl puts the reward) instead of on a tool message and a dangling generation prompt.
            agent_data.prompt_ids, agent_data.response_mask, agent_data.response_logprobs = before
            return AgentState.TERMINATED
        return state


def _ensure_response_token(output: AgentLoopOutput, tokenizer: Any) -> None:
    """Give an output with no response one masked padding token.

    verl places the reward on the last response token (``rm_scores[-1]`` in the V1 path), so an empty response
    cannot carry one. Only a rollout cut before its first generation completed has no token; the token is masked,
    so it adds nothing to the loss, and the sample keeps its (valid or invalid) status.
    """
    if len(output.response_mask) == 0:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # verl's finalisation takes prompt_ids[-0:] (the whole prompt) as the response when the mask is empty.
        output.response_ids = [int(pad)]
        output.response_mask = [0]
        if output.response_logprobs is not None:
            output.response_logprobs = [0.0]


def _step_summary(recorded: list[str], calls: list[FunctionCall], results: list[str]) -> str:
    """One line for a step: what the episode recorded of its actions (else the calls themselves) and where it
    left the page."""
    if recorded:
        line = "; ".join(recorded)
    else:
        line = "; ".join(
            f"{call.name}({call.arguments[:80]}) -> {result.splitlines()[0][:120] if result else ''}"
            for call, result in zip(calls, results, strict=False)
        )
    url, title, _ = parse_observation(results[-1] if results else None)
    if url or title:
        line += f" [page: {title or ''} {url or ''}]".replace("  ", " ")
    return line


_warned: set[str] = set()


def _warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log a configuration problem once per process (a loop object is built for every sample)."""
    if key not in _warned:
        _warned.add(key)
        logger.log(level, message, *args)


def _warn_legacy_drop() -> None:
    _warn_once(
        "legacy-drop",
        "The drop switch (%s=1 or drop_invalid: true) has no effect under the legacy trainer "
        "(trainer.use_v1=false): it needs exactly one sample per prompt, so invalid rollouts are kept, flagged "
        "env_invalid, loss-masked and excluded from the GRPO baseline by grpo_env_aware. Use the V1 trainer to "
        "drop them.",
        DROP_INVALID_ENV,
        level=logging.ERROR,
    )
