"""``bench/learning_curve.py --suite miniwob`` offline: its rows and their validation split, the run it asks verl for,
what it reads back per task, and the report's per-task table; ``docs/learning-results.md``'s MiniWoB figures are
that table rendered from ``bench/learning_curve_miniwob.json``'s runs the page names.

The runs themselves (verl's ``main_ppo`` on nemo-gym 0.7.0 with Chromium) are the benchmark.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_benchmarks import BENCH, learning_curve_args, load

from nemo_gym_browser.local.miniwob import grading, inventory
from nemo_gym_browser.local.miniwob.policy import LEARNING_TASKS

KEY = grading.GradeKey(bytes(range(32)))
DOCS = BENCH.parent / "docs" / "learning-results.md"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_the_miniwob_rows_train_on_training_seeds_and_validate_each_task_on_held_back_ones_under_its_own_name(
    tmp_path,
):
    module = load("learning_curve")
    data = module.miniwob_rows(KEY, tmp_path, 3, LEARNING_TASKS)
    train, (val,) = rows(data["train"]), data["val"]
    held = rows(val)

    assert len(train) == module.MINIWOB_TRAIN_SEEDS * len(LEARNING_TASKS) and len(held) == 3 * len(LEARNING_TASKS)
    seeds = {name: {row["task_metadata"]["seed"] for row in split} for name, split in (("t", train), ("h", held))}
    assert all(not inventory.is_held_back(seed) for seed in seeds["t"])
    assert all(inventory.is_held_back(seed) for seed in seeds["h"])
    assert {row["data_source"] for row in held} == {f"miniwob/{task}" for task in LEARNING_TASKS}
    assert {row["data_source"] for row in train} == {f"miniwob/{task}" for task in LEARNING_TASKS}
    # faults spare exactly the validation episodes, named by their marked task ids
    assert data["val_ids"] == {row["task_id"] for row in held}
    assert all(row["task_id"].startswith(module.VAL_TASK_PREFIX) for row in held)
    assert not any(row["task_id"].startswith(module.VAL_TASK_PREFIX) for row in train)
    # on a port of its own, so the integration tier's MiniWoB tests (the suite's port) run beside the benchmark
    assert {row["initial_url"].split("/")[2] for row in train + held} == {f"127.0.0.1:{module.MINIWOB_BENCH_PORT}"}
    assert module.MINIWOB_BENCH_PORT != 8766


def test_a_miniwob_benchmark_resumes_only_runs_served_on_the_same_port(tmp_path):
    module, args = learning_curve_args(tmp_path, "--suite", "miniwob")
    settings = vars(args) | {"workdir": str(tmp_path), "model": str(tmp_path)}
    stored = tmp_path / "curve.json"
    stored.write_text(json.dumps({"settings": {**settings, "miniwob_port": 8766}, "runs": []}, default=str))
    with pytest.raises(ValueError, match="miniwob_port"):
        module.resumed_runs(stored, settings)
    stored.write_text(json.dumps({"settings": settings, "runs": []}, default=str))
    assert module.resumed_runs(stored, settings) == []


def test_a_miniwob_run_validates_on_its_one_held_back_file_and_runs_only_on_the_real_server(tmp_path, capsys):
    module, args = learning_curve_args(tmp_path, "--suite", "miniwob", "--environment", "real")
    data = {"model": tmp_path, "train": tmp_path / "train.jsonl", "val": (tmp_path / "val-heldback.jsonl",)}
    spec = module.run_spec(args, arm="stock", seed=2, rate=0.85, url="http://127.0.0.1:1", data=data)

    assert f"data.val_files=['{tmp_path / 'val-heldback.jsonl'}']" in spec.extra_overrides
    assert "+nemo_gym_browser.train_on_failures=True" in spec.extra_overrides
    assert module.main(["--suite", "miniwob", "--environment", "fake", "--workdir", str(tmp_path)]) == 2
    assert "real only" in capsys.readouterr().err


def test_held_back_success_is_read_per_task_from_verls_validation_metrics_and_averaged_over_tasks():
    module = load("learning_curve")
    metrics = {
        0: {
            "val-core/miniwob/click-test/reward/mean@2": 1.0,
            "val-aux/miniwob/click-test/env/browsed/mean@2": 1.0,
            "val-core/miniwob/focus-text-2/reward/mean@2": 0.5,
            "val-aux/miniwob/focus-text-2/env/browsed/mean@2": 0.5,
            "val-core/miniwob/focus-text-2/reward/mean@4": 0.0,  # another n: not this benchmark's
            "critic/score/mean": 0.2,
        },
        1: {"critic/score/mean": 0.3},  # a training step: nothing evaluated
    }
    assert module.by_task(metrics, 2) == {
        0: {"click-test": {"success": 1.0, "browsed": 1.0}, "focus-text-2": {"success": 0.5, "browsed": 0.5}}
    }
    assert module.evaluated(metrics, 2, "miniwob") == {0: {"heldback_success": 0.75, "heldback_browsed": 0.75}}


def run(rate: float, arm: str, seed: int, before: dict[str, float], after: dict[str, float]) -> dict:
    by_task = {0: {t: {"success": s} for t, s in before.items()}, 6: {t: {"success": s} for t, s in after.items()}}
    return {"rate": rate, "arm": arm, "seed": seed, "by_task": by_task}


def test_the_task_table_shows_before_and_after_per_task_with_the_spread_over_seeds_and_the_mean_of_tasks():
    module = load("learning_curve")
    runs = [
        run(0.0, "recipe", 1, {"a": 0.5, "b": 0.0}, {"a": 1.0, "b": 0.5}),
        run(0.0, "recipe", 0, {"a": 0.5, "b": 0.0}, {"a": 0.5, "b": 0.25}),
        run(0.85, "stock", 0, {"a": 0.5, "b": 0.0}, {"a": 0.25, "b": 0.0}),
    ]
    assert module.task_table(runs).splitlines() == [
        "| task | 0% recipe, 2 seeds | 85% stock, 1 seed |",
        "| --- | --- | --- |",
        "| a | 0.50 → 0.75 (0.50–1.00) | 0.50 → 0.25 |",
        "| b | 0.00 → 0.38 (0.25–0.50) | 0.00 → 0.00 |",
        "| mean of 2 | 0.25 → 0.56 (0.38–0.75) | 0.25 → 0.12 |",
    ]


def test_the_cost_table_gives_each_runs_step_time_and_episodes_per_minute_and_the_recipes_resampling():
    module = load("learning_curve")
    training = {1: {"step_s": 100.0, "invalid_rate": 0.5, "resampled_rate": 0.25}, 2: {"step_s": 140.0}}
    runs = [
        {"rate": 0.85, "arm": "stock", "seed": 0, "minutes": 9.04, "peak_memory_gib": 7.0, "training": training},
        {"rate": 0.85, "arm": "recipe", "seed": 0, "minutes": 12.0, "peak_memory_gib": 7.25, "training": training},
    ]
    assert module.cost_table(runs, 64).splitlines()[2:] == [
        "| 85% recipe seed 0 | 12.0 | 120.0 | 32 | 7.2 | 0.50 | 0.25 |",
        "| 85% stock seed 0 | 9.0 | 120.0 | 32 | 7.0 | - | - |",
    ]


# ----- docs/learning-results.md ------------------------------------------------------------------------------------

MARKER = re.compile(
    r"<!-- measured: bench/learning_curve_miniwob\.json, (task_table|cost_table) of ([^>(]*?) "
    r"\(tests/test_learning_curve_miniwob\.py\) -->\n(\|.*?)\n\n",
    re.DOTALL,
)


def test_the_pages_miniwob_tables_are_the_benchmarks_tables_of_the_runs_they_name():
    module = load("learning_curve")
    found = list(MARKER.finditer(DOCS.read_text(encoding="utf-8")))
    assert {match.group(1) for match in found} == {"task_table", "cost_table"}, "docs/learning-results.md: no tables"
    report = json.loads((BENCH / "learning_curve_miniwob.json").read_text())
    runs = {module.run_name(run["arm"], run["seed"], run["rate"]): run for run in report["runs"]}
    for one in runs.values():  # JSON keys are text
        one["by_task"] = {int(step): tasks for step, tasks in one["by_task"].items()}
    episodes = report["settings"]["prompts_per_step"] * report["settings"]["group_size"]
    for match in found:
        named = match.group(2).split()
        assert set(named) <= set(runs), f"runs the page names but the JSON does not hold: {set(named) - set(runs)}"
        shown = [runs[name] for name in named]
        table = module.task_table(shown) if match.group(1) == "task_table" else module.cost_table(shown, episodes)
        assert match.group(3) == table
