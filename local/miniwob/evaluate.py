"""Play the MiniWoB++ suite through the recipe's real loop against a real ``interactive_browser`` server with
Chromium, and count per task how often MiniWoB scores 1.

:func:`play` runs every sample through ``BrowserToolAgentLoop`` (built as verl builds it) with a scripted policy:
the observation-reading solver (:mod:`.solver`) or one that finishes at once. The reward is the real server's
``/verify``; nothing here grades. :func:`main` serves the site, starts a local environment, plays held-back seeds
and writes the per-task table as JSON.

    python -m nemo_gym_browser.local.miniwob.evaluate --per-task 20 --output bench/miniwob_solver.json

Exit status: 0 played (whatever the success), 1 the environment failed to come up or an episode was invalid,
2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .grading import GradeKey
from .inventory import EXCLUDED, INCLUDED, Limit, included_tasks
from .solver import SOLVERS, render_call, script
from .suite import write_rows

logger = logging.getLogger(__name__)

POLICIES = ("solver", "finish-at-once")
ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 60.0, "verify_timeout_s": 30.0, "close_timeout_s": 15.0}
DEFAULT_CONCURRENCY = 3


@dataclass(frozen=True)
class Episode:
    task: str
    seed: int
    reward: float
    invalid: bool
    failure: str | None
    calls: int
    wall_s: float


def _finish_at_once(view: Any) -> str:
    return render_call({"action": "finish", "answer": "done"})


def policy_script(name: str) -> Callable[[Any], str]:
    if name not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {name!r}")
    return script if name == "solver" else _finish_at_once


async def play(
    samples: Sequence[dict[str, Any]],
    server_url: str,
    *,
    policy: str = "solver",
    concurrency: int = DEFAULT_CONCURRENCY,
) -> list[Episode]:
    """Every sample once through the recipe's loop; the loop's shared clients are closed however it ends."""
    from ...browser_agent_loop import close_shared_clients
    from ..chat_tokenizer import build_chat_tokenizer
    from ..in_process_loop import build_loop, compose_trainer_config, load_tools
    from ..scripted_policy import ScriptedPolicy

    tokenizer, tools, config = build_chat_tokenizer(), load_tools(), compose_trainer_config()
    limit = asyncio.Semaphore(concurrency)

    async def one(sample: dict[str, Any]) -> Episode:
        metadata = sample["extra_info"]["task_metadata"]
        async with limit:
            loop = build_loop(
                ScriptedPolicy(tokenizer, policy_script(policy)),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=config,
                environment={"server_urls": [server_url], **ENVIRONMENT},
                max_attempts=1,
            )
            started = time.monotonic()
            output = await loop.run({}, **sample)
        fields = output.extra_fields
        return Episode(
            task=metadata["miniwob_task"],
            seed=metadata["seed"],
            reward=float(output.reward_score),
            invalid=bool(fields["env_invalid"]),
            failure=fields["env_failure_reason"],
            calls=int(fields["env_browser_actions"]),
            wall_s=round(time.monotonic() - started, 2),
        )

    try:
        return list(await asyncio.gather(*(one(sample) for sample in samples)))
    finally:
        await close_shared_clients()


def table(episodes: Sequence[Episode]) -> dict[str, dict[str, Any]]:
    """Per task: episodes, successes, success rate, invalid episodes, mean browser calls and seconds."""
    by_task: dict[str, list[Episode]] = {}
    for episode in episodes:
        by_task.setdefault(episode.task, []).append(episode)
    return {
        task: {
            "episodes": len(runs),
            "successes": sum(run.reward == 1.0 for run in runs),
            "success": round(sum(run.reward == 1.0 for run in runs) / len(runs), 4),
            "invalid": sum(run.invalid for run in runs),
            "mean_browser_calls": round(statistics.fmean(run.calls for run in runs), 2),
            "mean_wall_s": round(statistics.fmean(run.wall_s for run in runs), 2),
            "failed_seeds": [run.seed for run in runs if run.reward != 1.0],
        }
        for task, runs in sorted(by_task.items())
    }


def solver_table(payload: dict[str, Any]) -> str:
    """The per-task solver table of ``docs/miniwob.md`` from this module's JSON, a row for every included task."""
    lines = ["| task | solved (held-back seeds) | browser calls | seconds per episode |", "| --- | --- | --- | --- |"]
    for entry in INCLUDED:
        row = payload["tasks"].get(entry.task)
        if row is None:
            lines.append(f"| {entry.task} | no solver | | |")
            continue
        solved = f"{row['successes']}/{row['episodes']}"
        lines.append(f"| {entry.task} | {solved} | {row['mean_browser_calls']:.1f} | {row['mean_wall_s']:.1f} |")
    return "\n".join(lines)


def exclusion_table() -> str:
    """The excluded tasks of ``docs/miniwob.md``, grouped by what stops them, NeMo Gym's gaps marked."""
    lines = ["| what stops it | clicks and typing would do | tasks (what on the page) |", "| --- | --- | --- |"]
    for limit in Limit:
        entries = [entry for entry in EXCLUDED if entry.limit is limit]
        details: dict[str, list[str]] = {}
        for entry in entries:
            details.setdefault(entry.detail, []).append(entry.task)
        tasks = "; ".join(f"{', '.join(names)} ({detail})" for detail, names in details.items())
        lines.append(f"| {limit.value} | {'yes: a NeMo Gym gap' if limit.nemo_gym else 'no'} | {tasks} |")
    return "\n".join(lines)


def _machine() -> dict[str, Any]:
    model = next(
        (line.split(":", 1)[1].strip() for line in _cpuinfo().splitlines() if line.startswith("model name")), None
    )
    return {
        "cpus": os.cpu_count(),
        "cpu": model,
        "load_average_1min": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
    }


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def load_samples(path: Path) -> list[dict[str, Any]]:
    from ...dataset import BrowserJSONLDataset

    dataset = BrowserJSONLDataset(str(path))
    return [dataset[index] for index in range(len(dataset))]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.miniwob.evaluate",
        description="Play held-back MiniWoB++ seeds through the recipe's loop on the real server and count successes.",
        epilog="example: ... --per-task 20 --tasks click-button,enter-text --output /tmp/miniwob.json",
    )
    parser.add_argument("--per-task", type=int, default=20, help="held-back seeds per task")
    parser.add_argument("--tasks", help="comma-separated tasks (default: every included task the policy can play)")
    parser.add_argument("--policy", choices=POLICIES, default="solver")
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--output", type=Path, help="write the table and every episode as JSON here")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ...launch_environment import EnvironmentStartError, LocalEnvironment
    from .site import MiniWobSite

    if args.tasks:
        tasks = args.tasks.split(",")
    else:  # the solver plays the tasks it has a plan for; finishing at once is tried on every included task
        tasks = [task for task in included_tasks() if args.policy != "solver" or task in SOLVERS]
    key = GradeKey.generate()
    machine = _machine()
    with tempfile.TemporaryDirectory() as workdir:
        try:
            rows = write_rows(key, Path(workdir), per_task={"heldback": args.per_task}, tasks=tasks)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        samples = load_samples(rows["heldback"])
        started = time.monotonic()
        try:
            with MiniWobSite(key) as site, LocalEnvironment() as environment:
                del site  # serving is all it does here
                played = time.monotonic()
                episodes = asyncio.run(play(samples, environment.url, policy=args.policy, concurrency=args.concurrency))
                finished = time.monotonic()
        except EnvironmentStartError as exc:
            print(f"error: the environment did not come up: {exc}", file=sys.stderr)
            return 1
    results = table(episodes)
    for task, row in results.items():
        print(
            f"{task:28} {row['successes']:3}/{row['episodes']:<3} {row['mean_browser_calls']:5.1f} calls "
            f"{row['mean_wall_s']:5.1f} s"
        )
    summary = {
        "policy": args.policy,
        "per_task": args.per_task,
        "concurrency": args.concurrency,
        "episodes": len(episodes),
        "play_s": round(finished - played, 1),
        "setup_s": round(played - started, 1),
        "episodes_per_minute": round(60 * len(episodes) / max(finished - played, 1e-9), 2),
        "machine": machine,
        "command": " ".join(["python -m nemo_gym_browser.local.miniwob.evaluate", *(argv or sys.argv[1:])]),
    }
    print(json.dumps(summary))
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        payload = {"summary": summary, "tasks": results, "episodes": [asdict(e) for e in episodes]}
        args.output.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    return 1 if any(episode.invalid for episode in episodes) else 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    raise SystemExit(main())
