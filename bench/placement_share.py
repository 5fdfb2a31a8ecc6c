"""On a skewed batch over several worker processes: a static per-worker share of the session cap against the Ray
placement authority.

``--workers`` Ray actors (separate processes, as verl's ``AgentLoopWorker``s are) each run their chunk of one batch at
once through their own ``EnvironmentClient`` on ``--servers`` fake servers capped at ``--cap`` sessions; the batch is
skewed as verl's is (a prompt's ``--group`` samples adjacent, equal chunks in order, one worker's prompts long). Two
designs: ``static`` (:class:`~nemo_gym_browser.testing.static_share.StaticSharePlacement`, each worker within its own
share) and ``authority`` (``placement="ray"``, one ``PlacementAuthority`` actor). Each runs the batch whole and with
the last worker killed ``--kill-after`` seconds in. Measured on the servers: wall time, the most sessions any server
held (never above the cap), utilisation, when each worker finished, and the killed worker's browsers left open and
for how long. Numbers to ``bench/placement_share.json``; method: ``docs/benchmarks.md``.

Examples:
    python bench/placement_share.py
    python bench/placement_share.py --workers 6 --cap 3 --seed 1

exit codes: 0 measured, 1 a server held more sessions than its cap, 2 usage error
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nemo_gym_browser.gym_contract.environment import EnvironmentClient
from nemo_gym_browser.gym_contract.placement import Placement
from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer
from nemo_gym_browser.settings import EnvironmentConfig
from nemo_gym_browser.testing.benchmarking import describe_machine, header
from nemo_gym_browser.testing.private_ray import private_ray
from nemo_gym_browser.testing.static_share import StaticSharePlacement, static_share

START = "site/index.html"
DESIGNS = ("static", "authority")
JSON_PATH = Path(__file__).with_suffix(".json")
# Turns per episode: most prompts are answered in a few pages, some need a long search.
SHORT_STEPS = (2, 4)
LONG_STEPS = (10, 14)
LONG_SHARE = 0.3
# How often the servers' open browsers are sampled for utilisation (the peak is counted exactly, at every seed).
SAMPLE_EVERY_S = 0.05
# No run should come near this; it only keeps a broken run from hanging the benchmark.
RUN_TIMEOUT_S = 240.0
# How long to wait for the authority to reap a dead worker's browsers after the survivors are done, in lease ttls.
REAP_WAIT_TTLS = 4


class StaticShareClient(EnvironmentClient):
    """An ``EnvironmentClient`` whose sessions go through a given placement (the config names no static share)."""

    def __init__(self, config: EnvironmentConfig, placement: Placement) -> None:
        super().__init__(config)
        self._given_placement = placement

    def _placement_host(self) -> Placement:
        return self._given_placement


def rollout_worker_class() -> Any:
    """The Ray actor class of one rollout worker (built here so that Ray ships it by value)."""
    import ray

    @ray.remote(num_cpus=0)
    class RolloutWorker:
        def __init__(self, rank: int, workers: int, cap: int, lease_ttl_s: float) -> None:
            self.rank = rank
            self.workers = workers
            self.cap = cap
            self.lease_ttl_s = lease_ttl_s

        def ready(self) -> int:
            return self.rank

        async def run(self, design: str, urls: list[str], steps: list[int], think_s: float) -> None:
            """Every episode of this worker's chunk at once, as verl's ``AgentLoopWorker`` runs them."""
            config = EnvironmentConfig(
                server_urls=tuple(urls),
                max_sessions_per_server=self.cap,
                placement="ray" if design == "authority" else "process",
                lease_ttl_s=self.lease_ttl_s,
                transient_retries=0,
            )
            client = (
                EnvironmentClient(config)
                if design == "authority"
                else StaticShareClient(config, StaticSharePlacement(self.rank, self.workers))
            )
            async with client:
                await asyncio.gather(
                    *(self.episode(client, index, count, think_s) for index, count in enumerate(steps))
                )

        async def episode(self, client: EnvironmentClient, index: int, steps: int, think_s: float) -> None:
            async with client.session(
                rollout_id=f"w{self.rank}-e{index}", attempt=1, task_id="t", initial_url=START
            ) as session:
                for _ in range(steps):
                    await asyncio.sleep(think_s)  # the policy's turn
                    await session.observe()

    return RolloutWorker


def skewed_batch(workers: int, per_worker: int, group: int, seed: int) -> list[list[int]]:
    """Turns per episode for each worker's chunk: a prompt's samples share its length and land on one worker."""
    rng = random.Random(seed)
    episodes = []
    for _ in range(workers * per_worker // group):
        low, high = LONG_STEPS if rng.random() < LONG_SHARE else SHORT_STEPS
        base = rng.randint(low, high)
        episodes += [max(1, base + rng.randint(-1, 1)) for _ in range(group)]
    return [episodes[rank * per_worker : (rank + 1) * per_worker] for rank in range(workers)]


@dataclass
class Run:
    """What one batch did, as the servers saw it."""

    design: str
    killed: bool
    wall_s: float = 0.0
    peak_per_server: list[int] = field(default_factory=list)
    utilisation: float = 0.0
    worker_done_s: list[float | None] = field(default_factory=list)  # None: the killed worker
    killed_at_s: float | None = None
    killed_holding: int = 0  # browsers the killed worker held when it died
    left_open_at_end: int = 0  # of those, still open when the survivors were done
    freed_after_kill_s: float | None = None  # until the last of them was closed (None: never, within the wait)


def open_by(servers: list[InProcessEnvironmentServer], prefix: str) -> int:
    return sum(session.startswith(prefix) for server in servers for session in server.open_session_ids)


async def run_batch(
    design: str, handles: list[Any], plan: list[list[int]], args: argparse.Namespace, *, kill: bool
) -> Run:
    import ray

    servers = [InProcessEnvironmentServer(latency_s=args.latency) for _ in range(args.servers)]
    for server in servers:
        await server.start()
    run = Run(design=design, killed=kill)
    doomed = len(handles) - 1 if kill else None
    doomed_prefix = f"w{doomed}-"
    try:
        urls = [server.url for server in servers]
        started = time.monotonic()
        done: list[float | None] = [None] * len(handles)
        open_area = 0.0
        last_sample = started

        async def one(rank: int) -> None:
            await handles[rank].run.remote(design, urls, plan[rank], args.think)
            done[rank] = time.monotonic() - started

        survivors = [asyncio.ensure_future(one(rank)) for rank in range(len(handles)) if rank != doomed]
        doomed_run = handles[doomed].run.remote(design, urls, plan[doomed], args.think) if kill else None
        deadline = started + RUN_TIMEOUT_S
        while not all(task.done() for task in survivors):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{design}: the batch did not finish within {RUN_TIMEOUT_S:.0f} s")
            await asyncio.sleep(SAMPLE_EVERY_S)
            now = time.monotonic()
            open_area += sum(server.open_sessions for server in servers) * (now - last_sample)
            last_sample = now
            elapsed = now - started
            if kill and run.killed_at_s is None and elapsed >= args.kill_after and open_by(servers, doomed_prefix):
                ray.kill(handles[doomed], no_restart=True)
                run.killed_at_s = elapsed
                with contextlib.suppress(Exception):  # the kill is asynchronous: count once the process is gone
                    await asyncio.wait_for(doomed_run, 5.0)
                run.killed_holding = open_by(servers, doomed_prefix)
            if run.killed_at_s is not None and run.freed_after_kill_s is None and not open_by(servers, doomed_prefix):
                run.freed_after_kill_s = elapsed - run.killed_at_s
        for task in survivors:
            task.result()  # a failed worker fails the benchmark
        run.wall_s = max(value for value in done if value is not None)
        run.utilisation = open_area / (run.wall_s * args.cap * args.servers)
        run.worker_done_s = done
        if kill:
            run.left_open_at_end = open_by(servers, doomed_prefix)
            with_reaping = time.monotonic() + REAP_WAIT_TTLS * args.lease_ttl
            while design == "authority" and run.freed_after_kill_s is None and time.monotonic() < with_reaping:
                await asyncio.sleep(SAMPLE_EVERY_S)
                if not open_by(servers, doomed_prefix):
                    run.freed_after_kill_s = time.monotonic() - started - run.killed_at_s
        run.peak_per_server = [server.peak_open_sessions for server in servers]
        return run
    finally:
        for server in servers:
            await server.stop()


async def measure(args: argparse.Namespace, plan: list[list[int]]) -> list[Run]:
    import ray

    worker = rollout_worker_class()
    handles = [worker.remote(rank, args.workers, args.cap, args.lease_ttl) for rank in range(args.workers)]
    runs = []
    try:
        for kill in (False, True):
            for design in DESIGNS:
                await asyncio.gather(*(handle.ready.remote() for handle in handles))
                runs.append(await run_batch(design, handles, plan, args, kill=kill))
                if kill:  # the last worker died: a new one takes its rank
                    handles[-1] = worker.remote(args.workers - 1, args.workers, args.cap, args.lease_ttl)
                print(f"  {design:<9} {'one worker killed' if kill else 'whole batch':<18} {runs[-1].wall_s:6.1f} s")
    finally:
        for handle in handles:
            ray.kill(handle, no_restart=True)
    return runs


def ratio(static: float | None, authority: float | None) -> str:
    if static is None or authority is None or authority == 0:
        return "-"
    return f"{static / authority:.2f}x"


def ratios(runs: list[Run]) -> dict[str, float]:
    """Static over authority, for the figures where a ratio means something."""
    by = {(run.design, run.killed): run for run in runs}
    static, authority = by[("static", False)], by[("authority", False)]
    killed_static, killed_authority = by[("static", True)], by[("authority", True)]
    return {
        "wall_time": round(static.wall_s / authority.wall_s, 3),
        "utilisation": round(static.utilisation / authority.utilisation, 3),
        "wall_time_one_worker_killed": round(killed_static.wall_s / killed_authority.wall_s, 3),
    }


def report(runs: list[Run], args: argparse.Namespace) -> None:
    by = {(run.design, run.killed): run for run in runs}
    whole = [by[(design, False)] for design in DESIGNS]
    died = [by[(design, True)] for design in DESIGNS]

    def spread(run: Run) -> str:
        times = [value for value in run.worker_done_s if value is not None]
        return f"{min(times):.1f}-{max(times):.1f}"

    rows: list[tuple[str, str, str, str]] = [
        ("wall time, whole batch (s)", *(f"{run.wall_s:.1f}" for run in whole), ratio(*(run.wall_s for run in whole))),
        ("workers done at (s, first-last)", *(spread(run) for run in whole), "-"),
        (
            "server utilisation",
            *(f"{run.utilisation:.0%}" for run in whole),
            ratio(*(run.utilisation for run in whole)),
        ),
        (f"peak sessions per server (cap {args.cap})", *(str(max(run.peak_per_server)) for run in whole), "-"),
        (
            "one worker killed: survivors' wall (s)",
            *(f"{run.wall_s:.1f}" for run in died),
            ratio(*(r.wall_s for r in died)),
        ),
        ("  browsers it held when killed", *(str(run.killed_holding) for run in died), "-"),
        ("  of those, open when the batch ended", *(str(run.left_open_at_end) for run in died), "-"),
        (
            "  closed and slots free after (s)",
            *("never" if run.freed_after_kill_s is None else f"{run.freed_after_kill_s:.1f}" for run in died),
            "-",
        ),
        (f"  peak sessions per server (cap {args.cap})", *(str(max(run.peak_per_server)) for run in died), "-"),
    ]
    print(f"{'':<42} {'static':>11} {'authority':>11} {'static/auth':>11}")
    for label, static, authority, quotient in rows:
        print(f"{label:<42} {static:>11} {authority:>11} {quotient:>11}")


def batch_bounds(plan: list[list[int]], work: list[float], args: argparse.Namespace) -> dict[str, float]:
    """Lower bounds on the batch's wall time that follow from the plan (computed, not measured)."""
    slots = args.cap * args.servers
    names = [str(index) for index in range(args.servers)]
    share = [sum(static_share(args.cap, names, rank, args.workers).values()) for rank in range(args.workers)]
    longest = max(steps for chunk in plan for steps in chunk) * (args.think + args.latency) + 2 * args.latency
    return {
        "static_s": max(max(load / slots_of for load, slots_of in zip(work, share, strict=True)), longest),
        "any_s": max(sum(work) / slots, longest),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="examples:" + __doc__.split("Examples:")[1],
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument("--workers", type=int, default=8, help="rollout worker processes (8)")
    parser.add_argument("--servers", type=int, default=4, help="in-process environment servers (4)")
    parser.add_argument("--cap", type=int, default=4, help="max_sessions_per_server (4)")
    parser.add_argument("--episodes", type=int, default=8, help="episodes per worker (8)")
    parser.add_argument("--group", type=int, default=4, help="samples per prompt, adjacent in the batch (4)")
    parser.add_argument("--latency", type=float, default=0.5, help="seconds per environment call on the server (0.5)")
    parser.add_argument("--think", type=float, default=0.5, help="seconds of policy time per turn (0.5)")
    parser.add_argument("--lease-ttl", type=float, default=5.0, help="the authority's lease_ttl_s (5)")
    parser.add_argument("--kill-after", type=float, default=4.0, help="seconds into the batch the worker dies (4)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the episode lengths (0)")
    parser.add_argument("--json", type=Path, default=JSON_PATH, help=f"where the numbers go ({JSON_PATH.name})")
    args = parser.parse_args(argv)
    counts = (args.workers, args.servers, args.cap, args.episodes, args.group)
    if min(counts) < 1 or args.workers < 2 or (args.workers * args.episodes) % args.group:
        parser.print_usage(sys.stderr)
        print("error: counts must be positive, --workers at least 2, and groups must fill the batch", file=sys.stderr)
        return 2
    if args.cap * args.servers < args.workers:
        parser.print_usage(sys.stderr)
        print("error: a static share needs at least one slot per worker (cap * servers >= workers)", file=sys.stderr)
        return 2

    print(header("placement_share: a static per-worker share of the session cap against the Ray authority"))
    plan = skewed_batch(args.workers, args.episodes, args.group, args.seed)
    per_call = args.think + args.latency
    work = [sum((steps * per_call + 2 * args.latency) for steps in chunk) for chunk in plan]
    print(
        f"{args.workers} workers x {args.episodes} episodes, {args.servers} servers x cap {args.cap} "
        f"(static share: {args.cap * args.servers / args.workers:g} slots per worker)"
    )
    print("turns per episode, by worker: " + "; ".join(",".join(map(str, chunk)) for chunk in plan))
    print("session-seconds per worker:   " + ", ".join(f"{value:.0f}" for value in work))
    bounds = batch_bounds(plan, work, args)
    print(
        f"from the plan alone: static >= {bounds['static_s']:.1f} s (the busiest worker's work over its share), "
        f"any design >= {bounds['any_s']:.1f} s (all work over every slot, or the longest episode)"
    )
    began = time.monotonic()
    with private_ray():
        runs = asyncio.run(measure(args, plan))
    runtime_s = time.monotonic() - began
    report(runs, args)
    print(f"measured in {runtime_s:.0f} s (Ray start included)")

    args.json.write_text(
        json.dumps(
            {
                "benchmark": "placement_share",
                "machine": asdict(describe_machine()),
                "settings": {key: value for key, value in vars(args).items() if key != "json"},
                "turns_per_episode_by_worker": plan,
                "session_seconds_by_worker": [round(value, 2) for value in work],
                "computed_lower_bounds_s": {key: round(value, 2) for key, value in bounds.items()},
                "runs": [asdict(run) for run in runs],
                "static_over_authority": ratios(runs),
                "runtime_s": round(runtime_s, 1),
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )
    over = [run for run in runs if max(run.peak_per_server) > args.cap]
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
