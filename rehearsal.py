"""The local rehearsal: a real environment, real rollouts through the recipe's loop, and the advantages that follow.

One command, no GPU, a few minutes: it brings up nemo-gym 0.7.0's ``interactive_browser`` with headless Chromium on
127.0.0.1 (``launch_environment.py``), walks one episode with ``smoke_environment.py``, prepares rollout rows from
the bundled task list (``examples/local_tasks.jsonl``, through ``prepare_webvoyager_data.py`` and
``BrowserJSONLDataset``), and rolls out GRPO groups through ``BrowserToolAgentLoop`` inside verl's own
``AgentLoopWorker``. A scripted policy stands in for the model; a fault-injecting proxy between the loop and the
server makes some sessions fail (a failed seed that recovers on resampling, sessions lost on every attempt, a
verifier that never answers). The advantages are then computed through the recipe's wiring (``patches.py`` →
``grpo_env_aware``, configured in ``configs/webvoyager_grpo.yaml``) and printed next to what stock GRPO would have
given each sample with the failures counted as zeros. Everything it started is stopped at the end.

Exit codes: 0 the rehearsal ran and every advantage matched the estimator's contract; 1 something failed; 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import logging
import os
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nemo_gym_browser.agent_attempt.sample_flags import ATTEMPTS_KEY, FAILURE_KIND_KEY, INVALID_KEY
from nemo_gym_browser.gym_contract.browser_calls import BROWSER_CLICK

RECIPE_DIR = Path(__file__).resolve().parent
TASKS = RECIPE_DIR / "examples" / "local_tasks.jsonl"
GROUP_SIZE = 4
MAX_ATTEMPTS = 3

EXAMPLES = """\
examples:
  python rehearsal.py                            # start a local environment, rehearse, stop it
  python rehearsal.py --url http://127.0.0.1:8100  # rehearse against a server you started yourself
"""


@dataclass(frozen=True)
class SamplePlan:
    """What one sample of a group does: the policy's behaviour, and the fault the proxy injects into its attempts."""

    correct: bool
    fault: str | None = None  # an endpoint to break
    fault_attempts: tuple[int, ...] = ()  # which attempts the fault hits (1-based)
    note: str = ""


# task id -> one plan per sample of its GRPO group
PLANS: dict[str, tuple[SamplePlan, ...]] = {
    "bundled--about": (SamplePlan(True), SamplePlan(True), SamplePlan(False), SamplePlan(False)),
    "bundled--code": (
        SamplePlan(True),
        SamplePlan(False, "seed_session", (1,), "seed failed once, recovered"),
        SamplePlan(False),
        SamplePlan(True),
    ),
    "bundled--form": (
        SamplePlan(True),
        SamplePlan(False),
        SamplePlan(False, BROWSER_CLICK, (1, 2, 3), "session lost on every attempt"),
        SamplePlan(False, BROWSER_CLICK, (1, 2, 3), "session lost on every attempt"),
    ),
    "bundled--home": (
        SamplePlan(True),
        SamplePlan(False, "verify", (1, 2, 3), "verify unavailable on every attempt"),
        SamplePlan(False, "verify", (1, 2, 3), "verify unavailable on every attempt"),
        SamplePlan(False, "verify", (1, 2, 3), "verify unavailable on every attempt"),
    ),
}


def scripts_for(task_id: str, sample: int) -> Any:
    """The scripted policy's behaviour for one sample (correct or a plausible mistake)."""
    from nemo_gym_browser.local import scripted_policy as sp

    correct = PLANS[task_id][sample].correct
    if task_id == "bundled--about":
        return sp.walk_and_finish("About", "done") if correct else sp.steps(sp.observe(), sp.finish("done"))
    if task_id == "bundled--code":
        return sp.walk_and_finish("About", "ALPHA-42" if correct else "ALPHA-24")
    if task_id == "bundled--form":
        return sp.walk_and_finish("Go to form" if correct else "About", "done")
    if task_id == "bundled--home":
        return sp.steps(sp.observe(), sp.finish("done")) if correct else sp.walk_and_finish("About", "done")
    raise KeyError(task_id)


def marker(task_id: str, sample: int) -> str:
    """Appended to a sample's task text so the scripted policy can tell the samples of a group apart."""
    return f"[rehearsal {task_id}#{sample}]"


def fault_rule(plans: dict[int, SamplePlan]) -> Any:
    """A proxy rule that breaks the planned endpoint of the planned attempts of the planned samples."""
    from nemo_gym_browser.gym_contract.session_ids import parse_session_id
    from nemo_gym_browser.local.faults.kinds import Fault

    faults = {
        "seed_session": Fault.status(503),
        BROWSER_CLICK: Fault.lose_session(),
        "verify": Fault.status(503),
    }

    def rule(request: Any) -> Any:
        parsed = parse_session_id(request.session_id)
        if parsed is None:
            return None
        index, attempt = parsed
        plan = plans.get(index)
        if plan and plan.fault == request.endpoint and attempt in plan.fault_attempts:
            return faults[request.endpoint]
        return None

    return rule


def compose_recipe_config(overrides: list[str]) -> Any:
    """``configs/webvoyager_grpo.yaml`` composed by hydra, as ``main_ppo`` composes it for the submit script."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(RECIPE_DIR / "configs"), version_base=None):
            return compose(config_name="webvoyager_grpo", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def run_smoke(url: str) -> None:
    print(f"\n== smoke_environment.py --url {url}")
    done = subprocess.run(
        [sys.executable, str(RECIPE_DIR / "smoke_environment.py"), "--url", url], timeout=300, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"the smoke episode failed (exit {done.returncode})")


def bundled_rows(workdir: Path) -> list[dict[str, Any]]:
    from nemo_gym_browser import prepare_webvoyager_data
    from nemo_gym_browser.dataset import BrowserJSONLDataset

    print(f"\n== prepare_webvoyager_data.py --input {TASKS.relative_to(RECIPE_DIR)}")
    train = prepare_webvoyager_data.prepare_rows(TASKS, workdir / "data")
    dataset = BrowserJSONLDataset([str(train)])
    return [dataset[i] for i in range(len(dataset))]


def group_rows(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[int, SamplePlan], dict[str, Any]]:
    """GRPO groups of ``GROUP_SIZE`` samples per task, each sample tagged for the scripted policy."""
    samples, plans, scripts = [], {}, {}
    for row in sorted(rows, key=lambda r: list(PLANS).index(r["extra_info"]["task_id"])):
        task_id = row["extra_info"]["task_id"]
        for k in range(GROUP_SIZE):
            sample = {key: value for key, value in row.items() if key != "dummy_tensor"}
            tag = marker(task_id, k)
            prompt = [dict(message) for message in row["raw_prompt"]]
            prompt[-1]["content"] = f"{prompt[-1]['content']} {tag}"
            sample.update(raw_prompt=prompt, index=len(samples), uid=task_id)
            plans[len(samples)] = PLANS[task_id][k]
            scripts[tag] = scripts_for(task_id, k)
            samples.append(sample)
    return samples, plans, scripts


def to_batch(samples: list[dict[str, Any]]) -> Any:
    import numpy as np
    import torch
    from tensordict import TensorDict
    from verl.protocol import DataProto

    columns = {}
    for key in samples[0]:
        column = np.empty(len(samples), dtype=object)
        column[:] = [sample[key] for sample in samples]
        columns[key] = column
    tensors = TensorDict({"dummy_tensor": torch.zeros(len(samples), 1, dtype=torch.uint8)}, batch_size=len(samples))
    return DataProto(batch=tensors, non_tensor_batch=columns, meta_info={"global_steps": 1, "validate": False})


async def roll_out(server_url: str, samples: list[dict[str, Any]], scripts: dict[str, Any], workdir: Path) -> Any:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    from nemo_gym_browser.browser_agent_loop import close_shared_clients
    from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer, save_tokenizer_and_config
    from nemo_gym_browser.local.scripted_policy import ScriptedPolicy

    model_dir = save_tokenizer_and_config(workdir / "model")
    config = compose_recipe_config(
        [
            f"actor_rollout_ref.model.path={model_dir}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={RECIPE_DIR / 'configs' / 'agent_loop.yaml'}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={RECIPE_DIR / 'configs' / 'browser_tool.yaml'}",
            f"actor_rollout_ref.rollout.n={GROUP_SIZE}",
            f"++nemo_gym_browser.environment.server_urls='{server_url}'",
            "++nemo_gym_browser.environment.call_timeout_s=30",
            f"++nemo_gym_browser.max_attempts={MAX_ATTEMPTS}",
            "++nemo_gym_browser.resample_backoff_s=0.2",
            "++nemo_gym_browser.episode_deadline_s=120",
        ]
    )
    tokenizer = build_chat_tokenizer()
    with contextlib.redirect_stdout(io.StringIO()):  # verl prints the tool schemas it loads
        worker = AgentLoopWorker(config, ScriptedPolicy(tokenizer, scripts))
    try:
        return await worker.generate_sequences(to_batch(samples)), config
    finally:
        await close_shared_clients()


def advantages(output: Any, config: Any) -> tuple[list[float], list[float]]:
    """Per-sample advantage through the recipe's wiring, and what stock GRPO gives with failures as zeros."""
    import torch
    from verl.trainer.ppo import core_algos
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from nemo_gym_browser import patches

    patches.install()
    data = output.select(deepcopy=True)
    data.batch["token_level_rewards"] = data.batch["rm_scores"]
    data = compute_advantage(
        data,
        adv_estimator=config.algorithm.adv_estimator,
        norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
        config=config.algorithm,
    )
    mask = data.batch["response_mask"].bool()
    recipe = [float(adv[m][0]) if m.any() else 0.0 for adv, m in zip(data.batch["advantages"], mask, strict=True)]
    # Stock GRPO, had the failures been ordinary samples: each sample's total reward, its group's mean and std.
    scores = output.batch["rm_scores"].sum(-1, keepdim=True)
    stock, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=scores,
        response_mask=torch.ones_like(scores),
        index=output.non_tensor_batch["uid"],
        norm_adv_by_std_in_grpo=config.algorithm.norm_adv_by_std_in_grpo,
    )
    return recipe, stock[:, 0].tolist()


def expected_advantages(rewards: list[float], invalid: list[bool], uids: list[str], norm: bool) -> list[float]:
    """The estimator's contract, written out plainly: GRPO over each group's valid samples, 0 for the rest."""
    result = [0.0] * len(rewards)
    for uid in dict.fromkeys(uids):
        members = [i for i, u in enumerate(uids) if u == uid and not invalid[i]]
        if len(members) < 2:
            continue
        values = [rewards[i] for i in members]
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
        for i in members:
            result[i] = (rewards[i] - mean) / (std + 1e-6) if norm else rewards[i] - mean
    return result


def print_table(output: Any, plans: dict[int, SamplePlan], recipe: list[float], stock: list[float]) -> None:
    columns = output.non_tensor_batch
    rewards = output.batch["rm_scores"].sum(-1).tolist()
    header = (
        f"{'group':<15} {'#':>2} {'policy':<8} {'reward':>6} {'invalid':<7} {'kind':<18} {'att':>3} "
        f"{'recipe adv':>10} {'stock adv':>10}  what happened"
    )
    print("\n" + header)
    print("-" * len(header))
    previous = None
    for i, uid in enumerate(columns["uid"]):
        if previous is not None and uid != previous:
            print()
        previous = uid
        plan = plans[i]
        kind = columns[FAILURE_KIND_KEY][i] or "-"
        print(
            f"{uid:<15} {i % GROUP_SIZE:>2} {'correct' if plan.correct else 'wrong':<8} {rewards[i]:>6.1f} "
            f"{'yes' if columns[INVALID_KEY][i] else 'no':<7} {kind:<18} {columns[ATTEMPTS_KEY][i]:>3} "
            f"{recipe[i]:>+10.3f} {stock[i]:>+10.3f}  {plan.note}"
        )


def check(output: Any, plans: dict[int, SamplePlan], recipe: list[float], config: Any) -> list[str]:
    """What must hold: flags as planned, advantages as the estimator's contract says."""
    columns = output.non_tensor_batch
    rewards = output.batch["rm_scores"].sum(-1).tolist()
    invalid = [bool(v) for v in columns[INVALID_KEY]]
    problems = []
    for i, plan in plans.items():
        exhausted = len(plan.fault_attempts) >= MAX_ATTEMPTS
        if invalid[i] != exhausted:
            problems.append(f"sample {i}: {INVALID_KEY}={invalid[i]}, planned {exhausted}")
        if not invalid[i] and rewards[i] != float(plan.correct):
            problems.append(f"sample {i}: reward {rewards[i]}, a {'correct' if plan.correct else 'wrong'} policy")
    expected = expected_advantages(
        rewards, invalid, list(columns["uid"]), bool(config.algorithm.norm_adv_by_std_in_grpo)
    )
    for i, (got, want) in enumerate(zip(recipe, expected, strict=True)):
        if abs(got - want) > 1e-4:
            problems.append(f"sample {i}: advantage {got:+.4f}, the contract says {want:+.4f}")
    return problems


async def rehearse(server_url: str, workdir: Path) -> int:
    from nemo_gym_browser.local.faults.proxy import FaultProxy

    rows = bundled_rows(workdir)
    samples, plans, scripts = group_rows(rows)
    async with FaultProxy(server_url) as proxy:
        proxy.set_rule(fault_rule(plans))
        print(
            f"\n== {len(samples)} rollouts ({len(rows)} GRPO groups of {GROUP_SIZE}) through BrowserToolAgentLoop, "
            f"faults injected by a proxy at {proxy.url}"
        )
        started = time.monotonic()
        output, config = await roll_out(proxy.url, samples, scripts, workdir)
        elapsed = time.monotonic() - started
        left_open = len(proxy.open_session_ids)
    recipe, stock = advantages(output, config)
    print_table(output, plans, recipe, stock)
    columns = output.non_tensor_batch
    resampled = sum(1 for a in columns[ATTEMPTS_KEY] if a > 1)
    invalid = sum(bool(v) for v in columns[INVALID_KEY])
    print(
        f"\nrollouts: {len(samples)} in {elapsed:.1f}s; resampled {resampled}, recovered {resampled - invalid}, "
        f"invalid after {MAX_ATTEMPTS} attempts {invalid}; sessions left open on the server: {left_open}"
    )
    print(
        f"estimator: {config.algorithm.adv_estimator} (norm_adv_by_std_in_grpo="
        f"{config.algorithm.norm_adv_by_std_in_grpo}); invalid samples get 0 and stay out of their group's mean and "
        "std, and a group left with one valid sample carries no signal. Stock GRPO counts the failures as zeros."
    )
    problems = check(output, plans, recipe, config)
    if left_open:
        problems.append(f"{left_open} sessions left open on the server")
    for problem in problems:
        print(f"MISMATCH: {problem}")
    print("OK: the table matches the estimator's contract" if not problems else "FAILED")
    return 0 if not problems else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rehearsal.py",
        description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--url", help="use this running interactive_browser server instead of starting one")
    parser.add_argument("--backend", default="remote_cdp", help="browser backend of the started server")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the recipe's log lines")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, format="%(levelname)s %(message)s")
    if not args.verbose:
        # verl announces, once per import, that this machine has no GPU and no optional engines: true and expected.
        warnings.filterwarnings("ignore", category=UserWarning, module=r"verl\.")
        os.environ.setdefault("VERL_LOGGING_LEVEL", "ERROR")
        for name in ("verl", "ray"):
            logging.getLogger(name).setLevel(logging.ERROR)

    from nemo_gym_browser.launch_environment import EnvironmentStartError, LocalEnvironment

    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="nemo-gym-browser-rehearsal-") as tmp, contextlib.ExitStack() as stack:
        url = args.url
        try:
            if url is None:
                print("== starting nemo-gym 0.7.0 interactive_browser with headless Chromium on 127.0.0.1")
                environment = stack.enter_context(LocalEnvironment(backend=args.backend))
                url = environment.url
                print(f"environment server up at {url} in {environment.startup_s:.1f}s")
            run_smoke(url)
            code = asyncio.run(rehearse(url, Path(tmp)))
        except (EnvironmentStartError, RuntimeError) as exc:
            print(f"rehearsal failed: {exc}", file=sys.stderr)
            return 1
    print(f"\nrehearsal finished in {time.monotonic() - started:.0f}s; everything it started is stopped")
    return code


if __name__ == "__main__":
    raise SystemExit(main())
