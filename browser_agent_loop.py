"""The policy acting in a NeMo Gym browser through verl 0.9.1's ``ToolAgentLoop``, with bounded, resampled episodes.

:class:`BrowserToolAgentLoop` (registered as ``nemo_gym_browser_agent`` through ``configs/agent_loop.yaml``) owns
each attempt's browser session, its bounds, the attempts of a rollout, its score and the per-sample flags.
``BrowserTool`` is re-exported here because tool configs name ``nemo_gym_browser.browser_agent_loop.BrowserTool``.

Lifetimes: one environment session per attempt, opened from the row's ``tools_kwargs`` by ``async with`` and so
closed whatever ends the attempt, cancellation included; one environment client per event loop and configuration,
shared by the loop objects verl builds per sample, closed by :func:`close_shared_clients`.

Errors: an :class:`~nemo_gym_browser.gym_contract.failures.EnvironmentFailure` ends the attempt at once and the rollout
is re-run in a new session, up to ``max_attempts`` (a judge without a usable verdict only after one episode: it retries
itself); what still fails is flagged ``env_invalid`` (or dropped under the drop switch). Policy outcomes are scores.
The flags go to ``AgentLoopOutput.extra_fields`` at the end of ``run``. Settings:
:func:`~nemo_gym_browser.settings.resolve_settings`. The rest: ``docs/agent-loop.md``, ``docs/failures.md``,
``docs/judge.md``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.utils.profiler import simple_timer

from . import trajectories
from .agent_attempt.browser_tool import AGENT_LOOP_NAME, EPISODE_ATTRIBUTE, BrowserTool, episode_of
from .agent_attempt.episode import BrowserEpisode, EpisodeSpec
from .agent_attempt.resume import AttemptSessions
from .agent_attempt.rollout_cancel import generate_within, track_rollout_requests
from .agent_attempt.sample_fields import OptionalFields, complete_optional_fields
from .agent_attempt.sample_flags import INVALID_KEY, SampleFlags
from .agent_attempt.stepwise import (
    LEGACY_STEPWISE_MESSAGE,
    UNBOUNDED_STEPWISE_MESSAGE,
    StepRecord,
    step_messages,
    step_summary,
)
from .agent_attempt.tool_parser import LenientHermesToolParser
from .gym_contract import session_ids
from .gym_contract.browser_calls import BROWSER_FINISH, parse_tool_call
from .gym_contract.environment import EnvironmentClient, parse_observation
from .gym_contract.failures import EnvironmentFailure, FailureKind
from .gym_contract.url_safety import UrlGuard, url_scheme
from .judge import BinaryJudge, JudgeEvidence
from .settings import DROP_INVALID_ENV, EnvironmentConfig, drop_invalid_enabled, resolve_settings
from .trainer_side import dropped_rollouts
from .trainer_side.wiring import ESTIMATOR_NAME

__all__ = ["AGENT_LOOP_NAME", "BrowserTool", "BrowserToolAgentLoop", "close_shared_clients", "running_under_v1_trainer"]

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

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
# A safety net above environment.call_timeout_s for a call the environment client failed to time out itself.
CALL_TIMEOUT_GRACE_S = 5.0
NO_JUDGE_REASON = (
    "the task has no verifier_metadata and no judge is configured (JUDGE_ENABLE=0 / judge: null), so nothing can "
    "score it; no episode was run"
)

_CURRENT_EPISODE: contextvars.ContextVar[BrowserEpisode | None] = contextvars.ContextVar(
    "nemo_gym_browser_current_episode", default=None
)


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


# ----- the agent loop -----------------------------------------------------------------------------------------


@dataclass
class _AttemptOutcome:
    """What one attempt left: its samples, its failure (None: it counts), its score and its episode."""

    outputs: list[AgentLoopOutput]  # one sample, or one per policy step in step-wise mode; [] if nothing ran
    failure: EnvironmentFailure | None
    reward: float = 0.0
    reward_source: str | None = None
    episode: BrowserEpisode | None = None  # None when no session opened; its steps and counters otherwise


@dataclass
class _Rollout:
    """One rollout across its attempts; ``outcome`` is the latest attempt's."""

    rollout_id: str
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0
    failed_kinds: list[str] = field(default_factory=list)
    failed_after_action_kinds: list[str] = field(default_factory=list)  # the failed attempts the policy had acted in
    resumed_kinds: list[str] = field(default_factory=list)  # the failures resumed from, every attempt's
    resume_diverged: int = 0  # resumes given up on every attempt because the replayed page differed
    timings: dict[str, float] = field(default_factory=lambda: {"generate_sequences": 0.0, "tool_calls": 0.0})
    outcome: _AttemptOutcome = field(default_factory=lambda: _AttemptOutcome(outputs=[], failure=None))

    def flags(self) -> SampleFlags:
        """The rollout's flags as it stands: the final attempt's outcome and counters, every attempt's kinds."""
        failure, episode = self.outcome.failure, self.outcome.episode
        return SampleFlags(
            invalid=failure is not None,
            attempts=self.attempts,
            failure_kind=failure.kind.value if failure else None,
            failure_reason=failure.reason if failure else None,
            deadline_hit=episode.deadline_hit if episode else False,
            reward_source=None if failure else self.outcome.reward_source,
            failed_attempt_kinds=tuple(self.failed_kinds),
            failed_after_action_kinds=tuple(self.failed_after_action_kinds),
            episode_wall_s=round(time.monotonic() - self.started, 4),
            refused_navigations=episode.refused_navigations if episode else 0,
            browser_actions=episode.browser_actions if episode else 0,
            resumed_kinds=tuple(self.resumed_kinds),
            resume_diverged=self.resume_diverged,
        )


class BrowserToolAgentLoop(ToolAgentLoop):
    """verl's ``ToolAgentLoop`` with one browser session per attempt, a deadline, resampling and flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # verl passes the registry entry whole, its name included
        settings_kwargs = {key: kwargs.pop(key) for key in list(kwargs) if key not in _VERL_LOOP_KWARGS}
        trainer_config = kwargs.get("trainer_config", args[0] if args else None)
        settings = resolve_settings(settings_kwargs, getattr(trainer_config, "config", None))
        if settings.token_builder_model_type is not None:
            # verl builds its token builder in AgentLoopBase.__init__ from this model type
            kwargs["hf_model_type"] = settings.token_builder_model_type
        super().__init__(*args, **kwargs)
        self.settings = settings
        if self.settings.max_tool_response_length is not None:
            self.max_tool_response_length = self.settings.max_tool_response_length
        if self.max_tool_response_length < _OBSERVATION_FLOOR_CHARS:
            _warn_once(
                "short-observations",
                "multi_turn.max_tool_response_length=%s characters cuts browser observations (up to ~5000 "
                "characters); set actor_rollout_ref.rollout.multi_turn.max_tool_response_length "
                "(configs/webvoyager_grpo.yaml) or nemo_gym_browser.max_tool_response_length",
                self.max_tool_response_length,
            )
        if self.tool_parser_name == "hermes":
            # a malformed <tool_call> becomes an error message the model reads, not a silent end of the episode
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
        self._optional_fields = OptionalFields(self.rollout_config, self.config.actor_rollout_ref.model.get("path"))
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
        """One rollout: attempts until one counts (:meth:`_run_attempts`); a rollout still invalid is dropped under
        the drop switch (:meth:`_drop`), else its samples get the reward and flags (:meth:`_flag_outputs`)."""
        spec = EpisodeSpec.from_tools_kwargs(kwargs.get("tools_kwargs"))
        under_v1 = running_under_v1_trainer(kwargs)
        if self.settings.stepwise.enabled and not under_v1:
            raise RuntimeError(LEGACY_STEPWISE_MESSAGE)
        rollout = _Rollout(rollout_id=session_ids.rollout_id(kwargs.get("index")))
        await self._run_attempts(sampling_params, kwargs, spec, rollout)
        flags = rollout.flags()
        if flags.invalid and drop_invalid_enabled(self.settings.drop_invalid):
            if under_v1:
                await self._drop(kwargs, spec, rollout, flags)
                return []
            _warn_legacy_drop()
        # Only the final attempt's samples are returned: an abandoned attempt's steps never reach the trainer.
        outputs = rollout.outcome.outputs or [await self._placeholder_output(kwargs)]
        self._flag_outputs(outputs, rollout, flags, kwargs)
        if self.settings.trajectory_dir:  # written after the flags, so the record shows what the trainer gets
            trajectories.write_episode(
                self.settings.trajectory_dir,
                episode_id=rollout.rollout_id,
                spec=spec,
                run_kwargs=kwargs,
                episode=rollout.outcome.episode,
                flags=flags,
                output=outputs[-1],  # the final sample (step-wise: the last step)
                tokenizer=self.tokenizer,
            )
        return outputs if self.settings.stepwise.enabled else outputs[0]

    async def _run_attempts(
        self, sampling_params: dict[str, Any], kwargs: dict[str, Any], spec: EpisodeSpec, rollout: _Rollout
    ) -> None:
        """Attempts until one counts (no infrastructure failure), the judge is unusable, or ``max_attempts``."""
        if spec.verifier_metadata is None and self._judge is None:
            # Nothing could score the episode: spend no browser and no model call on it (0 attempts).
            _warn_once(
                "no-judge",
                "task %s has no verifier_metadata and no judge is configured (JUDGE_ENABLE=0 / judge: null): such "
                "rollouts are flagged judge_unusable without an episode; set a judge or give every task "
                "verifier_metadata",
                spec.task_id,
            )
            rollout.outcome.failure = EnvironmentFailure(FailureKind.JUDGE_UNUSABLE, NO_JUDGE_REASON)
            return
        max_attempts = self.settings.max_attempts
        for attempt in range(1, max_attempts + 1):
            if attempt > 1 and self.settings.resample_backoff_s > 0:
                await asyncio.sleep(min(self.settings.resample_backoff_s * 2 ** (attempt - 2), _BACKOFF_CAP_S))
            rollout.attempts = attempt
            outcome = rollout.outcome = await self._run_attempt(
                sampling_params, kwargs, spec, rollout.rollout_id, attempt
            )
            for step_output in outcome.outputs:
                for key in rollout.timings:
                    rollout.timings[key] += float(getattr(step_output.metrics, key, 0.0) or 0.0)
            if outcome.episode is not None:
                rollout.resumed_kinds.extend(outcome.episode.resumed_kinds)
                rollout.resume_diverged += outcome.episode.resume_diverged
            if outcome.failure is None:
                return
            rollout.failed_kinds.append(outcome.failure.kind.value)
            if outcome.episode is not None and outcome.episode.policy_acted:
                rollout.failed_after_action_kinds.append(outcome.failure.kind.value)
            # The judge was already asked again on the same evidence; a new episode would give it nothing new.
            final = attempt == max_attempts or outcome.failure.kind is FailureKind.JUDGE_UNUSABLE
            logger.warning(
                "rollout %s task %s: attempt %d/%d failed (%s)%s",
                rollout.rollout_id,
                spec.task_id,
                attempt,
                max_attempts,
                outcome.failure.kind.value,
                ", giving up" if final else ", resampling",
            )
            if final:
                return

    async def _drop(self, kwargs: Mapping[str, Any], spec: EpisodeSpec, rollout: _Rollout, flags: SampleFlags) -> None:
        """Record a rollout still invalid after its attempts as dropped: verl stores nothing for it, so the step
        metrics count it from this record."""
        logger.warning(
            "rollout %s task %s: still invalid after %d attempts, dropped",
            rollout.rollout_id,
            spec.task_id,
            rollout.attempts,
        )
        await dropped_rollouts.record(kwargs.get("uid"), flags)

    def _flag_outputs(
        self, outputs: list[AgentLoopOutput], rollout: _Rollout, flags: SampleFlags, kwargs: Mapping[str, Any]
    ) -> None:
        """Write the rollout's reward, flags and timings onto its samples (every step sample in step-wise mode)."""
        outcome = rollout.outcome
        for number, output in enumerate(outputs, start=1):
            if flags.invalid and not self.settings.train_on_failures:
                # out of the loss, every step of the episode; the estimator drops the reward
                output.response_mask = [0] * len(output.response_mask)
            complete_optional_fields(output, self._optional_fields, self.tokenizer)
            output.reward_score = 0.0 if flags.invalid else outcome.reward
            # step-wise: the episode's flags on every step; the metrics count the final step only
            sample_flags = flags.at_step(number, len(outputs)) if self.settings.stepwise.enabled else flags
            output.extra_fields.update(sample_flags.extra_fields())
            if "global_steps" in kwargs:  # the V1 trainer needs them even when the model was never called
                for key in ("min_global_steps", "max_global_steps"):
                    if output.extra_fields.get(key) is None:
                        output.extra_fields[key] = kwargs["global_steps"]
            final = number == len(outputs)
            output.metrics = AgentLoopMetrics(  # the episode's timings, once, on its final sample
                generate_sequences=rollout.timings["generate_sequences"] if final else 0.0,
                tool_calls=rollout.timings["tool_calls"] if final else 0.0,
                num_preempted=output.metrics.num_preempted if outcome.outputs else -1,
            )

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
        outputs: list[AgentLoopOutput] = []
        outcome = _AttemptOutcome(outputs=[], failure=None)
        sessions = AttemptSessions(
            functools.partial(
                client.session,
                rollout_id=rollout_id,
                attempt=attempt,
                task_id=spec.task_id,
                initial_url=spec.initial_url,
                verifier_metadata=spec.verifier_metadata,
                taskset=spec.taskset,
            )
        )
        try:
            try:
                session = await sessions.open()
            except EnvironmentFailure as failure:  # the first seed: nothing ran
                logger.warning("%s: could not open a session (%s): %s", label, failure.kind.value, failure.reason)
                outcome.failure = failure
                return outcome
            episode = BrowserEpisode(
                session=session,
                guard=UrlGuard(self.settings.url_policy, start_url),
                deadline_s=self.settings.episode_deadline_s,
                hold_limit_s=self.settings.session_hold_limit_s,
                call_bound_s=self.settings.environment.call_timeout_s + CALL_TIMEOUT_GRACE_S,
                label=label,
                reopen=sessions.open,
                resume=self.settings.resume,
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
                    outcome.reward, outcome.reward_source = (await episode.verify()).reward, "verify"
                except EnvironmentFailure as failure:
                    episode.fail(failure)
        finally:
            await asyncio.shield(sessions.close())
        if episode.failure is None and not spec.verifier_metadata:
            await self._score_with_judge(episode, spec, rollout_id, outcome)
        outcome.outputs = outputs
        outcome.failure = episode.failure
        outcome.episode = episode
        return outcome

    # --- step-wise mode: one sample per policy step, over a bounded prompt ---------------------------------------

    async def _run_steps(
        self, sampling_params: dict[str, Any], kwargs: Mapping[str, Any], episode: BrowserEpisode
    ) -> list[AgentLoopOutput]:
        """The attempt as one sample per policy step (the episode's bounds and tool path are the default mode's).

        Each step's prompt is rendered afresh (:func:`~nemo_gym_browser.agent_attempt.stepwise.step_messages`) with
        verl's own prompt builder, generated by the server manager under :meth:`_bounded_generation`, and its tool calls
        run through verl's ``_call_tool`` on an ``AgentData`` carrying the episode, exactly as in the default mode. The
        episode ends as there: a turn without a tool call, the episode over (finish, deadline, failure), or the turn
        limit (after whose last generation only a ``finish`` is run).
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
        history: list[StepRecord] = []
        outputs: list[AgentLoopOutput] = []
        while not self.max_assistant_turns or len(outputs) < self.max_assistant_turns:
            prompt_ids = await self.ct_build_initial_tokens(
                step_messages(task_messages, history, self.settings.stepwise), tools=self.tool_schemas
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
                StepRecord(
                    assistant_text=self.tokenizer.decode(output.response_ids, skip_special_tokens=True).strip(),
                    results=results,
                    summary=step_summary(episode.steps[steps_before:], calls, results),
                )
            )
            if episode.over:
                break
        return outputs

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
            routed_experts=(
                generated.routed_experts[: len(tokens) - len(mask) + self.response_length]
                if generated.routed_experts is not None
                else None
            ),
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
                last_steps=tuple(str(step) for step in episode.steps),
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
            except TimeoutError:
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
            if isinstance(parsed, tuple) and parsed[0] == BROWSER_FINISH:
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


# Configuration problems already logged, per event loop as the shared clients: a worker runs all its samples on one
# event loop, so each is logged once per process, not by every sample's loop object.
_LOGGED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, set[str]] = weakref.WeakKeyDictionary()


def _warn_once(key: str, message: str, *args: Any, level: int = logging.WARNING) -> None:
    """Log a configuration problem once per event loop (a loop object built outside one logs it every time)."""
    try:
        logged = _LOGGED.setdefault(asyncio.get_running_loop(), set())
    except RuntimeError:
        logged = set()
    if key not in logged:
        logged.add(key)
        logger.log(level, message, *args)


def _warn_legacy_drop() -> None:
    _warn_once(
        "legacy-drop",
        "The drop switch (%s=1 or drop_invalid: true) has no effect under the legacy trainer "
        "(trainer.use_v1=false): it needs exactly one sample per prompt, so invalid rollouts are kept, flagged "
        "%s, loss-masked and excluded from the GRPO baseline by %s. Use the V1 trainer to drop them.",
        DROP_INVALID_ENV,
        INVALID_KEY,
        ESTIMATOR_NAME,
        level=logging.ERROR,
    )
