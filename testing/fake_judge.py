"""An in-process fake of an OpenAI-compatible chat-completions server, scripted to misbehave like real judges.

Contract it keeps (what vLLM's and hosted APIs' servers do): ``POST /v1/chat/completions`` and ``GET /v1/models``;
with ``api_key`` set a missing or wrong bearer key answers 401, an unknown model 404, a body that is not a chat
request 400 (checked before the script, consuming no behaviour); answers in the ``"vllm"`` or ``"hosted"`` body
shape, errors in the matching error shape.

Scripting: each chat request takes the next :class:`Behaviour` queued with :meth:`FakeJudgeServer.script`, or the
default; the factories below build the usual ones (:func:`verdict`, :func:`hedge`, :func:`http_error`,
:func:`rate_limited`, :func:`hang`, :func:`refusal`, :func:`on_policy_text`, ...). Every request, accepted or not,
is appended to ``requests``.

Lifetime: ``async with FakeJudgeServer() as server`` binds 127.0.0.1 on a free port and stops on exit; a hanging
behaviour is released when the server closes.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from aiohttp import web

from ..judge import DATA_BEGIN, DATA_END, FAILURE_TOKEN, SUCCESS_TOKEN

logger = logging.getLogger(__name__)

Shape = Literal["vllm", "hosted"]
# How long a hanging behaviour waits at most when nobody closes the server (a test that forgot to).
_HANG_LIMIT_S = 60.0


@dataclass(frozen=True)
class RecordedRequest:
    """One request as the server received it."""

    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None
    received_at: float

    @property
    def messages(self) -> list[dict[str, Any]]:
        return list((self.body or {}).get("messages") or [])

    @property
    def user_text(self) -> str:
        return "\n".join(str(m.get("content", "")) for m in self.messages if m.get("role") == "user")

    def data_block(self, name: str) -> str | None:
        """The text of the fenced evidence block ``name`` in the user message, or ``None``."""
        begin, end = re.escape(f"{DATA_BEGIN} {name} "), re.escape(f"{DATA_END} {name} ")
        pattern = re.compile(rf"^{begin}(\w+)>>>\n(.*?)\n{end}\1>>>$", re.DOTALL | re.MULTILINE)
        match = pattern.search(self.user_text)
        return match.group(2) if match else None


@dataclass(frozen=True)
class Behaviour:
    """One scripted answer. ``respond`` (if set) builds the behaviour from the request instead."""

    action: Literal["answer", "hang", "disconnect"] = "answer"
    content: str | None = None
    reasoning: str | None = None
    reasoning_field: Literal["reasoning_content", "reasoning"] = "reasoning_content"
    shape: Shape = "vllm"
    finish_reason: str = "stop"
    refusal: str | None = None
    status: int = 200
    error_message: str = "scripted error"
    retry_after: str | None = None
    raw_body: str | None = None
    delay_s: float = 0.0
    respond: Callable[[RecordedRequest], Behaviour] | None = field(default=None, compare=False)


def verdict(success: bool, justification: str = "", *, shape: Shape = "vllm", delay_s: float = 0.0) -> Behaviour:
    """A well-formed answer: a justification, then the verdict token on the final line."""
    token = SUCCESS_TOKEN if success else FAILURE_TOKEN
    text = justification or ("The answer satisfies the task." if success else "The answer does not satisfy the task.")
    return Behaviour(content=f"{text}\n{token}", shape=shape, delay_s=delay_s)


def with_reasoning(
    success: bool,
    reasoning: str,
    *,
    field: Literal["reasoning_content", "reasoning"] = "reasoning_content",
    shape: Shape = "vllm",
) -> Behaviour:
    """A well-formed verdict in ``content`` with a separate reasoning field beside it."""
    return replace(verdict(success, shape=shape), reasoning=reasoning, reasoning_field=field)


def hedge(shape: Shape = "vllm") -> Behaviour:
    return Behaviour(
        content="The answer is partly right; it is hard to say whether the task was completed.", shape=shape
    )


def both_tokens(shape: Shape = "vllm") -> Behaviour:
    return Behaviour(content=f"Either way could be argued.\n{SUCCESS_TOKEN}\n{FAILURE_TOKEN}", shape=shape)


def token_only_in_reasoning(
    success: bool = True,
    *,
    content: str | None = "",
    field: Literal["reasoning_content", "reasoning"] = "reasoning_content",
    shape: Shape = "vllm",
) -> Behaviour:
    """The verdict token appears only in the reasoning field; ``content`` is empty (or ``None``)."""
    token = SUCCESS_TOKEN if success else FAILURE_TOKEN
    return Behaviour(content=content, reasoning=f"Checking the page...\n{token}", reasoning_field=field, shape=shape)


def http_error(status: int = 500, message: str = "internal server error", *, shape: Shape = "vllm") -> Behaviour:
    return Behaviour(status=status, error_message=message, shape=shape)


def rate_limited(retry_after: str | None = "1", *, shape: Shape = "hosted") -> Behaviour:
    return Behaviour(status=429, error_message="rate limit reached", retry_after=retry_after, shape=shape)


def hang() -> Behaviour:
    """Accept the request and never answer (until the server closes)."""
    return Behaviour(action="hang")


def disconnect() -> Behaviour:
    """Close the connection without answering."""
    return Behaviour(action="disconnect")


def truncated(shape: Shape = "vllm") -> Behaviour:
    return Behaviour(content="The agent found the page and the answer loo", finish_reason="length", shape=shape)


def refusal() -> Behaviour:
    return Behaviour(content=None, refusal="I can't help with grading this.", shape="hosted")


def malformed_body() -> Behaviour:
    return Behaviour(raw_body='{"choices": [{"message": ')


def content_filtered() -> Behaviour:
    """A hosted endpoint whose output filter withheld the answer (``finish_reason`` ``content_filter``)."""
    return Behaviour(content=None, finish_reason="content_filter", shape="hosted")


def prompt_filtered() -> Behaviour:
    """A hosted endpoint whose input filter refused the prompt: HTTP 400 with ``error.code`` ``content_filter``."""
    message = "The response was filtered due to the prompt triggering the content management policy."
    error = {"message": message, "type": None, "param": "prompt", "code": "content_filter", "status": 400}
    return Behaviour(status=400, raw_body=json.dumps({"error": error}))


def on_policy_text(behaviour: Behaviour, otherwise: Behaviour | None = None) -> Behaviour:
    """``behaviour`` for a prompt carrying the policy's text (an answer, steps or a page), ``otherwise`` (a
    failure verdict by default) for the task alone: a judge that the policy's text, not the task, derails."""

    def respond(request: RecordedRequest) -> Behaviour:
        carries = any(request.data_block(name) is not None for name in ("final_answer", "steps", "page_text"))
        return behaviour if carries else (otherwise or verdict(False))

    return Behaviour(respond=respond)


def no_choices() -> Behaviour:
    return Behaviour(raw_body=json.dumps({"id": "chatcmpl-empty", "object": "chat.completion", "choices": []}))


def echo_page() -> Behaviour:
    """A judge that obeys the page completely: it answers with the page text it was shown, verbatim."""
    return Behaviour(respond=lambda request: Behaviour(content=request.data_block("page_text") or ""))


def decide(predicate: Callable[[RecordedRequest], bool], *, shape: Shape = "vllm") -> Behaviour:
    """A verdict computed from the request (e.g. ``lambda r: "42" in r.data_block("final_answer")``)."""
    return Behaviour(respond=lambda request: verdict(bool(predicate(request)), shape=shape))


def echo_headers_error(pad: int = 0) -> Behaviour:
    """A 500 whose body repeats the request headers (some proxies do): the judge must scrub its reason.

    The ``Authorization`` value comes first, repeated, after ``pad`` filler characters: scripting several pads
    makes sure that wherever the judge cuts its reason, some cut falls inside a copy of the key (a scrub
    applied after cutting would then leak a fragment).
    """

    def respond(request: RecordedRequest) -> Behaviour:
        auth = request.headers.get("Authorization", "")
        repeats = "; ".join(f"hop {n}: {auth}" for n in range(12))
        return http_error(500, f"bad gateway{'.' * pad}; {repeats}; request headers: {request.headers}")

    return Behaviour(respond=respond)


class FakeJudgeServer:
    """See the module docstring. ``requests`` lists every request; ``max_in_flight`` the peak concurrency."""

    def __init__(self, *, model: str = "fake-judge", api_key: str | None = None, default: Behaviour | None = None):
        self.model = model
        self.api_key = api_key
        self.default = default or verdict(False)
        self.requests: list[RecordedRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._queue: deque[Behaviour] = deque()
        self._ids = itertools.count(1)
        self._closing = asyncio.Event()
        self._runner: web.AppRunner | None = None
        self._port: int | None = None

    @property
    def base_url(self) -> str:
        if self._port is None:
            raise RuntimeError("the fake judge is not started")
        return f"http://127.0.0.1:{self._port}/v1"

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def script(self, *behaviours: Behaviour) -> None:
        """Queue behaviours for the next requests, in order."""
        self._queue.extend(behaviours)

    async def start(self) -> FakeJudgeServer:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._port = self._runner.addresses[0][1]
        return self

    async def close(self) -> None:
        self._closing.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeJudgeServer:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # --- handlers ---

    async def _record(self, request: web.Request) -> RecordedRequest:
        body: dict[str, Any] | None = None
        if request.can_read_body:
            try:
                loaded = json.loads(await request.read())
                body = loaded if isinstance(loaded, dict) else None
            except ValueError:
                body = None
        recorded = RecordedRequest(request.method, request.path, dict(request.headers), body, time.monotonic())
        self.requests.append(recorded)
        return recorded

    def _refuse(self, recorded: RecordedRequest) -> web.Response | None:
        if self.api_key is not None and recorded.headers.get("Authorization") != f"Bearer {self.api_key}":
            return _error(401, "invalid API key", "hosted")
        if recorded.body is None or not isinstance(recorded.body.get("messages"), list):
            return _error(400, "body must be a chat-completions request", "vllm")
        if recorded.body.get("model") != self.model:
            return _error(404, f"The model `{recorded.body.get('model')}` does not exist.", "vllm")
        return None

    async def _models(self, request: web.Request) -> web.Response:
        await self._record(request)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        recorded = await self._record(request)
        refused = self._refuse(recorded)
        if refused is not None:
            return refused
        behaviour = self._queue.popleft() if self._queue else self.default
        while behaviour.respond is not None:
            behaviour = behaviour.respond(recorded)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if behaviour.delay_s:
                await asyncio.sleep(behaviour.delay_s)
            if behaviour.action == "hang":
                try:
                    await asyncio.wait_for(self._closing.wait(), _HANG_LIMIT_S)
                except TimeoutError:
                    pass
                return _error(504, "hung", behaviour.shape)
            if behaviour.action == "disconnect":
                assert request.transport is not None
                request.transport.abort()
                return web.Response(status=204)
            return self._answer(behaviour)
        finally:
            self.in_flight -= 1

    def _answer(self, behaviour: Behaviour) -> web.Response:
        headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after is not None else None
        if behaviour.raw_body is not None:
            return web.Response(status=behaviour.status, text=behaviour.raw_body, content_type="application/json")
        if behaviour.status >= 400:
            return _error(behaviour.status, behaviour.error_message, behaviour.shape, headers)
        return web.json_response(self._completion(behaviour), status=behaviour.status, headers=headers)

    def _completion(self, behaviour: Behaviour) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": behaviour.content}
        usage = {"prompt_tokens": 100, "completion_tokens": 20, "total_tokens": 120}
        choice: dict[str, Any] = {"index": 0, "message": message, "logprobs": None}
        body: dict[str, Any] = {
            "id": f"chatcmpl-{next(self._ids)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": usage,
        }
        if behaviour.shape == "vllm":
            message["reasoning_content"] = None
            message["tool_calls"] = []
            choice["stop_reason"] = None
            body["prompt_logprobs"] = None
        else:
            message["refusal"] = behaviour.refusal
            message["annotations"] = []
            usage["completion_tokens_details"] = {"reasoning_tokens": 0}
            body["system_fingerprint"] = "fp_fake"
            body["service_tier"] = "default"
        if behaviour.reasoning is not None:
            message[behaviour.reasoning_field] = behaviour.reasoning
        choice["finish_reason"] = behaviour.finish_reason
        return body


def _error(status: int, message: str, shape: Shape, headers: dict[str, str] | None = None) -> web.Response:
    if shape == "vllm":
        body: dict[str, Any] = {"object": "error", "message": message, "type": "Error", "param": None, "code": status}
    else:
        body = {"error": {"message": message, "type": "error", "param": None, "code": str(status)}}
    return web.json_response(body, status=status, headers=headers)


__all__ = [
    "Behaviour",
    "FakeJudgeServer",
    "RecordedRequest",
    "both_tokens",
    "content_filtered",
    "decide",
    "disconnect",
    "echo_headers_error",
    "echo_page",
    "hang",
    "hedge",
    "http_error",
    "malformed_body",
    "no_choices",
    "on_policy_text",
    "prompt_filtered",
    "rate_limited",
    "refusal",
    "token_only_in_reasoning",
    "truncated",
    "verdict",
    "with_reasoning",
]
