"""The tiny policy for MiniWoB++: warm-started on the solver's demonstrations, played through the recipe's loop
against the real ``interactive_browser`` server with Chromium, for the tasks a policy this size can learn.

What it is
    :data:`LEARNING_TASKS` are eight included tasks that the solver (:mod:`.solver`) solves in two browser calls:
    observe the page, click one listed element. :func:`demonstration_script` is that solver acting in the right
    format and order but clicking the element it would click only with probability ``correct``, else one drawn
    from every element the page lists (the right one included), so which element to click is left for RL to
    lift. :func:`collect_demonstrations` plays it on training seeds through ``BrowserToolAgentLoop`` against a
    real server and keeps what the loop produced (``prompt_ids``, ``response_ids``, ``response_mask``);
    :func:`build_miniwob` continues the shipped aisle policy (its tokenizer and weights: it already observes,
    clicks and finishes in the recipe's format) on them with :func:`..warm_start.warm_start` and saves the folder
    (shipped as :data:`MINIWOB_POLICY_DIR`). Held-back seeds are never demonstrated (:func:`.inventory.seeds`).

    python -m nemo_gym_browser.local.miniwob.policy --threads 2 --output /tmp/miniwob-policy

Exit status: 0 built, 1 the environment did not come up, 2 usage error.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..warm_start import Demonstration, WarmStartSpec, episode_demonstrations
from .grading import GradeKey
from .solver import Page, next_call, render_call, tool_answers
from .suite import write_rows

logger = logging.getLogger(__name__)

# Included tasks the solver plays as observe, click (docs/miniwob.md's table: 2.0 browser calls, 20/20).
LEARNING_TASKS = (
    "click-button",
    "click-dialog",
    "click-dialog-2",
    "click-tab",
    "click-test",
    "focus-text",
    "focus-text-2",
    "unicode-test",
)
MINIWOB_POLICY_DIR = Path(__file__).resolve().parent.parent / "miniwob_policy"
# Training seeds demonstrated per task, and the warm start: one pass of demonstrations that click the solver's
# element one time in two (else any listed element), from the aisle policy's weights.
DEMO_SEEDS = 32
MINIWOB_WARM = WarmStartSpec(correct=0.5, guess=0.0, demos_per_task=1, steps=300, batch_size=32, lr=1e-3,
                             warmup_steps=20, seed=1)  # fmt: skip
ENVIRONMENT = {"call_timeout_s": 30.0, "seed_timeout_s": 60.0, "verify_timeout_s": 30.0, "close_timeout_s": 15.0}
CONCURRENCY = 3


def demonstration_script(correct: float, seed: int) -> Callable[[Any], str]:
    """The solver as a scripted-policy script whose clicks hit the solver's element with probability ``correct``,
    else any element the last observation lists; drawn from ``seed``, the page's URL (task and MiniWoB seed) and
    the call's index, so a conversation always gets the same turn."""
    if not 0.0 <= correct <= 1.0:
        raise ValueError(f"correct must be in [0, 1], got {correct}")

    def play(view: Any) -> str:
        answers = tool_answers(view.text)
        call = next_call(answers)
        if call.get("action") == "click" and answers:
            page = Page.parse(answers[-1])
            draw = random.Random(f"{seed}:{page.url}:{len(answers)}")
            if page.elements and draw.random() >= correct:
                call = {**call, "element_id": draw.choice(page.elements).id}
        return render_call(call)

    return play


async def collect_demonstrations(
    tokenizer: Any,
    samples: Sequence[dict[str, Any]],
    server_url: str,
    *,
    correct: float,
    seed: int,
    concurrency: int = CONCURRENCY,
) -> tuple[list[Demonstration], int]:
    """One episode of :func:`demonstration_script` per sample through the recipe's loop against ``server_url``;
    returns the demonstrations and how many episodes the environment failed (left out)."""
    from ...browser_agent_loop import close_shared_clients
    from ..in_process_loop import build_loop, compose_trainer_config, load_tools, run_episode
    from ..policy_model import PROMPT_LENGTH, RESPONSE_LENGTH
    from ..scripted_policy import ScriptedPolicy

    config = compose_trainer_config(prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH)
    tools, limit = load_tools(), asyncio.Semaphore(concurrency)
    script = demonstration_script(correct, seed)

    async def one(sample: dict[str, Any]) -> list[Demonstration]:
        async with limit:
            loop = build_loop(
                ScriptedPolicy(tokenizer, script),
                tokenizer=tokenizer,
                tools=tools,
                trainer_config=config,
                environment={"server_urls": [server_url], **ENVIRONMENT},
            )
            outputs = await run_episode(loop, {}, sample, "trajectory")
        if any(output.extra_fields.get("env_invalid") for output in outputs):
            logger.warning("left out %s: %s", sample["extra_info"]["task_id"], outputs[-1].extra_fields)
            return []
        task = sample["extra_info"]["task_metadata"]["miniwob_task"]
        return episode_demonstrations(outputs, sample["extra_info"]["task_id"], task, "trajectory")

    try:
        played = await asyncio.gather(*(one(sample) for sample in samples))
    finally:
        await close_shared_clients()
    return [demo for demos in played for demo in demos], sum(not demos for demos in played)


def build_miniwob(
    output_dir: Path,
    *,
    tasks: Sequence[str] = LEARNING_TASKS,
    seeds_per_task: int = DEMO_SEEDS,
    warm: WarmStartSpec = MINIWOB_WARM,
    start_from: Path | None = None,
) -> dict[str, Any]:
    """Serve the site and a real environment, record the demonstrations, warm-start, save ``output_dir``."""
    from ...launch_environment import LocalEnvironment
    from .. import tiny_policy
    from ..policy_model import policy_tokenizer
    from .evaluate import load_samples
    from .site import MiniWobSite

    start_from = Path(start_from) if start_from is not None else tiny_policy.AISLE_POLICY_DIR
    tokenizer = policy_tokenizer()
    key = GradeKey.generate()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="miniwob-policy-") as workdir:
        rows = write_rows(key, Path(workdir), per_task={"train": seeds_per_task}, tasks=tasks)
        samples = load_samples(rows["train"])
        with MiniWobSite(key), LocalEnvironment() as environment:
            demos, failed = asyncio.run(
                collect_demonstrations(tokenizer, samples, environment.url, correct=warm.correct, seed=warm.seed)
            )
    demo_seconds = time.monotonic() - started
    report = tiny_policy.train_and_save(
        output_dir, demos, tokenizer=tokenizer, warm=warm, demo_seconds=demo_seconds, start_from=start_from
    )
    return {"report": report, "environment_failures": failed}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_gym_browser.local.miniwob.policy",
        description="Build the MiniWoB++ tiny policy: solver demonstrations through the recipe's loop on the real "
        "server with Chromium (the site served on 127.0.0.1 with a fresh key), then the warm start.",
    )
    parser.add_argument("--output", type=Path, required=True, metavar="DIR")
    parser.add_argument("--seeds-per-task", type=int, default=DEMO_SEEDS, help="training seeds (%(default)s)")
    parser.add_argument("--correct", type=float, default=MINIWOB_WARM.correct, help="default %(default)s")
    parser.add_argument("--steps", type=int, default=MINIWOB_WARM.steps, help="default %(default)s")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.seeds_per_task < 1 or args.steps < 0 or not 0.0 <= args.correct <= 1.0:
        print("error: --seeds-per-task >= 1, --steps >= 0, --correct in [0, 1]", file=sys.stderr)
        return 2
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    from ...launch_environment import EnvironmentStartError

    warm = replace(MINIWOB_WARM, correct=args.correct, steps=args.steps, warmup_steps=min(20, args.steps))
    try:
        built = build_miniwob(args.output, seeds_per_task=args.seeds_per_task, warm=warm)
    except EnvironmentStartError as exc:
        print(f"error: the environment did not come up: {exc}", file=sys.stderr)
        return 1
    report = built["report"]
    print(
        json.dumps(
            {
                "output": str(args.output),
                "demonstrations": report.demonstrations,
                "demonstration_success": round(report.demonstration_success, 3),
                "environment_failures": built["environment_failures"],
                "demo_seconds": report.demo_seconds,
                "train_seconds": report.train_seconds,
                "final_loss": report.losses[-1] if report.losses else None,
            }
        )
    )
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
