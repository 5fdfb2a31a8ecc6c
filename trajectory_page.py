"""The page over a run's trajectory records (``python -m nemo_gym_browser.trajectories DIR --html out.html``).

A section per training step, each GRPO group's episodes side by side with their steps, reward, flags, and the
recipe's advantage (read from the V1 trainer's advantage log, ``NEMO_GYM_BROWSER_ADVANTAGE_LOG``) next to stock
GRPO's (computed here from the group's rewards, failures as zeros). Static HTML with inline CSS, nothing fetched;
its Content-Security-Policy allows that one style block and nothing else. The records are those
:mod:`trajectories` writes; the policy's text in them (answers, typed text, URLs it chose) is untrusted, so the
page escapes every string it shows, and a record of the wrong shape is refused naming its file and line.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import html
import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from .agent_attempt.sample_flags import (
    DEADLINE_HIT_KEY,
    FAILURE_KIND_KEY,
    FAILURE_REASON_KEY,
    INVALID_KEY,
    REWARD_SOURCE_KEY,
)
from .gym_contract.rows import RowValueError, parse_row_json
from .task_lists.tasks import InputError

# verl's GRPO: a group of one has mean 0 and std 1; std is the unbiased one; eps as in verl.
GRPO_EPS = 1e-6


# ----- reading ------------------------------------------------------------------------------------------------


Scalar = StrictStr | StrictInt | StrictFloat | StrictBool | None
Number = Annotated[StrictFloat | StrictInt, Field(allow_inf_nan=False)]


class _Shape(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class _StepShape(_Shape):
    action: Scalar = None
    arguments: Scalar | dict[str, Any] = None  # record version 1: one text; 2: the arguments the browser got
    result: Scalar = None  # version 1 only; version 2 writes outcome and detail
    outcome: Scalar = None
    detail: Scalar = None
    at_s: Number | None = None


class _FlagsShape(_Shape):
    invalid: StrictBool | None = Field(None, alias=INVALID_KEY)
    failure_kind: Scalar = Field(None, alias=FAILURE_KIND_KEY)
    failure_reason: Scalar = Field(None, alias=FAILURE_REASON_KEY)
    attempts: Scalar = None
    deadline_hit: StrictBool | None = Field(None, alias=DEADLINE_HIT_KEY)
    reward_source: Scalar = Field(None, alias=REWARD_SOURCE_KEY)


class _PageShape(_Shape):
    url: Scalar = None
    title: Scalar = None
    text: Scalar = None


class _ResumeShape(_Shape):
    after_steps: StrictInt
    kind: Scalar = None
    outcome: Scalar = None
    replayed_calls: StrictInt = 0
    seconds: Number = 0.0
    detail: Scalar = None


class _RecordShape(_Shape):
    """What the page reads of a record, with the types it relies on (other keys pass unread)."""

    episode_id: StrictStr | StrictInt
    flags: _FlagsShape
    reward: Number | None = None
    global_steps: Number | None = None
    written_at: Number | None = None
    uid: Scalar = None
    session_id: Scalar = None
    task_id: Scalar = None
    question: Scalar = None
    start_url: Scalar = None
    final_answer: Scalar = None
    last_model_turn: Scalar = None
    steps: list[_StepShape] = []
    failed_attempt_kinds: list[Scalar] = []
    resumed_kinds: list[Scalar] = []
    resumes: list[_ResumeShape] = []
    last_page: _PageShape | None = None


def _first_problem(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"]) or "the record"
    return f"{where}: {error['msg']}" + (f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else "")


def _json_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, value)`` of each non-blank line; a line that is not strict JSON raises InputError there."""
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{path}:{number}", f"not valid UTF-8 ({exc.reason})") from None
            if not line.strip():
                continue
            try:
                yield number, parse_row_json(line)
            except RowValueError as exc:
                raise InputError(f"{path}:{number}", f"not a JSON line ({exc})") from None


def load_records(folder: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every record under ``folder`` (``step-*/*.jsonl``, any depth), in file and line order; a record the page
    cannot show raises :class:`~nemo_gym_browser.task_lists.tasks.InputError` naming its file and line."""
    root = Path(folder)
    if not root.is_dir():
        raise InputError(str(root), "not a folder (expected the trajectory_dir of a run)")
    records = []
    for path in sorted(root.rglob("*.jsonl")):
        for number, record in _json_lines(path):
            if not isinstance(record, dict) or "episode_id" not in record or "flags" not in record:
                raise InputError(f"{path}:{number}", "not a trajectory record (no episode_id or flags)")
            try:
                _RecordShape.model_validate(record)
            except ValidationError as exc:
                problem = _first_problem(exc)
                raise InputError(f"{path}:{number}", f"not a trajectory record the page can show: {problem}") from None
            records.append(record)
    if not records:
        raise InputError(str(root), "no trajectory records (*.jsonl) found; was trajectory_dir set for the run?")
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
        raise InputError(str(log), "no such advantage log (written when NEMO_GYM_BROWSER_ADVANTAGE_LOG is set)")
    finals: dict[str, tuple[int, dict[str, Any]]] = {}
    counts: dict[str, int] = {}
    for number, entry in _json_lines(log):
        try:
            samples = entry["samples"]
            for sample in samples:
                session_key, _, index = str(sample["key"]).rpartition("_")
                position = int(index)
                float(sample["advantage"]), float(sample["score"])
                counts[session_key] = counts.get(session_key, 0) + 1
                if session_key not in finals or position >= finals[session_key][0]:
                    finals[session_key] = (position, sample)
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(
                f"{log}:{number}",
                f"not an advantage-log line ({{'step', 'samples': [{{'key', 'advantage', "
                f"'score', ...}}]}}): {type(exc).__name__}: {exc}",
            ) from None
    return {
        key: LoggedAdvantage(
            advantage=float(sample["advantage"]),
            score=float(sample["score"]),
            env_invalid=sample.get(INVALID_KEY),
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


def _sort_key(value: Any) -> tuple[int, float, str]:
    """Numbers first, in order, then text; None last: a key that never compares a number with a string."""
    if value is None:
        return (2, 0.0, "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0.0, str(value))


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
        members.sort(key=lambda r: (_sort_key(r.get("session_id")), r.get("written_at") or 0))
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
ol.steps li.resume{list-style:none;color:#a60;font-style:italic}
.action{font-weight:600}code{font:12px ui-monospace,monospace;background:#eef0f4;padding:0 2px}
.when{color:#889;font-size:11px}.answer,.page-seen,.reason,.said{font-size:12px;margin:4px 0;word-break:break-word}
"""


# The page needs its one inline style block and nothing else: no script, image, font, frame or fetch, from anywhere.
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; "
    f"style-src 'sha256-{base64.b64encode(hashlib.sha256(_CSS.encode()).digest()).decode()}'; "
    "base-uri 'none'; form-action 'none'"
)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _signed(value: float | None) -> tuple[str, str]:
    if value is None:
        return "n/a", "zero"
    shown = f"{value:+.3f}"
    return shown, "pos" if value > 5e-4 else "neg" if value < -5e-4 else "zero"


def _shown_arguments(arguments: Any) -> str:
    if isinstance(arguments, Mapping):
        return ", ".join(f"{key}={json.dumps(value, ensure_ascii=False)}" for key, value in arguments.items())
    return str(arguments)


def _shown_result(step: Mapping[str, Any]) -> str | None:
    if "outcome" not in step:
        return step.get("result")  # a record of version 1
    return f"{step['outcome']}: {step['detail']}" if step.get("detail") else step.get("outcome")


def _episode_html(episode: Episode) -> str:
    record = episode.record
    flags = record.get("flags") or {}
    reward = float(record.get("reward") or 0.0)
    kind = "invalid" if flags.get(INVALID_KEY) else "reward-pos" if reward > 0 else "reward-zero"
    recipe_text, recipe_class = _signed(episode.recipe.advantage if episode.recipe else None)
    stock_text, stock_class = _signed(episode.stock_advantage)
    tags = []
    if flags.get(INVALID_KEY):
        tags.append(f'<span class="tag bad">invalid: {_e(flags.get(FAILURE_KIND_KEY))}</span>')
    else:
        tags.append(f'<span class="tag ok">scored by {_e(flags.get(REWARD_SOURCE_KEY) or "nothing")}</span>')
    tags.append(f'<span class="tag">attempts {_e(flags.get("attempts"))}</span>')
    if flags.get(DEADLINE_HIT_KEY):
        tags.append('<span class="tag bad">deadline hit</span>')
    for failed in record.get("failed_attempt_kinds") or []:
        tags.append(f'<span class="tag">failed attempt: {_e(failed)}</span>')
    for resumed in record.get("resumed_kinds") or []:
        tags.append(f'<span class="tag">resumed after: {_e(resumed)}</span>')
    resumes: dict[int, list[Mapping[str, Any]]] = {}
    for resume in record.get("resumes") or []:
        resumes.setdefault(resume["after_steps"], []).append(resume)
    steps = []
    for index, step in enumerate([*(record.get("steps") or []), None]):
        for resume in resumes.get(index, []):  # a session failed here: the next call was made again, or not
            detail = f": {resume['detail']}" if resume.get("detail") else ""
            steps.append(
                f'<li class="resume">{_e(resume.get("kind"))}, {_e(resume.get("outcome"))}: '
                f"{_e(resume.get('replayed_calls'))} call(s) replayed in {float(resume.get('seconds') or 0):.1f} s"
                f"{_e(detail)}</li>"
            )
        if step is None:
            break
        when = f' <span class="when">{step["at_s"]:.1f} s</span>' if isinstance(step.get("at_s"), (int, float)) else ""
        arguments = f"(<code>{_e(_shown_arguments(step.get('arguments')))}</code>)" if step.get("arguments") else ""
        steps.append(
            f'<li><span class="action">{_e(step.get("action") or "?")}</span>{arguments} → {_e(_shown_result(step))}'
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
    if flags.get(FAILURE_REASON_KEY):
        parts.append(f'<p class="reason">reason: {_e(flags[FAILURE_REASON_KEY])}</p>')
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
    valid = sum(1 for episode in group.episodes if not (episode.record.get("flags") or {}).get(INVALID_KEY))
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
            f'<meta http-equiv="Content-Security-Policy" content="{_e(CONTENT_SECURITY_POLICY)}">',
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
