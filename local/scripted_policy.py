"""A scripted policy behind verl's server-manager interface, for tests and benchmarks without a model.

What it is
    :class:`ScriptedPolicy` has the one method verl's agent loops call on their ``server_manager``:
    ``async generate(request_id, *, prompt_ids, sampling_params, **kw) -> TokenOutput``. It decodes the
    conversation so far, hands a :class:`PolicyView` of it to a *script* (a function returning the assistant's
    next text, e.g. a hermes ``<tool_call>{json}</tool_call>`` block), and returns that text tokenised and
    terminated by the end-of-turn token, exactly as an inference server would.

Guarantees
    * Stateless and deterministic: the next turn is a function of the conversation only (its task text, how many
      assistant turns it already has, the last tool observations). It never keys anything on ``request_id``,
      which verl makes ``det-<priority>`` (not unique) under ``rollout.full_determinism``.
    * Instant by default; ``think_time_s`` (a number or a function of the view) adds an ``asyncio.sleep`` per
      turn to imitate a slow model.
    * ``TokenOutput.extra_fields`` carries ``global_steps``/``min_global_steps``/``max_global_steps`` like verl's
      own server client, and ``log_probs`` (zeros) are returned when the sampling params ask for them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from verl.workers.rollout.replica import TokenOutput

from ..agent_attempt.stepwise import STEP_HISTORY_HEADER
from ..gym_contract.browser_calls import SINGLE_TOOL_NAME
from .chat_tokenizer import IM_END, IM_START, TOOL_RESPONSE_END, TOOL_RESPONSE_START

# One element line of a NeMo Gym observation: "  [12] a: About us".
_ELEMENT_LINE = re.compile(r"^\s*\[(\d+)\]\s*([^:]*):\s*(.*)$")
# A step-wise prompt's history line, which counts the policy steps its bounded prompt no longer shows whole.
_STEP_HISTORY = re.compile(re.escape(STEP_HISTORY_HEADER).replace(re.escape("{steps}"), r"(\d+)"))


class PolicyView:
    """What a script may look at, computed lazily from the prompt's token ids.

    Only the turns a script asks about are decoded (the task's user turn, the last tool turn), so a policy
    driving hundreds of long episodes stays cheap; ``text`` decodes the whole conversation on demand.
    """

    def __init__(self, token_ids: Sequence[int], tokenizer: Any) -> None:
        self.token_ids = list(token_ids)
        self._tokenizer = tokenizer
        self._im_start = tokenizer.convert_tokens_to_ids(IM_START)

    @functools.cached_property
    def _turns(self) -> list[tuple[str, int, int]]:
        """``(role, body start, body end)`` per turn, in order (the body excludes the header and ``<|im_end|>``)."""
        ids, starts = self.token_ids, [i for i, t in enumerate(self.token_ids) if t == self._im_start]
        turns = []
        for index, start in enumerate(starts):
            end = starts[index + 1] if index + 1 < len(starts) else len(ids)
            # The header is "<|im_start|>role\n": the role ends at the first token holding the newline.
            header_end = start + 1
            while header_end < end and "\n" not in self._tokenizer.decode([ids[header_end]]):
                header_end += 1
            role = self._tokenizer.decode(ids[start + 1 : header_end]).strip()
            turns.append((role, min(header_end + 1, end), end))
        return turns

    def _decode(self, start: int, end: int) -> str:
        text = self._tokenizer.decode(self.token_ids[start:end])
        return text.split(IM_END, 1)[0]

    @functools.cached_property
    def text(self) -> str:
        """The whole conversation, special tokens included."""
        return self._tokenizer.decode(self.token_ids)

    @functools.cached_property
    def turn(self) -> int:
        """Assistant turns already in the conversation (0 on the first generation)."""
        return max(sum(role == "assistant" for role, _, _ in self._turns) - 1, 0)

    @functools.cached_property
    def step(self) -> int:
        """Policy steps already taken in the episode (0 on the first generation), in either sample mode: a
        step-wise prompt holds only the latest steps, so there the count is read from its history line (the user
        message after the task's)."""
        users = [(start, end) for role, start, end in self._turns if role == "user"]
        match = _STEP_HISTORY.match(self._decode(*users[1])) if len(users) > 1 else None
        return int(match.group(1)) if match else self.turn

    @functools.cached_property
    def task(self) -> str:
        """The first user message."""
        for role, start, end in self._turns:
            if role == "user":
                return self._decode(start, end)
        return ""

    @functools.cached_property
    def observations(self) -> tuple[str, ...]:
        """The tool responses of the latest tool turn (empty when the last turn was not a tool turn)."""
        if len(self._turns) < 2:
            return ()
        role, start, end = self._turns[-2]  # the last turn is the generation prompt
        turn = self._decode(start, end)
        if role != "user" or not turn.startswith(TOOL_RESPONSE_START):
            return ()
        pattern = re.escape(TOOL_RESPONSE_START) + r"\n(.*?)\n" + re.escape(TOOL_RESPONSE_END)
        return tuple(re.findall(pattern, turn, flags=re.DOTALL))

    @property
    def last_observation(self) -> str | None:
        return self.observations[-1] if self.observations else None


Script = Callable[[PolicyView], str]
Step = Callable[[PolicyView], str]


# ----- building assistant turns ------------------------------------------------------------------------------


def tool_call(name: str, arguments: Mapping[str, Any] | str) -> str:
    """One hermes tool call block. ``arguments`` given as a string is written verbatim (to script bad JSON)."""
    args = arguments if isinstance(arguments, str) else json.dumps(dict(arguments), ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(name)}, "arguments": {args}}}\n</tool_call>'


def browser(action: str, **arguments: Any) -> str:
    """A call of the single ``browser`` tool."""
    return tool_call(SINGLE_TOOL_NAME, {"action": action, **arguments})


def native(action: str, **arguments: Any) -> str:
    """A call of one of NeMo Gym's five native tools (``browser_<action>``)."""
    return tool_call(f"browser_{action}", arguments)


def find_element(observation: str | None, pattern: str) -> int | None:
    """The id of the first element whose ``tag: name`` matches ``pattern`` (case-insensitive regex), if any."""
    if not observation:
        return None
    regex = re.compile(pattern, re.IGNORECASE)
    for line in observation.splitlines():
        match = _ELEMENT_LINE.match(line)
        if match and (regex.search(match.group(3)) or regex.search(f"{match.group(2)}: {match.group(3)}")):
            return int(match.group(1))
    return None


# ----- steps and scripts -------------------------------------------------------------------------------------


def say(text: str) -> Step:
    """A fixed assistant text (a tool call, plain prose that ends the episode, or malformed output)."""
    return lambda view: text


def observe(*, use_native: bool = False) -> Step:
    return say(native("observe") if use_native else browser("observe"))


def navigate(url: str, *, use_native: bool = False) -> Step:
    return say(native("navigate", url=url) if use_native else browser("navigate", url=url))


def finish(answer: str, *, use_native: bool = False) -> Step:
    return say(native("finish", answer=answer) if use_native else browser("finish", answer=answer))


def click_matching(pattern: str, *, use_native: bool = False, missing_id: int = 9999) -> Step:
    """Click the element of the last observation whose name matches; an id not on the page when none does."""

    def step(view: PolicyView) -> str:
        element_id = find_element(view.last_observation, pattern)
        element_id = missing_id if element_id is None else element_id
        return native("click", element_id=element_id) if use_native else browser("click", element_id=element_id)

    return step


def type_into(pattern: str, text: str, *, use_native: bool = False, missing_id: int = 9999) -> Step:
    def step(view: PolicyView) -> str:
        element_id = find_element(view.last_observation, pattern)
        element_id = missing_id if element_id is None else element_id
        args = {"element_id": element_id, "text": text}
        return native("type", **args) if use_native else browser("type", **args)

    return step


def steps(*sequence: Step, then: str = "I am done.") -> Script:
    """A script that plays ``sequence`` one step per policy step (:attr:`PolicyView.step`, so in either sample
    mode), then ends the episode with plain text."""

    def script(view: PolicyView) -> str:
        return sequence[view.step](view) if view.step < len(sequence) else then

    return script


def repeat(step: Step) -> Script:
    """A script that never stops on its own (for deadline and turn-limit tests)."""
    return lambda view: step(view)


def walk_and_finish(link: str, answer: str, *, use_native: bool = False) -> Script:
    """observe, click the link whose name matches ``link``, finish with ``answer``."""
    return steps(
        observe(use_native=use_native),
        click_matching(link, use_native=use_native),
        finish(answer, use_native=use_native),
    )


# ----- the server manager ------------------------------------------------------------------------------------


class ScriptedPolicy:
    """A verl server manager that plays scripts instead of a model.

    Args:
        tokenizer: the tokenizer the agent loop uses (the one from :mod:`nemo_gym_browser.local.chat_tokenizer`).
        script: one script for every conversation, or a mapping from a substring of the task text to a script
            (the first key found in the task wins; the key ``"*"`` is the fallback).
        think_time_s: seconds to wait before answering, or a function of the view giving them (or giving an
            awaitable to wait for instead).
        global_steps: the weight version reported in ``extra_fields`` (as verl's inference servers do).
    """

    def __init__(
        self,
        tokenizer: Any,
        script: Script | Mapping[str, Script],
        *,
        think_time_s: float | Callable[[PolicyView], float | Awaitable[Any]] = 0.0,
        global_steps: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.scripts: Mapping[str, Script] = script if isinstance(script, Mapping) else {"*": script}
        self.think_time_s = think_time_s
        self.global_steps = global_steps
        self.calls = 0
        self.request_ids: list[str] = []
        self._eos = tokenizer.convert_tokens_to_ids(IM_END)

    def _script_for(self, view: PolicyView) -> Script:
        for key, script in self.scripts.items():
            if key != "*" and key in view.task:
                return script
        if "*" in self.scripts:
            return self.scripts["*"]
        raise LookupError(f"no script matches the task {view.task[:80]!r} and there is no '*' fallback")

    async def generate(
        self, request_id: str, *, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any], **kwargs: Any
    ) -> TokenOutput:
        self.calls += 1
        self.request_ids.append(request_id)
        view = PolicyView(prompt_ids, self.tokenizer)
        delay = self.think_time_s(view) if callable(self.think_time_s) else self.think_time_s
        if inspect.isawaitable(delay):
            await delay  # a test holding the policy until something happened
        elif delay > 0:
            await asyncio.sleep(delay)
        text = self._script_for(view)(view)
        token_ids = (self.tokenizer.encode(text, add_special_tokens=False) if text else []) + [self._eos]
        log_probs = [0.0] * len(token_ids) if sampling_params.get("logprobs") else None
        steps_ = self.global_steps
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed",
            num_preempted=0,
            extra_fields={"global_steps": steps_, "min_global_steps": steps_, "max_global_steps": steps_},
        )
