"""What crosses HTTP to and from the in-process environment server, shaped as nemo_gym 0.7.0's FastAPI stack shapes it.

Owns the request and answer bodies (pydantic models with the real field names, constraints and class names: they
appear in the ``loc`` of a 422), FastAPI's body parsing and its 422 ``{"detail": [...]}`` answers (:func:`parse_body`),
Starlette's signed session cookie (:class:`CookieCodec`) and its ``JSONResponse`` rendering (:func:`json_response`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, JsonValue, TypeAdapter, ValidationError, field_validator

__all__ = [
    "CLOSE_BODY",
    "COOKIE_NAME",
    "ELEMENT_BODY",
    "FINISH_BODY",
    "NAVIGATE_BODY",
    "SEED_BODY",
    "SESSION_ID_KEY",
    "TYPE_BODY",
    "VERIFY_BODY",
    "BrowserSeedSessionRequest",
    "BrowserVerifyRequest",
    "CookieCodec",
    "EpisodeId",
    "ResourcesCloseSessionRequest",
    "ResourcesSeedSessionRequest",
    "TaskId",
    "ToolResponse",
    "Unprocessable",
    "json_response",
    "jsonable",
    "parse_body",
]

# `<ServerClassName>___<server instance name>`: nemo_gym's session-middleware key, also the cookie name.
COOKIE_NAME = "InteractiveBrowserResourcesServer___interactive_browser"
# Starlette's SessionMiddleware default lifetime (14 days) and cookie flags.
_COOKIE_MAX_AGE_S = 14 * 24 * 60 * 60
_COOKIE_EXPIRED = "Thu, 01 Jan 1970 00:00:00 GMT"
# The key of the session id inside the cookie's session dict (nemo_gym's add_session_id middleware).
SESSION_ID_KEY = "session_id"


# ----------------------------------------------------------------------------------------------------------------
# Bodies (field names, constraints and class names as in nemo_gym 0.7.0)
# ----------------------------------------------------------------------------------------------------------------


class EpisodeId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rollout_id: str = Field(min_length=1, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    attempt: int = Field(default=0, ge=0)

    @field_validator("rollout_id")
    @classmethod
    def _reserve_attempt_suffix(cls, rollout_id: str) -> str:
        if re.search(r"-a[1-9][0-9]*$", rollout_id):
            raise ValueError("rollout_id must not end with the reserved attempt suffix '-a<N>'")
        return rollout_id


class TaskId(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    taskset: str = Field(min_length=1)
    task_id: str = Field(min_length=1)


class ResourcesSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resources_session_id: str = Field(min_length=1)
    episode_id: EpisodeId
    task_id: TaskId
    task_data: dict[str, JsonValue]


class BrowserSeedSessionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    initial_url: str = "about:blank"
    verifier_metadata: dict[str, Any] | None = None


class ResourcesCloseSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    resources_session_id: str
    episode_id: EpisodeId


class NavigateRequest(BaseModel):
    url: str


class ElementRequest(BaseModel):
    element_id: int


class TypeRequest(BaseModel):
    element_id: int
    text: str


class FinishRequest(BaseModel):
    answer: str = ""


class ToolResponse(BaseModel):
    observation: str
    done: bool = False
    error: str | None = None


class NeMoGymResponseCreateParamsNonStreaming(BaseModel):
    """The request half of a rollout: nemo_gym's field names, order and defaults (extra keys forbidden); the
    values themselves are not checked as deeply as the real model does."""

    model_config = ConfigDict(extra="forbid")

    background: Any = None
    include: Any = None
    input: str | list[Any]
    instructions: Any = None
    max_output_tokens: Any = None
    max_tool_calls: Any = None
    metadata: Any = None
    model: Any = None
    parallel_tool_calls: bool = True
    previous_response_id: Any = None
    prompt: Any = None
    reasoning: Any = None
    service_tier: Any = None
    store: Any = None
    context_management: Any = None
    conversation: Any = None
    moderation: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None
    stream_options: Any = None
    temperature: Any = None
    text: Any = None
    tool_choice: Any = "auto"
    tools: list[Any] = Field(default_factory=list)
    top_logprobs: Any = None
    top_p: Any = None
    truncation: Any = None
    user: Any = None
    stream: Literal[False] | None = None


class NeMoGymResponse(BaseModel):
    """The response half: OpenAI's ``Response`` (openai 2.44) field names, order and required fields."""

    model_config = ConfigDict(extra="allow")

    id: str
    created_at: float
    error: Any = None
    incomplete_details: Any = None
    instructions: Any = None
    metadata: Any = None
    model: str
    object: Literal["response"]
    output: list[Any]
    parallel_tool_calls: bool
    temperature: Any = None
    tool_choice: Any
    tools: list[Any]
    top_p: Any = None
    background: Any = None
    completed_at: Any = None
    conversation: Any = None
    max_output_tokens: Any = None
    max_tool_calls: Any = None
    moderation: Any = None
    previous_response_id: Any = None
    prompt: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    reasoning: Any = None
    safety_identifier: Any = None
    service_tier: Any = None
    status: Any = None
    text: Any = None
    top_logprobs: Any = None
    truncation: Any = None
    usage: Any = None
    user: Any = None


class BrowserVerifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True)

    responses_create_params: NeMoGymResponseCreateParamsNonStreaming
    response: NeMoGymResponse
    capture_rollout_id: str | None = Field(default=None, alias="_ng_rollout_id", exclude=True)
    verifier_metadata: dict[str, Any] | None = None


# Typed first and left to right, like the real handler: the legacy model allows extras and would swallow it.
SEED_BODY = TypeAdapter(
    Annotated[ResourcesSeedSessionRequest | BrowserSeedSessionRequest, Field(union_mode="left_to_right")]
)
CLOSE_BODY = TypeAdapter(dict[str, Any] | None)
NAVIGATE_BODY = TypeAdapter(NavigateRequest)
ELEMENT_BODY = TypeAdapter(ElementRequest)
TYPE_BODY = TypeAdapter(TypeRequest)
FINISH_BODY = TypeAdapter(FinishRequest)
VERIFY_BODY = TypeAdapter(BrowserVerifyRequest)


# ----------------------------------------------------------------------------------------------------------------
# FastAPI's body parsing and validation errors, Starlette's session cookie and JSON rendering
# ----------------------------------------------------------------------------------------------------------------


class Unprocessable(Exception):
    """Answer 422 with FastAPI's ``{"detail": errors}``."""

    def __init__(self, errors: list[dict[str, Any]]) -> None:
        super().__init__("422")
        self.errors = errors


def jsonable(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, BaseException):
        return {}  # FastAPI's jsonable_encoder turns an exception in `ctx` into {}
    return value


def _request_errors(exc: ValidationError, prefix: tuple[str, ...]) -> list[dict[str, Any]]:
    return [jsonable({**err, "loc": [*prefix, *err["loc"]]}) for err in exc.errors(include_url=False)]


_Model = TypeVar("_Model")


def parse_body(raw: bytes, content_type: str | None, adapter: TypeAdapter[_Model], *, required: bool) -> _Model:
    """FastAPI's handling of a single body parameter: JSON only for a JSON content type, 422s shaped like its own."""
    body: Any = None
    if raw:
        media = (content_type or "").split(";")[0].strip().lower()
        if media == "application/json" or (media.startswith("application/") and media.endswith("+json")):
            try:
                body = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise Unprocessable(
                    [
                        {
                            "type": "json_invalid",
                            "loc": ["body", exc.pos],
                            "msg": "JSON decode error",
                            "input": {},
                            "ctx": {"error": exc.msg},
                        }
                    ]
                ) from exc
        else:
            body = raw
    if body is None and required:
        raise Unprocessable([{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}])
    try:
        return adapter.validate_python(body, from_attributes=True)  # as FastAPI validates a body
    except ValidationError as exc:
        raise Unprocessable(_request_errors(exc, ("body",))) from exc


class CookieCodec:
    """A signed, opaque cookie value carrying the session dict, like Starlette's (which survives restarts too)."""

    def __init__(self, secret: str) -> None:
        self._key = secret.encode()

    def _sign(self, payload: str) -> str:
        return hmac.new(self._key, payload.encode(), hashlib.sha256).hexdigest()[:24]

    def encode(self, session: Mapping[str, str]) -> str:
        payload = base64.urlsafe_b64encode(json.dumps(dict(session)).encode()).decode().rstrip("=")
        return f"{payload}.{self._sign(payload)}"

    def decode(self, value: str | None) -> dict[str, str]:
        if not value or "." not in value:
            return {}
        payload, signature = value.rsplit(".", 1)
        if not hmac.compare_digest(signature, self._sign(payload)):
            return {}
        try:
            session = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        except (ValueError, json.JSONDecodeError):
            return {}
        return session if isinstance(session, dict) else {}

    def set_cookie(self, response: web.Response, session: Mapping[str, str], *, had_session: bool) -> None:
        """Starlette's SessionMiddleware: re-send a non-empty session; clear one that was emptied."""
        if session:
            response.set_cookie(
                COOKIE_NAME,
                self.encode(session),
                path="/",
                max_age=_COOKIE_MAX_AGE_S,
                httponly=True,
                samesite="lax",
            )
        elif had_session:
            response.set_cookie(COOKIE_NAME, "null", path="/", expires=_COOKIE_EXPIRED, httponly=True, samesite="lax")


def json_response(payload: Any, status: int = 200) -> web.Response:
    # Starlette's JSONResponse rendering.
    text = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return web.Response(status=status, text=text, content_type="application/json")
