"""Trajectories a person can read: one JSONL record per episode, written while training.

Contract: :func:`episode_record` is the record of one rollout, written by ``BrowserToolAgentLoop.run`` when the
setting ``trajectory_dir`` is set: the task, the final attempt's steps (each ``Step``'s fields: action, arguments
as an object, outcome, detail, ``at_s``; :data:`RECORD_VERSION` 2, and records of version 1 still render), its answer
and last page, the flags, the reward, the kinds of earlier failed attempts, the model's last turn, and verl's
``uid``/``session_id``/``global_steps``.
:func:`write_record` appends it to ``<trajectory_dir>/step-<global_steps>/<host>-<pid>.jsonl`` with one ``os.write``
of one whole line (``O_APPEND``): concurrent records never interleave and no two processes share a file.

Guarantees: no secret (credentials of the process never appear; URL user-info and credential-like parameter values
become ``REDACTED``), bounded text, folders 0700 and files 0600; rollouts the drop switch removed are not written.
A failure to write is logged once per folder and never fails the rollout. ``python -m nemo_gym_browser.trajectories
DIR --html out.html`` renders the records (:mod:`trajectory_page`). In full: ``docs/trajectories.md``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .agent_attempt.episode import Step
from .agent_attempt.sample_flags import (
    DEADLINE_HIT_KEY,
    FAILURE_KIND_KEY,
    FAILURE_REASON_KEY,
    INVALID_KEY,
    REWARD_SOURCE_KEY,
    SampleFlags,
)
from .gym_contract.credentials import redact, secret_values
from .gym_contract.environment import parse_observation
from .gym_contract.text import shorten

logger = logging.getLogger(__name__)

RECORD_VERSION = 2  # 2: a step's arguments as the browser got them, its outcome and detail (1: one text each)
STEP_DIR_PREFIX = "step-"
UNKNOWN_STEP_DIR = "step-none"  # rollouts outside a trainer (rehearsal, tests)
# Bounds that keep one record a few kilobytes whatever the policy writes.
ARGUMENT_CHARS = 300
RESULT_CHARS = 300
ANSWER_CHARS = 2000
PAGE_TEXT_CHARS = 600
REASON_CHARS = 500
MAX_STEPS = 200  # a record keeps the first steps beyond this many (a turn limit is far below)
MAX_ARGUMENTS = 20  # entries kept of each mapping or list in a step's arguments (an invalid call's are the policy's)
MAX_ARGUMENT_DEPTH = 3  # nesting kept of a step's arguments; deeper values are written as their text
REDACTED = "REDACTED"
RECORD_DIR_MODE = 0o700
RECORD_FILE_MODE = 0o600
# Query parameter names whose values are treated as credentials.
_SECRET_PARAMETER = re.compile(
    r"(token|key|secret|passw|pwd|auth|session|sid|sig|credential|cookie|code|bearer|jwt)", re.IGNORECASE
)
# name=value pairs: in a query or fragment (after ?, &, ; or #) up to the next separator; in a path after ;.
_QUERY_PARAMETER = re.compile(r"(?P<lead>[?&;#/])(?P<name>[^=?&;#/]+)=(?P<value>[^&;#]*)")
_PATH_PARAMETER = re.compile(r"(?P<lead>;)(?P<name>[^=?&;#/]+)=(?P<value>[^;/?#]*)")
_URL = re.compile(r"\b[a-z][a-z0-9+.\-]*://[^\s'\"<>]+", re.IGNORECASE)  # any scheme: file: and ftp: URLs too


# ----- writing ------------------------------------------------------------------------------------------------


def _cut(text: Any, limit: int) -> str | None:
    if text is None:
        return None
    return shorten(str(text), limit)


def _redact_parameters(text: str, pattern: re.Pattern[str]) -> str:
    def replace(match: re.Match[str]) -> str:
        if not _SECRET_PARAMETER.search(unquote(match.group("name"))):
            return match.group(0)
        return f"{match.group('lead')}{match.group('name')}={REDACTED}"

    return pattern.sub(replace, text)


def redact_url(url: str) -> str:
    """``url`` without user-info and with credential-like parameter values replaced (see the module docstring):
    in the query, in the fragment (``#access_token=...``, ``#/callback?token=...``) and in ``;`` parameters of the
    path (``;jsessionid=...``)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1] if "@" in parts.netloc else parts.netloc
    path = _redact_parameters(parts.path, _PATH_PARAMETER)
    query = _redact_parameters("?" + parts.query, _QUERY_PARAMETER)[1:]
    fragment = _redact_parameters("#" + parts.fragment, _QUERY_PARAMETER)[1:]
    if (netloc, path, query, fragment) == (parts.netloc, parts.path, parts.query, parts.fragment):
        return url
    return urlunsplit((parts.scheme, netloc, path, query, fragment))


def redact_text(text: str | None) -> str | None:
    """``text`` with every URL in it (``scheme://...``) passed through :func:`redact_url`."""
    if not text:
        return text
    return _URL.sub(lambda match: redact_url(match.group(0)), text)


def _argument_value(value: Any, depth: int = 0) -> Any:
    """A step's argument as JSON, bounded and with credentials redacted (an invalid call's may be anything)."""
    if isinstance(value, str):
        return _cut(redact_text(value), ARGUMENT_CHARS)
    if value is None or isinstance(value, (bool, int)) or (isinstance(value, float) and math.isfinite(value)):
        return value
    if depth < MAX_ARGUMENT_DEPTH and isinstance(value, Mapping):
        items = list(value.items())[:MAX_ARGUMENTS]
        return {_cut(redact_text(str(key)), ARGUMENT_CHARS): _argument_value(item, depth + 1) for key, item in items}
    if depth < MAX_ARGUMENT_DEPTH and isinstance(value, (list, tuple)):
        return [_argument_value(item, depth + 1) for item in value[:MAX_ARGUMENTS]]
    return _cut(redact_text(str(value)), ARGUMENT_CHARS)


def step_record(index: int, step: Step) -> dict[str, Any]:
    """One step of a record: its fields, the arguments as the browser got them (bounded, redacted)."""
    return {
        "index": index,
        "action": step.action,
        "arguments": _argument_value(dict(step.arguments)),
        "outcome": str(step.outcome),
        "detail": _cut(redact_text(step.detail), RESULT_CHARS),
        # When the step's result came back, in seconds since the session was opened (generation included).
        "at_s": round(step.elapsed_s, 3),
    }


def _steps_of(steps: Sequence[Step]) -> list[dict[str, Any]]:
    return [step_record(index, step) for index, step in enumerate(steps[:MAX_STEPS])]


def _resumes_of(episode: Any) -> list[dict[str, Any]]:
    """Where the final attempt's sessions failed and what resuming did (:class:`~.agent_attempt.episode.Resume`)."""
    return [
        {
            "after_steps": resume.after_steps,
            "kind": resume.kind,
            "outcome": resume.outcome,
            "replayed_calls": resume.replayed_calls,
            "seconds": round(resume.seconds, 3),
            "detail": _cut(redact_text(resume.detail), REASON_CHARS),
        }
        for resume in getattr(episode, "resumes", ())[:MAX_STEPS]
    ]


def _last_page(episode: Any) -> dict[str, Any] | None:
    observation = getattr(episode, "last_observation", None) if episode is not None else None
    if not observation:
        return None

    url, title, text = parse_observation(observation)
    return {
        "url": _cut(redact_url(url), ARGUMENT_CHARS) if url else None,
        "title": _cut(redact_text(title), ARGUMENT_CHARS),
        "text": _cut(redact_text(text), PAGE_TEXT_CHARS),
    }


def _last_model_turn(output: Any, tokenizer: Any) -> str | None:
    """The sample's last run of policy tokens (its last turn), decoded: what the model said when no step shows it."""
    if tokenizer is None:
        return None
    ids, mask = list(getattr(output, "response_ids", None) or []), list(getattr(output, "response_mask", None) or [])
    if len(ids) != len(mask):
        return None
    end = len(mask)
    while end > 0 and mask[end - 1] == 0:  # the tool turn after it, if any
        end -= 1
    start = end
    while start > 0 and mask[start - 1] == 1:
        start -= 1
    if start == end:
        return None  # no policy token counted (an invalid sample's mask is zeroed)
    return _cut(redact_text(tokenizer.decode(ids[start:end], skip_special_tokens=True).strip()), ANSWER_CHARS)


def _plain_scalar(value: Any) -> Any:
    """verl passes numpy scalars and strings; a record holds JSON types only."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError):
            pass
    return str(value)


def episode_record(
    *,
    episode_id: str,
    spec: Any,
    run_kwargs: Mapping[str, Any],
    episode: Any,
    flags: SampleFlags,
    output: Any,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The JSON-ready record of one finished rollout with the flags its samples carry (``output``: the final one)."""
    metrics = getattr(output, "metrics", None)
    shown_flags = {
        INVALID_KEY: flags.invalid,
        FAILURE_KIND_KEY: flags.failure_kind,
        FAILURE_REASON_KEY: _cut(redact_text(flags.failure_reason), REASON_CHARS),
        "attempts": flags.attempts,
        DEADLINE_HIT_KEY: flags.deadline_hit,
        REWARD_SOURCE_KEY: flags.reward_source,
    }
    reward = getattr(output, "reward_score", None)
    return {
        "version": RECORD_VERSION,
        "episode_id": episode_id,
        "task_id": getattr(spec, "task_id", None),
        "question": _cut(redact_text(getattr(spec, "question", None)), ANSWER_CHARS),
        "start_url": redact_url(spec.initial_url) if getattr(spec, "initial_url", None) else None,
        "global_steps": _plain_scalar(run_kwargs.get("global_steps")),
        "uid": _plain_scalar(run_kwargs.get("uid")),
        "session_id": _plain_scalar(run_kwargs.get("session_id")),
        "index": _plain_scalar(run_kwargs.get("index")),
        "reward": float(reward) if reward is not None else None,
        "flags": shown_flags,
        "failed_attempt_kinds": list(flags.failed_attempt_kinds),
        "resumed_kinds": list(flags.resumed_kinds),
        "resumes": _resumes_of(episode) if episode is not None else [],
        "steps": _steps_of(episode.steps) if episode is not None else [],
        "final_answer": _cut(redact_text(getattr(episode, "final_answer", None)), ANSWER_CHARS) if episode else None,
        "last_page": _last_page(episode),
        "last_model_turn": _last_model_turn(output, tokenizer),
        "timing": {
            "episode_wall_s": flags.episode_wall_s,
            "generate_s": round(float(getattr(metrics, "generate_sequences", 0.0) or 0.0), 4),
            "tool_calls_s": round(float(getattr(metrics, "tool_calls", 0.0) or 0.0), 4),
            "model_s": round(episode.model_s, 4) if episode is not None else None,
        },
        "worker": f"{socket.gethostname()}-{os.getpid()}",
        "written_at": round(time.time(), 3),
    }


def record_path(trajectory_dir: str | os.PathLike[str], global_steps: Any) -> Path:
    """``<dir>/step-<global_steps>/<host>-<pid>.jsonl``: one file per training step and process."""
    step = _plain_scalar(global_steps)
    folder = f"{STEP_DIR_PREFIX}{int(step):06d}" if isinstance(step, (int, float)) else UNKNOWN_STEP_DIR
    return Path(trajectory_dir) / folder / f"{socket.gethostname()}-{os.getpid()}.jsonl"


_write_failures_logged: set[str] = set()


def write_record(trajectory_dir: str | os.PathLike[str], record: Mapping[str, Any]) -> Path | None:
    """Append ``record`` as one line; a failure to write is logged (once per folder) and never fails the rollout."""
    path = record_path(trajectory_dir, record.get("global_steps"))
    # The process's own credentials never reach a record, whichever field a server or the policy put them in.
    text = redact(json.dumps(record, ensure_ascii=False, default=str), secret_values(os.environ))
    line = (text + "\n").encode("utf-8")
    try:
        # Owner-only: records hold the policy's text and the pages it saw.
        Path(trajectory_dir).mkdir(mode=RECORD_DIR_MODE, parents=True, exist_ok=True)
        path.parent.mkdir(mode=RECORD_DIR_MODE, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, RECORD_FILE_MODE)
        try:
            os.write(descriptor, line)  # one write of one whole line: concurrent rollouts never interleave
        finally:
            os.close(descriptor)
    except OSError as exc:
        if str(trajectory_dir) not in _write_failures_logged:
            _write_failures_logged.add(str(trajectory_dir))
            logger.warning("episode %s: trajectory not written to %s: %s", record.get("episode_id"), path, exc)
        return None
    return path


def write_episode(trajectory_dir: str | os.PathLike[str], **fields: Any) -> Path | None:
    """Build the record of one rollout (``fields``: the keywords of :func:`episode_record`) and append it; what
    ``BrowserToolAgentLoop.run`` calls."""
    try:
        record = episode_record(**fields)
    except Exception:  # a record is for reading; it must never cost the rollout
        logger.exception("episode %s: could not build its trajectory record", fields.get("episode_id"))
        return None
    return write_record(trajectory_dir, record)


if __name__ == "__main__":
    from .trajectory_page import main

    raise SystemExit(main())
