"""Trajectories a person can read: one JSONL record per episode, written while training.

What this module owns
    * The record of one rollout (:func:`episode_record`), written by ``BrowserToolAgentLoop.run`` when the setting
      ``trajectory_dir`` is set (null: nothing is written): the task (id, question, start URL), the final attempt's
      steps (action, arguments, result, when), its final answer and last page, the per-sample flags, the reward,
      the kinds of the failed attempts before it, the model's last turn (decoded), and verl's ``uid`` /
      ``session_id`` / ``global_steps`` when the V1 trainer passed them. The steps are the lines ``BrowserEpisode``
      already keeps for the judge (``steps``), split into their parts, never a second recording; :class:`StepLines`
      notes when each line was added.
    * Where records go (:func:`write_record`): ``<trajectory_dir>/step-<global_steps>/<host>-<pid>.jsonl``, one file
      per training step and worker process, one ``os.write`` of one whole line per episode on a file opened with
      ``O_APPEND``: records of concurrent rollouts never interleave, and no two processes share a file. A failure
      to write is logged once per folder and never fails the rollout.

What a record never holds
    * Secrets. The judge's key lives in the judge's config and never reaches an episode; no credential of the
      writing process (``credentials.secret_values``) appears in a line. URLs (the start URL, the last page, URLs
      inside steps, answers, page text and failure reasons) may carry credentials: their user-info is removed and
      the values of parameters whose name looks like a credential (``token``, ``key``, ``secret``, ``password``,
      ``auth``, ``session``, ``sig`` ...) are replaced by ``REDACTED``, in the query, the fragment and ``;``
      parameters alike; other parameters (a search query) are kept, because a reader needs them to follow the
      episode. Folders are created 0700 and files 0600: only the run's user reads them.
    * Unbounded text: arguments, results, the final answer and the page text are cut to fixed lengths.
    * Rollouts the drop switch removed (``NEMO_GYM_BROWSER_DROP_INVALID=1``): the loop returns before writing;
      the run's ledger of dropped rollouts counts them.

``python -m nemo_gym_browser.trajectories DIR --html out.html`` renders the records as a page
(:mod:`trajectory_page`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .credentials import redact, secret_values
from .environment import parse_observation
from .text import shorten

logger = logging.getLogger(__name__)

RECORD_VERSION = 1
STEP_DIR_PREFIX = "step-"
UNKNOWN_STEP_DIR = "step-none"  # rollouts outside a trainer (rehearsal, tests)
# Bounds that keep one record a few kilobytes whatever the policy writes.
ARGUMENT_CHARS = 300
RESULT_CHARS = 300
ANSWER_CHARS = 2000
PAGE_TEXT_CHARS = 600
REASON_CHARS = 500
MAX_STEPS = 200  # a record keeps the first steps beyond this many (a turn limit is far below)
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
# A step line of BrowserEpisode: "click(element_id=3) -> ok", "navigate(url='...') -> refused", "x: invalid call (...)".
_STEP_LINE = re.compile(r"^(?P<action>\w+)\((?P<arguments>.*?)\) -> (?P<result>.*)$", re.DOTALL)
_INVALID_LINE = re.compile(r"^(?P<action>[\w.-]+): (?P<result>invalid call .*)$", re.DOTALL)


# ----- writing ------------------------------------------------------------------------------------------------


class StepLines(list):
    """``BrowserEpisode.steps``: the step lines, plus the monotonic time each was added (``times``)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.times: list[float] = [time.monotonic()] * len(self)

    def append(self, line: Any) -> None:
        super().append(line)
        self.times.append(time.monotonic())


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


def split_step_line(line: str) -> dict[str, Any]:
    """``{"action", "arguments", "result"}`` of one of ``BrowserEpisode``'s step lines (the whole line as result
    when its shape is unknown)."""
    line = str(line)
    match = _STEP_LINE.match(line) or _INVALID_LINE.match(line)
    if match is None:
        return {"action": None, "arguments": None, "result": _cut(redact_text(line), RESULT_CHARS)}
    parts = match.groupdict()
    return {
        "action": parts["action"],
        "arguments": _cut(redact_text(parts.get("arguments")), ARGUMENT_CHARS),
        "result": _cut(redact_text(parts["result"]), RESULT_CHARS),
    }


def _steps_of(episode: Any) -> list[dict[str, Any]]:
    if episode is None:
        return []
    lines = list(getattr(episode, "steps", []) or [])[:MAX_STEPS]
    times = getattr(getattr(episode, "steps", None), "times", None)
    started = getattr(episode, "started", None)
    steps = []
    for index, line in enumerate(lines):
        step = {"index": index, **split_step_line(line)}
        if times is not None and started is not None and index < len(times):
            # When the step's result came back, in seconds since the session was opened (generation included).
            step["at_s"] = round(times[index] - started, 3)
        steps.append(step)
    return steps


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
    output: Any,
    tokenizer: Any = None,
) -> dict[str, Any]:
    """The JSON-ready record of one finished rollout (``output`` carries the flags in ``extra_fields``)."""
    extra = dict(getattr(output, "extra_fields", None) or {})
    metrics = getattr(output, "metrics", None)
    flags = {
        "env_invalid": bool(extra.get("env_invalid", False)),
        "env_failure_kind": extra.get("env_failure_kind"),
        "env_failure_reason": _cut(redact_text(extra.get("env_failure_reason")), REASON_CHARS),
        "attempts": extra.get("env_attempts"),
        "deadline_hit": bool(extra.get("deadline_hit", False)),
        "reward_source": extra.get("reward_source"),
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
        "flags": flags,
        "failed_attempt_kinds": list(extra.get("env_failed_attempt_kinds") or []),
        "steps": _steps_of(episode),
        "final_answer": _cut(redact_text(getattr(episode, "final_answer", None)), ANSWER_CHARS) if episode else None,
        "last_page": _last_page(episode),
        "last_model_turn": _last_model_turn(output, tokenizer),
        "timing": {
            "episode_wall_s": extra.get("env_episode_wall_s"),
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


def write_episode(
    trajectory_dir: str | os.PathLike[str],
    *,
    episode_id: str,
    spec: Any,
    run_kwargs: Mapping[str, Any],
    episode: Any,
    output: Any,
    tokenizer: Any = None,
) -> Path | None:
    """Build and append the record of one rollout (what ``BrowserToolAgentLoop.run`` calls)."""
    try:
        record = episode_record(
            episode_id=episode_id, spec=spec, run_kwargs=run_kwargs, episode=episode, output=output, tokenizer=tokenizer
        )
    except Exception:  # a record is for reading; it must never cost the rollout
        logger.exception("episode %s: could not build its trajectory record", episode_id)
        return None
    return write_record(trajectory_dir, record)


if __name__ == "__main__":
    from .trajectory_page import main

    raise SystemExit(main())
