"""What the run-wide session cap costs per session: Ray placement against per-process placement.

The same sessions (seed, then close: the two environment calls every session makes) against the same fake
``interactive_browser`` server (in its own process, no added latency, so the placement's share is as large as it can
be), once with ``placement="process"`` (this process counts its own sessions) and once with ``placement="ray"`` (one
``PlacementAuthority`` actor on a private loopback Ray instance counts every process's sessions). Three figures:

* ``lease``: one acquire and its release alone, no HTTP (the ray figure is one actor round trip; the release is
  sent without waiting);
* ``sequential``: one session at a time, wall time per session;
* ``concurrent``: ``--concurrency`` sessions at once (under the cap), wall time of a wave divided by its sessions.

Added per session = ray - process. Rounds alternate the two modes; each figure is the median over rounds.

Examples:
    python bench/placement_overhead.py
    python bench/placement_overhead.py --sessions 500 --concurrency 128 --rounds 7

exit codes: 0 measured, 2 usage error
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.gym_contract.placement import SessionTicket, make_placement
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.testing.benchmarking import fake_environment_process, header, write_report
from nemo_gym_browser.testing.private_ray import private_ray

START = "site/index.html"
MODES = ("process", "ray")
DEFAULT_JSON = Path(__file__).resolve().parent / "placement_overhead.json"


async def lease_seconds(mode: str, url: str, count: int) -> float:
    """Mean time of one acquire plus its release, without HTTP."""

    async def nothing_to_close(orphan: object) -> None:
        return None

    host = make_placement(mode, (url,), lease_ttl_s=60.0, reap=nothing_to_close)
    try:
        started = time.perf_counter()
        for index in range(count):
            ticket = SessionTicket(session_id=f"lease-{index}", rollout_id="bench", attempt=1)
            host.release(await host.acquire((url,), 1, ticket))
        return (time.perf_counter() - started) / count
    finally:
        await host.close()


async def one_session(client: EnvironmentClient, name: str) -> None:
    async with client.session(rollout_id=name, attempt=1, task_id="t", initial_url=START):
        pass


async def sequential_seconds(client: EnvironmentClient, count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        await one_session(client, f"s{uuid.uuid4().hex[:12]}")
    return (time.perf_counter() - started) / count


async def concurrent_seconds(client: EnvironmentClient, concurrency: int) -> float:
    started = time.perf_counter()
    await asyncio.gather(*(one_session(client, f"c{uuid.uuid4().hex[:12]}") for _ in range(concurrency)))
    return (time.perf_counter() - started) / concurrency


async def measure(url: str, args: argparse.Namespace) -> dict[str, dict[str, list[float]]]:
    figures: dict[str, dict[str, list[float]]] = {mode: {"lease": [], "seq": [], "conc": []} for mode in MODES}
    clients = {
        mode: EnvironmentClient(
            EnvironmentConfig(server_urls=(url,), placement=mode, max_sessions_per_server=args.concurrency)
        )
        for mode in MODES
    }
    try:
        for client in clients.values():  # warm up: connections, the actor, code paths
            await sequential_seconds(client, 20)
        for _ in range(args.rounds):
            for mode, client in clients.items():
                figures[mode]["lease"].append(await lease_seconds(mode, url, args.sessions))
                figures[mode]["seq"].append(await sequential_seconds(client, args.sessions))
                figures[mode]["conc"].append(await concurrent_seconds(client, args.concurrency))
    finally:
        for client in clients.values():
            await client.close()
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:" + __doc__.split("Examples:")[1],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--sessions", type=int, default=200, help="sessions per sequential measurement (200)")
    parser.add_argument("--concurrency", type=int, default=64, help="sessions at once in the concurrent wave (64)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds, each mode once per round (5)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    if min(args.sessions, args.concurrency, args.rounds) < 1:
        parser.print_usage(sys.stderr)
        print("error: --sessions, --concurrency and --rounds must be at least 1", file=sys.stderr)
        return 2

    print(header("placement_overhead: the run-wide session cap's cost per session"))
    with private_ray(), fake_environment_process(latency_s=0.0) as url:
        figures = asyncio.run(measure(url, args))

    medians: dict[str, dict[str, float]] = {}
    print(f"{'ms per session':<28} {'process':>9} {'ray':>9} {'added':>9}")
    for key, label in (("lease", "lease (acquire + release)"), ("seq", "sequential session"), ("conc", "concurrent")):
        process, ray_ms = (statistics.median(figures[mode][key]) * 1000 for mode in MODES)
        shown = label if key != "conc" else f"{label} ({args.concurrency} at once)"
        print(f"{shown:<28} {process:>9.3f} {ray_ms:>9.3f} {ray_ms - process:>+9.3f}")
        medians[key] = {"process_ms": process, "ray_ms": ray_ms, "added_ms": ray_ms - process}
    write_report(args.json, vars(args), {"median_ms_per_session": medians})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
