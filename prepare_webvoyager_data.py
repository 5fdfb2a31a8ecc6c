"""WebVoyager task lists -> NeMo Gym rollout rows for this recipe, split into train and validation files.

What this module owns
    * Reading tasks from a local JSONL in WebVoyager's format (``id``, ``ques``, ``web``, optional ``web_name``;
      extra fields are kept as ``task_metadata``), from a Hugging Face dataset (``datasets.load_dataset``) or from
      a dataset folder written by ``save_to_disk``. Aliases of those fields (``task_id``, ``question``,
      ``start_url``/``initial_url``, ``site``) are read when WebVoyager's own field is absent; a row that carries
      both uses WebVoyager's field, keeps the alias as task metadata, and is warned about (once per input, with a
      count and the first place) when the two differ. Lines that already are NeMo Gym rows (they carry
      ``responses_create_params``) pass through, validated.
    * The row contract that ``dataset.py`` reads back (:func:`task_from_nemo_gym_row`): a NeMo Gym row plus the
      task fields this recipe adds (``task_id``, ``site``, ``question``, ``reference_answer``,
      ``reference_type``, ``data_source``, ``task_metadata``).
    * Applying the one ``verifier_metadata`` rule (:func:`rows.validate_verifier_metadata`) to every task: an
      unknown key, an empty value or several keys (the server silently grades only the first) is refused here with
      its ``file:line``, not found as a 500 or a wrong reward at verify time, long after the data was made.
    * A deterministic split: a task is in validation when a hash of ``(seed, task id)`` falls below the
      validation fraction, so adding or removing other tasks never moves it.
    * The report of tasks whose question names a calendar date that is already past (:func:`find_named_dates`).

Guarantees
    * Bad input (malformed JSON, a missing or wrong field, a duplicate id, an unknown verifier key, an unknown
      site in a filter, an empty result) exits 2 and names the file and line (or dataset record) of each error.
    * Nothing is half-written: every row is validated before any file is opened for writing, and each output
      file is written to a temporary file in the output folder and renamed into place.
    * It never contacts a website, and touches the network only when ``--hf-dataset`` names a Hub dataset.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import hashlib
import json
import logging
import os
import re
import sys
import tempfile
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tqdm import tqdm

from nemo_gym_browser.environment import TOOL_NAMES
from nemo_gym_browser.rows import VERIFIER_KEYS, VerifierMetadataError, validate_verifier_metadata
from nemo_gym_browser.text import shorten

logger = logging.getLogger(__name__)

DATA_SOURCE = "webvoyager"
TRAIN_FILE = "train.jsonl"
VAL_FILE = "val.jsonl"
DEFAULT_VAL_FRACTION = 0.1
DEFAULT_SEED = 0
# Below this many records a progress bar is noise; above it, reading a Hub dataset can take a while.
PROGRESS_MIN_RECORDS = 1000
# Enough errors to see a pattern without burying the first one.
MAX_ERRORS_SHOWN = 20
# A question longer than this is cut in the stale-date listing, which is one line per task.
LISTING_QUESTION_CHARS = 70
MESSAGE_ROLES = frozenset({"system", "developer", "user", "assistant"})
TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})

# WebVoyager's field names first; the aliases cover common re-publications of the task list. The first field present
# wins (``id`` is WebVoyager's key); the others are kept as task metadata, so mirrors with extra columns still read.
ID_FIELDS = ("id", "task_id")
QUESTION_FIELDS = ("ques", "question")
URL_FIELDS = ("web", "start_url", "initial_url")
SITE_FIELDS = ("web_name", "site")
REFERENCE_FIELDS = ("reference_answer", "reference_type")
# Fields of a row this recipe writes next to NeMo Gym's own.
TASK_FIELDS = ("task_id", "site", "question", "reference_answer", "reference_type", "data_source", "task_metadata")

BROWSER_TOOL = "browser"
TOOL_INTERFACES = ("browser", "native")

SYSTEM_PROMPT_BROWSER = """\
You are a web agent. You operate a real web browser through the `browser` tool to complete the user's task.

Each call to `browser` takes an `action`:
- observe: show the current page: its URL, title, a numbered list of interactive elements as `[id] tag: name`, \
and the page text.
- navigate: open `url`.
- click: click the element `element_id`.
- type: type `text` into the element `element_id`.
- finish: end the task and report `answer`.

Rules:
1. The browser is already open on the start page, but you have not seen it yet: your first call is observe.
2. Element ids come from the latest observation only. After navigate, click or type the page may change: \
observe again before you use an id.
3. Make one tool call at a time and read its result before the next.
4. When you are done, call finish exactly once with the answer to the task: the facts asked for, stated fully \
and briefly. If the task asks you to do something on the site, say what you did and what you found."""

SYSTEM_PROMPT_NATIVE = """\
You are a web agent. You operate a real web browser through tools to complete the user's task.

Tools:
- browser_observe(): show the current page: its URL, title, a numbered list of interactive elements as \
`[id] tag: name`, and the page text.
- browser_navigate(url): open a URL.
- browser_click(element_id): click an element.
- browser_type(element_id, text): type text into an element.
- browser_finish(answer): end the task and report your answer.

Rules:
1. The browser is already open on the start page, but you have not seen it yet: your first call is \
browser_observe.
2. Element ids come from the latest observation only. After navigating, clicking or typing the page may change: \
observe again before you use an id.
3. Make one tool call at a time and read its result before the next.
4. When you are done, call browser_finish exactly once with the answer to the task: the facts asked for, stated \
fully and briefly. If the task asks you to do something on the site, say what you did and what you found."""

USER_PROMPT = "Task: {question}\n\nWebsite: {site}. The browser is open at {url}"


def _function_tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    """A Responses-API function tool, the shape NeMo Gym rows carry in ``responses_create_params.tools``."""
    return {
        "type": "function",
        "name": name,
        "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required},
    }


_ELEMENT_ID = {"type": "integer", "description": "An element id from the latest observation."}
BROWSER_TOOL_SCHEMAS = [
    _function_tool(
        BROWSER_TOOL,
        "Operate the web browser: observe the page, navigate to a URL, click or type into an element, or finish "
        "with the answer.",
        {
            "action": {"type": "string", "enum": ["observe", "navigate", "click", "type", "finish"]},
            "url": {"type": "string", "description": "navigate: the URL to open."},
            "element_id": {**_ELEMENT_ID, "description": "click, type: " + _ELEMENT_ID["description"]},
            "text": {"type": "string", "description": "type: the text to enter."},
            "answer": {"type": "string", "description": "finish: the answer to the task."},
        },
        ["action"],
    )
]
NATIVE_TOOL_SCHEMAS = [
    _function_tool("browser_observe", "Show the current page: URL, title, interactive elements and text.", {}, []),
    _function_tool("browser_navigate", "Open a URL.", {"url": {"type": "string"}}, ["url"]),
    _function_tool("browser_click", "Click an element.", {"element_id": _ELEMENT_ID}, ["element_id"]),
    _function_tool(
        "browser_type",
        "Type text into an element.",
        {"element_id": _ELEMENT_ID, "text": {"type": "string"}},
        ["element_id", "text"],
    ),
    _function_tool("browser_finish", "End the task and report the answer.", {"answer": {"type": "string"}}, ["answer"]),
]
assert tuple(tool["name"] for tool in NATIVE_TOOL_SCHEMAS) == TOOL_NAMES


def tool_interface_of(names: Iterable[str]) -> str | None:
    """The ``--tool-interface`` whose tools are exactly ``names`` (``browser`` or ``native``), else None.

    Rows record the interface they were prepared for as the tools in ``responses_create_params.tools``; the
    submit script's ``TOOL_INTERFACE`` picks the tool config with the same names.
    """
    named = set(names)
    if named == {BROWSER_TOOL}:
        return "browser"
    if named == set(TOOL_NAMES):
        return "native"
    return None


# ---------------------------------------------------------------------------------------------------------------------
# Errors and tasks


class InputError(Exception):
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
    except VerifierMetadataError as exc:
        raise InputError(location, str(exc)) from exc


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
    parts = urlsplit(url.strip())
    # A relative path is a page under the environment server's own folder (the server turns it into file://),
    # as in NeMo Gym's bundled examples; anything else must be a web URL.
    relative = not parts.scheme and not parts.netloc and not url.strip().startswith("/") and ".." not in parts.path
    if not relative and (parts.scheme not in ("http", "https") or not parts.netloc):
        raise InputError(
            location, f"'{url_field}' must be an http(s) URL or a path relative to the server's folder, got {url!r}"
        )
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
    initial_url = _require_text(row.get("initial_url"), "initial_url", location, allow_none=True)
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
    if "responses_create_params" in obj:
        return task_from_nemo_gym_row(obj, location)
    return task_from_webvoyager(obj, location)


# ---------------------------------------------------------------------------------------------------------------------
# Reading inputs


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    """(``file:line``, parsed object or the InputError that line raised) for each non-blank line."""
    with path.open("rb") as handle:
        for lineno, raw in enumerate(handle, 1):
            location = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield location, InputError(location, f"not valid UTF-8 ({exc.reason} at byte {exc.start})")
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                yield location, json.loads(text)
            except json.JSONDecodeError as exc:
                yield location, InputError(location, f"malformed JSON: {exc.msg} (column {exc.colno})")


def _count_lines(path: Path) -> int:
    with path.open("rb") as handle:
        return sum(1 for _ in handle)


def _dataset_records(dataset: Any, source: str) -> Iterator[tuple[str, Any]]:
    for index, record in enumerate(dataset):
        yield f"{source}#{index}", record


def load_hub_dataset(name: str, config: str | None, split: str, cache_dir: str | None) -> Any:
    """``datasets.load_dataset`` (a Hub name, or a local folder laid out like a Hub dataset repository)."""
    import datasets

    try:
        return datasets.load_dataset(name, config, split=split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many unrelated types; all mean "cannot use this input"
        raise InputError(f"{name}[{split}]", f"cannot load the dataset: {type(exc).__name__}: {exc}") from exc


def load_disk_dataset(path: str, split: str | None) -> tuple[Any, str]:
    """A ``Dataset`` or one split of a ``DatasetDict`` written by ``save_to_disk``."""
    import datasets

    try:
        loaded = datasets.load_from_disk(path)
    except Exception as exc:  # see load_hub_dataset
        raise InputError(path, f"cannot load a saved dataset: {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise InputError(path, f"choose a split with --hf-split; the saved dataset has {splits}")
        return loaded[split], f"{path}[{split}]"
    if split is not None:
        raise InputError(path, f"--hf-split {split} given, but the saved dataset has no splits")
    return loaded, path


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


def _reference_key(task: Task) -> tuple[str, int] | None:
    match = re.fullmatch(r"(.+)--(\d+)", task.task_id)
    if match is None:
        return None
    return (task.site or match.group(1), int(match.group(2)))


# ---------------------------------------------------------------------------------------------------------------------
# Dates named in questions

_MONTHS = {
    "January": 1, "Jan": 1, "February": 2, "Feb": 2, "March": 3, "Mar": 3, "April": 4, "Apr": 4, "May": 5,
    "June": 6, "Jun": 6, "July": 7, "Jul": 7, "August": 8, "Aug": 8, "September": 9, "Sept": 9, "Sep": 9,
    "October": 10, "Oct": 10, "November": 11, "Nov": 11, "December": 12, "Dec": 12,
}  # fmt: skip
# Capitalised month names only, and a day number next to them: "may" the verb and "March 2024" are not dates.
_MONTH = r"(?:{})\b\.?".format("|".join(sorted(_MONTHS, key=len, reverse=True)))
_DAY = r"(?:[12]\d|3[01]|0?[1-9])(?:st|nd|rd|th)?(?![\d:])"
_YEAR = r"(?:19|20)\d\d(?!\d)"
_RANGE = r"\s*(?:-|–|—|to|through|until|till)\s*"
_DATE_PATTERN = re.compile(
    rf"\b(?P<m1>{_MONTH})\s+(?P<d1>{_DAY})(?:{_RANGE}(?:(?P<m1e>{_MONTH})\s+)?(?P<d1e>{_DAY}))?(?:,?\s+(?P<y1>{_YEAR}))?"
    rf"|\b(?P<d2>{_DAY})(?:\s*[-–—]\s*(?P<d2e>{_DAY}))?\s+(?:of\s+)?(?P<m2>{_MONTH})(?:,?\s+(?P<y2>{_YEAR}))?"
    r"|\b(?P<iy>(?:19|20)\d\d)-(?P<im>0?[1-9]|1[0-2])-(?P<id>[0-3]?\d)(?!\d)"
    r"|\b(?P<sa>[0-3]?\d)/(?P<sb>[0-3]?\d)/(?P<sy>(?:19|20)\d\d)(?!\d)"
)
# Text between two dates that makes them one span, so a year written once applies to both ends.
_CONNECTOR = re.compile(r"\s*,?\s*(?:-|–|—|to|through|until|till|and)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class NamedDate:
    """A calendar date named in a text. ``year`` is None when the text gives none and no neighbour lends one."""

    text: str
    start: int
    end: int
    month: int
    day: int
    year: int | None

    @property
    def date(self) -> dt.date | None:
        return dt.date(self.year, self.month, self.day) if self.year is not None else None


def _month_number(token: str) -> int:
    return _MONTHS[token.rstrip(".").strip()]


def _day_number(token: str) -> int:
    return int(re.match(r"\d+", token).group())


def _valid(month: int, day: int, year: int | None) -> bool:
    try:
        dt.date(2000 if year is None else year, month, day)  # 2000 is a leap year: "February 29" stays valid
    except ValueError:
        return False
    return True


def _dates_of_match(match: re.Match[str]) -> list[NamedDate]:
    """One regex match -> one or two dates (a range names both ends)."""
    text, start, end = match.group(), match.start(), match.end()
    g = match.groupdict()
    if g["sy"] is not None:
        a, b, year = int(g["sa"]), int(g["sb"]), int(g["sy"])
        readings = [(b, a)] if a > 12 else [(a, b)] if b > 12 else [(a, b), (b, a)]
        dates = [dt.date(year, m, d) for m, d in readings if _valid(m, d, year)]
        if not dates:
            return []
        latest = max(dates)  # day/month order unknown: judge by the later reading, never by a guess
        return [NamedDate(text, start, end, latest.month, latest.day, year)]
    if g["iy"] is not None:
        year, month, day = int(g["iy"]), int(g["im"]), int(g["id"])
        return [NamedDate(text, start, end, month, day, year)] if _valid(month, day, year) else []
    if g["m1"] is not None:
        month, day, year = _month_number(g["m1"]), _day_number(g["d1"]), g["y1"]
        end_month = _month_number(g["m1e"]) if g["m1e"] else month
        end_day = _day_number(g["d1e"]) if g["d1e"] else None
        if end_day is not None and g["m1e"] is None and end_day <= day:
            end_day = None  # "Jan 22 to 5 people" is not a range
    else:
        month, day, year = _month_number(g["m2"]), _day_number(g["d2"]), g["y2"]
        end_month, end_day = month, (_day_number(g["d2e"]) if g["d2e"] else None)
        if end_day is not None and end_day <= day:
            end_day = None
    year = int(year) if year else None
    if end_day is None:
        return [NamedDate(text, start, end, month, day, year)] if _valid(month, day, year) else []
    # "February 28 to March 2, 2024": the year belongs to the end; the start is in the year before if it wraps.
    start_year = None if year is None else year - 1 if (month, day) > (end_month, end_day) else year
    found = []
    if _valid(month, day, start_year):
        found.append(NamedDate(text, start, end, month, day, start_year))
    if _valid(end_month, end_day, year):
        found.append(NamedDate(text, start, end, end_month, end_day, year))
    return found


def find_named_dates(text: str) -> list[NamedDate]:
    """Calendar dates named in ``text``, in order.

    Recognised: "January 20, 2024", "Jan. 20th", "20 January 2024", "1st Jan", ranges such as "March 20-27, 2024",
    "February 28 to March 2, 2024", "Jan 22 to 25", "6-8 March 2024", ISO "2024-01-20" and "20/12/2023" (when the
    day/month order is ambiguous, the later reading). A date without a year borrows one from a dated neighbour it
    is joined to ("6 March to 8 March 2024"); otherwise its year stays unknown. Month-only ("March 2024") and
    year-only ("in 2023", "2023-24") mentions are not dates.
    """
    dates = [found for match in _DATE_PATTERN.finditer(text) for found in _dates_of_match(match)]

    def joined(left: NamedDate, right: NamedDate) -> bool:
        return left.end <= right.start and _CONNECTOR.fullmatch(text[left.end : right.start]) is not None

    for i in reversed(range(len(dates) - 1)):  # borrow from the right first: "6 March to 8 March 2024"
        here, after = dates[i], dates[i + 1]
        if here.year is None and after.year is not None and joined(here, after):
            year = after.year - 1 if (here.month, here.day) > (after.month, after.day) else after.year
            if _valid(here.month, here.day, year):
                dates[i] = NamedDate(here.text, here.start, here.end, here.month, here.day, year)
    for i in range(1, len(dates)):  # then from the left: "from Jan 1, 2024 to Jan 4"
        before, here = dates[i - 1], dates[i]
        if here.year is None and before.year is not None and joined(before, here):
            year = before.year + 1 if (here.month, here.day) < (before.month, before.day) else before.year
            if _valid(here.month, here.day, year):
                dates[i] = NamedDate(here.text, here.start, here.end, here.month, here.day, year)
    return dates


@dataclass(frozen=True)
class DateCheck:
    dates: list[NamedDate]
    past: bool  # every mention has a year, and the latest is before today
    undated: bool  # it names dates, none with a year

    @property
    def latest(self) -> dt.date | None:
        dated = [named.date for named in self.dates if named.date is not None]
        return max(dated) if dated else None


def check_dates(text: str, today: dt.date) -> DateCheck:
    """Whether ``text`` names only dates already past. Conservative: the latest date decides, so "between
    February 12, 2024 and August 9, 2050" is not past, and a date without a year (whose next occurrence is always
    ahead) keeps the whole text from being past."""
    dates = find_named_dates(text)
    latest = DateCheck(dates=dates, past=False, undated=False).latest
    all_dated = all(named.year is not None for named in dates)
    return DateCheck(
        dates=dates, past=latest is not None and all_dated and latest < today, undated=bool(dates) and latest is None
    )


# ---------------------------------------------------------------------------------------------------------------------
# Rows and split


def split_of(task_id: str, seed: int, val_fraction: float) -> str:
    """The split of a task, from its own id and the seed only: adding tasks never moves another one."""
    digest = hashlib.sha256(f"{seed}\x00{task_id}".encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else "train"


def build_row(task: Task, tool_interface: str) -> dict[str, Any]:
    """The NeMo Gym row for a task; a row that came in as one keeps everything it had."""
    if task.row is not None:
        row = dict(task.row)
        if task.verifier_metadata is None:
            row.pop("verifier_metadata", None)
        else:
            row["verifier_metadata"] = task.verifier_metadata
        row.setdefault("task_id", task.task_id)
        for name in REFERENCE_FIELDS:
            if row.get(name) is None and getattr(task, name) is not None:
                row[name] = getattr(task, name)
        return row
    system = SYSTEM_PROMPT_BROWSER if tool_interface == "browser" else SYSTEM_PROMPT_NATIVE
    tools = BROWSER_TOOL_SCHEMAS if tool_interface == "browser" else NATIVE_TOOL_SCHEMAS
    user = USER_PROMPT.format(question=task.question, site=task.site, url=task.initial_url)
    row: dict[str, Any] = {
        "responses_create_params": {
            "input": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "tools": tools,
        },
        "initial_url": task.initial_url,
    }
    if task.verifier_metadata is not None:
        row["verifier_metadata"] = task.verifier_metadata
    row.update(
        task_id=task.task_id,
        site=task.site,
        question=task.question,
        reference_answer=task.reference_answer,
        reference_type=task.reference_type,
        data_source=DATA_SOURCE,
        task_metadata=task.metadata,
    )
    return row


def write_jsonl_files(outputs: Mapping[Path, Iterable[Mapping[str, Any]]]) -> None:
    """Write every file or none: each goes to a temporary file beside it, and is renamed only when all are written.

    A failure removes the temporary files, and the output folder too when this call created it and it is empty.
    """
    folders = {path.parent for path in outputs}
    # every folder this call creates, deepest first, so that a failure can remove them in that order
    created = sorted(
        {folder for leaf in folders for folder in (leaf, *leaf.parents) if not folder.exists()},
        key=lambda folder: len(folder.parts),
        reverse=True,
    )
    temporaries: list[tuple[str, Path]] = []
    try:
        for folder in folders:
            folder.mkdir(parents=True, exist_ok=True)
        umask = os.umask(0)
        os.umask(umask)
        for path, rows in outputs.items():
            handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
            temporaries.append((temporary, path))
            os.fchmod(handle, 0o666 & ~umask)  # mkstemp makes 0600; an output file gets the usual mode
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                for row in rows:
                    stream.write(json.dumps(row, ensure_ascii=False) + "\n")
                stream.flush()
                os.fsync(stream.fileno())
        for temporary, path in temporaries:
            os.replace(temporary, path)
    except BaseException:
        for temporary, _ in temporaries:
            if os.path.exists(temporary):
                os.unlink(temporary)
        for folder in created:
            if folder.exists() and not any(folder.iterdir()):
                folder.rmdir()
        raise


# ---------------------------------------------------------------------------------------------------------------------
# The command


@dataclass
class Report:
    source: str
    records: int = 0
    kept: list[tuple[Task, dict[str, Any], str]] = field(default_factory=list)  # (task, row, split)
    dropped: Counter[str] = field(default_factory=Counter)
    date_checks: dict[str, DateCheck] = field(default_factory=dict)
    past_listed: list[Task] = field(default_factory=list)
    references: int | None = None
    references_used: int = 0
    warnings: list[str] = field(default_factory=list)  # about input that was used, e.g. alias conflicts


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prepare_webvoyager_data.py",
        description=(
            "Turn a WebVoyager task list into NeMo Gym rollout rows for this recipe, split into "
            f"OUTPUT_DIR/{TRAIN_FILE} and OUTPUT_DIR/{VAL_FILE}."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"""\
examples:
  # the WebVoyager task list with its reference answers, 10% validation
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl \\
      --reference-answers reference_answer.json --output-dir data/webvoyager

  # see what would be written, and which tasks name dates already past, without writing
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl --output-dir data/webvoyager --dry-run

  # two sites only, no tasks with past dates, rows for NeMo Gym's five native browser tools
  python prepare_webvoyager_data.py --input WebVoyager_data.jsonl --output-dir data/two_sites \\
      --include-site Allrecipes --include-site ArXiv --exclude-stale-dates --tool-interface native

  # a Hugging Face dataset, or one saved with save_to_disk
  python prepare_webvoyager_data.py --hf-dataset ORG/NAME --hf-split test --output-dir data/hf
  python prepare_webvoyager_data.py --from-disk saved/webvoyager --hf-split train --output-dir data/disk

input:
  One JSON object per line (blank lines are skipped, a missing final newline is fine). WebVoyager's fields:
  id, ques, web, optional web_name (aliases: task_id, question, start_url/initial_url, site). Other fields are
  kept under task_metadata. A row with a field and its alias uses WebVoyager's field (id is the task id) and keeps
  the alias under task_metadata; a warning per input counts the rows where the two differ. A line with
  responses_create_params is a NeMo Gym row and passes through, validated. verifier_metadata, where given, must
  hold exactly one of {", ".join(VERIFIER_KEYS)}, a non-empty string (the server grades only the first of
  these it finds, in this order, and ignores the rest).

split:
  A task goes to validation when sha256(seed, task id) falls below --val-fraction: deterministic, and stable
  when tasks are added or removed. The validation share is therefore close to, not exactly, the fraction.

exit status: 0 written (or dry run done), 2 bad usage or bad input (each error names its file and line).""",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", type=Path, action="append", metavar="FILE.jsonl", help="local JSONL (repeatable)")
    source.add_argument("--hf-dataset", metavar="NAME", help="Hugging Face dataset name (or a local dataset folder)")
    source.add_argument("--from-disk", metavar="PATH", help="a dataset folder written by save_to_disk")
    parser.add_argument("--hf-split", metavar="SPLIT", help="split to read (--hf-dataset default: train)")
    parser.add_argument("--hf-config", metavar="CONFIG", help="dataset configuration name for --hf-dataset")
    parser.add_argument("--cache-dir", metavar="DIR", help="datasets cache folder for --hf-dataset")
    parser.add_argument("--output-dir", type=Path, required=True, metavar="DIR", help="where the files go")
    parser.add_argument("--reference-answers", type=Path, metavar="FILE", help="WebVoyager reference_answer.json")
    parser.add_argument(
        "--val-fraction", type=float, default=DEFAULT_VAL_FRACTION, metavar="F",
        help=f"share of tasks for validation, 0 <= F < 1 (default {DEFAULT_VAL_FRACTION})",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"split seed (default {DEFAULT_SEED})")
    parser.add_argument("--include-site", action="append", default=[], metavar="SITE", help="keep only these sites")
    parser.add_argument("--exclude-site", action="append", default=[], metavar="SITE", help="drop these sites")
    parser.add_argument("--limit", type=int, metavar="N", help="keep the first N tasks left after the filters")
    parser.add_argument(
        "--exclude-stale-dates", action="store_true",
        help="drop tasks whose question names only dates before today (listed either way)",
    )  # fmt: skip
    parser.add_argument("--today", type=dt.date.fromisoformat, metavar="YYYY-MM-DD", help="date the check uses")
    parser.add_argument(
        "--tool-interface", choices=TOOL_INTERFACES, default="browser",
        help="the tools the prompt teaches: 'browser' (one tool with an action, the recipe's default) or "
        "'native' (NeMo Gym's five browser_* tools; such rows also run in NeMo Gym's own agent)",
    )  # fmt: skip
    parser.add_argument("--dry-run", action="store_true", help="validate and report, write nothing")
    return parser


def alias_warnings(conflicts: Mapping[tuple[str, str, str], tuple[int, str]]) -> list[str]:
    """One line per (input, field used, alias) from ``{(input, field, alias): (rows, first location)}``."""
    lines = []
    for (origin, used, alias), (rows, first) in conflicts.items():
        verb = "rows give" if rows != 1 else "row gives"
        key = " (WebVoyager's key)" if used == ID_FIELDS[0] else ""
        lines.append(
            f"{origin}: {rows} {verb} both '{used}' and '{alias}' with different values (first at {first}); "
            f"'{used}' is used{key}, '{alias}' is kept in task_metadata"
        )
    return lines


def _read_tasks(args: argparse.Namespace) -> tuple[str, list[Task], list[InputError], int, list[str]]:
    """(source description, tasks, errors, records read, alias warnings). Errors are collected, not raised, to
    report them all; alias conflicts are counted per input (file or dataset) and reported once each."""
    records: Iterable[tuple[str, str, Any]]  # (input, location, parsed object or InputError)
    if args.input:
        missing = [path for path in args.input if not path.is_file()]
        if missing:
            raise InputError(str(missing[0]), "no such file")
        source = ", ".join(str(path) for path in args.input)
        total = sum(_count_lines(path) for path in args.input)
        records = ((str(path), *record) for path in args.input for record in _jsonl_records(path))
    else:
        if args.hf_dataset:
            split = args.hf_split or "train"
            dataset = load_hub_dataset(args.hf_dataset, args.hf_config, split, args.cache_dir)
            source = f"{args.hf_dataset}[{split}]"
        else:
            dataset, source = load_disk_dataset(args.from_disk, args.hf_split)
        total = len(dataset)
        records = ((source, *record) for record in _dataset_records(dataset, source))

    tasks: list[Task] = []
    errors: list[InputError] = []
    first_seen: dict[str, str] = {}
    conflicts: dict[tuple[str, str, str], tuple[int, str]] = {}
    count = 0
    progress = tqdm(
        records, total=total, unit="rows", desc="reading", disable=True if total < PROGRESS_MIN_RECORDS else None
    )
    for origin, location, obj in progress:
        count += 1
        try:
            if isinstance(obj, InputError):
                raise obj
            task = parse_record(obj, location)
            if task.task_id in first_seen:
                what = "same content as" if task.id_derived else "first at"
                raise InputError(location, f"duplicate task id {task.task_id!r} ({what} {first_seen[task.task_id]})")
            first_seen[task.task_id] = location
            tasks.append(task)
        except InputError as exc:
            errors.append(exc)
            continue
        for used, alias in task.alias_conflicts:
            rows, first = conflicts.get((origin, used, alias), (0, location))
            conflicts[(origin, used, alias)] = (rows + 1, first)
    return source, tasks, errors, count, alias_warnings(conflicts)


def _attach_references(tasks: list[Task], answers: Mapping[tuple[str, int], ReferenceAnswer]) -> list[Task]:
    attached = []
    for task in tasks:
        key = _reference_key(task)
        reference = answers.get(key) if key is not None else None
        if reference is not None:
            if task.reference_answer is not None and task.reference_answer != reference.answer:
                raise InputError(task.location, "its reference_answer differs from the one in --reference-answers")
            task = dataclasses.replace(task, reference_answer=reference.answer, reference_type=reference.type)
        attached.append(task)
    return attached


def _select_sites(tasks: list[Task], include: list[str], exclude: list[str], report: Report) -> list[Task]:
    known = {(task.site or "").casefold(): task.site for task in tasks}
    for name in [*include, *exclude]:
        if name.casefold() not in known:
            sites = ", ".join(sorted(str(site) for site in known.values()))
            raise InputError(None, f"unknown site {name!r} in a site filter; the input has: {sites}")
    wanted = {name.casefold() for name in include}
    unwanted = {name.casefold() for name in exclude}
    kept = []
    for task in tasks:
        site = (task.site or "").casefold()
        if (wanted and site not in wanted) or site in unwanted:
            report.dropped["site filter"] += 1
        else:
            kept.append(task)
    return kept


def prepare(args: argparse.Namespace, today: dt.date) -> Report:
    """Read, validate, filter, split. Raises InputError; writes nothing."""
    answers = load_reference_answers(args.reference_answers) if args.reference_answers else None
    source, tasks, errors, count, warnings = _read_tasks(args)
    if errors:
        raise _Errors(errors)
    report = Report(source=source, records=count, warnings=warnings)
    if answers is not None:
        tasks = _attach_references(tasks, answers)
        report.references = len(answers)
    tasks = _select_sites(tasks, args.include_site, args.exclude_site, report)
    selected = []
    for task in tasks:
        check = check_dates(task.question, today)
        report.date_checks[task.task_id] = check
        if check.past:
            report.past_listed.append(task)
            if args.exclude_stale_dates:
                report.dropped["past date"] += 1
                continue
        selected.append(task)
    if args.limit is not None and len(selected) > args.limit:
        report.dropped["--limit"] += len(selected) - args.limit
        selected = selected[: args.limit]
    if not selected:
        raise InputError(source, "no task left to write" + (" after the filters" if report.dropped else ""))
    for task in selected:
        report.kept.append(
            (task, build_row(task, args.tool_interface), split_of(task.task_id, args.seed, args.val_fraction))
        )
    if answers is not None:
        report.references_used = sum(1 for task, _, _ in report.kept if _reference_key(task) in answers)
    return report


def prepare_rows(task_file: Path, output_dir: Path, tool_interface: str = BROWSER_TOOL) -> Path:
    """Every task of ``task_file`` (any input format ``--input`` reads) as rows in ``output_dir/train.jsonl``.

    The library form of ``--input FILE --val-fraction 0 --output-dir DIR``: the same validation and rows, no report.
    Raises :class:`InputError` naming every record it refuses.
    """
    argv = ["--input", str(task_file), "--val-fraction", "0", "--output-dir", str(output_dir)]
    args = _parser().parse_args([*argv, "--tool-interface", tool_interface])
    try:
        report = prepare(args, dt.date.today())
    except _Errors as exc:
        raise InputError(str(task_file), "; ".join(str(error) for error in exc.errors[:MAX_ERRORS_SHOWN])) from None
    path = Path(output_dir) / TRAIN_FILE
    write_jsonl_files({path: [row for _, row, _ in report.kept]})
    return path


class _Errors(Exception):
    def __init__(self, errors: list[InputError]):
        super().__init__(f"{len(errors)} input errors")
        self.errors = errors


def format_report(report: Report, args: argparse.Namespace, today: dt.date, written: Sequence[Path]) -> str:
    lines = [f"source: {report.source} ({report.records} records)"]
    if report.references is not None:
        lines.append(
            f"reference answers: {args.reference_answers} ({report.references}, {report.references_used} used)"
        )
    lines.append(f"split: validation fraction {args.val_fraction}, seed {args.seed} (hash of the task id)")
    lines.append(f"tool interface: {args.tool_interface}")
    action = "excluded" if args.exclude_stale_dates else "kept; --exclude-stale-dates drops them"
    lines.append("")
    lines.append(f"tasks naming only dates before {today.isoformat()}: {len(report.past_listed)} ({action})")
    for task in report.past_listed:
        check = report.date_checks[task.task_id]
        dated = sorted({named.date for named in check.dates if named.date is not None})
        span = dated[0].isoformat() if len(dated) == 1 else f"{dated[0].isoformat()}..{dated[-1].isoformat()}"
        lines.append(f"  {task.task_id:<20} {span:<22} {shorten(task.question, LISTING_QUESTION_CHARS, one_line=True)}")

    sites = sorted({task.site or "-" for task, _, _ in report.kept}, key=str.casefold)
    types = sorted({task.reference_type for task, _, _ in report.kept if task.reference_type is not None})
    header = ["site", "train", "val", "total", *types, "no ref", "verifier", "past date", "no year"]
    table: list[list[Any]] = []
    totals = Counter()
    for site in [*sites, None]:
        rows = [(task, split) for task, _, split in report.kept if site is None or (task.site or "-") == site]
        counts = Counter(
            train=sum(split == "train" for _, split in rows),
            val=sum(split == "val" for _, split in rows),
            total=len(rows),
            **{kind: sum(task.reference_type == kind for task, _ in rows) for kind in types},
        )
        counts["no ref"] = sum(task.reference_answer is None for task, _ in rows)
        counts["verifier"] = sum(task.verifier_metadata is not None for task, _ in rows)
        counts["past date"] = sum(report.date_checks[task.task_id].past for task, _ in rows)
        counts["no year"] = sum(report.date_checks[task.task_id].undated for task, _ in rows)
        table.append(["total" if site is None else site, *(counts[name] for name in header[1:])])
        totals = counts
    widths = [max(len(str(row[i])) for row in [header, *table]) for i in range(len(header))]

    def render(row: Sequence[Any]) -> str:
        return "  ".join(
            str(cell).ljust(widths[0]) if i == 0 else str(cell).rjust(widths[i]) for i, cell in enumerate(row)
        )

    lines += ["", render(header), render(["-" * width for width in widths]), *map(render, table[:-1])]
    lines += [render(["-" * width for width in widths]), render(table[-1]), ""]
    dropped = ", ".join(f"{reason}: {n}" for reason, n in sorted(report.dropped.items())) or "none"
    lines.append(f"dropped: {sum(report.dropped.values())} ({dropped})")
    if totals["val"] == 0 and args.val_fraction > 0:
        lines.append("warning: the validation split is empty; verl needs at least one validation row")
    if written:
        counts = Counter(split for _, _, split in report.kept)
        lines.append("wrote: " + ", ".join(f"{path} ({counts[path.stem]} rows)" for path in written))
    else:
        lines.append("dry run: nothing written")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not 0 <= args.val_fraction < 1:
        print(f"error: --val-fraction must be in [0, 1), got {args.val_fraction}", file=sys.stderr)
        return 2
    if args.limit is not None and args.limit < 1:
        print(f"error: --limit must be at least 1, got {args.limit}", file=sys.stderr)
        return 2
    if args.hf_split and args.input:
        print("error: --hf-split applies to --hf-dataset and --from-disk only", file=sys.stderr)
        return 2
    today = args.today or dt.date.today()
    try:
        report = prepare(args, today)
    except _Errors as exc:
        for error in exc.errors[:MAX_ERRORS_SHOWN]:
            print(f"error: {error}", file=sys.stderr)
        if len(exc.errors) > MAX_ERRORS_SHOWN:
            print(f"error: ... and {len(exc.errors) - MAX_ERRORS_SHOWN} more", file=sys.stderr)
        print("nothing written", file=sys.stderr)
        return 2
    except InputError as exc:
        print(f"error: {exc}\nnothing written", file=sys.stderr)
        return 2
    for warning in report.warnings:
        print(f"warning: {warning}", file=sys.stderr)

    written: list[Path] = []
    if not args.dry_run:
        outputs = {
            args.output_dir / TRAIN_FILE: [row for _, row, split in report.kept if split == "train"],
            args.output_dir / VAL_FILE: [row for _, row, split in report.kept if split == "val"],
        }
        try:
            write_jsonl_files(outputs)
        except OSError as exc:
            print(f"error: cannot write to {args.output_dir}: {exc}\nnothing written", file=sys.stderr)
            return 2
        written = list(outputs)
    print(format_report(report, args, today, written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
