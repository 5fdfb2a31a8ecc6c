"""How many browser sessions at once this machine serves: seed latency and memory against concurrency.

The real ``interactive_browser`` server (nemo-gym 0.7.0, headless Chromium, on 127.0.0.1) and the Corner Shop's
deal boards. For each concurrency N, waves of N episodes start together; each episode seeds a session on a deal
board, observes the page (the first thing a policy does) and closes it. Measured per N: the seed time (median, max),
the observe time (median, max), the wave's wall time per episode, and the peak memory of the environment's process
tree (server + Chromium, PSS: shared pages once) and of the whole machine (MemTotal - MemAvailable).

What it is for: the local run (``local/training_run.py``, ``rehearse.sh --train``) caps the browsers open at once
(``max_sessions_per_server``) at a number these figures show the machine can serve while training runs beside it.

Examples:
    python bench/session_capacity.py
    python bench/session_capacity.py --concurrency 1 4 16 --waves 2

exit codes: 0 measured, 2 usage error
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.launch_environment import LocalEnvironment
from nemo_gym_browser.local import shop_tasks
from nemo_gym_browser.processes import all_processes, descendants, machine_used_bytes, pss_bytes
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.testing.benchmarking import header, write_report

DEFAULT_JSON = Path(__file__).resolve().parent / "session_capacity.json"
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32)


class PeakMemory:
    """Samples the environment's process tree and the machine every 0.25 s while a wave runs."""

    def __init__(self, root_pids: set[int]) -> None:
        self.root_pids = root_pids
        self.tree_bytes = self.machine_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.25):
            pids = self.root_pids | {proc.pid for proc in descendants(self.root_pids, all_processes())}
            self.tree_bytes = max(self.tree_bytes, sum(pss_bytes(pid) for pid in pids))
            self.machine_bytes = max(self.machine_bytes, machine_used_bytes())

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


async def episode(client: EnvironmentClient, url: str, timings: dict[str, list[float]]) -> None:
    started = time.perf_counter()
    async with client.session(rollout_id=f"cap-{uuid.uuid4().hex[:12]}", attempt=1, task_id="t", initial_url=url) as s:
        seeded = time.perf_counter()
        await s.observe()
        timings["seed"].append(seeded - started)
        timings["observe"].append(time.perf_counter() - seeded)


async def measure(env_url: str, args: argparse.Namespace, roots: set[int]) -> dict[str, dict[str, float]]:
    boards = [record["web"] for record in shop_tasks.task_records("train", suite="deal")]
    config = EnvironmentConfig(
        server_urls=(env_url,), placement="process", max_sessions_per_server=max(args.concurrency)
    )
    client = EnvironmentClient(config)
    figures: dict[str, dict[str, float]] = {}
    try:
        await episode(client, boards[0], {"seed": [], "observe": []})  # warm: the first page load of Chromium
        for concurrency in args.concurrency:
            timings: dict[str, list[float]] = {"seed": [], "observe": []}
            failures = 0
            with PeakMemory(roots) as peak:
                started = time.perf_counter()
                for wave in range(args.waves):
                    urls = [boards[(wave * concurrency + index) % len(boards)] for index in range(concurrency)]
                    results = await asyncio.gather(
                        *(episode(client, url, timings) for url in urls), return_exceptions=True
                    )
                    failures += sum(isinstance(result, BaseException) for result in results)
                wall = time.perf_counter() - started
            row = {
                "seed_median_s": statistics.median(timings["seed"]) if timings["seed"] else float("nan"),
                "seed_max_s": max(timings["seed"], default=float("nan")),
                "observe_median_s": statistics.median(timings["observe"]) if timings["observe"] else float("nan"),
                "observe_max_s": max(timings["observe"], default=float("nan")),
                "wall_per_episode_s": wall / (concurrency * args.waves),
                "failed_episodes": failures,
                "environment_peak_gib": peak.tree_bytes / 2**30,
                "machine_peak_used_gib": peak.machine_bytes / 2**30,
            }
            figures[str(concurrency)] = row
            print(
                f"{concurrency:>4} {row['seed_median_s']:8.2f} {row['seed_max_s']:8.2f} {row['observe_median_s']:8.2f}"
                f" {row['observe_max_s']:8.2f} {row['wall_per_episode_s']:9.2f} {failures:6d}"
                f" {row['environment_peak_gib']:8.2f} {row['machine_peak_used_gib']:8.2f}",
                flush=True,
            )
    finally:
        await client.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:" + __doc__.split("Examples:")[1],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=list(DEFAULT_CONCURRENCY),
        help=f"episodes at once, one measurement each (default {' '.join(map(str, DEFAULT_CONCURRENCY))})",
    )
    parser.add_argument("--waves", type=int, default=3, help="waves per concurrency (default 3)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if min(args.concurrency) < 1 or args.waves < 1:
        parser.print_usage(sys.stderr)
        print("error: --concurrency values and --waves must be at least 1", file=sys.stderr)
        return 2

    print(header("session_capacity: seed latency and memory against browsers open at once (real server)"))
    print("   N  seed p50  seed max   obs p50   obs max  wall/ep  failed  env GiB  used GiB")
    with shop_tasks.serve(), LocalEnvironment() as environment:
        figures = asyncio.run(measure(environment.url, args, environment.pids))
    write_report(args.json, vars(args), figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
