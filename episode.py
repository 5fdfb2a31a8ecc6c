"""One attempt at a task: what the row asks for (:class:`EpisodeSpec`) and the attempt's live state and clocks
(:class:`BrowserEpisode`).

Lifetimes
    A :class:`BrowserEpisode` lives exactly as long as its attempt's environment session: the agent loop builds it
    once the session is seeded and drops it when the session is closed; it never outlives the session and never
    closes it. It records what happened (steps, final answer, last page, counters) and the first infrastructure
    failure; an attempt with a failure, a deadline hit or a finished task is :attr:`~BrowserEpisode.over`, and every
    later tool call is answered with a closing message instead of reaching the browser.

Who caused it decides
    An infrastructure failure (an :class:`~nemo_gym_browser.failures.EnvironmentFailure`, an unmapped error of
    the client, a call hung past its bound, the session held past its hold limit) is recorded on the episode the
    moment it happens and ends the attempt. Bad arguments, unknown actions, refused navigations and the deadline are
    policy outcomes: the model reads them and the episode is scored as it stands.

Time: the deadline and the hold limit
    ``episode_deadline_s`` bounds the episode's *environment time*: wall time from the seeded session on, less
    the time spent inside the model's ``generate``. A trainer holding generation (colocate_async pauses it for a
    whole training phase; verl's ``FullyAsyncLLMServerClient`` waits the pause out inside ``generate``) or a
    request queued in the inference server therefore never spends it, and never becomes a policy zero. It is
    checked before each generation and around each browser call (a call in flight runs to its own timeout), so
    browser time is bounded by the deadline plus one call timeout; it never cuts a generation.
    ``session_hold_limit_s`` bounds what the attempt costs the environment server in wall time, generation
    included (a browser held open while the trainer pauses): past it the attempt fails as an infrastructure
    ``timeout`` and is resampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from . import trajectories
from .browser_calls import BROWSER_FINISH, BROWSER_NAVIGATE, NATIVE_TOOL_ACTIONS, SINGLE_TOOL_NAME, parse_tool_call
from .environment import BrowserSession, ToolResult, parse_observation
from .failures import EnvironmentFailure, FailureKind
from .settings import plain_config
from .url_safety import UrlGuard, UrlRefused

logger = logging.getLogger(__name__)

DEADLINE_MESSAGE = "The time limit of this episode has been reached; no further browser actions are possible."
FINISHED_MESSAGE = "The task is already finished; no further browser actions are possible."
ABANDONED_MESSAGE = "The browser environment failed; this attempt is abandoned."


def render_result(result: ToolResult) -> str:
    """The text the model reads for one browser answer."""
    if result.error:
        return f"Error: {result.error}" + (f"\n{result.observation}" if result.observation else "")
    if result.done:
        return result.observation or "Finished: your answer was recorded."
    return result.observation or "(the browser returned no observation)"


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
    def policy_acted(self) -> bool:
        """Whether a tool call of the policy's reached this episode (valid or not): a failure after that may be the
        policy's doing dressed as the environment's, and is counted apart (``env/failed_after_action/*``)."""
        return self.tool_calls > 0 or self.policy_errors > 0 or self.refused_navigations > 0

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
        if tool == BROWSER_NAVIGATE and isinstance(arguments.get("url"), str):
            try:
                await self.guard.check(arguments["url"])
            except UrlRefused as refusal:
                self.refused_navigations += 1
                self.steps.append(f"navigate({arguments['url'][:80]!r}) -> refused")
                return f"Error: navigation refused: {refusal}"
        self.tool_calls += 1
        self.browser_actions += tool != BROWSER_FINISH
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
        except TimeoutError:
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
