"""Trajectories a person can read: one JSONL record per episode while training, and a static HTML page over them.

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
      ``O_APPEND``: records of concurrent rollouts never interleave, and no two processes share a file.
    * The page (``python -m nemo_gym_browser.trajectories DIR --html out.html``): a section per training step, each
      GRPO group's episodes side by side with their steps, reward, flags, the recipe's advantage (read from the
      V1 trainer's advantage log, ``NEMO_GYM_BROWSER_ADVANTAGE_LOG``) next to stock GRPO's (computed here from the
      group's rewards, failures as zeros). Static HTML with inline CSS, nothing fetched.

What a record never holds
    * Secrets. The judge's key lives in the judge's config and never reaches an episode. URLs (the start URL, the
      last page, URLs inside steps and failure reasons) may carry credentials: their user-info is removed and the
      values of query parameters whose name looks like a credential (``token``, ``key``, ``secret``, ``password``,
      ``auth``, ``session``, ``sig`` ...) are replaced by ``REDACTED``; other parameters (a search query) are kept,
      because a reader needs them to follow the episode.
    * Unbounded text: arguments, results, the final answer and the page text are cut to fixed lengths.
    * Rollouts the drop switch removed (``NEMO_GYM_BROWSER_DROP_INVALID=1``): the loop returns before writing;
      the run's ledger of dropped rollouts counts them.

The policy's text (answers, typed text, URLs it chose) is untrusted: the page escapes every string it shows.
"""

from __future__ import annotations

import argparse
import html
import json
import logging
import math
import os
import re
import socket
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

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
# Query parameter names whose values are treated as credentials.
_SECRET_PARAMETER = re.compile(
    r"(token|key|secret|passw|pwd|auth|session|sid|sig|credential|cookie|code|bearer|jwt)", re.IGNORECASE
)
_URL = re.compile(r"https?://[^\s'\"<>]+", re.IGNORECASE)
# A step line of BrowserEpisode: "click(element_id=3) -> ok", "navigate(url='...') -> refused", "x: invalid call (...)".
_STEP_LINE = re.compile(r"^(?P<action>\w+)\((?P<arguments>.*?)\) -> (?P<result>.*)$", re.DOTALL)
_INVALID_LINE = re.compile(r"^(?P<action>[\w.-]+): (?P<result>invalid call .*)$", re.DOTALL)
# verl's GRPO: a group of one has mean 0 and std 1; std is the unbiased one; eps as in verl.
GRPO_EPS = 1e-6


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


def redact_url(url: str) -> str:
    """``url`` without user-info and with credential-like query values replaced (see the module docstring)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    netloc = parts.netloc.rsplit("@", 1)[-1] if "@" in parts.netloc else parts.netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        if any(_SECRET_PARAMETER.search(name) for name, _ in pairs):
            query = urlencode([(name, REDACTED if _SECRET_PARAMETER.search(name) else value) for name, value in pairs])
    if netloc == parts.netloc and query == parts.query:
        return url
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str | None) -> str | None:
    """``text`` with every http(s) URL in it passed through :func:`redact_url`."""
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
        "title": _cut(title, ARGUMENT_CHARS),
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
        "question": _cut(getattr(spec, "question", None), ANSWER_CHARS),
        "start_url": redact_url(spec.initial_url) if getattr(spec, "initial_url", None) else None,
        "global_steps": _plain_scalar(run_kwargs.get("global_steps")),
        "uid": _plain_scalar(run_kwargs.get("uid")),
        "session_id": _plain_scalar(run_kwargs.get("session_id")),
        "index": _plain_scalar(run_kwargs.get("index")),
        "reward": float(reward) if reward is not None else None,
        "flags": flags,
        "failed_attempt_kinds": list(extra.get("env_failed_attempt_kinds") or []),
        "steps": _steps_of(episode),
        "final_answer": _cut(getattr(episode, "final_answer", None), ANSWER_CHARS) if episode is not None else None,
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
    line = (json.dumps(record, ensure_ascii=False, default=str) + "\n").encode("utf-8")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
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


# ----- reading ------------------------------------------------------------------------------------------------


class InputError(Exception):
    """A folder, record or advantage log the page cannot be built from (exit status 2)."""


def load_records(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record under ``folder`` (``step-*/*.jsonl``, any depth), in file and line order."""
    root = Path(folder)
    if not root.is_dir():
        raise InputError(f"{root}: not a folder (expected the trajectory_dir of a run)")
    records = []
    for path in sorted(root.rglob("*.jsonl")):
        with path.open(encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise InputError(f"{path}:{number}: not a JSON line ({exc.msg})") from None
                if not isinstance(record, dict) or "episode_id" not in record or "flags" not in record:
                    raise InputError(f"{path}:{number}: not a trajectory record (no episode_id or flags)")
                records.append(record)
    if not records:
        raise InputError(f"{root}: no trajectory records (*.jsonl) found; was trajectory_dir set for the run?")
    return records


@dataclass(frozen=True)
class LoggedAdvantage:
    """The recipe's advantage of one episode, from the trainer's advantage log (its final sample)."""

    advantage: float
    score: float
    env_invalid: bool | None
    samples: int  # samples of the episode in the log (more than one in step-wise mode)


def load_advantage_log(path: str | os.PathLike[str]) -> dict[str, LoggedAdvantage]:
    """``{"<uid>_<session_id>": LoggedAdvantage}`` from the V1 trainer's advantage log (``patches.py``).

    verl keys a sample ``{uid}_{session_id}_{index}``; an episode's advantage is its highest index's, the sample
    verl's V1 GRPO scores the group with.
    """
    log = Path(path)
    if not log.is_file():
        raise InputError(f"{log}: no such advantage log (written when NEMO_GYM_BROWSER_ADVANTAGE_LOG is set)")
    finals: dict[str, tuple[int, dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    with log.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                samples = entry["samples"]
                for sample in samples:
                    session_key, _, index = str(sample["key"]).rpartition("_")
                    position = int(index)
                    float(sample["advantage"]), float(sample["score"])
                    counts[session_key] = counts.get(session_key, 0) + 1
                    if session_key not in finals or position >= finals[session_key][0]:
                        finals[session_key] = (position, sample)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise InputError(
                    f"{log}:{number}: not an advantage-log line ({{'step', 'samples': [{{'key', 'advantage', "
                    f"'score', ...}}]}}): {type(exc).__name__}: {exc}"
                ) from None
    return {
        key: LoggedAdvantage(
            advantage=float(sample["advantage"]),
            score=float(sample["score"]),
            env_invalid=sample.get("env_invalid"),
            samples=counts[key],
        )
        for key, (_, sample) in finals.items()
    }


def stock_grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """verl's stock GRPO over one group, failures entering as the zeros they were scored: ``(r - mean) / (std +
    eps)`` with the unbiased std; a group of one gets mean 0 and std 1, as in verl."""
    n = len(rewards)
    if n == 0:
        return []
    if n == 1:
        mean, std = 0.0, 1.0
    else:
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
    return [(r - mean) / (std + GRPO_EPS) for r in rewards]


@dataclass
class Episode:
    record: dict[str, Any]
    stock_advantage: float
    recipe: LoggedAdvantage | None = None

    @property
    def session_key(self) -> str | None:
        uid, session = self.record.get("uid"), self.record.get("session_id")
        return None if uid is None or session is None else f"{uid}_{session}"


@dataclass
class Group:
    """One GRPO group: the episodes of one prompt (verl's ``uid``; the task id outside the trainer)."""

    step: int | None
    key: str
    episodes: list[Episode] = field(default_factory=list)


def build_groups(
    records: Iterable[Mapping[str, Any]], advantages: Mapping[str, LoggedAdvantage] | None = None
) -> list[Group]:
    """Records grouped by training step and GRPO group, episodes by session, each with both advantages."""
    grouped: dict[tuple[int | None, str], list[dict[str, Any]]] = {}
    for record in records:
        step = record.get("global_steps")
        step = int(step) if isinstance(step, (int, float)) else None
        key = f"uid {record['uid']}" if record.get("uid") is not None else f"task {record.get('task_id')}"
        grouped.setdefault((step, key), []).append(dict(record))
    groups = []
    for (step, key), members in sorted(
        grouped.items(), key=lambda item: (item[0][0] is None, item[0][0] or 0, item[0][1])
    ):
        members.sort(key=lambda r: (r.get("session_id") is None, r.get("session_id") or 0, r.get("written_at") or 0))
        rewards = [float(r.get("reward") or 0.0) for r in members]  # an invalid episode is scored 0 by the loop
        group = Group(step=step, key=key)
        for record, stock in zip(members, stock_grpo_advantages(rewards), strict=True):
            episode = Episode(record=record, stock_advantage=stock)
            if advantages is not None and episode.session_key is not None:
                episode.recipe = advantages.get(episode.session_key)
            group.episodes.append(episode)
        groups.append(group)
    return groups


def disagreements(groups: Iterable[Group]) -> list[str]:
    """Episodes whose logged score differs from the record's reward (a log from another run, or a bug)."""
    found = []
    for group in groups:
        for episode in group.episodes:
            if episode.recipe is None:
                continue
            reward = float(episode.record.get("reward") or 0.0)
            if abs(episode.recipe.score - reward) > 1e-6:
                found.append(
                    f"episode {episode.record['episode_id']} ({episode.session_key}): reward {reward:g} in its "
                    f"record, score {episode.recipe.score:g} in the advantage log"
                )
    return found


# ----- the page -----------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f4f5f7;color:#1d2330}
header.page{padding:12px 20px;background:#1d2330;color:#fff}header.page h1{margin:0 0 4px;font-size:20px}
header.page p{margin:2px 0;color:#c9cfdb}nav a{color:#9cc3ff;margin-right:10px}
section.step{padding:8px 20px}section.step>h2{font-size:17px;border-bottom:2px solid #1d2330;padding-bottom:2px}
.group{background:#fff;border:1px solid #d5d9e0;border-radius:6px;margin:12px 0;padding:10px}
.group h3{margin:0;font-size:15px}.group .question{margin:2px 0;color:#333}.group .meta{color:#667;font-size:12px}
.episodes{display:flex;gap:10px;overflow-x:auto;padding-top:8px;align-items:flex-start}
.episode{flex:0 0 300px;border:1px solid #d5d9e0;border-top:5px solid #999;border-radius:4px;padding:8px;
background:#fcfcfd}
.episode.reward-pos{border-top-color:#2e9d4f}.episode.reward-zero{border-top-color:#d2872c}
.episode.invalid{border-top-color:#888;background:repeating-linear-gradient(45deg,#f3f3f3,#f3f3f3 8px,#ebebeb 8px,
#ebebeb 16px)}
.episode h4{margin:0 0 6px;font-size:14px}.tag{display:inline-block;padding:0 6px;border-radius:8px;font-size:11px;
background:#e3e7ee;margin-right:4px}.tag.bad{background:#f6d4d4;color:#8a1c1c}.tag.ok{background:#d6f0dd;color:#1b5e2f}
table.adv{border-collapse:collapse;width:100%;margin:4px 0}table.adv th{text-align:left;font-weight:normal;color:#556}
table.adv td{text-align:right;font:600 14px ui-monospace,monospace}.pos{color:#1b7a3a}.neg{color:#b3261e}
.zero{color:#667}ol.steps{margin:6px 0;padding-left:22px;font-size:12px}ol.steps li{margin:2px 0;word-break:break-word}
.action{font-weight:600}code{font:12px ui-monospace,monospace;background:#eef0f4;padding:0 2px}
.when{color:#889;font-size:11px}.answer,.page-seen,.reason,.said{font-size:12px;margin:4px 0;word-break:break-word}
"""


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _signed(value: float | None) -> tuple[str, str]:
    if value is None:
        return "n/a", "zero"
    shown = f"{value:+.3f}"
    return shown, "pos" if value > 5e-4 else "neg" if value < -5e-4 else "zero"


def _episode_html(episode: Episode) -> str:
    record = episode.record
    flags = record.get("flags") or {}
    reward = float(record.get("reward") or 0.0)
    kind = "invalid" if flags.get("env_invalid") else "reward-pos" if reward > 0 else "reward-zero"
    recipe_text, recipe_class = _signed(episode.recipe.advantage if episode.recipe else None)
    stock_text, stock_class = _signed(episode.stock_advantage)
    tags = []
    if flags.get("env_invalid"):
        tags.append(f'<span class="tag bad">invalid: {_e(flags.get("env_failure_kind"))}</span>')
    else:
        tags.append(f'<span class="tag ok">scored by {_e(flags.get("reward_source") or "nothing")}</span>')
    tags.append(f'<span class="tag">attempts {_e(flags.get("attempts"))}</span>')
    if flags.get("deadline_hit"):
        tags.append('<span class="tag bad">deadline hit</span>')
    for failed in record.get("failed_attempt_kinds") or []:
        tags.append(f'<span class="tag">failed attempt: {_e(failed)}</span>')
    steps = []
    for step in record.get("steps") or []:
        when = f' <span class="when">{step["at_s"]:.1f} s</span>' if isinstance(step.get("at_s"), (int, float)) else ""
        arguments = f"(<code>{_e(step.get('arguments'))}</code>)" if step.get("arguments") else ""
        steps.append(
            f'<li><span class="action">{_e(step.get("action") or "?")}</span>{arguments} → {_e(step.get("result"))}'
            f"{when}</li>"
        )
    page = record.get("last_page") or {}
    recipe_title = (
        f"{episode.recipe.samples} sample(s) in the log"
        if episode.recipe
        else "not in the advantage log (or none given)"
    )
    parts = [
        f'<article class="episode {kind}" data-episode-id="{_e(record.get("episode_id"))}" '
        f'data-session="{_e(record.get("session_id"))}">',
        f"<h4>session {_e(record.get('session_id'))} · reward {reward:g}</h4>",
        "<div>" + "".join(tags) + "</div>",
        '<table class="adv">',
        f'<tr><th title="{_e(recipe_title)}">recipe advantage</th>'
        f'<td class="adv-recipe {recipe_class}">{_e(recipe_text)}</td></tr>',
        f'<tr><th>stock GRPO</th><td class="adv-stock {stock_class}">{_e(stock_text)}</td></tr>',
        "</table>",
    ]
    if flags.get("env_failure_reason"):
        parts.append(f'<p class="reason">reason: {_e(flags["env_failure_reason"])}</p>')
    parts.append(f'<ol class="steps">{"".join(steps)}</ol>' if steps else '<p class="reason">no browser steps</p>')
    if record.get("final_answer") is not None:
        parts.append(f'<p class="answer">answer: <code>{_e(record["final_answer"])}</code></p>')
    if record.get("last_model_turn"):
        parts.append(f'<p class="said">model\'s last turn: <code>{_e(record["last_model_turn"])}</code></p>')
    if page:
        parts.append(f'<p class="page-seen">last page: {_e(page.get("title"))} <code>{_e(page.get("url"))}</code></p>')
    parts.append("</article>")
    return "\n".join(parts)


def _group_html(group: Group) -> str:
    first = group.episodes[0].record
    valid = sum(1 for episode in group.episodes if not (episode.record.get("flags") or {}).get("env_invalid"))
    rewards = [float(episode.record.get("reward") or 0.0) for episode in group.episodes]
    return "\n".join(
        [
            f'<div class="group" data-group="{_e(group.key)}">',
            f"<h3>{_e(first.get('task_id'))}</h3>",
            f'<p class="question">{_e(first.get("question"))}</p>',
            f'<p class="meta">{_e(group.key)} · start <code>{_e(first.get("start_url"))}</code> · '
            f"{len(group.episodes)} episodes, {valid} valid · mean reward {sum(rewards) / len(rewards):.3f}</p>",
            '<div class="episodes">',
            *(_episode_html(episode) for episode in group.episodes),
            "</div></div>",
        ]
    )


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def render_page(groups: Sequence[Group], *, source: str, advantage_log: str | None) -> str:
    """The whole page: a section per training step, a box per GRPO group, its episodes side by side."""
    steps: dict[int | None, list[Group]] = {}
    for group in groups:
        steps.setdefault(group.step, []).append(group)
    episodes = sum(len(group.episodes) for group in groups)
    nav = " ".join(
        f'<a href="#step-{_e(step if step is not None else "none")}">'
        f"{_e(f'step {step}' if step is not None else 'outside training')}</a>"
        for step in steps
    )
    sections = []
    for step, members in steps.items():
        anchor = step if step is not None else "none"
        title = f"Training step {step}" if step is not None else "Outside training (no global step)"
        sections.append(
            f'<section class="step" id="step-{_e(anchor)}" data-step="{_e(anchor)}"><h2>{_e(title)}</h2>\n'
            + "\n".join(_group_html(group) for group in members)
            + "\n</section>"
        )
    log_note = (
        f"recipe advantages from {_e(advantage_log)}"
        if advantage_log
        else "no advantage log given (--advantages): recipe advantages are shown as n/a"
    )
    return "\n".join(
        [
            "<!DOCTYPE html>",
            '<html lang="en"><head><meta charset="utf-8">',
            '<meta name="viewport" content="width=device-width, initial-scale=1">',
            "<title>Trajectories</title>",
            f"<style>{_CSS}</style></head><body>",
            '<header class="page"><h1>Trajectories</h1>',
            f"<p>{_count(episodes, 'episode')} in {_count(len(groups), 'group')} over "
            f"{_count(len(steps), 'training step')}, from {_e(source)}; "
            f"{log_note}. Stock GRPO: (r − mean) / (std + 1e-6) over the whole group, failures as zeros.</p>",
            f"<nav>{nav}</nav></header>",
            *sections,
            "</body></html>",
        ]
    )


# ----- command line -------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.trajectories",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Render the episodes a run wrote with trajectory_dir as one static HTML page: a section per "
        "training step, each GRPO group's episodes side by side with their steps, reward, flags, the recipe's "
        "advantage and stock GRPO's.",
        epilog="""examples:
  # records of a run started with nemo_gym_browser.trajectory_dir=/shared/traj and
  # NEMO_GYM_BROWSER_ADVANTAGE_LOG=/shared/advantages.jsonl (V1 trainer)
  python -m nemo_gym_browser.trajectories /shared/traj --advantages /shared/advantages.jsonl --html traj.html

  # records only: stock GRPO's advantages are computed, the recipe's shown as n/a
  python -m nemo_gym_browser.trajectories /shared/traj --html traj.html

stock GRPO is computed here from each group's rewards, an invalid episode entering as its 0, as verl's GRPO
would score it; the recipe's advantage is the one the trainer used, read from the advantage log.

exit status: 0 page written; 1 page written but the advantage log disagrees with the records (a score differs,
or no episode is in the log); 2 usage or input error (no records, a malformed line), nothing written.""",
    )
    parser.add_argument("folder", type=Path, metavar="DIR", help="the run's trajectory_dir")
    parser.add_argument("--html", type=Path, required=True, metavar="OUT.html", help="the page to write")
    parser.add_argument(
        "--advantages",
        type=Path,
        metavar="FILE",
        help="the V1 trainer's advantage log (NEMO_GYM_BROWSER_ADVANTAGE_LOG)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        records = load_records(args.folder)
        advantages = load_advantage_log(args.advantages) if args.advantages else None
    except (InputError, OSError, UnicodeDecodeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    groups = build_groups(records, advantages)
    page = render_page(groups, source=str(args.folder), advantage_log=str(args.advantages) if args.advantages else None)
    try:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(page, encoding="utf-8")
    except OSError as exc:
        print(f"error: cannot write {args.html}: {exc}", file=sys.stderr)
        return 2
    episodes = sum(len(group.episodes) for group in groups)
    matched = sum(1 for group in groups for episode in group.episodes if episode.recipe is not None)
    print(
        f"{args.html}: {episodes} episodes, {len(groups)} groups"
        + (f", {matched} in the advantage log" if advantages is not None else "")
    )
    problems = disagreements(groups)
    if advantages is not None and matched == 0:
        problems.append(f"no episode of {args.folder} is in {args.advantages} (another run's log?)")
    for problem in problems:
        print(f"check failed: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
