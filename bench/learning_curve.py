"""The mission's claim, shown by training: infrastructure zeros in GRPO's baseline slow learning; the recipe does not.

Two arms, each a real ``python -m verl.trainer.main_ppo`` run (V1 trainer, ``BrowserToolAgentLoop``, the CPU backend
in place of vLLM) of the same warm-started tiny policy on the same Corner Shop training tasks, with the same seed:

    recipe   ``grpo_env_aware`` through ``patches.py``; a spoiled episode is re-run up to 3 attempts, and what still
             fails stays out of its group's baseline
    stock    verl's GRPO as it ships (the recipe's wiring off, one attempt): a spoiled episode is a zero in its group

and, per arm, the same share of training sessions spoiled by the environment: the fault proxy answers 503 to the
session's verify (after the policy acted), drawn per session from a hash of its id. Validation runs the 24
held-back tasks (items no training task names) greedily every ``--eval-every`` steps and before training; their
sessions are never faulted, so the success rate measures the policy alone.

Prints the held-back success rate per step for each arm and rate, the minutes each run took, and writes a PNG and
the raw numbers (JSON). The environment is the project's fake ``interactive_browser`` server serving the shop's
pages (observations byte-identical to the real server's, checked by the integration tier) by default, to keep the
CPU for the model; ``--environment real`` runs nemo-gym 0.7.0 with Chromium instead.

    python bench/learning_curve.py                        # rates 0 / 0.3 / 0.6, both arms
    python bench/learning_curve.py --rates 0.6 --steps 20 --eval-every 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from nemo_gym_browser.local import shop_tasks
from nemo_gym_browser.local import training_run as tr
from nemo_gym_browser.testing.benchmarking import header

ARMS = (("recipe", tr.RECIPE_ESTIMATOR), ("stock", tr.STOCK_ESTIMATOR))
SUCCESS_KEY = f"val-core/{tr.DATA_SOURCE}/reward/mean@1"
HERE = Path(__file__).resolve().parent


@contextlib.contextmanager
def environment(kind: str) -> Any:
    """The URL of an ``interactive_browser`` serving the shop: the fake server in a thread, or the real one."""
    if kind == "fake":
        from nemo_gym_browser.testing.fake_environment import FakeEnvironmentServer

        with FakeEnvironmentServer(site=shop_tasks.fake_site()).run_in_thread() as fake:
            yield fake.url
    else:
        from nemo_gym_browser.launch_environment import LocalEnvironment

        with shop_tasks.serve(), LocalEnvironment() as real:
            yield real.url


def run_arm(
    args: argparse.Namespace, url: str, model: Path, rows: tuple[Path, Path], rate: float, arm: str, estimator: str
) -> dict[str, Any]:
    held_back = frozenset(record["id"] for record in shop_tasks.task_records("heldback"))
    rule = tr.random_faults(rate, args.seed, spare_tasks=held_back)
    with tr.InjectedFaults(url, rule) as faults:
        spec = tr.RunSpec(
            model_path=model,
            train_file=rows[0],
            val_file=rows[1],
            server_urls=(faults.url,),
            output_dir=args.workdir / f"rate{rate:g}-{arm}",
            steps=args.steps,
            prompts_per_step=args.prompts_per_step,
            group_size=args.group_size,
            estimator=estimator,
            lr=args.lr,
            test_freq=args.eval_every,
            val_before_train=True,
            seed=args.seed,
        )
        result = tr.run_main_ppo(spec, timeout_s=args.timeout)
        injected = faults.counts()
    if not result.ok:
        print(result.log_tail(40), file=sys.stderr)
        raise SystemExit(f"{arm} at rate {rate}: main_ppo exited {result.returncode} ({result.log_path})")
    success = {step: m[SUCCESS_KEY] for step, m in sorted(result.steps.items()) if SUCCESS_KEY in m}
    train_reward = {step: m["critic/score/mean"] for step, m in sorted(result.steps.items()) if step > 0}
    # env/* metrics come from the recipe's wiring: the stock arm (wiring off) has none
    invalid = [m["env/invalid_rate"] for step, m in result.steps.items() if step > 0 and "env/invalid_rate" in m]
    resampled = [m["env/resampled_rate"] for step, m in result.steps.items() if step > 0 and "env/resampled_rate" in m]
    return {
        "rate": rate,
        "arm": arm,
        "minutes": result.elapsed_s / 60,
        "success": success,
        "train_reward": train_reward,
        "mean_invalid_rate": sum(invalid) / len(invalid) if invalid else None,
        "mean_resampled_rate": sum(resampled) / len(resampled) if resampled else None,
        "peak_memory_gib": result.peak_memory_bytes / 2**30,
        "step_seconds": {step: m["timing_s/step"] for step, m in sorted(result.steps.items()) if "timing_s/step" in m},
        "injected_503": injected.get("status", 0),
    }


def print_table(runs: list[dict[str, Any]]) -> None:
    steps = sorted({step for run in runs for step in run["success"]})
    columns = [(run["rate"], run["arm"]) for run in runs]
    print("\nheld-back success rate (greedy, 24 tasks never trained on) by training step")
    print("step " + " ".join(f"{f'{rate:.0%} {arm}':>12}" for rate, arm in columns))
    for step in steps:
        cells = []
        for run in runs:
            value = run["success"].get(step)
            cells.append(f"{value:12.3f}" if value is not None else f"{'-':>12}")
        print(f"{step:4d} " + " ".join(cells))
    print(
        "\nrun           minutes  s/step  peak GiB  mean train reward  invalid after attempts  resampled  503s injected"
    )
    for run in runs:
        rewards = list(run["train_reward"].values())
        mean_reward = sum(rewards) / max(len(rewards), 1)
        seconds = list(run["step_seconds"].values())
        per_step = sum(seconds) / max(len(seconds), 1)
        invalid, resampled = run["mean_invalid_rate"], run["mean_resampled_rate"]
        print(
            f"{run['rate']:>4.0%} {run['arm']:<7} {run['minutes']:8.1f} {per_step:7.1f} {run['peak_memory_gib']:9.1f} "
            f"{mean_reward:18.3f} {'-' if invalid is None else f'{invalid:.3f}':>23} "
            f"{'-' if resampled is None else f'{resampled:.3f}':>10} {run['injected_503']:14d}"
        )
    print("(invalid and resampled come from the recipe's env/* metrics; the stock arm has no wiring to count them)")


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({run["rate"] for run in runs})
    width = max(4.2 * len(rates), 6.4)  # one panel still fits the title line
    figure, axes = plt.subplots(1, len(rates), figsize=(width, 3.6), sharey=True, squeeze=False)
    for axis, rate in zip(axes[0], rates, strict=True):
        for run in (r for r in runs if r["rate"] == rate):
            steps = sorted(run["success"])
            style = {"marker": "o", "linestyle": "-"} if run["arm"] == "recipe" else {"marker": "s", "linestyle": "--"}
            axis.plot(steps, [run["success"][s] for s in steps], label=run["arm"], markerfacecolor="none", **style)
        axis.set_title(f"{rate:.0%} of training sessions spoiled")
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-back success rate")
    axes[0][0].legend()
    figure.suptitle(textwrap.fill(title, width=int(width * 15)), fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.3, 0.6])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--prompts-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--environment", choices=("fake", "real"), default="fake")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nemo-gym-browser-learning-curve"))
    parser.add_argument("--plot", type=Path, default=HERE / "learning_curve.png")
    parser.add_argument("--json", type=Path, default=HERE / "learning_curve.json")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run")
    args = parser.parse_args(argv)
    if any(not 0.0 <= rate <= 1.0 for rate in args.rates) or min(args.steps, args.eval_every) < 1:
        parser.error("rates must be in [0, 1]; --steps and --eval-every at least 1")
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(header("learning curve: the recipe vs stock GRPO under injected infrastructure failures"), flush=True)

    started = time.monotonic()
    rows = tr.prepare_task_rows(args.workdir, shop_tasks.TRAIN_FILE, shop_tasks.HELD_BACK_FILE)
    model = tr.tiny_policy_folder(args.workdir, args.seed)
    print(f"policy {model} ready after {time.monotonic() - started:.0f} s", flush=True)
    runs = []
    with environment(args.environment) as url:
        for rate in args.rates:
            for arm, estimator in ARMS:
                run = run_arm(args, url, model, rows, rate, arm, estimator)
                runs.append(run)
                last = run["success"][max(run["success"])]
                print(f"  rate {rate:.0%} {arm:<6}: {run['minutes']:.1f} min, held-back success {last:.3f}", flush=True)
    print_table(runs)
    total = (time.monotonic() - started) / 60
    settings = (
        f"{args.steps} steps x {args.prompts_per_step} tasks x {args.group_size} episodes, lr {args.lr}, "
        f"seed {args.seed}, {args.environment} environment; {total:.0f} min in all"
    )
    print(f"\n{settings}")
    args.json.write_text(
        json.dumps({"settings": vars(args) | {"workdir": str(args.workdir)}, "runs": runs}, indent=1, default=str)
        + "\n"
    )
    plot(runs, args.plot, settings)
    print(f"wrote {args.plot} and {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
