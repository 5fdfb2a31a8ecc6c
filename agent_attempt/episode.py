"""One attempt at a task: what the row asks for (:class:`EpisodeSpec`) and the attempt's live state and clocks
(:class:`BrowserEpisode`).

Lifetimes: a :class:`BrowserEpisode` lives as long as its attempt: the agent loop builds it once the first session
is seeded and owns every session the attempt opens (a resume opens the next through ``reopen``); the episode never
closes one. It records the steps, the final answer, the last page, the counters, the resumes and the first
infrastructure failure; once :attr:`~BrowserEpisode.over` every later tool call gets a closing message.

Errors: an infrastructure failure under a browser call or ``/verify`` is first resumed (a new session, the calls so
far replayed and checked, :mod:`.resume`) within the budgets of ``ResumeSettings``; what cannot be resumed (another
page, budget spent, an unmapped error, the hold limit) is recorded and ends the attempt. Bad arguments, unknown
actions, refused navigations and the deadline are policy outcomes the model reads. Clocks: ``episode_deadline_s``
counts environment time (wall time less time in ``generate`` and in replays); ``session_hold_limit_s`` counts wall
time (``docs/agent-loop.md``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeVar

from ..gym_contract.browser_calls import (
    BROWSER_FINISH,
    BROWSER_NAVIGATE,
    NATIVE_TOOL_ACTIONS,
    SINGLE_TOOL_NAME,
    TOOL_OF_ACTION,
    parse_tool_call,
)
from ..gym_contract.environment import BrowserSession, ToolResult, VerifyResult, parse_observation
from ..gym_contract.failures import EnvironmentFailure, FailureKind
from ..gym_contract.url_safety import UrlGuard, UrlRefused
from ..settings import ResumeSettings, plain_config
from .resume import RESUMABLE_KINDS, ReplayedStep, page_fingerprint, replay

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

DEADLINE_MESSAGE = "The time limit of this episode has been reached; no further browser actions are possible."
FINISHED_MESSAGE = "The task is already finished; no further browser actions are possible."
ABANDONED_MESSAGE = "The browser environment failed; this attempt is abandoned."
# How much of a step the judge and the step-wise history read: each argument, and the browser's error.
STEP_ARGUMENT_CHARS = 80
STEP_ERROR_CHARS = 120


class StepOutcome(StrEnum):
    OK = "ok"  # the browser answered
    ERROR = "error"  # the browser answered with an error the model reads (element not found, bad arguments, ...)
    REFUSED = "refused"  # the URL guard refused the navigation: the browser was not called
    INVALID = "invalid"  # the call did not parse: the browser was not called


@dataclass(frozen=True)
class Step:
    """One tool call of the policy's as its episode recorded it.

    ``str(step)`` is the line the judge and the step-wise history read (``click(element_id=3) -> ok``). The steps
    that :attr:`reached_browser`, called again in order as ``session.call(step.tool, step.arguments)``, repeat
    what the browser was asked.
    """

    action: str  # observe, navigate, click, type, finish; an invalid call: the tool name the policy wrote
    arguments: Mapping[str, Any] = field(default_factory=dict)  # as the browser got them (an invalid call: as written)
    outcome: StepOutcome = StepOutcome.OK
    detail: str | None = None  # the browser's error, the refusal, or why the call is invalid
    elapsed_s: float = 0.0  # from the session's opening to the step's end, the model's time included
    page: str | None = None  # the fingerprint of the observation the policy read (a resume's replay checks it)

    @property
    def reached_browser(self) -> bool:
        return self.outcome in (StepOutcome.OK, StepOutcome.ERROR)

    @property
    def tool(self) -> str:
        """The environment's name of the action (``browser_click``), what the session is called with."""
        return TOOL_OF_ACTION.get(self.action, self.action)

    def replayed(self) -> ReplayedStep:
        return ReplayedStep(self.tool, self.arguments, self.outcome is StepOutcome.ERROR, self.page)

    def __str__(self) -> str:
        if self.outcome is StepOutcome.INVALID:
            return f"{self.action}: invalid call ({self.detail})"
        if self.outcome is StepOutcome.REFUSED:
            return f"{self.action}({str(self.arguments.get('url'))[:STEP_ARGUMENT_CHARS]!r}) -> refused"
        shown = ", ".join(f"{k}={v!r}"[:STEP_ARGUMENT_CHARS] for k, v in self.arguments.items())
        if self.outcome is StepOutcome.ERROR:
            return f"{self.action}({shown}) -> error: {(self.detail or '')[:STEP_ERROR_CHARS]}"
        return f"{self.action}({shown}) -> ok"


def render_result(result: ToolResult) -> str:
    """The text the model reads for one browser answer."""
    if result.error:
        return f"Error: {result.error}" + (f"\n{result.observation}" if result.observation else "")
    if result.done:
        return result.observation or "Finished: your answer was recorded."
    return result.observation or "(the browser returned no observation)"


@dataclass(frozen=True)
class Resume:
    """One infrastructure failure the episode tried to resume from, as its trajectory record shows it."""

    after_steps: int  # the steps recorded when it failed: the failed call is the next one
    kind: str  # the FailureKind value
    outcome: str  # "resumed", "diverged" (the replayed page differed), "failed" (the new session failed too)
    replayed_calls: int = 0
    seconds: float = 0.0
    detail: str | None = None  # where a replay differed, or how the new session failed


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
        tools_kwargs = plain_config(tools_kwargs) or {}
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
        reopen: Callable[[], Awaitable[BrowserSession]] | None = None,
        resume: ResumeSettings | None = None,
    ) -> None:
        self.session = session
        self._reopen = reopen
        self.resume_settings = resume if resume is not None else ResumeSettings()
        self.resumes: list[Resume] = []
        self.replay_s = 0.0  # time spent replaying: the environment's repair, never the policy's deadline
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
        self.steps: list[Step] = []
        self.tool_calls = 0
        self.browser_actions = 0  # calls that act on the page (observe, navigate, click, type): not finish
        self.policy_errors = 0
        self.refused_navigations = 0
        self._page_changed = False

    @property
    def policy_acted(self) -> bool:
        """Whether a tool call of the policy's reached this episode (valid or not): a failure after that may be the
        policy's doing dressed as the environment's, and is counted apart (``env/failed_after_action/*``)."""
        return self.tool_calls > 0 or self.policy_errors > 0 or self.refused_navigations > 0

    @property
    def over(self) -> bool:
        """No further action or generation makes sense (infrastructure failed, deadline passed, task finished)."""
        return self.failure is not None or self.deadline_hit or self.finished

    def environment_s(self) -> float:
        """Seconds on the environment clock: held so far, less the time inside the model's generate and replays."""
        now = time.monotonic()
        generating = now - self._generating_since if self._generating_since is not None else 0.0
        return now - self.started - self.model_s - generating - self.replay_s

    @property
    def resumed_kinds(self) -> tuple[str, ...]:
        """The kinds of the failures this episode resumed from, oldest first."""
        return tuple(resume.kind for resume in self.resumes if resume.outcome == "resumed")

    @property
    def resume_diverged(self) -> int:
        return sum(resume.outcome == "diverged" for resume in self.resumes)

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
            written = dict(parameters) if isinstance(parameters, Mapping) else {}
            self._add_step(tool_name, written, StepOutcome.INVALID, parsed)  # the name as the policy wrote it
            return f"Error: {parsed}"
        tool, arguments = parsed
        if self.remaining() <= 0:
            self.hit_deadline("a tool call")
            return DEADLINE_MESSAGE
        if self.hold_remaining() <= 0:
            self.fail(self.held_too_long(tool))
            return ABANDONED_MESSAGE
        if tool == BROWSER_NAVIGATE and isinstance(arguments.get("url"), str):
            try:
                await self.guard.check(arguments["url"])
            except UrlRefused as refusal:
                self.refused_navigations += 1
                self._add_step(NATIVE_TOOL_ACTIONS[tool], arguments, StepOutcome.REFUSED, str(refusal))
                return f"Error: navigation refused: {refusal}"
        self.tool_calls += 1
        self.browser_actions += tool != BROWSER_FINISH
        try:
            result = await self._resuming(lambda: self._bounded_call(tool, arguments))
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

    def _may_resume(self, failure: EnvironmentFailure, resumes: int) -> bool:
        """Whether ``failure`` may be resumed from, the failing call having been resumed ``resumes`` times."""
        budget = self.resume_settings
        return (
            self._reopen is not None
            and failure.kind in RESUMABLE_KINDS
            and resumes < budget.max_per_call
            and len(self.resumes) < budget.max_per_episode
            and self.remaining() > 0  # past the deadline the episode would end as it stands: the failure is its end
            and self.hold_remaining() > 0
        )

    async def _resume(self, failure: EnvironmentFailure) -> str:
        """One try: a new session, the steps that reached the browser replayed and checked. Returns the outcome:
        ``resumed`` (the new session stands where the old one did), ``diverged`` or ``failed`` (the new one failed)."""
        started = time.monotonic()
        steps = [step.replayed() for step in self.steps if step.reached_browser]
        outcome, calls, detail = "failed", 0, None
        try:
            self.session = await self._reopen()  # the loop closes the one replaced
            done = await replay(self.session, steps, self.call_bound_s)
            outcome, calls, detail = ("resumed" if done.matched else "diverged"), done.calls, done.mismatch
        except EnvironmentFailure as again:
            detail = f"{again.kind.value}: {again.reason}"
        finally:
            seconds = time.monotonic() - started
            self.replay_s += seconds
            self.resumes.append(Resume(len(self.steps), failure.kind.value, outcome, calls, seconds, detail))
        log = logger.info if outcome == "resumed" else logger.warning
        log("%s: %s after %s (%d call(s) replayed in %.1fs)%s", self.label, outcome, failure.kind.value, calls,
            seconds, f": {detail}" if detail else "")  # fmt: skip
        return outcome

    async def _repair(self, failure: EnvironmentFailure, resumes: int) -> int:
        """Resume after ``failure`` (a new session that failed too is tried again, within the budgets); the failing
        call's resumes after it. Raises ``failure`` when the episode cannot be resumed."""
        while self._may_resume(failure, resumes):
            resumes += 1
            outcome = await self._resume(failure)
            if outcome == "resumed":
                return resumes
            if outcome == "diverged":
                break
        raise failure

    async def _resuming(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """``call()`` on the current session; after an infrastructure failure, resumed and made again while the
        budgets allow."""
        resumes = 0
        while True:
            try:
                return await call()
            except EnvironmentFailure as failure:
                resumes = await self._repair(failure, resumes)

    async def verify(self) -> VerifyResult:
        """The server's grade of the episode, resumed like a browser call when the session is lost under it."""
        return await self._resuming(lambda: self.session.verify())

    async def _bounded_call(self, tool: str, arguments: dict[str, Any]) -> ToolResult:
        """One browser action, bounded by the per-call timeout only.

        A call still in flight when the episode deadline passes may finish within its own timeout (the caller then
        ends the episode at the deadline, scored as it stands); one that does not is a hung call, an infrastructure
        failure, whatever the deadline. So an episode lasts at most its deadline plus one per-call timeout on the
        environment clock (resumes, like generation, run off it), and a hang near the end of an episode is never
        turned into a policy zero.
        """
        try:
            return await asyncio.wait_for(self.session.call(tool, arguments), self.call_bound_s)
        except TimeoutError:
            raise EnvironmentFailure(
                FailureKind.TIMEOUT, f"{tool} did not answer within {self.call_bound_s:g}s"
            ) from None

    def _add_step(
        self, action: str, arguments: dict[str, Any], outcome: StepOutcome, detail: str | None, page: str | None = None
    ) -> None:
        self.steps.append(Step(action, dict(arguments), outcome, detail, time.monotonic() - self.started, page))

    def _record(self, tool: str, arguments: dict[str, Any], result: ToolResult) -> None:
        action = NATIVE_TOOL_ACTIONS[tool]
        if result.error:
            self.policy_errors += 1
            self._add_step(action, arguments, StepOutcome.ERROR, result.error)
        else:
            self._add_step(action, arguments, StepOutcome.OK, None, page_fingerprint(result.observation))
        if action in ("navigate", "click", "type"):
            self._page_changed = True  # before the page is read: what the policy's own action led to is not the start
        if result.observation:
            # The task's start page is honoured by the URL guard; for a relative start URL it is learnt from the
            # first observation of the page as seeded, before any action of the policy's changed it (a navigation's
            # redirect target, which may be a private address, is never adopted as the start page).
            if not self._page_changed and not self.guard.knows_start_page:
                start_url, _, _ = parse_observation(result.observation)
                if start_url:
                    self.guard.note_start_page(start_url)
            self.last_observation = result.observation
        if action == "finish" and not result.error and self.final_answer is None:
            self.final_answer = arguments.get("answer")
        if result.done:
            self.finished = True
