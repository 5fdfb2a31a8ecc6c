"""What an environment server's answer says, read so that neither its bytes nor the policy's text decide more.

What this module owns
    * Reading a body (:func:`read_body`, :func:`parse_json`): at most ``max_answer_bytes`` after decompression,
      strict UTF-8, JSON nested at most :data:`MAX_JSON_DEPTH` deep. Anything else raises :class:`MalformedAnswer`;
      the client maps it to an infrastructure failure of the call's kind, so no byte from a server escapes as an
      unmapped exception.
    * The cause of a tool's ``error`` (:func:`lost_session_reason`): only the server's fixed message shapes count,
      ``no active session; ...`` whole, or ``<verb> failed: [<Api>: ]<browser-gone message>`` where the opening of
      the first line after the lead-ins is the browser's own. The real server echoes the policy's URL (``... at
      <url>``) and typed text (Playwright's call log, after the first line); neither reaches that opening, and an
      argument carrying such a message is also cut out before matching. Any other error is the policy's to read.
    * A reward's range (:func:`checked_reward`): a finite number in [0, 1]; NaN, infinities, negative or larger
      values are the server's error, never a reward.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any

import aiohttp

from .browser_calls import BROWSER_OBSERVE

# The server's answers nest a few levels (verify echoes the request body we sent); far deeper is not its answer.
MAX_JSON_DEPTH = 64
NO_SESSION_ERROR = "no active session; seed_session must be called first"
# The real server's tool errors: f"{verb} failed: {exception}" (app.py), observe's verb included.
_TOOL_ERROR = re.compile(r"(navigate|click|type|observe) failed: ")
# Lead-ins of a Playwright message before its own text: "<Class.method>: ", "Protocol error (<Domain.method>): ".
_LEAD_IN = re.compile(r"(?:[A-Za-z]\w*\.\w+: )?(?:Protocol error \([\w.]+\): )?(?:Error: )?")
# Openings of the messages Playwright and the server's backend give when the browser itself is gone.
BROWSER_GONE_OPENINGS = (
    "target page, context or browser has been closed",
    "target closed",
    "browser has been closed",
    "browser closed",
    "connection closed",
    "backend is not open",
)
_REDACTED = "<policy argument>"


class MalformedAnswer(ValueError):
    """The server answered something that is not a well-formed answer (too large, not UTF-8, not JSON, too deep)."""


async def read_body(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body of ``response``, refusing it as soon as it is known to exceed ``limit`` bytes."""
    declared = response.content_length
    if declared is not None and declared > limit:
        raise MalformedAnswer(f"a body of {declared} bytes, above max_answer_bytes={limit}")
    body = bytearray()
    async for chunk in response.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            raise MalformedAnswer(f"a body of more than {limit} bytes (max_answer_bytes)")
    return bytes(body)


def parse_json(body: bytes) -> Any:
    """``body`` as JSON (None when empty); raises :class:`MalformedAnswer` for anything a server should not send."""
    if not body:
        return None
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise MalformedAnswer(f"a body that is not UTF-8 (byte {exc.start})") from exc
    try:
        payload = json.loads(text)
    except RecursionError as exc:
        raise MalformedAnswer(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from exc
    except ValueError as exc:  # JSONDecodeError, and the int-digit limit of int()
        raise MalformedAnswer(f"malformed JSON ({type(exc).__name__})") from exc
    if _depth(payload) > MAX_JSON_DEPTH:
        raise MalformedAnswer(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    return payload


def _depth(payload: Any) -> int:
    """Nesting depth of parsed JSON, without recursion (a deep value must not overflow the stack here either)."""
    deepest, stack = 0, [(payload, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, list):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                stack.extend((item, depth + 1) for item in value)
    return deepest


def lost_session_reason(tool: str, arguments: Mapping[str, Any], error: str) -> str | None:
    """Why ``error`` (a tool answer's) says the session or its browser is gone; None when the policy reads it."""
    if error.strip() == NO_SESSION_ERROR:
        return f"the server no longer knows this session ({tool})"
    shape = _TOOL_ERROR.match(error)
    if shape is None:
        return None
    if tool == BROWSER_OBSERVE and shape.group(1) == "observe":
        return f"observe takes no argument, so its failure is the browser's: {error}"
    first_line = _without_arguments(error[shape.end() :].split("\n", 1)[0], arguments)
    opening = first_line[_LEAD_IN.match(first_line).end() :].lower()  # type: ignore[union-attr]
    if opening.startswith(BROWSER_GONE_OPENINGS):
        return f"the browser is gone: {error}"
    return None


def _without_arguments(text: str, arguments: Mapping[str, Any]) -> str:
    """``text`` with every argument that carries a browser-gone phrase cut out, longest first.

    Only those: cutting a short argument such as ``"closed"`` could break the server's own message apart. An
    argument equal to the browser's own message is cut too: an echo and a coincidence cannot be told apart, and
    the policy's reading is the one it cannot profit from (a dead browser fails its next call anyway).
    """
    forging = {
        value
        for value in arguments.values()
        if isinstance(value, str) and any(phrase in value.lower() for phrase in BROWSER_GONE_OPENINGS)
    }
    for value in sorted(forging, key=len, reverse=True):
        text = text.replace(value, _REDACTED)
    return text


def checked_reward(value: Any) -> float:
    """``value`` as a reward: a finite int or float in [0, 1]; otherwise :class:`MalformedAnswer`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise MalformedAnswer(f"a reward that is not a number: {value!r:.80}")
    reward = float(value)
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise MalformedAnswer(f"a reward outside [0, 1]: {reward!r}")
    return reward
