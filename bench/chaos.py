"""Chaos: many rollouts of the real agent loop while the environment fails in every way we know, then the score.

Two targets, each run through ``testing/chaos_harness.py``: ``fake`` (several in-process fake servers, hundreds of
rollouts, faults injected by the fakes) and ``real`` (nemo-gym 0.7.0 with Chromium, ``bash
scripts/setup_environment.sh``, behind the loopback fault proxy; its kill phase really stops and restarts the server
and its Chromium). Each target runs three phases: every rollout's first attempt gets one cause (a targeted
infrastructure fault or a policy outcome); a server killed and restarted with sessions open; a burst of 503s.

Printed per target: the confusion matrix of injected cause against the recorded classification of the first
attempt, the sessions left open, the longest attempt against deadline + one per-call timeout, the share of rollout
slots that still produced a valid sample, and each target met or missed. The causes: ``docs/benchmarks.md#chaos``.

``--resume-per-episode N`` resumes faults as users get it (the recipe's default is 4); the default, 0, ends an
attempt at each fault. The resuming mode: ``docs/benchmarks.md#chaos``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import signal
import sys
import time
from pathlib import Path

from nemo_gym_browser.testing.benchmarking import header, write_report
from nemo_gym_browser.testing.chaos_backends import FakeBackend, local_environment_backend
from nemo_gym_browser.testing.chaos_harness import run_chaos
from nemo_gym_browser.testing.chaos_plan import REAL_SERVER_SETTINGS, ChaosSettings
from nemo_gym_browser.testing.chaos_report import ChaosReport

EXAMPLES = """\
examples:
  python bench/chaos.py                                  # fake (4 servers, 512 + 2x64 rollouts), then real
  python bench/chaos.py --target fake --servers 8 --rollouts 1024
  python bench/chaos.py --target real --real-rollouts 34 --real-phase-rollouts 6
  python bench/chaos.py --target fake --resume-per-episode 4 --json /tmp/chaos_resume.json   # resuming on

exit codes: 0 every target met, 1 a target missed, 2 usage error
"""


async def run_fake(args: argparse.Namespace) -> ChaosReport:
    # Hundreds of rollouts and the fake servers share one event loop here: its lag under load is tenths of a
    # second, so per-call timeouts and the deadline are kept well above it.
    settings = ChaosSettings(
        call_timeout_s=2.0,
        episode_deadline_s=6.0,
        max_sessions_per_server=args.sessions_per_server,
        resume_max_per_episode=args.resume_per_episode,
    )
    async with FakeBackend(args.servers, latency_s=args.latency_ms / 1000) as backend:
        return await run_chaos(
            backend,
            settings,
            target=f"fake: {args.servers} servers, {args.latency_ms:g} ms per call{_resuming(args)}",
            targeted_rollouts=args.rollouts,
            phase_rollouts=args.phase_rollouts,
        )


async def run_real_target(args: argparse.Namespace) -> ChaosReport:
    async with local_environment_backend() as backend:
        return await run_chaos(
            backend,
            dataclasses.replace(REAL_SERVER_SETTINGS, resume_max_per_episode=args.resume_per_episode),
            target=f"real: nemo-gym 0.7.0 interactive_browser + Chromium behind the fault proxy{_resuming(args)}",
            targeted_rollouts=args.real_rollouts,
            phase_rollouts=args.real_phase_rollouts,
        )


def _resuming(args: argparse.Namespace) -> str:
    return f", resuming (up to {args.resume_per_episode} per episode)" if args.resume_per_episode else ""


DEFAULT_JSON = Path(__file__).resolve().parent / "chaos.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="chaos.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", choices=("fake", "real", "both"), default="both")
    parser.add_argument("--servers", type=int, default=4, help="fake servers (default 4)")
    parser.add_argument("--sessions-per-server", type=int, default=64, help="client cap per fake server (64)")
    parser.add_argument("--rollouts", type=int, default=512, help="fake: rollouts of the targeted phase (512)")
    parser.add_argument("--phase-rollouts", type=int, default=64, help="fake: rollouts per server-wide phase (64)")
    parser.add_argument("--latency-ms", type=float, default=10.0, help="fake: delay per call (default 10)")
    parser.add_argument("--real-rollouts", type=int, default=34, help="real: rollouts of the targeted phase (34)")
    parser.add_argument("--real-phase-rollouts", type=int, default=6, help="real: rollouts per server-wide phase")
    parser.add_argument(
        "--resume-per-episode",
        type=int,
        default=0,
        metavar="N",
        help="resumes per attempt (resume.max_per_episode; the recipe's default is 4): a fault under a browser call "
        "or verify is repaired in a new session and the same sample goes on. 0 (default): each fault ends its "
        "attempt and the rollout is re-run, blame read per attempt",
    )
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the recipe's warnings")
    return parser


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwinds through the backends' finally blocks: servers and Chromium are stopped


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.servers < 1 or min(args.rollouts, args.real_rollouts) < 1 or args.sessions_per_server < 1:
        print("chaos.py: error: --servers, --sessions-per-server and the rollout counts must be >= 1", file=sys.stderr)
        return 2
    if min(args.phase_rollouts, args.real_phase_rollouts, args.latency_ms, args.resume_per_episode) < 0:
        print("chaos.py: error: phase rollouts, latency and --resume-per-episode must not be negative", file=sys.stderr)
        return 2
    # verl installs its own root handler on import, so quiet the recipe's loggers rather than the root.
    logging.getLogger("nemo_gym_browser").setLevel(logging.WARNING if args.verbose else logging.CRITICAL)
    signal.signal(signal.SIGTERM, _interrupt)
    started = time.monotonic()
    print(header("chaos: who gets blamed when the environment fails"))
    reports = []
    if args.target in ("fake", "both"):
        reports.append(asyncio.run(run_fake(args)))
        print(reports[-1].format(), flush=True)
    if args.target in ("real", "both"):
        reports.append(asyncio.run(run_real_target(args)))
        print(reports[-1].format(), flush=True)
    wall_s = time.monotonic() - started
    print(f"done in {wall_s:.0f} s")
    write_report(args.json, vars(args), {"wall_s": wall_s, "targets": [report_figures(r) for r in reports]})
    return 0 if all(ok for report in reports for _, ok in report.targets()) else 1


def report_figures(report: ChaosReport) -> dict[str, object]:
    """One target's outcome as plain values: the classification matrix and each check with its verdict."""
    return {
        "target": report.target,
        "rollouts": len(report.records),
        "wall_s": report.wall_s,
        "valid_fraction": report.valid_fraction,
        "resume_max_per_episode": report.settings.resume_max_per_episode,
        "resumed": report.resumed_count,
        "resume_diverged": report.diverged_count,
        "rerun_after_action": report.rerun_after_action_count,
        "matrix": {cause: dict(counts) for cause, counts in report.matrix.items()},
        "checks": [{"check": text, "passed": ok} for text, ok in report.targets()],
    }


if __name__ == "__main__":
    raise SystemExit(main())
