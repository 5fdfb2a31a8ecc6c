"""One task, whatever format it came in: a WebVoyager record, or a NeMo Gym row read back.

Contract: :class:`Task` from WebVoyager's format (``id``, ``ques``, ``web``, optional ``web_name``; extra fields kept
as ``task_metadata``; the aliases ``task_id``, ``question``, ``start_url``/``initial_url`` and ``site`` read when
WebVoyager's field is absent, a differing pair recorded in ``Task.alias_conflicts``), or from a NeMo Gym row with the
task fields this recipe adds (:func:`task_from_nemo_gym_row`; :func:`parse_record` tells the two apart), and
WebVoyager's ``reference_answer.json`` (:func:`load_reference_answers`). Every task passes the one ``initial_url`` and
``verifier_metadata`` rules of :mod:`~nemo_gym_browser.gym_contract.rows`, so a bad spec is refused with its location,
not found as a 500 or a wrong reward at verify time; records JSON cannot carry (``NaN``, ``Infinity``, deep nesting) are
refused before they reach an output file.

Errors: every refusal is an :class:`InputError` (a ``ValueError``) naming the record's location (``file:line`` or a
dataset record). The format in full: ``docs/data.md``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ..gym_contract.rows import (
    MAX_ROW_DEPTH,
    RowValueError,
    json_depth_exceeds,
    validate_initial_url,
    validate_verifier_metadata,
)

MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant"})
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})

# WebVoyager's field names first; the aliases cover common re-publications of the task list. The first field present
# wins (``id`` is WebVoyager's key); the others are kept as task metadata, so mirrors with extra columns still read.
ID_FIELDS = ("id", "task_id")
QUESTION_FIELDS = ("ques", "question")
URL_FIELDS = ("web", "start_url", "initial_url")
SITE_FIELDS = ("web_name", "site")
REFERENCE_FIELDS = ("reference_answer", "reference_type")


class InputError(ValueError):
    """Input the command cannot use. ``location`` is ``file:line``, a dataset record, or the file alone."""

    def __init__(self, location: str | None, message: str):
        super().__init__(f"{location}: {message}" if location else message)
        self.location = location
        self.message = message


@dataclass(frozen=True)
class Task:
    """One task, whatever format it came in. ``row`` is the NeMo Gym row when the input already was one."""

    task_id: str
    question: str
    site: str | None
    initial_url: str | None
    verifier_metadata: dict[str, str] | None
    reference_answer: str | None
    reference_type: str | None
    metadata: dict[str, Any]
    location: str
    messages: list[dict[str, str]] | None = None
    row: dict[str, Any] | None = None
    id_derived: bool = False
    # (field used, alias kept as metadata) for each alias whose value differs from the field used
    alias_conflicts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ReferenceAnswer:
    answer: str
    type: str


def _require_text(value: Any, name: str, location: str, *, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, str) or not value.strip():
        shown = "missing" if value is None else f"got {json.dumps(value, default=str)[:60]}"
        raise InputError(location, f"'{name}' must be a non-empty string ({shown})")
    return value


def _same_value(a: Any, b: Any) -> bool:
    """Whether two spellings of one field agree (``5`` and ``"5 "`` do: ids come as numbers or strings)."""
    if isinstance(a, str | int) and isinstance(b, str | int) and not isinstance(a, bool) and not isinstance(b, bool):
        return str(a).strip() == str(b).strip()
    return a == b


def _pick(obj: Mapping[str, Any], names: Sequence[str]) -> tuple[str | None, Any, list[tuple[str, str]]]:
    """(field, value, conflicts): the first field of ``names`` that ``obj`` has (null counts as absent), or
    (None, None, []). The others stay in ``obj`` (they become task metadata); ``conflicts`` names those whose value
    differs from the one used, as ``(field used, alias)`` pairs."""
    present = [name for name in names if obj.get(name) is not None]
    if not present:
        return None, None, []
    used = present[0]
    conflicts = [(used, name) for name in present[1:] if not _same_value(obj[name], obj[used])]
    return used, obj[used], conflicts


def _verifier_metadata(value: Any, location: str) -> dict[str, str] | None:
    """The row's grading spec under the one rule (:func:`rows.validate_verifier_metadata`), located on refusal."""
    try:
        return validate_verifier_metadata(value)
    except RowValueError as exc:
        raise InputError(location, str(exc)) from exc


def _initial_url(value: Any, location: str, name: str = "initial_url") -> Any:
    """The start URL under the one rule (:func:`rows.validate_initial_url`), located on refusal."""
    try:
        return validate_initial_url(value)
    except RowValueError as exc:
        raise InputError(location, str(exc).replace("'initial_url'", f"'{name}'", 1)) from None


def check_plain_json(obj: Any, location: str) -> None:
    """A record from a dataset (not JSON text) holds only what JSON can carry: finite numbers, bounded nesting."""
    if json_depth_exceeds(obj):
        raise InputError(location, f"the record nests more than {MAX_ROW_DEPTH} levels deep")
    try:
        json.dumps(obj, allow_nan=False, default=str)
    except ValueError:
        raise InputError(location, "the record holds NaN or Infinity, which JSON cannot carry") from None


def _json_safe(value: Any, location: str, name: str) -> Any:
    """``value`` as plain JSON data (dates from columnar datasets become ISO strings)."""

    def default(obj: Any) -> Any:
        if isinstance(obj, dt.date | dt.datetime | dt.time):
            return obj.isoformat()
        raise TypeError(type(obj).__name__)

    try:
        return json.loads(json.dumps(value, default=default, ensure_ascii=False))
    except (TypeError, ValueError) as exc:
        raise InputError(location, f"field '{name}' cannot be written as JSON ({exc})") from exc


def task_from_webvoyager(obj: Mapping[str, Any], location: str) -> Task:
    """A task in WebVoyager's format: ``id``, ``ques``, ``web``, optional ``web_name``; extra fields kept.

    Where a row carries a field and its alias (say ``id`` and ``task_id``), the first of the group is used and the
    alias is kept in the task metadata; ``Task.alias_conflicts`` records the pairs whose values differ."""
    id_field, raw_id, id_conflicts = _pick(obj, ID_FIELDS)
    if isinstance(raw_id, int) and not isinstance(raw_id, bool):
        raw_id = str(raw_id)
    task_id = _require_text(raw_id, id_field or "id", location)
    q_field, question, q_conflicts = _pick(obj, QUESTION_FIELDS)
    question = _require_text(question, q_field or "ques", location)
    url_field, url, url_conflicts = _pick(obj, URL_FIELDS)
    url = _require_text(url, url_field or "web", location)
    # A relative path is a page under the environment server's own folder (the server turns it into file://),
    # as in NeMo Gym's bundled examples; anything else must be a web URL.
    url = _initial_url(url.strip(), location, url_field or "web")
    parts = urlsplit(url)
    site_field, site, site_conflicts = _pick(obj, SITE_FIELDS)
    site = _require_text(site, site_field or "web_name", location, allow_none=True)
    if site is None:
        site = task_id.rsplit("--", 1)[0] if "--" in task_id else (parts.hostname or "local")
    reference_answer = _require_text(obj.get("reference_answer"), "reference_answer", location, allow_none=True)
    reference_type = _require_text(obj.get("reference_type"), "reference_type", location, allow_none=True)
    known = {id_field, q_field, url_field, site_field, "verifier_metadata", *REFERENCE_FIELDS}
    metadata = {key: _json_safe(val, location, key) for key, val in obj.items() if key not in known}
    return Task(
        task_id=task_id.strip(),
        question=question.strip(),
        site=site.strip(),
        initial_url=url.strip(),
        verifier_metadata=_verifier_metadata(obj.get("verifier_metadata"), location),
        reference_answer=reference_answer,
        reference_type=reference_type,
        metadata=metadata,
        location=location,
        alias_conflicts=tuple(id_conflicts + q_conflicts + url_conflicts + site_conflicts),
    )


def normalize_messages(items: Any, location: str) -> list[dict[str, str]]:
    """``responses_create_params.input`` as chat messages ``{"role", "content"}`` with text content.

    A plain string is one user message; a list of Responses-API text parts is joined; the ``developer`` role
    becomes ``system`` (what chat templates of open models know). Anything else is not a text prompt.
    """
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise InputError(location, "'responses_create_params.input' must be a non-empty list of messages")
    messages = []
    for position, item in enumerate(items):
        where = f"responses_create_params.input[{position}]"
        if not isinstance(item, Mapping):
            raise InputError(location, f"{where} must be a message object, got {type(item).__name__}")
        if item.get("type", "message") != "message":
            raise InputError(location, f"{where} has type {item.get('type')!r}; only messages can start an episode")
        role = item.get("role")
        if role not in MESSAGE_ROLES:
            raise InputError(location, f"{where}.role must be one of {sorted(MESSAGE_ROLES)}, got {role!r}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, Mapping) or part.get("type") not in TEXT_PART_TYPES:
                    raise InputError(location, f"{where}.content holds a non-text part; this recipe is text-only")
                texts.append(_require_text(part.get("text"), f"{where}.content[].text", location))
            content = "".join(texts)
        if not isinstance(content, str):
            raise InputError(location, f"{where}.content must be a string or a list of text parts")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(message["role"] == "user" for message in messages):
        raise InputError(location, "'responses_create_params.input' has no user message")
    return messages


def derived_task_id(row: Mapping[str, Any]) -> str:
    """A content id for a NeMo Gym row that carries no ``task_id``: same prompt, start and spec, same id."""
    content = {key: row.get(key) for key in ("responses_create_params", "initial_url", "verifier_metadata")}
    digest = hashlib.sha256(json.dumps(content, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    return f"row-{digest[:16]}"


def task_from_nemo_gym_row(row: Mapping[str, Any], location: str) -> Task:
    """Validate a NeMo Gym row (``responses_create_params`` + ``initial_url`` + optional ``verifier_metadata``)."""
    rcp = row.get("responses_create_params")
    if not isinstance(rcp, Mapping):
        raise InputError(location, "'responses_create_params' must be an object")
    messages = normalize_messages(rcp.get("input"), location)
    initial_url = _initial_url(
        _require_text(row.get("initial_url"), "initial_url", location, allow_none=True), location
    )
    task_id = row.get("task_id")
    id_derived = task_id is None
    if id_derived:
        task_id = derived_task_id(row)
    task_id = _require_text(task_id, "task_id", location)
    question = row.get("question")
    if question is None:
        question = next(message["content"] for message in reversed(messages) if message["role"] == "user")
    metadata = row.get("task_metadata") or {}
    if not isinstance(metadata, Mapping):
        raise InputError(location, "'task_metadata' must be an object")
    for name in ("site", "reference_answer", "reference_type", "data_source"):
        _require_text(row.get(name), name, location, allow_none=True)
    return Task(
        task_id=task_id.strip(),
        question=_require_text(question, "question", location).strip(),
        site=row.get("site"),
        initial_url=initial_url,
        verifier_metadata=_verifier_metadata(row.get("verifier_metadata"), location),
        reference_answer=row.get("reference_answer"),
        reference_type=row.get("reference_type"),
        metadata=dict(metadata),
        location=location,
        messages=messages,
        row=dict(row),
        id_derived=id_derived,
    )


def parse_record(obj: Any, location: str) -> Task:
    if not isinstance(obj, Mapping):
        raise InputError(location, f"expected a JSON object, got {type(obj).__name__}")
    check_plain_json(obj, location)
    if "responses_create_params" in obj:
        return task_from_nemo_gym_row(obj, location)
    return task_from_webvoyager(obj, location)


def load_reference_answers(path: Path) -> dict[tuple[str, int], ReferenceAnswer]:
    """WebVoyager's ``reference_answer.json``: ``{site: {"answers": [{"id": n, "type", "ans"}]}}``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InputError(str(path), f"cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise InputError(str(path), f"not valid UTF-8 ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}", f"malformed JSON: {exc.msg} (column {exc.colno})") from exc
    if not isinstance(data, Mapping):
        raise InputError(str(path), "expected an object keyed by site name")
    answers: dict[tuple[str, int], ReferenceAnswer] = {}
    for site, entry in data.items():
        items = entry.get("answers") if isinstance(entry, Mapping) else None
        if not isinstance(items, list):
            raise InputError(str(path), f"[{site!r}] must be an object with an 'answers' list")
        for position, item in enumerate(items):
            where = f"{path} [{site!r}].answers[{position}]"
            if not isinstance(item, Mapping):
                raise InputError(where, "must be an object with 'id', 'type' and 'ans'")
            number = item.get("id")
            if isinstance(number, str) and number.isdigit():
                number = int(number)
            if not isinstance(number, int) or isinstance(number, bool):
                raise InputError(where, f"'id' must be the task number, got {number!r}")
            answer = _require_text(item.get("ans"), "ans", where)
            kind = _require_text(item.get("type"), "type", where)
            if (site, number) in answers:
                raise InputError(where, f"second answer for task {site}--{number}")
            answers[(site, number)] = ReferenceAnswer(answer=answer, type=kind)
    return answers


def reference_key(task: Task) -> tuple[str, int] | None:
    """(site, number) of a WebVoyager task id such as ``Allrecipes--3``, the key of its reference answer."""
    match = re.fullmatch(r"(.+)--(\d+)", task.task_id)
    if match is None:
        return None
    return (task.site or match.group(1), int(match.group(2)))
