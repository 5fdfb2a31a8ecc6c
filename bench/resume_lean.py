"""What resuming changes in the samples a batch keeps: the lean to routes that fail less, re-run against resume.

A policy that draws its route per episode (browse with probability ``--browse-share``: observe, click About, finish,
two browser calls; otherwise answer at once: finish only) runs through the recipe's real ``BrowserToolAgentLoop``
against the in-process environment server, whose own fault rule fails every browser action call on its own with
probability ``rate`` (the session lost; seed, finish, verify and close never). Two arms, ``max_attempts`` 3:

* ``rerun``: ``resume.max_per_episode`` 0; a failure after the policy acted re-runs the rollout, a fresh sample;
* ``resume``: the default budgets; a new session, the calls so far replayed and checked, the same sample goes on.

The route is drawn from a generator keyed by the rollout, once per generation of a first turn: a re-run asks the
policy again and draws again; a resume never asks again and keeps the route. Per arm and rate: the browsing share
among first draws and among kept (valid) samples and their difference (the lean); tokens generated per kept sample
(every generation of every episode, kept or not, over the kept samples) and those of them in no kept sample; mean
episode wall seconds; and the episodes resumed, given up as diverged, re-run after an action, still invalid. Fault
draws and routes are hashes of ``--seed`` and the episode, the same in both arms (common random numbers). Targets
(stated met or not, never the exit code): at 30 % re-run keeps clearly fewer browsing samples than were drawn; with
resume the kept share is within 0.05 of the drawn one; re-run's kept share matches the arithmetic (a check of the
benchmark itself).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import random
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_browser.agent_attempt.sample_flags import SampleFlags
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.testing.benchmarking import LoopFactory, header, write_report

EXAMPLES = """\
examples:
  python bench/resume_lean.py                          # 400 episodes per arm and rate, table and JSON
  python bench/resume_lean.py --episodes 100 --seed 3 --json /tmp/lean.json
  python bench/resume_lean.py --rates 0.3 --latency-s 0.2   # one rate, slower browser calls

exit codes: 0 measured (targets met or not: see the JSON), 1 a broken run, 2 usage error
"""

DEFAULT_JSON = Path(__file__).resolve().parent / "resume_lean.json"
DEFAULT_RATES = (0.0, 0.30, 0.85)
ARMS: Mapping[str, dict[str, int]] = {"rerun": {"max_per_episode": 0}, "resume": {}}  # resume: the settings' defaults
MAX_ATTEMPTS = 3
TARGET_RATE = 0.30  # the realistic rate, where the targets are judged
RESUME_TOLERANCE = 0.05  # resume: kept browsing share within this of the drawn share
RERUN_LEAN_AT_LEAST = 0.10  # re-run: the lean the arithmetic predicts (about 0.17 at 30 %) shows at least this much
SAMPLING = {"temperature": 1.0, "logprobs": True}
ANSWER = "x"
TASK = "Open the About page, or answer from what you know"
# Seconds that hold on a loaded machine: no call here is meant to time out.
ENVIRONMENT = {"call_timeout_s": 60.0, "seed_timeout_s": 60.0, "verify_timeout_s": 60.0, "retry_backoff_s": 0.01}
BROWSER_CALLS = frozenset({"browser_observe", "browser_navigate", "browser_click", "browser_type"})


def unit_draw(*parts: object) -> float:
    """A number in [0, 1) that is a hash of ``parts``: the same every run, whatever the timing."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def episode_task_id(index: int) -> str:
    return f"lean-{index}"


def call_faults(rate: float, seed: int) -> Callable[[Any], Any]:
    """The server's rule: each browser action call of an episode loses its session with probability ``rate``.

    A call's draw is a hash of ``seed``, its episode (the task id the session was seeded for) and its number among
    the episode's browser calls over all its sessions (an episode's calls are sequential), so it depends on neither
    timing nor the random session ids; replayed calls are drawn like any other."""
    from nemo_gym_browser.local.faults.kinds import Fault

    calls: dict[str, int] = {}
    lock = threading.Lock()

    def rule(request: Any) -> Any:
        if request.endpoint not in BROWSER_CALLS or not request.task_id:
            return None
        with lock:
            number = calls[request.task_id] = calls.get(request.task_id, -1) + 1
        return Fault.lose_session() if unit_draw(seed, "call", request.task_id, number) < rate else None

    return rule


class RoutePolicy(sp.ScriptedPolicy):
    """One episode's policy: a route drawn on every generation of a first turn, tokens counted.

    Unlike a plain :class:`~nemo_gym_browser.local.scripted_policy.ScriptedPolicy` it has state on purpose: a
    fresh sample of a real policy is a fresh draw, so a re-run (which asks again) may take the other route, while a
    resume (which never asks again) keeps the one drawn.
    """

    def __init__(self, tokenizer: Any, rng: random.Random, browse_share: float) -> None:
        super().__init__(tokenizer, self._turn)
        self.rng = rng
        self.browse_share = browse_share
        self.routes: list[bool] = []  # per first-turn generation: True when it browsed
        self.generated_tokens = 0
        self.tokens_since_draw = 0  # the current sample's: what a re-run throws away and a resume keeps
        self._walk = sp.walk_and_finish("About", ANSWER)

    def _turn(self, view: sp.PolicyView) -> str:
        if view.step > 0:
            return self._walk(view)  # only a browsing route gets here: click About, then finish
        browse = self.rng.random() < self.browse_share
        self.routes.append(browse)
        self.tokens_since_draw = 0
        return sp.browser("observe") if browse else sp.browser("finish", answer=ANSWER)

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        output = await super().generate(request_id, **kwargs)
        self.generated_tokens += len(output.token_ids)
        self.tokens_since_draw += len(output.token_ids)
        return output


@dataclass(frozen=True)
class Episode:
    drawn_browse: bool  # the route of the first draw (the first attempt's)
    kept_browse: bool | None  # the route of the valid final sample; None when still invalid
    draws: int
    tokens: int  # every generation of the episode's
    kept_tokens: int  # those of the kept sample; 0 when still invalid
    flags: SampleFlags


@dataclass(frozen=True)
class Cell:
    """One arm at one rate, over ``episodes`` episodes."""

    arm: str
    rate: float
    episodes: int
    kept: int
    drawn_browse_share: float
    kept_browse_share: float | None
    lean: float | None  # kept share less drawn share: negative when the kept samples browse less than drawn
    rerun_expected_share: float  # the arithmetic for re-running: b(1-r)^2 / (b(1-r)^2 + 1 - b)
    tokens_per_kept: float | None
    wasted_tokens_per_kept: float | None  # generated in no kept sample (re-run attempts, invalid episodes)
    episode_wall_s: float  # mean over episodes, every attempt and resume included
    wall_s: float  # the cell's wall time, episodes run --concurrency at once
    resumed: int  # episodes resumed at least once
    resumes: int  # resumes that succeeded, over all episodes
    diverged: int  # episodes with a resume given up because the replayed page differed
    rerun_after_action: int  # episodes re-run at least once after the policy acted
    still_invalid: int
    draws_per_episode: float  # first-turn generations: 1 plus one per re-run that reached the model


def rerun_expected_share(rate: float, browse_share: float) -> float:
    """The browsing share among kept samples when every failure re-runs: a browsing attempt survives with
    probability (1 - rate)^2 and the attempts are alike, so the number of attempts cancels out."""
    survives = browse_share * (1 - rate) ** 2
    return survives / (survives + 1 - browse_share)


async def run_cell(
    factory_for: Callable[[str], LoopFactory], server: Any, arm: str, rate: float, args: argparse.Namespace
) -> tuple[Cell, list[str]]:
    from nemo_gym_browser.local.in_process_loop import make_row

    server.set_rule(call_faults(rate, args.seed))
    factory = factory_for(arm)
    gate = asyncio.Semaphore(args.concurrency)
    problems: list[str] = []

    async def episode(index: int) -> Episode | None:
        async with gate:
            rng = random.Random(unit_draw(args.seed, "route", index))  # keyed by the rollout, not the attempt
            policy = RoutePolicy(factory.tokenizer, rng, args.browse_share)
            row = make_row(
                task=TASK, task_id=episode_task_id(index), verifier_metadata={"answer_equals": ANSWER}, index=index
            )
            try:
                output = await factory.build(policy).run(dict(SAMPLING), **row)
            except Exception as exc:  # a broken run, never a measurement
                problems.append(f"episode {index}: {type(exc).__name__}: {exc}")
                return None
        flags = SampleFlags.from_extra_fields(output.extra_fields)
        kept = None if flags.invalid else policy.routes[-1]
        if kept is not None and kept != (flags.browser_actions > 0):
            problems.append(f"episode {index}: kept route {kept} but {flags.browser_actions} browser action(s)")
        kept_tokens = 0 if kept is None else policy.tokens_since_draw
        return Episode(policy.routes[0], kept, len(policy.routes), policy.generated_tokens, kept_tokens, flags)

    started = time.perf_counter()
    results = await asyncio.gather(*(episode(index) for index in range(args.episodes)))
    wall = time.perf_counter() - started
    episodes = [e for e in results if e is not None]
    if not episodes:
        raise RuntimeError(f"{arm} at {rate:.0%}: no episode ran: {problems[:3]}")
    kept = [e for e in episodes if e.kept_browse is not None]
    drawn = sum(e.drawn_browse for e in episodes) / len(episodes)
    kept_share = sum(bool(e.kept_browse) for e in kept) / len(kept) if kept else None
    cell = Cell(
        arm=arm,
        rate=rate,
        episodes=len(episodes),
        kept=len(kept),
        drawn_browse_share=drawn,
        kept_browse_share=kept_share,
        lean=None if kept_share is None else kept_share - drawn,
        rerun_expected_share=rerun_expected_share(rate, args.browse_share),
        tokens_per_kept=sum(e.tokens for e in episodes) / len(kept) if kept else None,
        wasted_tokens_per_kept=sum(e.tokens - e.kept_tokens for e in episodes) / len(kept) if kept else None,
        episode_wall_s=sum(e.flags.episode_wall_s for e in episodes) / len(episodes),
        wall_s=wall,
        resumed=sum(bool(e.flags.resumed_kinds) for e in episodes),
        resumes=sum(len(e.flags.resumed_kinds) for e in episodes),
        diverged=sum(e.flags.resume_diverged > 0 for e in episodes),
        rerun_after_action=sum(bool(e.flags.failed_after_action_kinds) for e in episodes),
        still_invalid=sum(e.flags.invalid for e in episodes),
        draws_per_episode=sum(e.draws for e in episodes) / len(episodes),
    )
    if server.open_sessions:
        problems.append(f"{arm} at {rate:.0%}: {server.open_sessions} session(s) left open")
    if rate == 0.0 and (cell.still_invalid or cell.resumes or cell.rerun_after_action):
        problems.append(f"{arm} at 0 %: failures where none were injected")
    return cell, problems


async def measure(args: argparse.Namespace) -> tuple[list[Cell], list[str]]:
    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
    from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
    from nemo_gym_browser.local.in_process_loop import agent_loop_entry, compose_trainer_config, load_tools

    tokenizer, config, tools = build_chat_tokenizer(), compose_trainer_config(), load_tools()
    cells, problems = [], []
    async with InProcessEnvironmentServer(latency_s=args.latency_s) as server:

        def factory_for(arm: str) -> LoopFactory:
            environment = {
                "server_urls": [server.url],
                "max_sessions_per_server": 4 * args.concurrency,  # resumes open the next before the last is closed
                **ENVIRONMENT,
            }
            entry = agent_loop_entry(
                environment=environment, max_attempts=MAX_ATTEMPTS, resample_backoff_s=0, resume=dict(ARMS[arm])
            )
            return LoopFactory(entry, tools, config, tokenizer)

        try:
            for rate in args.rates:
                for arm in ARMS:
                    cell, found = await run_cell(factory_for, server, arm, rate, args)
                    cells.append(cell)
                    problems += found
                    print(row(cell), flush=True)
        finally:
            await close_shared_clients()
    return cells, problems


# ----- output and targets ---------------------------------------------------------------------------------------


def _share(value: float | None, fmt: str = "{:.3f}") -> str:
    return fmt.format(value) if value is not None else "n/a"


TABLE_HEAD = (
    "| failing calls | arm | drawn browsing | kept browsing | lean | re-run arithmetic | tokens per kept "
    "| wasted | episode s | resumed | diverged | re-run after action | still invalid |\n"
    "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def row(c: Cell) -> str:
    cells = [
        f"{c.rate:.0%}",
        c.arm,
        f"{c.drawn_browse_share:.3f}",
        _share(c.kept_browse_share),
        _share(c.lean, "{:+.3f}"),
        f"{c.rerun_expected_share:.3f}",
        _share(c.tokens_per_kept, "{:.1f}"),
        _share(c.wasted_tokens_per_kept, "{:.1f}"),
        f"{c.episode_wall_s:.3f}",
        *map(str, (c.resumed, c.diverged, c.rerun_after_action, c.still_invalid)),
    ]
    return "| " + " | ".join(cells) + " |"


@dataclass(frozen=True)
class Target:
    name: str
    met: bool | None  # None: the rate was not measured
    detail: str


def targets(cells: Sequence[Cell]) -> list[Target]:
    at = {(c.arm, c.rate): c for c in cells}
    rerun, resume = at.get(("rerun", TARGET_RATE)), at.get(("resume", TARGET_RATE))
    found = []
    if rerun is None or rerun.lean is None:
        found += [
            Target(name, None, "30 % not measured")
            for name in ("rerun_leans_at_30", "rerun_matches_the_arithmetic_at_30")
        ]
    else:
        found.append(
            Target(
                "rerun_leans_at_30",
                rerun.lean <= -RERUN_LEAN_AT_LEAST,
                f"re-run at 30 %: kept browsing {rerun.kept_browse_share:.3f} against {rerun.drawn_browse_share:.3f} "
                f"drawn (lean {rerun.lean:+.3f}, at least -{RERUN_LEAN_AT_LEAST:.2f} expected; the arithmetic "
                f"says {rerun.rerun_expected_share:.3f})",
            )
        )
        found.append(
            Target(
                "rerun_matches_the_arithmetic_at_30",
                abs(rerun.kept_browse_share - rerun.rerun_expected_share) <= RESUME_TOLERANCE,
                f"re-run at 30 %: kept browsing {rerun.kept_browse_share:.3f} against the arithmetic's "
                f"{rerun.rerun_expected_share:.3f} (within {RESUME_TOLERANCE:.2f}: the benchmark measures what it "
                "models)",
            )
        )
    if resume is None or resume.lean is None:
        found.append(Target("resume_keeps_the_drawn_share_at_30", None, "30 % not measured"))
    else:
        found.append(
            Target(
                "resume_keeps_the_drawn_share_at_30",
                abs(resume.lean) <= RESUME_TOLERANCE,
                f"resume at 30 %: kept browsing {resume.kept_browse_share:.3f} against "
                f"{resume.drawn_browse_share:.3f} drawn (lean {resume.lean:+.3f}, within {RESUME_TOLERANCE:.2f} "
                "is the target)",
            )
        )
    return found


def _rate(text: str) -> float:
    value = float(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"a failing-call rate must be in [0, 1), not {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bench/resume_lean.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--episodes", type=int, default=400, help="episodes per arm and rate (default 400)")
    parser.add_argument(
        "--rates", type=_rate, nargs="+", default=list(DEFAULT_RATES), help="failing-call rates (default 0 0.3 0.85)"
    )
    parser.add_argument("--browse-share", type=float, default=0.5, help="the policy's chance to browse (default 0.5)")
    parser.add_argument("--concurrency", type=int, default=16, help="episodes at once (default 16)")
    parser.add_argument(
        "--latency-s", type=float, default=0.05, help="the server's delay per call, a browser's (default 0.05)"
    )
    parser.add_argument("--seed", type=int, default=0, help="routes and fault draws (default 0)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.concurrency < 1 or not 0.0 < args.browse_share < 1.0 or args.latency_s < 0:
        print(
            "bench/resume_lean.py: error: --episodes and --concurrency must be at least 1, --browse-share in (0, 1), "
            "--latency-s at least 0",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    print(header("resume_lean: the browsing share among kept samples, re-run against resume"))
    print(
        f"setup: {args.episodes} episodes per arm and rate, browse share {args.browse_share}, max_attempts "
        f"{MAX_ATTEMPTS}, {args.concurrency} at once, {args.latency_s:g} s per call, seed {args.seed}"
    )
    print(TABLE_HEAD, flush=True)
    quiet = logging.getLogger("nemo_gym_browser")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # each injected fault logs a warning
    try:
        cells, problems = asyncio.run(measure(args))
    except Exception as exc:
        print(f"FAIL: the run broke: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        quiet.setLevel(level)
    found = targets(cells)
    for target in found:
        state = "not measured" if target.met is None else ("met" if target.met else "MISSED")
        print(f"target {target.name}: {state}: {target.detail}")
    for problem in problems[:20]:
        print(f"FAIL: {problem}", file=sys.stderr)
    write_report(
        args.json,
        vars(args),
        {"max_attempts": MAX_ATTEMPTS, "cells": cells, "targets": found, "problems": problems},
    )
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
