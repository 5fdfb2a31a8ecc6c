"""Does a run learn, and does the env-aware baseline change what is learned? Both answered by training.

Every run is a real ``python -m verl.trainer.main_ppo`` (V1 trainer, ``BrowserToolAgentLoop``, the CPU backend in
place of vLLM) of the warm-started tiny policy on the Corner Shop's deal tasks (``shop_tasks``, suite ``deal``):
name the fruit a board marks on sale. Two routes solve one: read the board (an ``observe`` call, then ``finish``
with the marked fruit), or ``finish`` at once with a fruit from memory, never touching the browser, which is right
one time in four. The warm start takes both routes and reads the mark only some of the time.

Two arms, the same policy, tasks and seed:

    recipe   ``grpo_env_aware`` through ``patches.py``; an episode the infrastructure failed is re-run (3 attempts)
             and what still fails stays out of the loss and out of its group's baseline
    stock    verl's GRPO, one attempt, and a failed episode is scored 0 and trained on like a policy outcome
             (``train_on_failures``): what an integration without this recipe does

and, per arm, the same infrastructure failures where real ones happen: the fault proxy fails each browser call
(``observe``, ``navigate``, ``click``, ``type``) with probability ``--rates`` (drawn per call from the seed, the
session and the call's index), as a lost session by default, so an episode that browses is exposed and an answer
from memory never is. Validation (before training and every ``--eval-every`` steps) samples ``--val-samples``
episodes of each of ``--val-tasks`` training tasks and held-back boards at temperature 1, with no faults: clean
success, the share of episodes that browsed, and browser calls per episode.

Prints one line per run as it ends and, at the end, mean and range over seeds per arm, rate and evaluated step;
writes the JSON after every run (a long benchmark keeps what it measured) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

from nemo_gym_browser.local import main_ppo_process as mp
from nemo_gym_browser.local import run_spec as rs
from nemo_gym_browser.local import shop_tasks
from nemo_gym_browser.local import training_run as tr
from nemo_gym_browser.local.faults import injected as inj
from nemo_gym_browser.prepare_webvoyager_data import prepare_rows
from nemo_gym_browser.testing.benchmarking import header

ENGINES = tr.ENGINES

HERE = Path(__file__).resolve().parent
ARMS = ("recipe", "stock")
# Validation data sources: the training tasks and the held-back boards, scored apart by verl's validation.
VAL_SOURCES = {"train": "deal-train", "heldback": "deal-heldback"}
VAL_TASK_PREFIX = "val--"


def validation_rows(rows: Path, split: str, output: Path, limit: int) -> tuple[Path, frozenset[str]]:
    """A copy of the first ``limit`` prepared rows for validation: their own data source and task ids (so faults can
    spare them)."""
    lines = []
    for line in rows.read_text(encoding="utf-8").splitlines()[:limit]:
        row = json.loads(line)
        row["data_source"] = VAL_SOURCES[split]
        row["task_id"] = VAL_TASK_PREFIX + row["task_id"]
        lines.append(json.dumps(row))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return output, frozenset(json.loads(line)["task_id"] for line in lines)


def run_spec(args: argparse.Namespace, *, arm: str, seed: int, rate: float, url: str, data: dict[str, Any]) -> Any:
    n = args.val_samples
    overrides = [
        f"data.val_files=[{rs.hydra_string(data['val'][0])},{rs.hydra_string(data['val'][1])}]",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.rollout.val_kwargs.n={n}",
    ]
    if args.engine == "hfcpu":  # request ids stable across runs, so the sampling streams are (cpu_backend/server.py)
        overrides.append("actor_rollout_ref.rollout.full_determinism=True")
    if arm == "stock":
        overrides.append("+nemo_gym_browser.train_on_failures=True")
    return rs.RunSpec(
        model_path=data["model"],
        train_file=data["train"],
        val_file=data["val"][0],
        server_urls=(url,),
        output_dir=args.workdir / f"rate{rate:g}-{arm}-seed{seed}",
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_assistant_turns=4,
        estimator=rs.RECIPE_ESTIMATOR if arm == "recipe" else rs.STOCK_ESTIMATOR,
        lr=args.lr,
        test_freq=args.eval_every,
        val_before_train=True,
        seed=seed,
        rollout_name=ENGINES[args.engine],
        extra_overrides=tuple(overrides),
        faults=inj.FaultSpec(rate=rate, at="browser-call", kind=args.fault_kind),
    )


def evaluated(steps: dict[int, dict[str, Any]], n: int) -> dict[int, dict[str, float]]:
    """Per evaluated step: clean success and browsing, on training tasks and held-back boards."""
    out = {}
    for step, metrics in sorted(steps.items()):
        row = {}
        for split, source in VAL_SOURCES.items():
            for name, key in (
                ("success", f"val-core/{source}/reward/mean@{n}"),
                ("browsed", f"val-aux/{source}/env/browsed/mean@{n}"),
                ("browser_calls", f"val-aux/{source}/env/browser_actions/mean@{n}"),
            ):
                if key in metrics:
                    row[f"{split}_{name}"] = float(metrics[key])
        if row:
            out[step] = row
    return out


def run_one(args: argparse.Namespace, *, arm: str, seed: int, rate: float, url: str, data: dict[str, Any]) -> dict:
    spec = run_spec(args, arm=arm, seed=seed, rate=rate, url=url, data=data)
    with inj.InjectedFaults(url, spec.faults.rule(seed, spare_tasks=data["val_ids"])) as faults:
        result = mp.run_main_ppo(
            spec.replace(server_urls=(faults.url,)), timeout_s=args.timeout, python=rs.main_ppo_python(spec)
        )
        injected = faults.counts()
        left_open = len(faults.open_session_ids)
    if not result.ok:
        print(result.log_tail(40), file=sys.stderr)
        raise SystemExit(f"{arm} seed {seed} rate {rate}: main_ppo exited {result.returncode} ({result.log_path})")
    training = {
        step: {
            "reward": m.get("critic/score/mean"),
            "browsed_rate": m.get("env/browsed_rate"),
            "invalid_rate": m.get("env/invalid_rate"),
            "resampled_rate": m.get("env/resampled_rate"),
            "step_s": m.get("timing_s/step"),
            "gen_s": m.get("timing_s/gen"),
        }
        for step, m in sorted(result.steps.items())
        if step > 0
    }
    return {
        "arm": arm,
        "seed": seed,
        "rate": rate,
        "minutes": result.elapsed_s / 60,
        "peak_memory_gib": result.peak_memory_bytes / 2**30,
        "evaluated": evaluated(result.steps, args.val_samples),
        "training": training,
        "faults_injected": injected,
        "sessions_left_open": left_open,
    }


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})"


def mean_text(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


def print_summary(runs: list[dict[str, Any]]) -> None:
    print("\nclean success and browsing, mean (min-max) over seeds, by evaluated step")
    columns = ("train_success", "heldback_success", "train_browsed", "heldback_browsed", "train_browser_calls")
    print(f"{'rate':>5} {'arm':<7} {'step':>4} " + " ".join(f"{c:>20}" for c in columns))
    for rate in sorted({run["rate"] for run in runs}):
        for arm in ARMS:
            group = [run for run in runs if run["rate"] == rate and run["arm"] == arm]
            if not group:
                continue
            steps = sorted({int(s) for run in group for s in run["evaluated"]})
            for step in steps:
                cells = []
                for column in columns:
                    values = [
                        run["evaluated"][step][column]
                        for run in group
                        if step in run["evaluated"] and column in run["evaluated"][step]
                    ]
                    cells.append(f"{spread(values):>20}")
                print(f"{rate:>5.0%} {arm:<7} {step:>4} " + " ".join(cells))
    print("\nrun                         minutes  s/step  gen s  peak GiB  invalid  resampled  faults  left open")
    for run in runs:
        seconds = [t["step_s"] for t in run["training"].values() if t["step_s"] is not None]
        gen = [t["gen_s"] for t in run["training"].values() if t["gen_s"] is not None]
        invalid = [t["invalid_rate"] for t in run["training"].values() if t["invalid_rate"] is not None]
        resampled = [t["resampled_rate"] for t in run["training"].values() if t["resampled_rate"] is not None]
        name = f"{run['rate']:.0%} {run['arm']} seed {run['seed']}"
        print(
            f"{name:<27} {run['minutes']:7.1f} {sum(seconds) / max(len(seconds), 1):7.1f} "
            f"{sum(gen) / max(len(gen), 1):6.1f} {run['peak_memory_gib']:9.1f} "
            f"{mean_text(invalid):>8} {mean_text(resampled):>10} "
            f"{sum(run['faults_injected'].values()):7d} {run['sessions_left_open']:10d}"
        )


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = sorted({run["rate"] for run in runs})
    panels = (("heldback_success", "clean success, held-back boards"), ("train_browsed", "share of episodes browsing"))
    figure, axes = plt.subplots(
        len(panels), len(rates), figsize=(4.6 * len(rates), 3.2 * len(panels)), sharey="row", squeeze=False
    )
    colours = {"recipe": "tab:blue", "stock": "tab:red"}
    for column, rate in enumerate(rates):
        for row, (key, label) in enumerate(panels):
            axis = axes[row][column]
            for arm in ARMS:
                group = [run for run in runs if run["rate"] == rate and run["arm"] == arm]
                if not group:
                    continue
                steps = sorted({int(s) for run in group for s in run["evaluated"]})
                for run in group:  # one thin line per seed
                    xs = [s for s in steps if s in run["evaluated"] and key in run["evaluated"][s]]
                    axis.plot(xs, [run["evaluated"][s][key] for s in xs], color=colours[arm], alpha=0.3, lw=0.8)
                means = []
                for s in steps:
                    values = [run["evaluated"][s][key] for run in group if s in run["evaluated"]]
                    means.append(sum(values) / len(values))
                style = "-" if arm == "recipe" else "--"
                axis.plot(steps, means, style, color=colours[arm], marker="o", ms=3, label=f"{arm} (mean)")
            axis.set_ylim(-0.02, 1.02)
            axis.grid(alpha=0.3)
            if row == 0:
                axis.set_title(f"{rate:.0%} of browser calls fail")
            if row == len(panels) - 1:
                axis.set_xlabel("training step")
            if column == 0:
                axis.set_ylabel(label)
    axes[0][0].legend(fontsize=8)
    figure.suptitle(textwrap.fill(title, width=int(4.6 * len(rates) * 17)), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/learning_curve.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="""\
examples:
  python bench/learning_curve.py                                   # rates 0 and 0.85, seeds 0 1 2, both arms
  python bench/learning_curve.py --rates 0.85 --seeds 0 --steps 8  # one quick pair
  python bench/learning_curve.py --environment real --seeds 0      # nemo-gym 0.7.0 with Chromium

exit codes: 0 done, 1 a run failed, 2 impossible settings.""",
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.85],
                        help="chance that each browser call fails (default: 0 0.85)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per arm and seed (0 1 2)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="default: both")
    parser.add_argument("--stock-at-zero", action="store_true",
                        help="also run the stock arm at rate 0, where it produces the recipe's episodes "
                        "(tests/test_main_ppo_determinism.py); skipped by default")  # fmt: skip
    parser.add_argument("--fault-kind", choices=inj.FAULT_KINDS, default="lose_session",
                        help="what a failed browser call meets (default %(default)s)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="training steps per run (%(default)s)")
    parser.add_argument("--eval-every", type=int, default=2, help="validate every N steps (%(default)s)")
    parser.add_argument("--val-tasks", type=int, default=48,
                        help="validation tasks of each split: the first N (default %(default)s)")  # fmt: skip
    parser.add_argument("--val-samples", type=int, default=2, help="validation episodes per task (%(default)s)")
    parser.add_argument("--prompts-per-step", type=int, default=8, help="tasks per step (%(default)s)")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per task, one GRPO group (%(default)s)")
    parser.add_argument("--lr", type=float, default=3e-4, help="actor learning rate (%(default)s)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a policy folder (default: build the deal policy in --workdir)")  # fmt: skip
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hfcpu",
                        help="what serves the policy: hfcpu (local/cpu_backend, default) or vllm (verl's vLLM "
                        "rollout on vLLM's CPU build, .venv-vllm; the policy as its head_dim-32 copy)")  # fmt: skip
    parser.add_argument("--environment", choices=("fake", "real"), default="fake",
                        help="the fake interactive_browser (default) or nemo-gym 0.7.0 with Chromium")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nemo-gym-browser-learning-curve"))
    parser.add_argument("--plot", type=Path, default=HERE / "learning_curve.png")
    parser.add_argument("--json", type=Path, default=HERE / "learning_curve.json")
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run (%(default)s)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    problem = None
    if any(not 0.0 <= rate < 1.0 for rate in args.rates):
        problem = "--rates must be in [0, 1)"
    elif min(args.steps, args.eval_every, args.val_tasks, args.val_samples, args.prompts_per_step, args.group_size) < 1:
        problem = "--steps, --eval-every, --val-tasks, --val-samples, --prompts-per-step, --group-size: at least 1"
    elif args.model is not None and not (args.model / "config.json").is_file():
        problem = f"--model {args.model} has no config.json"
    if problem:
        print(f"learning_curve.py: error: {problem}", file=sys.stderr)
        return 2
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(header("learning curve: the recipe vs stock GRPO, browser calls failing"), flush=True)

    started = time.monotonic()
    train_file, held_file = shop_tasks.SUITE_FILES["deal"]
    train_rows = prepare_rows(train_file, args.workdir / "rows-train")
    held_rows = prepare_rows(held_file, args.workdir / "rows-heldback")
    val_train, train_ids = validation_rows(train_rows, "train", args.workdir / "val" / "train.jsonl", args.val_tasks)
    val_held, held_ids = validation_rows(held_rows, "heldback", args.workdir / "val" / "heldback.jsonl", args.val_tasks)
    model = args.model.resolve() if args.model else tr.deal_policy_folder(args.workdir)  # main_ppo runs elsewhere
    if args.engine == "vllm":
        model = tr.vllm_servable(model, args.workdir)
    data = {"model": model, "train": train_rows, "val": (val_train, val_held), "val_ids": train_ids | held_ids}
    print(f"policy {model} ready after {time.monotonic() - started:.0f} s", flush=True)

    runs: list[dict[str, Any]] = []
    settings = vars(args) | {"workdir": str(args.workdir), "model": str(model)}
    with tr.shop_environment(args.environment) as url:
        for rate in args.rates:
            for seed in args.seeds:
                for arm in args.arms:
                    if rate == 0 and arm == "stock" and "recipe" in args.arms and not args.stock_at_zero:
                        continue  # with no failure the arms produce the same episodes (test_main_ppo_determinism)
                    run = run_one(args, arm=arm, seed=seed, rate=rate, url=url, data=data)
                    runs.append(run)
                    first, last = min(run["evaluated"]), max(run["evaluated"])
                    before, after = run["evaluated"][first], run["evaluated"][last]
                    print(
                        f"  {rate:.0%} {arm:<6} seed {seed}: {run['minutes']:.1f} min; held-back success "
                        f"{before.get('heldback_success', float('nan')):.2f} -> "
                        f"{after.get('heldback_success', float('nan')):.2f}, browsing "
                        f"{before.get('train_browsed', float('nan')):.2f} -> "
                        f"{after.get('train_browsed', float('nan')):.2f}",
                        flush=True,
                    )
                    args.json.write_text(json.dumps({"settings": settings, "runs": runs}, indent=1, default=str) + "\n")
    print_summary(runs)
    total = (time.monotonic() - started) / 60
    title = (
        f"deal tasks, {args.steps} steps x {args.prompts_per_step} tasks x {args.group_size} episodes, lr {args.lr}, "
        f"seeds {' '.join(map(str, args.seeds))}, {args.fault_kind} at browser calls, {args.environment} "
        f"environment; {total:.0f} min in all"
    )
    print(f"\n{title}")
    plot(runs, args.plot, title)
    print(f"wrote {args.plot} and {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
