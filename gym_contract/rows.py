"""The row contract: what a NeMo Gym row for the ``interactive_browser`` server must carry, and the one rule for each
part that data preparation, the dataset, the preflight and the environment client all apply.

A row (one JSONL line) carries ``responses_create_params.input`` (the prompt), ``initial_url`` (where the server
opens the browser at seed time), optional ``verifier_metadata`` (how ``/verify`` grades; without it only the judge
can score the task) and optional ``agent_ref`` and task fields.

Rules: :func:`validate_initial_url` (an http(s) URL with a host, or a path inside the server's folder; no other
scheme), :func:`parse_row_json` (no ``NaN``/``Infinity``, duplicate keys or nesting deeper than
:data:`MAX_ROW_DEPTH`) and :func:`validate_verifier_metadata` (exactly one key of :data:`VERIFIER_KEYS`, a non-empty
string), which follows what the 0.7.0 server's ``_score`` does. A spec that passes is graded on the key it names and
nothing else; null values are dropped first, so send the returned mapping, never the input.

Errors: :class:`RowValueError` naming what is wrong. Why each rule: ``docs/data.md#the-row-contract``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from .url_safety import WEB_SCHEMES, UrlRefused, parse_web_url, url_scheme

# The grading keys the 0.7.0 server knows, in the order its _score tries them; it grades the first one present.
VERIFIER_KEYS = ("answer_equals", "final_url", "url_contains", "dom_contains")
_PRECEDENCE = " > ".join(VERIFIER_KEYS)


# A row nests about eight levels deep (responses_create_params.tools[].parameters.properties.<name>.enum); far
# deeper is not a row, and Python's json raises RecursionError near a thousand.
MAX_ROW_DEPTH = 64
_CONTROL_CHARACTERS = frozenset(chr(c) for c in range(0x20)) | {"\x7f"}


class RowValueError(ValueError):
    """A row value this recipe refuses: its JSON, its start URL, or ``verifier_metadata`` the server would grade
    wrongly or not at all. The message has no location: callers that read rows from a file add theirs
    (``file:line``, :class:`~nemo_gym_browser.task_lists.tasks.InputError`)."""


def _refuse_constant(name: str) -> Any:
    raise RowValueError(f"{name} is not JSON (a number must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise RowValueError(f"{text} is out of range for a JSON number")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise RowValueError(f"duplicate key {key!r} in one object (JSON readers disagree on which value wins)")
        seen[key] = value
    return seen


def json_depth_exceeds(value: Any, limit: int = MAX_ROW_DEPTH) -> bool:
    """Whether ``value`` nests lists and objects more than ``limit`` deep (iterative: no recursion limit)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping | list | tuple):
            if depth > limit:
                return True
            children = item.values() if isinstance(item, Mapping) else item
            stack.extend((child, depth + 1) for child in children)
    return False


def parse_row_json(text: str) -> Any:
    """One JSON value from ``text``, strictly: :class:`RowValueError` for malformed JSON, ``NaN``/``Infinity`` (or a
    number that overflows to it), a duplicate key, or nesting deeper than :data:`MAX_ROW_DEPTH`."""
    try:
        value = json.loads(
            text, parse_constant=_refuse_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys
        )
    except json.JSONDecodeError as exc:
        raise RowValueError(f"malformed JSON: {exc.msg} (column {exc.colno})") from None
    except RowValueError:
        raise
    except RecursionError:
        raise RowValueError(f"JSON nested more than {MAX_ROW_DEPTH} levels deep") from None
    except ValueError as exc:  # a huge integer literal
        raise RowValueError(f"malformed JSON: {exc}") from None
    if json_depth_exceeds(value):
        raise RowValueError(f"JSON nested more than {MAX_ROW_DEPTH} levels deep")
    return value


def validate_initial_url(value: Any) -> str | None:
    """``value`` if the server may open it at seed time, else :class:`RowValueError` saying why; None stays None.

    Allowed: an http(s) URL with a host the browser can read, or a relative path inside the server's folder (no
    leading ``/``, no ``..``). The server takes a relative path to a ``file:`` page under its own folder.
    """
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise RowValueError(f"'initial_url' must be a non-empty string, got {json.dumps(value, default=str)[:60]}")
    if value != value.strip() or any(char in _CONTROL_CHARACTERS for char in value):
        raise RowValueError(
            f"'initial_url' {value[:80]!r} has surrounding spaces or control characters (the browser would read "
            "another URL than the one checked)"
        )
    scheme = url_scheme(value)
    if scheme is not None and scheme not in WEB_SCHEMES:
        raise RowValueError(
            f"'initial_url' must be an http(s) URL or a path inside the server's folder, not a {scheme}: URL "
            f"({value[:80]!r})"
        )
    if scheme is not None:
        try:
            parse_web_url(value)
        except UrlRefused as exc:
            raise RowValueError(f"'initial_url' is not a usable web URL: {exc}") from None
        return value
    segments = value.replace("\\", "/").split("/")
    if value.startswith(("/", "\\")) or ".." in segments:
        raise RowValueError(
            f"'initial_url' {value[:80]!r} leaves the server's folder; a relative start page must stay inside it"
        )
    return value


def validate_verifier_metadata(value: Any) -> dict[str, str] | None:
    """The grading spec as the server should receive it, or None for a task without one (the judge grades it).

    ``None``, ``{}`` and a mapping of nulls only mean no spec. Otherwise exactly one key of :data:`VERIFIER_KEYS`
    with a non-empty string value; anything else raises :class:`RowValueError`.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise RowValueError(f"verifier_metadata must be an object, got {type(value).__name__}")
    spec = {key: val for key, val in value.items() if val is not None}
    if not spec:
        return None
    unknown = sorted(str(key) for key in spec if key not in VERIFIER_KEYS)
    if unknown:
        raise RowValueError(
            f"unknown verifier_metadata keys {unknown}: the server knows {list(VERIFIER_KEYS)}; it answers 500 at "
            "verify for an unknown key alone and ignores one next to a known key"
        )
    if len(spec) > 1:
        keys = [key for key in VERIFIER_KEYS if key in spec]
        raise RowValueError(
            f"verifier_metadata has {len(keys)} grading keys {keys}, but the server grades only one: the first "
            f"present in the order {_PRECEDENCE}, here {keys[0]!r}, ignoring the rest. Keep exactly one"
        )
    ((key, val),) = spec.items()
    if not isinstance(val, str) or not val.strip():
        raise RowValueError(f"verifier_metadata[{key!r}] must be a non-empty string, got {val!r}")
    return {key: val}
