"""A binary LLM judge over any OpenAI-compatible chat-completions endpoint (a vLLM server, a hosted API).

Contract: :meth:`BinaryJudge.judge` renders :class:`JudgeEvidence` through
:mod:`~nemo_gym_browser.agent_attempt.judge_prompt` and returns a :class:`Verdict` that is usable (``success`` True or
False) or not (``success is None``, with a reason); it never raises for judge-side problems. Only the last non-empty
line of ``message.content`` decides (:func:`parse_verdict_text`), and only when it is exactly one of the two tokens and
the other appears nowhere. An answer without a verdict is blamed on the policy only when the judge gives one on the task
with the policy's text withheld (:func:`without_policy_text`; ``Verdict.policy_caused``).

Lifetimes: the aiohttp session is opened lazily in the running event loop and released by ``await judge.close()``
(or ``async with``); every request runs under ``timeout_s`` and a semaphore of ``max_concurrency``; usable verdicts
are cached in a bounded LRU, and identical requests in flight share one call.

Errors: a missing API key variable raises :class:`~nemo_gym_browser.settings.JudgeConfigError` at construction; the
key is read once and never appears in a log line, an error, a reason or a repr. Retries, blame and the cache:
``docs/judge.md``.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import logging
import os
import random
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError

from .agent_attempt.judge_prompt import (  # re-exported (see __all__): callers import the judge's vocabulary from here
    DATA_BEGIN,
    DATA_END,
    FAILURE_TOKEN,
    SUCCESS_TOKEN,
    SYSTEM_PROMPT,
    JudgeEvidence,
    defang,
    render_messages,
    without_policy_text,
)
from .gym_contract.credentials import redact, secret_values
from .gym_contract.text import shorten
from .settings import JudgeConfig, JudgeConfigError

logger = logging.getLogger(__name__)

_THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL)

# A verdict reason is log and metric material, not a transcript.
_REASON_CAP = 300
# Status codes a repeat cannot fix (bad request, auth, unknown model, prompt too long).
_NOT_RETRYABLE = frozenset({400, 401, 403, 404, 413, 422})
# The error code a hosted endpoint gives a prompt its content filter refused (Azure OpenAI: HTTP 400).
_PROMPT_FILTERED_CODE = "content_filter"
# Usable verdicts kept per worker (LRU by count; 0 turns the cache off): an entry is a few hundred bytes.
VERDICT_CACHE_SIZE = 4096


@dataclass(frozen=True)
class Verdict:
    """The judge's answer. ``usable`` is true exactly when ``success`` is not ``None``.

    ``attempts`` counts the HTTP requests this call made (0 when it was served by the cache or joined an
    identical in-flight call, then ``cached`` is true); summed over calls it equals the requests sent.
    """

    success: bool | None
    usable: bool
    reason: str
    attempts: int = 0
    cached: bool = False
    policy_caused: bool = False  # a failure because the policy's text left the judge without a verdict

    def __post_init__(self) -> None:
        if self.usable != (self.success is not None):
            raise ValueError("a usable verdict has success True/False; an unusable one has success None")
        if self.policy_caused and self.success is not False:
            raise ValueError("only a failure can be caused by the policy's text")


# --- wire models (OpenAI chat-completions, as served by vLLM and hosted APIs) ---------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    messages: list[ChatMessage]
    temperature: float
    max_tokens: int
    stream: bool = False


class ResponseMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str | None = None
    content: str | list[Any] | None = None
    refusal: str | None = None
    # Read only to say in a reason that a reasoning field existed; never parsed for a verdict.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ResponseChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    message: ResponseMessage | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    model_config = ConfigDict(extra="ignore")
    choices: list[ResponseChoice]


# --- parsing ----------------------------------------------------------------------------------------------------


def _excerpt(text: str, limit: int = 80) -> str:
    return shorten(text, limit, one_line=True)


def parse_verdict_text(content: str | None) -> tuple[bool | None, str]:
    """Read a verdict from the judge's ``content`` alone. Returns ``(success or None, reason)``.

    Rule: drop complete ``<think>...</think>`` blocks; the last non-empty line, stripped of surrounding
    whitespace, must equal :data:`SUCCESS_TOKEN` or :data:`FAILURE_TOKEN` exactly, and the other token must not
    appear anywhere in the content. The justification (the lines before) becomes the reason.
    """
    if content is None or not content.strip():
        return None, "empty content"
    if "<think>" in content and "</think>" not in content:
        return None, "content is an unterminated <think> block"
    visible = _THINK_BLOCK.sub("", content)
    lines = [line.strip() for line in visible.splitlines() if line.strip()]
    if not lines:
        return None, "content holds only a <think> block"
    final = lines[-1]
    if final not in (SUCCESS_TOKEN, FAILURE_TOKEN):
        return None, f"final line is not a verdict token: {_excerpt(final)!r}"
    other = FAILURE_TOKEN if final == SUCCESS_TOKEN else SUCCESS_TOKEN
    if other in visible:
        return None, "both verdict tokens in the answer"
    justification = _excerpt(" ".join(lines[:-1]), _REASON_CAP) or "(no justification)"
    return final == SUCCESS_TOKEN, justification


def _content_text(content: str | list[Any] | None) -> str | None:
    """``content`` as text: a string, or the text parts of a list of content parts."""
    if content is None or isinstance(content, str):
        return content
    texts = [part.get("text") if isinstance(part, dict) and part.get("type") == "text" else part for part in content]
    return "".join(text for text in texts if isinstance(text, str))


# --- client -----------------------------------------------------------------------------------------------------


class _Secret:
    """Holds the API key; prints as a placeholder wherever it ends up. :meth:`scrub` takes the key and every other
    credential of this process (``credentials.secret_values``) out of text an endpoint sent."""

    __slots__ = ("_others", "_value")

    def __init__(self, value: str, others: frozenset[str] = frozenset()) -> None:
        self._value = value
        self._others = others

    def reveal(self) -> str:
        return self._value

    def scrub(self, text: str) -> str:
        return redact(text, {self._value, *self._others})

    def __repr__(self) -> str:
        return "<secret>"

    __str__ = __repr__

    def __reduce__(self) -> Any:
        raise TypeError("the judge API key is not picklable")


@dataclass(frozen=True)
class _Attempt:
    success: bool | None
    reason: str
    retryable: bool = True
    retry_after_s: float | None = None
    answered: bool = False  # the judge read the prompt and answered (or refused) it without a verdict


def _retry_after_seconds(value: str | None) -> float | None:
    """``Retry-After`` as seconds: a number (fractions accepted) or an HTTP date."""
    if not value:
        return None
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(when.timestamp() - time.time(), 0.0)


class BinaryJudge:
    """Asks an OpenAI-compatible chat endpoint whether an episode succeeded; see the module docstring.

    One instance per worker process is intended (:meth:`shared`): the cache, the concurrency cap and the
    connection pool are per instance.
    """

    _shared: ClassVar[dict[JudgeConfig, BinaryJudge]] = {}

    def __init__(self, config: JudgeConfig) -> None:
        self.config = config
        key = ""
        if config.api_key_env:
            key = os.environ.get(config.api_key_env, "")
            if not key:
                raise JudgeConfigError(
                    f"the judge API key variable {config.api_key_env!r} is unset or empty in this process "
                    "(export it before `ray start` on every node, or set api_key_env to null for a keyless server)"
                )
        self._key = _Secret(key, secret_values(os.environ, [config.api_key_env]))
        self._url = config.base_url.rstrip("/") + "/chat/completions"
        self._cache: OrderedDict[str, Verdict] = OrderedDict()
        self._inflight: dict[str, asyncio.Task[Verdict]] = {}
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def shared(cls, config: JudgeConfig) -> BinaryJudge:
        """The process-wide judge for ``config`` (agent loops are built per sample; the cache must not be)."""
        judge = cls._shared.get(config)
        if judge is None:
            judge = cls._shared[config] = cls(config)
        return judge

    def __repr__(self) -> str:
        return f"BinaryJudge(base_url={self.config.base_url!r}, model={self.config.model!r})"

    async def __aenter__(self) -> BinaryJudge:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Cancel in-flight requests and release the connection pool. Never raises; idempotent."""
        tasks = list(self._inflight.values()) if self._loop is asyncio.get_running_loop() else []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self._inflight = {}
        session, self._session = self._session, None
        same_loop = self._loop is asyncio.get_running_loop()
        self._semaphore = None
        self._loop = None
        if session is not None and not session.closed and same_loop:
            try:
                await session.close()
            except Exception as exc:  # closing must not raise into a caller's finally
                logger.warning("judge: closing the HTTP session failed: %s", type(exc).__name__)

    async def judge(self, evidence: JudgeEvidence) -> Verdict:
        """A usable verdict, or an unusable one with the reason. Never raises for judge-side problems."""
        control = without_policy_text(evidence)
        return await self._verdict(evidence, control=None if control == evidence else control)

    async def _verdict(self, evidence: JudgeEvidence, control: JudgeEvidence | None) -> Verdict:
        """The verdict on ``evidence``; when the judge answered it without one, ``control`` decides who caused it."""
        messages = render_messages(evidence, self.config)
        body = ChatCompletionRequest(
            model=self.config.model,
            messages=[ChatMessage(**message) for message in messages],
            temperature=self.config.temperature,
            max_tokens=self.config.max_tokens,
        ).model_dump_json()
        key = hashlib.sha256(body.encode()).hexdigest()
        label = evidence.rollout_id or "-"

        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            logger.debug("judge[%s]: cache hit %s", label, key[:12])
            return replace(cached, attempts=0, cached=True)

        self._bind_loop()
        task = self._inflight.get(key)
        if task is not None:
            logger.debug("judge[%s]: joining the in-flight request %s", label, key[:12])
            verdict = await asyncio.shield(task)
            return replace(verdict, attempts=0, cached=True)

        task = asyncio.get_running_loop().create_task(self._judge_uncached(body, key, label, control))
        self._inflight[key] = task
        task.add_done_callback(lambda done: self._forget(key, done))
        # Shielded: a cancelled caller must not cancel the request other callers may have joined.
        return await asyncio.shield(task)

    # --- internals ---

    def _forget(self, key: str, task: asyncio.Task[Verdict]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]

    def _bind_loop(self) -> None:
        """Tie the session, semaphore and in-flight table to the running loop (a new loop gets new ones)."""
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        if self._loop is not None:
            logger.debug("judge: used from a new event loop; opening a new HTTP session")
        self._loop = loop
        self._session = None
        self._inflight = {}
        self._semaphore = asyncio.Semaphore(self.config.max_concurrency)

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Content-Type": "application/json"}
            if self._key.reveal():
                headers["Authorization"] = f"Bearer {self._key.reveal()}"
            self._session = aiohttp.ClientSession(
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=self.config.timeout_s,
                    connect=min(self.config.connect_timeout_s, self.config.timeout_s),
                ),
                connector=aiohttp.TCPConnector(limit=self.config.max_concurrency),
            )
        return self._session

    async def _judge_uncached(self, body: str, key: str, label: str, control: JudgeEvidence | None) -> Verdict:
        verdict, answered = await self._ask(body, label)
        if not verdict.usable and answered and control is not None:
            verdict = await self._blame(verdict, control, label)
        if control is not None and not verdict.usable:  # a probe (no control) is reported with the verdict it decides
            logger.warning("judge[%s]: %s", label, verdict.reason)
        if verdict.usable and VERDICT_CACHE_SIZE:
            self._cache[key] = verdict
            while len(self._cache) > VERDICT_CACHE_SIZE:
                self._cache.popitem(last=False)
        return verdict

    async def _blame(self, verdict: Verdict, control: JudgeEvidence, label: str) -> Verdict:
        """The judge answered without a verdict: ask it about the task with the policy's text withheld.

        A verdict there means the judge works and the policy's text left it without one: a failure the policy
        caused. None there either: the judge (or the dataset's task) is at fault, and the verdict stays unusable.
        """
        probe = await self._verdict(control, control=None)
        attempts = verdict.attempts + probe.attempts
        if not probe.usable:
            reason = f"{verdict.reason}; without the policy's text too: {probe.reason}"
            return replace(verdict, reason=reason[:_REASON_CAP], attempts=attempts)
        reason = (
            f"a failure: the policy's text left the judge without a verdict, it gives one without ({verdict.reason})"
        )
        logger.info("judge[%s]: %s", label, reason)
        return Verdict(False, usable=True, reason=reason[:_REASON_CAP], attempts=attempts, policy_caused=True)

    async def _ask(self, body: str, label: str) -> tuple[Verdict, bool]:
        """Up to ``max_attempts`` requests; the verdict, and whether the last one was answered on its content."""
        attempts = 0
        outcome = _Attempt(None, "no attempt made")
        for attempts in range(1, self.config.max_attempts + 1):
            outcome = await self._attempt(body, label, attempts)
            if outcome.success is not None:
                logger.debug("judge[%s]: success=%s after %d attempt(s)", label, outcome.success, attempts)
                return Verdict(outcome.success, usable=True, reason=outcome.reason, attempts=attempts), True
            logger.info(
                "judge[%s]: unusable answer (attempt %d/%d): %s",
                label,
                attempts,
                self.config.max_attempts,
                outcome.reason,
            )
            if not outcome.retryable or attempts == self.config.max_attempts:
                break
            await asyncio.sleep(self._delay(attempts, outcome.retry_after_s))
        reason = self._key.scrub(f"no usable verdict after {attempts} attempt(s): {outcome.reason}")[:_REASON_CAP]
        return Verdict(None, usable=False, reason=reason, attempts=attempts), outcome.answered

    def _delay(self, attempt: int, retry_after_s: float | None) -> float:
        if retry_after_s is not None:
            return min(retry_after_s, self.config.backoff_max_s)
        # Exponential backoff with jitter in [0.5, 1] of the step, so retries of a group spread out.
        step = min(self.config.backoff_s * 2 ** (attempt - 1), self.config.backoff_max_s)
        return step * random.uniform(0.5, 1.0)

    async def _attempt(self, body: str, label: str, attempt: int) -> _Attempt:
        """One request; every transport, HTTP and parse problem becomes an unusable :class:`_Attempt`."""
        assert self._semaphore is not None
        async with self._semaphore:
            logger.debug("judge[%s]: request attempt %d to %s", label, attempt, self._url)
            try:
                async with self._http().post(self._url, data=body) as response:
                    status = response.status
                    retry_after = response.headers.get("Retry-After")
                    raw = await response.read()
            except TimeoutError:
                return _Attempt(None, f"timed out after {self.config.timeout_s:g}s")
            except (aiohttp.ClientError, OSError) as exc:
                return _Attempt(None, f"transport error: {type(exc).__name__}: {_excerpt(self._key.scrub(str(exc)))}")
        if not 200 <= status < 300:
            # Scrub before cutting: a cut could leave a fragment of the key that no longer matches it.
            detail = _excerpt(self._key.scrub(raw.decode("utf-8", "replace")), 160)
            return _Attempt(
                None,
                f"HTTP {status}: {detail}",
                retryable=status not in _NOT_RETRYABLE,
                retry_after_s=_retry_after_seconds(retry_after) if status == 429 else None,
                answered=_error_code(raw) == _PROMPT_FILTERED_CODE,
            )
        try:
            parsed = ChatCompletionResponse.model_validate_json(raw)
        except ValidationError as exc:
            return _Attempt(None, f"unparseable response body ({exc.error_count()} error(s))")
        return _read_choice(parsed, self._key.scrub)


def _error_code(raw: bytes) -> str | None:
    """``error.code`` of an OpenAI-style error body (a fixed field, never free text), if there is one."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, RecursionError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def _read_choice(parsed: ChatCompletionResponse, scrub: Callable[[str], str]) -> _Attempt:
    """A well-formed reply: a verdict, or an answer without one (``answered``); no message at all is malformed.

    The reply's text is scrubbed of credentials before any of it is cut into a reason: an endpoint may echo a key.
    """
    if not parsed.choices or parsed.choices[0].message is None:
        return _Attempt(None, "response has no message")
    choice = parsed.choices[0]
    message = choice.message
    assert message is not None
    if message.refusal:
        return _Attempt(None, f"refusal: {_excerpt(scrub(message.refusal))}", answered=True)
    if choice.finish_reason == "length":
        return _Attempt(None, "answer truncated (finish_reason=length)", answered=True)
    if choice.finish_reason == "content_filter":
        return _Attempt(None, "answer withheld (finish_reason=content_filter)", answered=True)
    content = _content_text(message.content)
    content = scrub(content) if content is not None else None
    success, reason = parse_verdict_text(content)
    if success is None and reason == "empty content" and (message.reasoning_content or message.reasoning):
        reason = "empty content (a reasoning field is present; it is never read for a verdict)"
    return _Attempt(success, reason, answered=success is None)


__all__ = [
    "DATA_BEGIN",
    "DATA_END",
    "FAILURE_TOKEN",
    "SUCCESS_TOKEN",
    "SYSTEM_PROMPT",
    "BinaryJudge",
    "JudgeEvidence",
    "Verdict",
    "defang",
    "parse_verdict_text",
    "render_messages",
    "without_policy_text",
]
