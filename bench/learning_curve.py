"""Does a run learn, and does the env-aware baseline change what is learned? Both answered by training.

Every run is a real ``python -m verl.trainer.main_ppo`` (V1 trainer, ``BrowserToolAgentLoop``, the CPU backend in
place of vLLM) of a warm-started tiny policy on one suite: ``deal`` (name the fruit a board marks: read the board, or
answer from memory), ``aisle`` (two dependent browser calls) or ``miniwob`` (MiniWoB++ pages, always on nemo-gym with
Chromium; the site on 127.0.0.1 at ``--miniwob-port`` with a grade key never written down). Two arms, the same
policy, tasks and seed: ``recipe`` (``grpo_env_aware``, 3 attempts, a session lost under the policy resumed, what still
fails stays out of the loss and the baseline), ``rerun`` (the recipe with resuming off: a failed attempt is sampled
again from the start) and ``stock`` (verl's GRPO, one attempt, a failure scored 0 and trained on). The fault proxy
fails each browser call with probability ``--rates``; validation runs without faults, per data source.

Writes the JSON after every run (``--resume`` runs only what it lacks, ``--report-only`` runs nothing) and a PNG.
What each run records and how the arms are compared: docs/benchmarks.md ("Learning curve") and
docs/learning-results.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nemo_gym_browser import settings
from nemo_gym_browser.local import main_ppo_process as mp
from nemo_gym_browser.local import run_spec as rs
from nemo_gym_browser.local import shop_tasks
from nemo_gym_browser.local import training_run as tr
from nemo_gym_browser.local.faults import injected as inj
from nemo_gym_browser.prepare_webvoyager_data import prepare_rows
from nemo_gym_browser.testing.benchmarking import header

ENGINES = tr.ENGINES

HERE = Path(__file__).resolve().parent
ARMS = ("recipe", "rerun", "stock")
RECIPE_ARMS = ("recipe", "rerun")  # grpo_env_aware, attempts, failures kept out
RESUME_OFF_OVERRIDE = "++nemo_gym_browser.resume.max_per_episode=0"
SUITES = ("deal", "aisle", "miniwob")
MINIWOB_TRAIN_SEEDS = 64  # training seeds per MiniWoB task (the dataloader draws the steps' tasks from them)
# The benchmark's MiniWoB site has a port of its own (the rows name it): a benchmark running for hours leaves
# the suite's fixed port (8766) to the integration tier.
MINIWOB_BENCH_PORT = 8767
SAMPLE_MODES = settings.SAMPLE_MODES
STEPWISE_OVERRIDE = "nemo_gym_browser.stepwise.enabled=true"
TARGET_SUCCESS = 0.8  # held-back clean success a run is timed to ("steps to 0.8")
SPLITS = ("train", "heldback")
VAL_TASK_PREFIX = "val--"


def val_sources(suite: str = "deal") -> dict[str, str]:
    """Validation data sources: the training tasks and the held-back ones, scored apart by verl's validation."""
    return {split: f"{suite}-{split}" for split in SPLITS}


VAL_SOURCES = val_sources()


def validation_rows(
    rows: Path, split: str, output: Path, limit: int, suite: str = "deal"
) -> tuple[Path, frozenset[str]]:
    """A copy of the first ``limit`` prepared rows for validation: their own data source and task ids (so faults can
    spare them)."""
    lines = []
    for line in rows.read_text(encoding="utf-8").splitlines()[:limit]:
        row = json.loads(line)
        row["data_source"] = val_sources(suite)[split]
        row["task_id"] = VAL_TASK_PREFIX + row["task_id"]
        lines.append(json.dumps(row))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return output, frozenset(json.loads(line)["task_id"] for line in lines)


def run_name(arm: str, seed: int, rate: float, mode: str = "trajectory") -> str:
    return f"rate{rate:g}-{arm}-seed{seed}" + ("" if mode == "trajectory" else f"-{mode}")


def run_spec(
    args: argparse.Namespace,
    *,
    arm: str,
    seed: int,
    rate: float,
    url: str,
    data: dict[str, Any],
    mode: str = "trajectory",
) -> Any:
    n = args.val_samples
    overrides = [
        f"data.val_files=[{','.join(rs.hydra_string(path) for path in data['val'])}]",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"actor_rollout_ref.rollout.val_kwargs.n={n}",
    ]
    if args.engine == "hfcpu":  # request ids stable across runs, so the sampling streams are (cpu_backend/server.py)
        overrides.append("actor_rollout_ref.rollout.full_determinism=True")
    if arm == "stock":
        overrides.append("+nemo_gym_browser.train_on_failures=True")
    if arm == "rerun":
        overrides.append(RESUME_OFF_OVERRIDE)
    if mode == "stepwise":
        overrides.append(STEPWISE_OVERRIDE)
    return rs.RunSpec(
        model_path=data["model"],
        train_file=data["train"],
        val_file=data["val"][0],
        server_urls=(url,),
        output_dir=args.workdir / run_name(arm, seed, rate, mode),
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        max_assistant_turns=4,
        estimator=rs.RECIPE_ESTIMATOR if arm in RECIPE_ARMS else rs.STOCK_ESTIMATOR,
        lr=args.lr,
        test_freq=args.eval_every,
        val_before_train=True,
        seed=seed,
        rollout_name=ENGINES[args.engine],
        extra_overrides=tuple(overrides),
        faults=inj.FaultSpec(rate=rate, at="browser-call", kind=args.fault_kind),
    )


def evaluated(steps: dict[int, dict[str, Any]], n: int, suite: str = "deal") -> dict[int, dict[str, float]]:
    """Per evaluated step: clean success and browsing, on training tasks and held-back ones (MiniWoB: held-back
    seeds only, the mean over its tasks of :func:`by_task`)."""
    if suite == "miniwob":
        return {
            step: {
                f"heldback_{name}": sum(task[name] for task in tasks.values()) / len(tasks)
                for name in ("success", "browsed", "browser_calls")
                if all(name in task for task in tasks.values())
            }
            for step, tasks in by_task(steps, n).items()
        }
    out = {}
    for step, metrics in sorted(steps.items()):
        row = {}
        for split, source in val_sources(suite).items():
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


def by_task(steps: dict[int, dict[str, Any]], n: int) -> dict[int, dict[str, dict[str, float]]]:
    """MiniWoB: per evaluated step and task, held-back clean success, browsing and browser calls (the tasks are the
    data sources ``miniwob/<task>`` verl's validation reported)."""
    from nemo_gym_browser.local.miniwob.suite import DATA_SOURCE_PREFIX

    out: dict[int, dict[str, dict[str, float]]] = {}
    prefix = f"val-core/{DATA_SOURCE_PREFIX}"
    for step, metrics in sorted(steps.items()):
        tasks = {}
        for key in metrics:
            if key.startswith(prefix) and key.endswith(f"/reward/mean@{n}"):
                task = key[len(prefix) : -len(f"/reward/mean@{n}")]
                source = DATA_SOURCE_PREFIX + task
                row = {"success": float(metrics[key])}
                for name, metric in (("browsed", "env/browsed"), ("browser_calls", "env/browser_actions")):
                    if f"val-aux/{source}/{metric}/mean@{n}" in metrics:
                        row[name] = float(metrics[f"val-aux/{source}/{metric}/mean@{n}"])
                tasks[task] = row
        if tasks:
            out[step] = dict(sorted(tasks.items()))
    return out


def steps_to(evaluations: dict[int, dict[str, float]], target: float = TARGET_SUCCESS) -> int | None:
    """The first evaluated step whose held-back clean success is at least ``target`` (None: not within the run)."""
    return next((step for step, row in sorted(evaluations.items()) if row.get("heldback_success", 0.0) >= target), None)


def sample_tokens(steps: dict[int, dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Per training step, tokens per sample: the mean (all prompt and response tokens the step trained on over its
    samples: episodes, or step samples in step-wise mode) and verl's longest prompt and longest response."""
    out = {}
    for step, metrics in sorted(steps.items()):
        if step < 1 or "prompt_length/max" not in metrics:
            continue
        row = {key: float(metrics[key]) for key in LENGTH_KEYS if key in metrics}
        samples = metrics.get("env/step_samples") or metrics.get("env/samples")
        if samples:
            row["samples"] = float(samples)
            if "perf/total_num_tokens" in metrics:
                row["tokens_per_sample_mean"] = float(metrics["perf/total_num_tokens"]) / float(samples)
        out[step] = row
    return out


LENGTH_KEYS = ("prompt_length/mean", "prompt_length/max", "response_length/mean", "response_length/max")


def run_costs(run: dict[str, Any], mini_batch: int | None = None) -> dict[str, Any]:
    """What a run cost: seconds per training step, tokens per sample (mean; max = the longest prompt plus the
    longest response of any step, which one sample reaches when it holds both), peak memory; steps to 0.8 and the
    training minutes they took (their steps' own times, validation excluded: early steps of a policy that browses
    little are shorter than the mean).

    With ``mini_batch`` (verl's ``ppo_mini_batch_size`` x ``rollout.n``, in samples) also the optimizer updates: verl's
    V1 trainer cuts a step's samples into mini-batches of that many, padding the last, one update each, so a step of
    step samples makes several updates where a step of episodes makes one."""
    seconds = [t["step_s"] for t in run["training"].values() if t.get("step_s") is not None]
    tokens = run.get("tokens", {})
    # the stock arm logs no env/ sample counts: there verl's own mean prompt and response lengths
    means = [
        t["tokens_per_sample_mean"]
        if "tokens_per_sample_mean" in t
        else t["prompt_length/mean"] + t["response_length/mean"]
        for t in tokens.values()
        if "tokens_per_sample_mean" in t or {"prompt_length/mean", "response_length/mean"} <= t.keys()
    ]
    maxima = [t["prompt_length/max"] + t["response_length/max"] for t in tokens.values() if "response_length/max" in t]
    samples = [t["samples"] for t in tokens.values() if t.get("samples")]
    reached = steps_to(run["evaluated"])
    updates = {
        step: math.ceil(t["samples"] / mini_batch) for step, t in tokens.items() if mini_batch and t.get("samples")
    }
    return {
        "steps_to_target": reached,
        "updates_per_step": sum(updates.values()) / len(updates) if updates else None,
        "updates_to_target": (
            sum(n for step, n in updates.items() if step <= reached) if updates and reached is not None else None
        ),
        "seconds_per_step": sum(seconds) / len(seconds) if seconds else None,
        "minutes_to_target": (
            sum(t.get("step_s") or 0.0 for step, t in run["training"].items() if step <= reached) / 60
            if reached is not None
            else None
        ),
        "tokens_per_sample_mean": sum(means) / len(means) if means else None,
        "tokens_per_sample_max": max(maxima) if maxima else None,
        "samples_per_step": sum(samples) / len(samples) if samples else None,
        "peak_memory_gib": run["peak_memory_gib"],
    }


def by_mode(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per suite, sample mode, arm and rate: each seed's steps to 0.8 and the mean costs over seeds."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for run in runs:
        key = (run.get("suite", "deal"), run.get("sample_mode", "trajectory"), run["arm"], run["rate"])
        groups.setdefault(key, []).append(run)
    summary = []
    for (suite, mode, arm, rate), group in groups.items():
        costs = [run["costs"] for run in group]
        row: dict[str, Any] = {"suite": suite, "sample_mode": mode, "arm": arm, "rate": rate}
        row["seeds"] = [run["seed"] for run in group]
        row["steps_to_target"] = [cost["steps_to_target"] for cost in costs]
        row["updates_to_target"] = [cost.get("updates_to_target") for cost in costs]
        for key in (
            "seconds_per_step",
            "tokens_per_sample_mean",
            "samples_per_step",
            "updates_per_step",
            "minutes_to_target",
            "peak_memory_gib",
        ):
            values = [cost[key] for cost in costs if cost.get(key) is not None]
            row[key] = sum(values) / len(values) if values else None
        maxima = [cost["tokens_per_sample_max"] for cost in costs if cost["tokens_per_sample_max"] is not None]
        row["tokens_per_sample_max"] = max(maxima) if maxima else None
        summary.append(row)
    return summary


# the settings a run's result depends on: a resumed benchmark must have been started with the same ones
RUN_SETTINGS = (
    "suite", "model", "engine", "environment", "fault_kind", "steps", "eval_every", "val_tasks", "val_samples",
    "prompts_per_step", "group_size", "lr",
)  # fmt: skip


def run_plan(args: argparse.Namespace) -> list[tuple[str, float, int, str]]:
    """(mode, rate, seed, arm) in the order they run: rate first, so a long benchmark's runs without failures, in
    every mode, land before the failure comparison."""
    return [
        (mode, rate, seed, arm)
        for rate in args.rates
        for mode in args.sample_mode
        for seed in args.seeds
        for arm in args.arms
        # with no failure the arms produce the same episodes (test_main_ppo_determinism; nothing to resume)
        if not (rate == 0 and arm != "recipe" and "recipe" in args.arms and not args.stock_at_zero)
    ]


def run_key(run: dict[str, Any]) -> tuple[str, float, int, str]:
    return (run.get("sample_mode", "trajectory"), run["rate"], run["seed"], run["arm"])


def same_weights(one: Path, other: Path) -> bool:
    """Two policy folders with the same ``SHA256SUMS`` (the shipped policies' weights): one policy in two checkouts."""
    sums = [folder / "SHA256SUMS" for folder in (one, other)]
    return all(path.is_file() for path in sums) and sums[0].read_bytes() == sums[1].read_bytes()


def resumed_runs(path: Path, settings: dict[str, Any]) -> list[dict[str, Any]]:
    """The runs a benchmark wrote to ``path`` before it stopped, checked to come from the same settings (a run is
    kept whatever the rates, seeds, arms or modes asked now: it is measured). JSON turned the step keys into text:
    they are numbers again, so steps sort as steps."""
    if not path.is_file():
        return []
    try:
        report = json.loads(path.read_text())
        previous, runs = report["settings"], report["runs"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--resume: {path} is not a learning_curve.py report ({exc})") from None
    compared = RUN_SETTINGS + (("miniwob_port",) if settings.get("suite") == "miniwob" else ())
    differing = [
        key
        for key in compared
        if str(previous.get(key)) != str(settings.get(key))
        and not (key == "model" and same_weights(Path(str(previous.get(key))), Path(str(settings.get(key)))))
    ]
    if differing:
        shown = ", ".join(f"{key} {previous.get(key)!r} there, {settings.get(key)!r} now" for key in differing)
        raise ValueError(f"--resume: {path} was measured with other settings ({shown}); give another --json")
    for run in runs:
        for field in ("evaluated", "training", "tokens", "by_task"):
            run[field] = {int(step): value for step, value in run.get(field, {}).items()}
        run["costs"] = run_costs(run, int(settings["prompts_per_step"]) * int(settings["group_size"]))
    return runs


def write_report(path: Path, settings: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    report = {"settings": settings, "runs": runs, "by_mode": by_mode(runs)}
    path.write_text(json.dumps(report, indent=1, default=str) + "\n")


def run_one(
    args: argparse.Namespace,
    *,
    arm: str,
    seed: int,
    rate: float,
    url: str,
    data: dict[str, Any],
    mode: str = "trajectory",
) -> dict:
    spec = run_spec(args, arm=arm, seed=seed, rate=rate, url=url, data=data, mode=mode)
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
            "resumed_rate": m.get("env/resumed_rate"),
            "resume_diverged_rate": m.get("env/resume_diverged_rate"),
            "rerun_after_action_rate": m.get("env/rerun_after_action_rate"),
            "step_s": m.get("timing_s/step"),
            "gen_s": m.get("timing_s/gen"),
        }
        for step, m in sorted(result.steps.items())
        if step > 0
    }
    run = {
        "arm": arm,
        "seed": seed,
        "rate": rate,
        "minutes": result.elapsed_s / 60,
        "peak_memory_gib": result.peak_memory_bytes / 2**30,
        "evaluated": evaluated(result.steps, args.val_samples, args.suite),
        **({"by_task": by_task(result.steps, args.val_samples)} if args.suite == "miniwob" else {}),
        "training": training,
        "faults_injected": injected,
        "sessions_left_open": left_open,
        "suite": args.suite,
        "sample_mode": mode,
        "tokens": sample_tokens(result.steps),
    }
    run["costs"] = run_costs(run, args.prompts_per_step * args.group_size)
    return run


def task_table(runs: list[dict[str, Any]]) -> str:
    """MiniWoB: a Markdown table of held-back success per task, before training (step 0) and after it (the last
    evaluated step), mean (min–max) over seeds, a column per failure rate and arm; its last row is the mean over
    tasks. Built from the runs' ``by_task`` only, so a page quoting it names the runs it was made from."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: (r["rate"], ARMS.index(r["arm"]), r["seed"])):
        if run.get("by_task"):
            groups.setdefault((run["rate"], run["arm"]), []).append(run)
    tasks = sorted({task for group in groups.values() for run in group for task in run["by_task"][0]})
    header = ["task"] + [
        f"{rate:.0%} {arm}, {len(group)} seed{'s' if len(group) > 1 else ''}" for (rate, arm), group in groups.items()
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]

    def cell(group: list[dict[str, Any]], value: Any) -> str:
        before = [value(run, run["by_task"][0]) for run in group]
        after = [value(run, run["by_task"][max(run["by_task"])]) for run in group]
        last = f"{sum(after) / len(after):.2f}" + (f" ({min(after):.2f}–{max(after):.2f})" if len(after) > 1 else "")
        return f"{sum(before) / len(before):.2f} → {last}"

    for task in tasks:
        row = [task] + [cell(group, lambda run, step, t=task: step[t]["success"]) for group in groups.values()]
        lines.append("| " + " | ".join(row) + " |")
    mean = [
        cell(group, lambda run, step: sum(t["success"] for t in step.values()) / len(step)) for group in groups.values()
    ]
    lines.append("| " + " | ".join([f"mean of {len(tasks)}", *mean]) + " |")
    return "\n".join(lines)


def cost_table(runs: list[dict[str, Any]], episodes_per_step: int) -> str:
    """A Markdown table of what each run cost: minutes in all, seconds per training step, training episodes (the
    ``episodes_per_step`` each step keeps) per minute of training steps, peak memory, and the recipe's share of
    episodes still failed after its attempts and of attempts re-run."""
    lines = [
        "| run | minutes | s/step | episodes per minute | peak GiB | invalid after attempts | resampled |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for run in sorted(runs, key=lambda r: (r["rate"], ARMS.index(r["arm"]), r["seed"])):
        steps = [t for t in run["training"].values() if t.get("step_s") is not None]
        seconds = sum(t["step_s"] for t in steps) / len(steps)
        invalid = [t["invalid_rate"] for t in steps if t.get("invalid_rate") is not None]
        resampled = [t["resampled_rate"] for t in steps if t.get("resampled_rate") is not None]
        lines.append(
            f"| {run['rate']:.0%} {run['arm']} seed {run['seed']} | {run['minutes']:.1f} | {seconds:.1f} | "
            f"{60 * episodes_per_step / seconds:.0f} | {run['peak_memory_gib']:.1f} | "
            f"{mean_text(invalid) if run['arm'] in RECIPE_ARMS else '-'} | "
            f"{mean_text(resampled) if run['arm'] in RECIPE_ARMS else '-'} |"
        )
    return "\n".join(lines)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})"


def number_text(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else "-".rjust(width)


def mean_text(values: list[float]) -> str:
    return f"{sum(values) / len(values):.2f}" if values else "-"


def print_summary(runs: list[dict[str, Any]], settings: dict[str, Any] | None = None) -> None:
    print("\nclean success and browsing, mean (min-max) over seeds, by evaluated step")
    columns = ("train_success", "heldback_success", "train_browsed", "heldback_browsed", "train_browser_calls")
    modes = [mode for mode in SAMPLE_MODES if any(run.get("sample_mode", "trajectory") == mode for run in runs)]
    width = 7 if len(modes) == 1 else 17  # "arm" or "arm/mode"
    print(f"{'rate':>5} {'arm':<{width}} {'step':>4} " + " ".join(f"{c:>20}" for c in columns))
    for rate, arm, mode in ((r, a, m) for r in sorted({run["rate"] for run in runs}) for a in ARMS for m in modes):
        group = [
            run
            for run in runs
            if run["rate"] == rate and run["arm"] == arm and run.get("sample_mode", "trajectory") == mode
        ]
        if group:
            label = arm if len(modes) == 1 else f"{arm}/{mode}"
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
                print(f"{rate:>5.0%} {label:<{width}} {step:>4} " + " ".join(cells))
    print(f"\nper sample mode: steps to {TARGET_SUCCESS} held-back success (per seed), costs (mean over seeds)")
    print(f"{'suite':<6} {'mode':<10} {'arm':<7} {'rate':>5} {'steps to':>14} {'updates to':>14} {'s/step':>7} "
          f"{'min to':>6} {'samples':>7} {'updates':>7} {'tokens/sample':>13} {'max':>6} {'peak GiB':>8}")  # fmt: skip
    for row in by_mode(runs):
        reached = " ".join("-" if step is None else str(step) for step in row["steps_to_target"])
        updates = " ".join("-" if n is None else str(n) for n in row["updates_to_target"])
        print(
            f"{row['suite']:<6} {row['sample_mode']:<10} {row['arm']:<7} {row['rate']:>5.0%} {reached:>14} "
            f"{updates:>14} {number_text(row['seconds_per_step'], 7, 1)} {number_text(row['minutes_to_target'], 6, 1)} "
            f"{number_text(row['samples_per_step'], 7, 0)} "
            f"{number_text(row['updates_per_step'], 7, 1)} "
            f"{number_text(row['tokens_per_sample_mean'], 13, 0)} {number_text(row['tokens_per_sample_max'], 6, 0)} "
            f"{number_text(row['peak_memory_gib'], 8, 1)}"
        )
    if any(run.get("by_task") for run in runs):
        print("\nheld-back success per task, before -> after training, mean (min-max) over seeds")
        print(task_table(runs))
        if settings is not None:
            print()
            print(cost_table(runs, int(settings["prompts_per_step"]) * int(settings["group_size"])))
    print("\nrun                         minutes  s/step  gen s  peak GiB  invalid  resampled  faults  left open")
    for run in runs:
        seconds = [t["step_s"] for t in run["training"].values() if t["step_s"] is not None]
        gen = [t["gen_s"] for t in run["training"].values() if t["gen_s"] is not None]
        invalid = [t["invalid_rate"] for t in run["training"].values() if t["invalid_rate"] is not None]
        resampled = [t["resampled_rate"] for t in run["training"].values() if t["resampled_rate"] is not None]
        mode = run.get("sample_mode", "trajectory")
        name = f"{run['rate']:.0%} {run['arm']} seed {run['seed']}" + ("" if mode == "trajectory" else f" {mode}")
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
    modes = [mode for mode in SAMPLE_MODES if any(run.get("sample_mode", "trajectory") == mode for run in runs)]
    # MiniWoB validates held-back seeds only: its browsing panel is theirs
    browsed = (
        "train_browsed"
        if any("train_browsed" in row for run in runs for row in run["evaluated"].values())
        else "heldback_browsed"
    )
    panels = (("heldback_success", "clean success, held-back tasks"), (browsed, "share of episodes browsing"))
    figure, axes = plt.subplots(
        len(panels), len(rates), figsize=(4.6 * len(rates), 3.2 * len(panels)), sharey="row", squeeze=False
    )
    colours = {  # an arm's modes in shades apart, so two modes' lines in one panel stay told apart
        ("recipe", "trajectory"): "tab:blue",
        ("recipe", "stepwise"): "tab:green",
        ("rerun", "trajectory"): "tab:purple",
        ("rerun", "stepwise"): "tab:olive",
        ("stock", "trajectory"): "tab:red",
        ("stock", "stepwise"): "tab:orange",
    }
    for column, rate in enumerate(rates):
        for row, (key, label) in enumerate(panels):
            axis = axes[row][column]
            for arm, mode in ((a, m) for a in ARMS for m in modes):
                group = [
                    run
                    for run in runs
                    if run["rate"] == rate and run["arm"] == arm and run.get("sample_mode", "trajectory") == mode
                ]
                if not group:
                    continue
                steps = sorted({int(s) for run in group for s in run["evaluated"]})
                for run in group:  # one thin line per seed
                    xs = [s for s in steps if s in run["evaluated"] and key in run["evaluated"][s]]
                    axis.plot(xs, [run["evaluated"][s][key] for s in xs], color=colours[arm, mode], alpha=0.3, lw=0.8)
                means = []
                for s in steps:
                    values = [run["evaluated"][s][key] for run in group if s in run["evaluated"]]
                    means.append(sum(values) / len(values))
                style = {"recipe": "-", "rerun": ":"}.get(arm, "--")
                marker = "o" if mode == "trajectory" else "s"
                name = arm if len(modes) == 1 else f"{arm}, {mode}"
                axis.plot(steps, means, style, color=colours[arm, mode], marker=marker, ms=3, label=f"{name} (mean)")
            axis.set_ylim(-0.02, 1.02)
            axis.grid(alpha=0.3)
            if row == 0:
                axis.set_title(f"{rate:.0%} of browser calls fail")
            if row == len(panels) - 1:
                axis.set_xlabel("training step")
            if column == 0:
                axis.set_ylabel(label)
    labelled = {}  # every line once, whichever panel drew it (the 0 % panel has no stock line)
    for axis in axes.flat:
        for handle, label in zip(*axis.get_legend_handles_labels(), strict=True):
            labelled.setdefault(label, handle)
    axes[0][-1].legend(labelled.values(), labelled.keys(), fontsize=8)
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
  # the aisle tasks (two dependent browser calls) in both sample modes, the recipe at no failures
  python bench/learning_curve.py --suite aisle --sample-mode trajectory stepwise --rates 0 --arms recipe \\
      --steps 40 --json bench/learning_curve_aisle.json --plot bench/learning_curve_aisle.png
  # the same command with --resume after a stop: the runs the JSON holds are kept, the others run

exit codes: 0 done, 1 a run failed, 2 impossible settings.""",
    )
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.85],
                        help="chance that each browser call fails (default: 0 0.85)")  # fmt: skip
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="one run per arm and seed (0 1 2)")
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=["recipe", "stock"],
                        help="recipe (resuming), rerun (resuming off), stock (default: recipe stock)")  # fmt: skip
    parser.add_argument("--stock-at-zero", action="store_true",
                        help="also run the stock and rerun arms at rate 0, where they produce the recipe's episodes "
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
    parser.add_argument("--suite", choices=SUITES, default="deal",
                        help="the Corner Shop tasks: deal (observe, then finish) or aisle (observe, click the marked "
                        "aisle, then finish), or MiniWoB++ pages (miniwob: observe, click; --val-tasks held-back "
                        "seeds per task) (default %(default)s)")  # fmt: skip
    parser.add_argument("--miniwob-port", type=int, default=MINIWOB_BENCH_PORT,
                        help="miniwob suite: the port its site is served on, named by its rows (default "
                        "%(default)s; the suite's own 8766 stays free for the integration tier)")  # fmt: skip
    parser.add_argument("--sample-mode", nargs="+", choices=SAMPLE_MODES, default=["trajectory"],
                        help="one sample per episode (trajectory) or per policy step (stepwise); each mode listed "
                        "runs every arm, seed and rate (default: trajectory)")  # fmt: skip
    parser.add_argument("--model", type=Path, default=None,
                        help="a policy folder (default: the suite's shipped one, local/deal_policy, "
                        "local/aisle_policy or local/miniwob_policy)")  # fmt: skip
    parser.add_argument("--engine", choices=sorted(ENGINES), default="hfcpu",
                        help="what serves the policy: hfcpu (local/cpu_backend, default) or vllm (verl's vLLM "
                        "rollout on vLLM's CPU build, .venv-vllm; the policy as its head_dim-32 copy)")  # fmt: skip
    parser.add_argument("--environment", choices=("fake", "real"), default=None,
                        help="the fake interactive_browser or nemo-gym 0.7.0 with Chromium (default: fake; the "
                        "miniwob suite runs on real only)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/nemo-gym-browser-learning-curve"))
    parser.add_argument("--plot", type=Path, default=None, help="the figure (default: --json with .png)")
    parser.add_argument("--json", type=Path, default=HERE / "learning_curve.json")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs --json already holds (same settings) and run only the missing ones: a "
                        "benchmark longer than a session, stopped, goes on where it stopped")  # fmt: skip
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: rewrite --json's summary, print its tables and draw --plot from the runs "
                        "it holds (a replot, or a look at a benchmark still running; --resume would run what is "
                        "missing)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=7200.0, help="seconds per run (%(default)s)")
    return parser


def shop_data(args: argparse.Namespace) -> dict[str, Any]:
    """The Corner Shop suite's policy and rows: training tasks, and a copy of each split's first ``--val-tasks``."""
    train_file, held_file = shop_tasks.SUITE_FILES[args.suite]
    rows_dir = args.workdir if args.suite == "deal" else args.workdir / args.suite
    train_rows = prepare_rows(train_file, rows_dir / "rows-train")
    held_rows = prepare_rows(held_file, rows_dir / "rows-heldback")
    val_train, train_ids = validation_rows(
        train_rows, "train", rows_dir / "val" / "train.jsonl", args.val_tasks, args.suite
    )
    val_held, held_ids = validation_rows(
        held_rows, "heldback", rows_dir / "val" / "heldback.jsonl", args.val_tasks, args.suite
    )
    if args.model:
        model = args.model.resolve()  # main_ppo runs elsewhere
    else:
        model = tr.aisle_policy_folder() if args.suite == "aisle" else tr.deal_policy_folder(args.workdir)
    return {"model": model, "train": train_rows, "val": (val_train, val_held), "val_ids": train_ids | held_ids}


def miniwob_rows(
    key: Any, output_dir: Path, val_seeds: int, tasks: tuple[str, ...], port: int = MINIWOB_BENCH_PORT
) -> dict[str, Any]:
    """MiniWoB's rows under ``output_dir``: :data:`MINIWOB_TRAIN_SEEDS` training seeds of each task, and the first
    ``val_seeds`` held-back seeds of each for validation, their task ids marked (so faults spare them) and their
    data source each task's own."""
    from nemo_gym_browser.local.miniwob.suite import suite_rows

    output_dir.mkdir(parents=True, exist_ok=True)
    train, val = output_dir / "train.jsonl", output_dir / "val-heldback.jsonl"
    held = suite_rows(key, "heldback", val_seeds, tasks=tasks, port=port)
    for row in held:
        row["task_id"] = VAL_TASK_PREFIX + row["task_id"]
    for path, rows in ((train, suite_rows(key, "train", MINIWOB_TRAIN_SEEDS, tasks=tasks, port=port)), (val, held)):
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return {"train": train, "val": (val,), "val_ids": frozenset(row["task_id"] for row in held)}


@contextlib.contextmanager
def miniwob_environment(key: Any, port: int = MINIWOB_BENCH_PORT) -> Iterator[str]:
    """The MiniWoB site on ``port`` beside nemo-gym 0.7.0 with Chromium; yields the environment's URL."""
    from nemo_gym_browser.launch_environment import LocalEnvironment
    from nemo_gym_browser.local.miniwob.site import MiniWobSite

    with MiniWobSite(key, port=port), LocalEnvironment() as real:
        yield real.url


def miniwob_data(args: argparse.Namespace) -> tuple[dict[str, Any], Any]:
    """The MiniWoB suite's policy, rows and environment, under a grade key made now (held in memory only: the rows
    in the workdir carry the codes it makes, the site checks them; a resumed benchmark makes new ones)."""
    from nemo_gym_browser.local.miniwob.grading import GradeKey
    from nemo_gym_browser.local.miniwob.policy import LEARNING_TASKS, MINIWOB_POLICY_DIR

    key = GradeKey.generate()
    data = miniwob_rows(key, args.workdir / "miniwob", args.val_tasks, LEARNING_TASKS, args.miniwob_port)
    data["model"] = (args.model or MINIWOB_POLICY_DIR).resolve()
    return data, miniwob_environment(key, args.miniwob_port)


def report(path: Path, plot_path: Path, settings: dict[str, Any], runs: list[dict[str, Any]]) -> None:
    """Writes the JSON report, prints the summary tables and draws the plot, titled from the settings and from the
    runs themselves (resumed ones included: the figure shows what took this long)."""
    write_report(path, settings, runs)
    print_summary(runs, settings)
    total = sum(run["minutes"] for run in runs)
    modes = list(dict.fromkeys(run.get("sample_mode", "trajectory") for run in runs))
    seeds = sorted({run["seed"] for run in runs})
    title = (
        f"{settings.get('suite', 'deal')} tasks"
        + ("" if modes == ["trajectory"] else f" ({' and '.join(modes)} samples)")
        + f", {settings['steps']} steps x {settings['prompts_per_step']} tasks x {settings['group_size']} episodes, "
        f"lr {settings['lr']}, seeds {' '.join(map(str, seeds))}, {settings['fault_kind']} at browser calls, "
        f"{settings['environment']} environment; {len(runs)} runs, {total:.0f} min"
    )
    print(f"\n{title}")
    plot(runs, plot_path, title)
    print(f"wrote {plot_path} and {path}")


def report_only(args: argparse.Namespace) -> int:
    """``--report-only``: the report of the runs ``--json`` holds, with its own settings; nothing runs."""
    try:
        settings = json.loads(args.json.read_text())["settings"]
        runs = resumed_runs(args.json, settings)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"learning_curve.py: error: --report-only: {args.json}: {exc}", file=sys.stderr)
        return 2
    if not runs:
        print(f"learning_curve.py: error: --report-only: {args.json} holds no runs", file=sys.stderr)
        return 2
    report(args.json, args.plot, settings, runs)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.plot is None:  # beside its JSON: a report of one benchmark never redraws another's figure
        args.plot = args.json.with_suffix(".png")
    if args.environment is None:
        args.environment = "real" if args.suite == "miniwob" else "fake"
    problem = None
    if args.suite == "miniwob" and args.environment != "real":
        problem = "--suite miniwob runs on --environment real only (the fake server serves the Corner Shop)"
    elif any(not 0.0 <= rate < 1.0 for rate in args.rates):
        problem = "--rates must be in [0, 1)"
    elif min(args.steps, args.eval_every, args.val_tasks, args.val_samples, args.prompts_per_step, args.group_size) < 1:
        problem = "--steps, --eval-every, --val-tasks, --val-samples, --prompts-per-step, --group-size: at least 1"
    elif args.model is not None and not (args.model / "config.json").is_file():
        problem = f"--model {args.model} has no config.json"
    if problem:
        print(f"learning_curve.py: error: {problem}", file=sys.stderr)
        return 2
    if args.report_only:
        return report_only(args)
    args.workdir = args.workdir.resolve()
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(header("learning curve: the recipe vs stock GRPO, browser calls failing"), flush=True)

    started = time.monotonic()
    if args.suite == "miniwob":
        data, environment = miniwob_data(args)
    else:
        data, environment = shop_data(args), tr.shop_environment(args.environment)
    model = data["model"]
    if args.engine == "vllm":
        model = tr.vllm_servable(model, args.workdir)
    data["model"] = model
    print(f"policy {model} ready after {time.monotonic() - started:.0f} s", flush=True)

    settings = vars(args) | {"workdir": str(args.workdir), "model": str(model)}
    runs: list[dict[str, Any]] = []
    if args.resume:
        try:
            runs = resumed_runs(args.json, settings)
        except ValueError as exc:
            print(f"learning_curve.py: error: {exc}", file=sys.stderr)
            return 2
        print(f"resumed {len(runs)} run(s) from {args.json}", flush=True)
    done = {run_key(run) for run in runs}
    with environment as url:
        for mode, rate, seed, arm in (item for item in run_plan(args) if item not in done):
            run = run_one(args, arm=arm, seed=seed, rate=rate, url=url, data=data, mode=mode)
            runs.append(run)
            first, last = min(run["evaluated"]), max(run["evaluated"])
            before, after = run["evaluated"][first], run["evaluated"][last]
            costs = run["costs"]
            browsed = "train_browsed" if "train_browsed" in before else "heldback_browsed"  # MiniWoB: held-back only
            print(
                f"  {rate:.0%} {arm:<6} seed {seed}" + ("" if mode == "trajectory" else f" {mode}") + ": "
                f"{run['minutes']:.1f} min; held-back success "
                f"{before.get('heldback_success', float('nan')):.2f} -> "
                f"{after.get('heldback_success', float('nan')):.2f}, browsing "
                f"{before.get(browsed, float('nan')):.2f} -> "
                f"{after.get(browsed, float('nan')):.2f}; tokens per sample "
                f"{number_text(costs['tokens_per_sample_mean'], 0, 0)} (max "
                f"{number_text(costs['tokens_per_sample_max'], 0, 0)})",
                flush=True,
            )
            write_report(args.json, settings, runs)
    report(args.json, args.plot, settings, runs)  # a resume with nothing left to run still rewrites the summary
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
