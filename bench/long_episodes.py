"""Tokens per sample and memory per episode as episodes grow: one sample per episode vs one per step (step-wise).

Each cell runs episodes of exactly N policy steps (a scripted policy: observe, click, observe ... then finish)
through the recipe's real ``BrowserToolAgentLoop`` (built as verl's ``AgentLoopWorker`` builds it, on verl's
prompt builder and tool path) against the in-process environment server in its own process, once per mode. The fake
site's two pages are at the real server's caps (50 elements with 80-character names, 2000 characters of text), so
every observation is as long as a busy real page's:

* one-sample (the default): the whole episode is one sample; every observation stays in it;
* step-wise (``stepwise.enabled``): a sample per step whose prompt is the task, one line per earlier step (at most
  ``--history-steps``) and the latest ``--history-observations`` step(s) whole.

Reported per cell: samples per episode, tokens per sample (prompt + response; max and mean over the samples), and
the peak Python heap (``tracemalloc``) while the agent-loop process runs one episode, the server excluded. Tokens are
counted with the project's test tokenizer (about 3-4 characters per token on browser traffic, as Qwen2.5 measures
in ``bench/observation_lengths.py``). The trainer's activation memory per micro-batch follows tokens per sample.

The check: step-wise tokens per sample stay flat in episode length (the longest episode's largest sample at most
``FLAT_TOLERANCE`` above the shortest's) while one-sample grows. Exit 1 when it does not hold.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import sys
import tracemalloc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from nemo_gym_browser.testing.benchmarking import LoopFactory, header, write_report

EXAMPLES = """\
examples:
  python bench/long_episodes.py                                  # 5-, 15- and 30-step episodes, both modes
  python bench/long_episodes.py --lengths 5,30 --episodes 1 --history-steps 5

exit codes: 0 measured and step-wise flat, 1 step-wise tokens per sample grew, 2 usage error
"""

DEFAULT_JSON = Path(__file__).resolve().parent / "long_episodes.json"
FLAT_TOLERANCE = 0.25  # a bounded history still fills up to history_steps lines: some growth is expected
SAMPLING = {"temperature": 1.0, "logprobs": True}
ANSWER = "ALPHA-42"
ABOUT = {"url_contains": "about.html"}
# Room for the longest one-sample episode: nothing may be cut, or the comparison would flatter it.
RESPONSE_LENGTH = 262144
PROMPT_LENGTH = 8192
ELEMENTS, NAME_CHARS, TEXT_CHARS = 50, 80, 2000  # nemo-gym 0.7.0's observation caps
SERVER_START_TIMEOUT_S = 60.0


def busy_site():  # the fake server's Site: index and about pages at the observation caps, linking to each other
    from nemo_gym_browser.local.environment_server import site_model as fe

    base = fe.BUNDLED_ROOT + "site/"
    filler = [f"Item {i}: " + ("a detailed product or article name " * 3) for i in range(ELEMENTS - 2)]
    items = tuple(fe.link(name[:NAME_CHARS], f"item{i}.html") for i, name in enumerate(filler))
    elements = (fe.link("About", "about.html"), fe.link("Home", "index.html"), *items)
    body = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 40)[: TEXT_CHARS - 40]
    return fe.Site(
        {
            base + "index.html": fe.Page(title="Home", text="Home\n" + body, elements=elements),
            base + "about.html": fe.Page(title="About", text="Secret code: ALPHA-42\n" + body, elements=elements),
        }
    )


def _serve(ports, stop) -> None:  # child process: the fake server on the busy site until told to stop
    from nemo_gym_browser.local.environment_server.server import InProcessEnvironmentServer

    async def serve() -> None:
        async with InProcessEnvironmentServer(busy_site()) as server:
            ports.put(server.port)
            await asyncio.get_running_loop().run_in_executor(None, stop.wait)

    asyncio.run(serve())


@contextmanager
def busy_server() -> Iterator[str]:
    """The fake server in its own process (its allocations stay out of the measured heap); yields its URL."""
    context = multiprocessing.get_context("spawn")
    ports, stop = context.Queue(), context.Event()
    child = context.Process(target=_serve, args=(ports, stop), daemon=True)
    child.start()
    try:
        try:
            port = ports.get(timeout=SERVER_START_TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError("the in-process environment server process did not start") from None
        yield f"http://127.0.0.1:{port}"
    finally:
        stop.set()
        child.join(10)
        if child.is_alive():
            child.terminate()
            child.join(10)


@dataclass(frozen=True)
class Cell:
    steps: int
    mode: str
    samples: float  # per episode
    tokens_max: int
    tokens_mean: float
    peak_mib: float  # per episode, the largest over its episodes
    reward: float  # mean: every episode should end on its finish (1.0)


def parse_lengths(text: str) -> list[int]:
    lengths = [int(part) for part in text.split(",") if part.strip()]
    if not lengths or min(lengths) < 2:
        raise ValueError("--lengths needs episode lengths of at least 2 steps, e.g. 5,15,30")
    return lengths


async def measure(url: str, lengths: Sequence[int], episodes: int, stepwise: dict) -> list[Cell]:
    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.local import scripted_policy as sp
    from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
    from nemo_gym_browser.local.in_process_loop import agent_loop_entry, compose_trainer_config, load_tools, make_row
    from nemo_gym_browser.testing import stepwise_policy as swp

    tokenizer = build_chat_tokenizer()
    config = compose_trainer_config(
        response_length=RESPONSE_LENGTH,
        prompt_length=PROMPT_LENGTH,
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max(lengths) + 5}"],
    )
    tools = load_tools()
    cells = []
    try:
        for steps in lengths:
            for mode, settings in (("one-sample", {"enabled": False}), ("step-wise", {**stepwise, "enabled": True})):
                entry = agent_loop_entry(environment={"server_urls": [url]}, stepwise=settings)
                factory = LoopFactory(entry, tools, config, tokenizer)
                sizes: list[int] = []
                samples, peaks, rewards = [], [], []
                for index in range(episodes):
                    loop = factory.build(sp.ScriptedPolicy(tokenizer, swp.walk(steps, ANSWER)))
                    row = make_row(task=f"Walk {steps} steps, then report the code", verifier_metadata=ABOUT)
                    v1 = {"uid": f"bench-{steps}", "session_id": index, "global_steps": 1}
                    tracemalloc.reset_peak()
                    before, _ = tracemalloc.get_traced_memory()
                    result = await loop.run(SAMPLING, **row, **v1)
                    _, peak = tracemalloc.get_traced_memory()
                    outputs = result if isinstance(result, list) else [result]
                    sizes.extend(len(o.prompt_ids) + len(o.response_ids) for o in outputs)
                    samples.append(len(outputs))
                    peaks.append((peak - before) / 2**20)
                    rewards.append(outputs[-1].reward_score)
                cells.append(
                    Cell(
                        steps=steps,
                        mode=mode,
                        samples=sum(samples) / len(samples),
                        tokens_max=max(sizes),
                        tokens_mean=sum(sizes) / len(sizes),
                        peak_mib=max(peaks),
                        reward=sum(rewards) / len(rewards),
                    )
                )
    finally:
        await close_shared_clients()
    return cells


def table(cells: Sequence[Cell]) -> str:
    lines = [
        "| steps | mode       | samples/episode | tokens/sample max | tokens/sample mean | peak MiB/episode | reward |",
        "|------:|------------|----------------:|------------------:|-------------------:|-----------------:|-------:|",
    ]
    for c in cells:
        lines.append(
            f"| {c.steps:5d} | {c.mode:10s} | {c.samples:15.1f} | {c.tokens_max:17d} | {c.tokens_mean:18.0f} "
            f"| {c.peak_mib:16.2f} | {c.reward:6.2f} |"
        )
    return "\n".join(lines)


def flat(cells: Sequence[Cell]) -> tuple[bool, str]:
    """Whether step-wise tokens per sample stayed flat from the shortest to the longest episode."""
    stepwise = sorted((c for c in cells if c.mode == "step-wise"), key=lambda c: c.steps)
    single = sorted((c for c in cells if c.mode == "one-sample"), key=lambda c: c.steps)
    growth = stepwise[-1].tokens_max / stepwise[0].tokens_max - 1
    single_growth = single[-1].tokens_max / single[0].tokens_max - 1
    ok = growth <= FLAT_TOLERANCE and all(c.reward == 1.0 for c in cells)
    return ok, (
        f"{stepwise[0].steps} -> {stepwise[-1].steps} steps: step-wise largest sample {growth:+.0%} "
        f"(tolerance +{FLAT_TOLERANCE:.0%}), one-sample {single_growth:+.0%}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench/long_episodes.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--lengths", default="5,15,30", help="episode lengths in policy steps (default 5,15,30)")
    parser.add_argument("--episodes", type=int, default=2, help="episodes per length and mode (default 2)")
    parser.add_argument("--history-steps", type=int, default=10, help="step-wise: earlier steps as lines (10)")
    parser.add_argument("--history-observations", type=int, default=1, help="step-wise: latest steps whole (1)")
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON, help=f"figures as JSON (default {DEFAULT_JSON})")
    args = parser.parse_args(argv)
    try:
        lengths = parse_lengths(args.lengths)
        if args.episodes < 1 or args.history_steps < 0 or args.history_observations < 1:
            raise ValueError("--episodes and --history-observations must be at least 1, --history-steps at least 0")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    stepwise = {"history_steps": args.history_steps, "history_observations": args.history_observations}
    print(header("long episodes: tokens per sample and memory, one sample per episode vs step-wise"))
    print(
        f"history_steps={args.history_steps} history_observations={args.history_observations}, "
        f"{args.episodes} episode(s) per cell, test tokenizer"
    )
    tracemalloc.start()
    try:
        with busy_server() as url:
            cells = asyncio.run(measure(url, lengths, args.episodes, stepwise))
    finally:
        tracemalloc.stop()
    print(table(cells))
    ok, verdict = flat(cells)
    print(("OK " if ok else "FAIL ") + verdict)
    write_report(args.json, vars(args), {"cells": cells, "flat": ok, "verdict": verdict})
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
