"""What the recipe costs on top of the environment: 1, 64 and 256 concurrent episodes of the real agent loop.

Each episode is the recipe's real ``BrowserToolAgentLoop`` (built from ``configs/agent_loop.yaml`` as verl's
``AgentLoopWorker`` builds it), driven by an instant scripted policy against a fake server with a fixed per-call
latency in its own process: ``--steps`` browser actions plus seed, verify and close. Side by side at the same
concurrency: *raw* (the same HTTP calls with bare aiohttp: the environment's own cost) and *verl* (verl's stock
``ToolAgentLoop`` with a minimal bare-HTTP tool; one more generation per episode). Added latency per step =
(mean episode wall time - mean raw episode wall time) / steps, as a share of the raw call latency; everything in the
rollout process counts as added. Memory: a separate ``tracemalloc`` pass (peak heap per episode in flight) and the
timed pass's sampled RSS. Method in full: ``docs/benchmarks.md#rollout-overhead``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import io
import logging
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from omegaconf import OmegaConf
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

from nemo_gym_browser.agent_attempt.browser_tool import default_tool_schema
from nemo_gym_browser.agent_attempt.sample_flags import FAILURE_REASON_KEY, INVALID_KEY
from nemo_gym_browser.browser_agent_loop import close_shared_clients
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.local.in_process_loop import agent_loop_entry, compose_trainer_config, load_tools, make_row
from nemo_gym_browser.testing.benchmarking import LoopFactory, fake_environment_process, header, write_report

SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": False}
VERIFIER = {"url_contains": "about.html"}
START_URL = "site/index.html"
ABOUT_ELEMENT_ID = 1  # "About" on the bundled start page
TARGET_SHARE = 0.05  # the target: added latency under 5 % of the environment call
RSS_SAMPLE_S = 0.01
RAW_CALL_TIMEOUT_S = 60.0

EXAMPLES = """\
examples:
  python bench/rollout_overhead.py                           # 1, 64, 256 episodes; 50 ms per call; 10 steps
  python bench/rollout_overhead.py --concurrency 1 16 --rounds 1
  python bench/rollout_overhead.py --latency-ms 200 --steps 20

exit codes: 0 targets met, 1 a target missed (figures still printed), 2 usage error
"""


# ----- the fake model, with its own CPU time counted ------------------------------------------------------------


class TimedPolicy(sp.ScriptedPolicy):
    """The scripted policy, counting the CPU time its own ``generate`` spends (it never yields when instant)."""

    cpu_s = 0.0

    async def generate(self, request_id: str, **kwargs: Any) -> Any:
        started = time.thread_time()
        try:
            return await super().generate(request_id, **kwargs)
        finally:
            TimedPolicy.cpu_s += time.thread_time() - started


def episode_script(steps: int) -> sp.Script:
    """``steps`` actions: observe until two are left, click "About", finish (a rewarded episode)."""
    return sp.steps(*([sp.observe()] * (steps - 2)), sp.click_matching("About"), sp.finish("ALPHA-42"))


# ----- the three kinds of episode: raw HTTP, stock verl, the recipe ---------------------------------------------


@dataclass
class Wave:
    """One wave of concurrent episodes of one kind."""

    kind: str
    episodes: int
    wall_s: float
    episode_s: list[float]
    call_s: list[float]
    cpu_s: float
    policy_cpu_s: float
    peak_rss_delta: int
    rewards: list[float]


def seed_body(session_id: str) -> dict[str, Any]:
    return {
        "resources_session_id": session_id,
        "episode_id": {"rollout_id": session_id, "attempt": 1},
        "task_id": {"taskset": "bench", "task_id": "about"},
        "task_data": {"initial_url": START_URL, "verifier_metadata": VERIFIER},
    }


def close_body(session_id: str) -> dict[str, Any]:
    return {"resources_session_id": session_id, "episode_id": {"rollout_id": session_id, "attempt": 1}}


VERIFY_BODY = {
    "responses_create_params": {"input": []},
    "response": {
        "id": "r", "created_at": 0, "model": "m", "object": "response", "output": [],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
    },
}  # fmt: skip


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], call_s: list[float]) -> Any:
    started = time.perf_counter()
    async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(total=RAW_CALL_TIMEOUT_S)) as response:
        payload = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(f"{url} answered HTTP {response.status}: {payload}")
    call_s.append(time.perf_counter() - started)
    return payload


class RawRunner:
    """Episodes of bare HTTP calls: the environment's own cost, nothing of the recipe."""

    def __init__(self, url: str, steps: int) -> None:
        self.url = url
        self.steps = steps
        self.connector: aiohttp.TCPConnector | None = None

    def http(self) -> aiohttp.ClientSession:
        if self.connector is None:
            self.connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=10.0)
        return aiohttp.ClientSession(
            connector=self.connector, connector_owner=False, cookie_jar=aiohttp.CookieJar(unsafe=True)
        )

    async def episode(self, index: int, call_s: list[float]) -> float:
        session_id = f"raw{index}_{uuid.uuid4().hex[:12]}"  # "-a<digits>" at the end is reserved
        calls = [("seed_session", seed_body(session_id))]
        calls += [("browser_observe", {})] * (self.steps - 2)
        calls += [("browser_click", {"element_id": ABOUT_ELEMENT_ID}), ("browser_finish", {"answer": "ALPHA-42"})]
        calls += [("verify", VERIFY_BODY), ("close_session", close_body(session_id))]
        reward = 0.0
        async with self.http() as http:
            for path, body in calls:
                payload = await post(http, f"{self.url}/{path}", body, call_s)
                if path == "verify":
                    reward = float(payload["reward"])
        return reward

    async def close(self) -> None:
        if self.connector is not None:
            await self.connector.close()


class PlainHttpTool(BaseTool):
    """The least a verl tool recipe does: the ``browser`` tool as bare HTTP calls, one cookie jar per episode.

    The first call seeds, ``finish`` also verifies and closes. No timeouts beyond one total per call, no failure
    handling, no URL guard, no flags: a floor to compare the recipe with, not something to train with.
    """

    def __init__(self, raw: RawRunner) -> None:
        with contextlib.redirect_stdout(io.StringIO()):  # BaseTool prints its schema
            super().__init__({}, default_tool_schema("browser"))
        self.raw = raw

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        agent_data = kwargs["agent_data"]
        state = getattr(agent_data, "bench_http", None)
        if state is None:
            session_id = f"verl{id(agent_data)}_{uuid.uuid4().hex[:12]}"
            state = (self.raw.http(), session_id)
            agent_data.bench_http = state
            await post(state[0], f"{self.raw.url}/seed_session", seed_body(session_id), [])
        http, session_id = state
        arguments = {k: v for k, v in parameters.items() if k != "action"}
        answer = await post(http, f"{self.raw.url}/browser_{parameters['action']}", arguments, [])
        if parameters["action"] == "finish":
            await post(http, f"{self.raw.url}/verify", VERIFY_BODY, [])
            await post(http, f"{self.raw.url}/close_session", close_body(session_id), [])
            await http.close()
        return ToolResponse(text=answer["observation"] or "Finished."), 0.0, {}


class LoopRunner:
    """Episodes of an agent loop, one loop object per episode, built as verl builds them."""

    def __init__(self, entry: Any, tools: list[Any], trainer_config: Any, tokenizer: Any, script: sp.Script) -> None:
        self.factory = LoopFactory(entry, tools, trainer_config, tokenizer)
        self.tokenizer = tokenizer
        self.script = script

    def build(self) -> Any:
        return self.factory.build(TimedPolicy(self.tokenizer, self.script))

    @staticmethod
    def row(index: int) -> dict[str, Any]:
        return make_row(task="Open the About page and report the code", verifier_metadata=VERIFIER, index=index)


class RecipeRunner(LoopRunner):
    """The recipe's ``BrowserToolAgentLoop`` from ``configs/agent_loop.yaml``."""

    def __init__(self, url: str, steps: int, max_concurrency: int, tokenizer: Any) -> None:
        entry = agent_loop_entry(
            environment={"server_urls": [url], "max_sessions_per_server": max(64, max_concurrency)}
        )
        super().__init__(entry, load_tools(), compose_trainer_config(), tokenizer, episode_script(steps))

    async def episode(self, index: int, call_s: list[float]) -> float:
        output = await self.build().run(SAMPLING, **self.row(index))
        if output.extra_fields[INVALID_KEY]:
            raise RuntimeError(f"episode {index} failed in the environment: {output.extra_fields[FAILURE_REASON_KEY]}")
        return float(output.reward_score)


class VerlRunner(LoopRunner):
    """verl's stock ``ToolAgentLoop`` with :class:`PlainHttpTool`, observations as long as the recipe's."""

    def __init__(self, raw: RawRunner, steps: int, tokenizer: Any) -> None:
        recipe_entry = agent_loop_entry()
        config = compose_trainer_config(
            overrides=[
                f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={recipe_entry.max_tool_response_length}"
            ]
        )
        entry = OmegaConf.create({"_target_": "verl.experimental.agent_loop.tool_agent_loop.ToolAgentLoop"})
        super().__init__(entry, [PlainHttpTool(raw)], config, tokenizer, episode_script(steps))

    async def episode(self, index: int, call_s: list[float]) -> float:
        output = await self.build().run(SAMPLING, **self.row(index))
        # The About page's text in the conversation: the click reached the right page (as the verifier checks).
        text = self.tokenizer.decode(output.response_ids)
        if "Secret code: ALPHA-42" not in text:
            raise RuntimeError(f"verl episode {index} did not reach the About page:\n{text[-1500:]}")
        return 1.0


async def run_wave(
    kind: str, episode: Callable[[int, list[float]], Awaitable[float]], concurrency: int, first_index: int
) -> Wave:
    gc.collect()
    process = psutil.Process()
    rss_before = process.memory_info().rss
    peak = rss_before
    done = asyncio.Event()

    async def sample_rss() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, process.memory_info().rss)
            await asyncio.sleep(RSS_SAMPLE_S)

    sampler = asyncio.create_task(sample_rss())
    call_s: list[float] = []
    episode_s: list[float] = []

    async def timed(index: int) -> float:
        started = time.perf_counter()
        reward = await episode(index, call_s)
        episode_s.append(time.perf_counter() - started)
        return reward

    policy_cpu = TimedPolicy.cpu_s
    cpu = time.process_time()
    started = time.perf_counter()
    rewards = await asyncio.gather(*(timed(first_index + i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu
    done.set()
    await sampler
    return Wave(
        kind=kind,
        episodes=concurrency,
        wall_s=wall,
        episode_s=episode_s,
        call_s=call_s,
        cpu_s=cpu,
        policy_cpu_s=TimedPolicy.cpu_s - policy_cpu,
        peak_rss_delta=peak - rss_before,
        rewards=list(rewards),
    )


async def traced_peak_per_episode(
    episode: Callable[[int, list[float]], Awaitable[float]], concurrency: int, first_index: int
) -> float:
    """Peak Python heap above the pre-wave level, per episode in flight (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        before, _ = tracemalloc.get_traced_memory()
        await asyncio.gather(*(episode(first_index + i, []) for i in range(concurrency)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (peak - before) / concurrency


# ----- the measurement ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Result:
    concurrency: int
    raw_call_ms: float
    episode_s: dict[str, float]  # mean episode wall time per kind
    added_ms_per_step: dict[str, float]  # per loop kind, over the raw episode
    episodes_per_s: dict[str, float]
    cpu_ms_per_step: dict[str, float]  # per loop kind, beyond the raw episode's
    policy_cpu_ms_per_step: float  # the recipe run's scripted policy
    traced_kib_per_episode: float
    rss_kib_per_episode: float

    @property
    def share(self) -> float:
        return self.added_ms_per_step["recipe"] / self.raw_call_ms


LOOP_KINDS = ("verl", "recipe")
DEFAULT_JSON = Path(__file__).resolve().parent / "rollout_overhead.json"


async def measure(
    url: str, *, concurrencies: list[int], steps: int, rounds: int, min_episodes: int, memory: bool
) -> list[Result]:
    tokenizer = build_chat_tokenizer()
    raw = RawRunner(url, steps)
    runners = {
        "raw": raw,
        "verl": VerlRunner(raw, steps, tokenizer),
        "recipe": RecipeRunner(url, steps, max(concurrencies), tokenizer),
    }
    index = 0
    try:
        # Warm-up: pools, tokenizer caches, lazily built settings, first-use imports.
        for runner in runners.values():
            await run_wave("warm-up", runner.episode, 4, index)
            index += 4
        results = []
        for concurrency in concurrencies:
            waves: dict[str, list[Wave]] = {kind: [] for kind in runners}
            for _ in range(max(rounds, -(-min_episodes // concurrency))):
                for kind, runner in runners.items():
                    wave = await run_wave(kind, runner.episode, concurrency, index)
                    index += concurrency
                    if any(r != 1.0 for r in wave.rewards):
                        raise RuntimeError(f"{kind} episodes did not all reach the About page: {wave.rewards}")
                    waves[kind].append(wave)
            traced = float("nan")
            if memory:
                traced = await traced_peak_per_episode(runners["recipe"].episode, concurrency, index)
                index += concurrency
            rss = max(w.peak_rss_delta for w in waves["recipe"]) / concurrency
            results.append(summarise(concurrency, steps, waves, traced, rss))
            print(format_row(results[-1]), flush=True)
        return results
    finally:
        await raw.close()
        await close_shared_clients()


def summarise(concurrency: int, steps: int, waves: dict[str, list[Wave]], traced: float, rss: float) -> Result:
    def episodes(kind: str) -> int:
        return sum(w.episodes for w in waves[kind])

    def mean_episode(kind: str) -> float:
        return statistics.fmean(e for w in waves[kind] for e in w.episode_s)

    def cpu_per_step(kind: str) -> float:
        return sum(w.cpu_s for w in waves[kind]) / episodes(kind) / steps

    raw_call = statistics.fmean(c for w in waves["raw"] for c in w.call_s)
    return Result(
        concurrency=concurrency,
        raw_call_ms=1000 * raw_call,
        episode_s={kind: mean_episode(kind) for kind in waves},
        added_ms_per_step={k: 1000 * (mean_episode(k) - mean_episode("raw")) / steps for k in LOOP_KINDS},
        episodes_per_s={kind: episodes(kind) / sum(w.wall_s for w in waves[kind]) for kind in waves},
        cpu_ms_per_step={k: 1000 * (cpu_per_step(k) - cpu_per_step("raw")) for k in LOOP_KINDS},
        policy_cpu_ms_per_step=1000 * sum(w.policy_cpu_s for w in waves["recipe"]) / episodes("recipe") / steps,
        traced_kib_per_episode=traced / 1024,
        rss_kib_per_episode=rss / 1024,
    )


COLUMNS = (
    f"{'episodes':>8} | {'raw call':>9} | {'episode s: raw / verl / recipe':>30} | {'added/step verl, recipe':>23} | "
    f"{'share':>6} | {'episodes/s':>10} | {'CPU/step verl, recipe (model)':>29} | {'heap/ep':>9} | {'RSS/ep':>9}"
)


def format_row(r: Result) -> str:
    e, a, c = r.episode_s, r.added_ms_per_step, r.cpu_ms_per_step
    return (
        f"{r.concurrency:>8} | {r.raw_call_ms:>6.1f} ms | {e['raw']:>8.3f} /{e['verl']:>8.3f} /{e['recipe']:>8.3f}   | "
        f"{a['verl']:>7.2f} ms,{a['recipe']:>7.2f} ms | {r.share:>6.1%} | {r.episodes_per_s['recipe']:>10.1f} | "
        f"{c['verl']:>5.2f} ms,{c['recipe']:>5.2f} ms ({r.policy_cpu_ms_per_step:.2f} ms) | "
        f"{r.traced_kib_per_episode:>5.0f} KiB | {r.rss_kib_per_episode:>5.0f} KiB"
    )


def verdicts(results: list[Result], latency_ms: float) -> list[tuple[str, bool]]:
    checks = []
    largest = max(results, key=lambda r: r.concurrency)
    checks.append(
        (
            f"added latency at {largest.concurrency} episodes: {largest.added_ms_per_step['recipe']:.2f} ms per step = "
            f"{largest.share:.1%} of the {largest.raw_call_ms:.1f} ms raw call (target < {TARGET_SHARE:.0%} of a "
            f"{latency_ms:g} ms call)",
            largest.share < TARGET_SHARE,
        )
    )
    measured = [r for r in results if r.concurrency > 1 and r.traced_kib_per_episode == r.traced_kib_per_episode]
    if len(measured) >= 2:
        low, high = measured[0], measured[-1]
        ratio = high.traced_kib_per_episode / low.traced_kib_per_episode
        checks.append(
            (
                f"memory per episode in flight: {low.traced_kib_per_episode:.0f} KiB at {low.concurrency}, "
                f"{high.traced_kib_per_episode:.0f} KiB at {high.concurrency} (ratio {ratio:.2f}; linear growth "
                "keeps it near 1, target within 0.67-1.5)",
                0.67 <= ratio <= 1.5,
            )
        )
    return checks


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollout_overhead.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256], help="episodes in flight")
    parser.add_argument("--latency-ms", type=float, default=50.0, help="fake server delay per call (default 50)")
    parser.add_argument("--steps", type=int, default=10, help="browser actions per episode, >= 2 (default 10)")
    parser.add_argument("--rounds", type=int, default=2, help="waves of each kind per concurrency (default 2)")
    parser.add_argument(
        "--min-episodes", type=int, default=16, help="more waves at low concurrency until each kind has this many"
    )
    parser.add_argument("--no-memory", action="store_true", help="skip the tracemalloc pass")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.steps < 2 or args.rounds < 1 or args.latency_ms < 0 or min(args.concurrency) < 1:
        print("rollout_overhead.py: error: need --steps >= 2, --rounds >= 1, --latency-ms >= 0, concurrency >= 1",
              file=sys.stderr)  # fmt: skip
        return 2
    logging.getLogger("nemo_gym_browser").setLevel(logging.ERROR)  # verl owns the root handler
    started = time.perf_counter()
    print(header("rollout_overhead: the recipe's cost over the environment call"))
    print(
        f"setup: {args.steps} actions + seed/verify/close per episode, fake server in its own process with "
        f"{args.latency_ms:g} ms per call, instant scripted policy, {args.rounds} round(s) per concurrency (at least "
        f"{args.min_episodes} episodes of each kind)"
    )
    print(COLUMNS)
    with fake_environment_process(args.latency_ms / 1000) as url:
        results = asyncio.run(
            measure(
                url,
                concurrencies=sorted(set(args.concurrency)),
                steps=args.steps,
                rounds=args.rounds,
                min_episodes=args.min_episodes,
                memory=not args.no_memory,
            )
        )
    print(
        "added/step: (episode - raw episode) / steps, for verl's stock ToolAgentLoop + a bare HTTP tool and for the "
        "recipe; share: the recipe's, of the raw call; episodes/s: the recipe's; CPU/step: rollout-process CPU per "
        "step beyond the raw episode's, (model): the scripted policy's part; heap/ep: tracemalloc peak per "
        "episode in flight; RSS/ep: sampled RSS peak per episode in flight"
    )
    checks = verdicts(results, args.latency_ms)
    for text, ok in checks:
        print(f"{'ok  ' if ok else 'MISS'} {text}")
    figures = {
        "results": [{**asdict(result), "share": result.share} for result in results],
        "checks": [{"check": text, "ok": ok} for text, ok in checks],
    }
    write_report(args.json, vars(args), figures)
    print(f"done in {time.perf_counter() - started:.0f} s")
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    raise SystemExit(main())
