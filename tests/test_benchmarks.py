"""The benchmarks under ``bench/`` answer --help, reject bad input, and the fast one runs and checks itself.

The slow ones (``rollout_overhead.py``, ``chaos.py``) are exercised through what they are made of: the chaos
harness has its own tests (``test_chaos.py``), the fault proxy too (``test_fault_proxy.py``).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    """Import ``bench/<name>.py`` by path (bench/ is a folder of scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "name",
    [
        "baseline_bias",
        "rollout_overhead",
        "chaos",
        "learning_curve",
        "decode_throughput",
        "session_capacity",
        "engines",
    ],
)
def test_each_benchmark_explains_itself_with_examples_under_help(name, capsys):
    module = load(name)

    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])

    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "examples:" in out and f"bench/{name}.py" in out and "exit codes" in out


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("baseline_bias", ["--group-size", "1"]),
        ("rollout_overhead", ["--steps", "1"]),
        ("chaos", ["--servers", "0"]),
        ("learning_curve", ["--rates", "1.0"]),
        ("learning_curve", ["--group-size", "0"]),
        ("decode_throughput", ["--concurrency", "0"]),
        ("session_capacity", ["--concurrency", "4", "0"]),
        ("session_capacity", ["--waves", "0"]),
        ("engines", ["--concurrency", "0"]),
        ("engines", ["--concurrency", "65"]),
        ("engines", ["--repeats", "0"]),
        ("engines", ["--prompt-tokens", "900", "600"]),
    ],
)
def test_each_benchmark_rejects_impossible_settings_with_exit_code_two(name, argv, capsys):
    assert load(name).main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_baseline_bias_prints_the_table_and_the_mission_point_and_writes_the_plot_and_figures(tmp_path, capsys):
    plot, figures = tmp_path / "bias.png", tmp_path / "bias.json"

    code = load("baseline_bias").main(
        ["--groups", "16", "--mission-repeats", "2", "--plot", str(plot), "--json", str(figures)]
    )

    out = capsys.readouterr().out
    assert code == 0
    assert "machine:" in out and "command:" in out
    assert "91.6% mission" in out and "   90% |" in out
    assert "reference case [1, 1*, 0, 0] -> valid [0.667, -0.333, -0.333]" in out and "FAIL" not in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(figures.read_text())
    assert report["settings"]["groups"] == 16 and report["machine"]["cores"] >= 1
    mission = report["figures"]["points"][-1]
    assert mission["label"] == "mission" and len(mission["correct"]) == 3
    assert report["figures"]["checks"] == {"reference_case": True, "no_failure_equals_stock": True}


def test_under_infrastructure_zeros_stock_grpo_favours_survivors_and_the_recipe_stays_near_the_oracle():
    bench = load("baseline_bias")

    points = bench.sweep(groups=64, group_size=16, seed=3, norm_by_std=False, mission_repeats=2)

    at_zero, at_half = points[0], points[5]
    assert at_zero.incorrect[0] == at_zero.incorrect[1] == at_zero.incorrect[2]
    stock, recipe, oracle = at_half.correct
    assert stock > oracle + 0.1  # the zeros lower the baseline: correct survivors are over-rewarded
    assert abs(recipe - oracle) < 0.05
    stock, recipe, oracle = at_half.incorrect
    assert stock > oracle + 0.05  # and incorrect survivors are punished less
    assert abs(recipe - oracle) < 0.05
    assert at_half.failed[1] == 0.0 and at_half.failed[0] < 0


# ----- learning_curve.py: suites and sample modes ----------------------------------------------------------------


def learning_curve_args(tmp_path: Path, *argv: str):
    module = load("learning_curve")
    args = module._parser().parse_args(["--workdir", str(tmp_path), *argv])
    args.workdir = tmp_path
    return module, args


def test_the_learning_curve_runs_the_deal_suite_in_trajectory_mode_unless_told_otherwise(tmp_path):
    module, args = learning_curve_args(tmp_path)
    data = {"model": tmp_path, "train": tmp_path / "t.jsonl", "val": (tmp_path / "a", tmp_path / "b")}
    spec = module.run_spec(args, arm="recipe", seed=1, rate=0.85, url="http://127.0.0.1:1", data=data)

    assert (args.suite, args.sample_mode) == ("deal", ["trajectory"])
    assert spec.output_dir == tmp_path / "rate0.85-recipe-seed1"  # where runs went before there were modes
    assert module.STEPWISE_OVERRIDE not in spec.extra_overrides
    assert module.val_sources() == {"train": "deal-train", "heldback": "deal-heldback"} == module.VAL_SOURCES


def test_a_stepwise_run_of_the_aisle_suite_turns_stepwise_samples_on_and_keeps_its_own_folder(tmp_path):
    module, args = learning_curve_args(tmp_path, "--suite", "aisle", "--sample-mode", "trajectory", "stepwise")
    data = {"model": tmp_path, "train": tmp_path / "t.jsonl", "val": (tmp_path / "a", tmp_path / "b")}
    spec = module.run_spec(args, arm="recipe", seed=0, rate=0.0, url="http://x", data=data, mode="stepwise")

    assert args.sample_mode == ["trajectory", "stepwise"]
    assert "nemo_gym_browser.stepwise.enabled=true" in spec.extra_overrides
    assert spec.output_dir == tmp_path / "rate0-recipe-seed0-stepwise"
    metrics = {"val-core/aisle-heldback/reward/mean@2": 0.5, "val-aux/aisle-train/env/browsed/mean@2": 0.25}
    assert module.evaluated({0: metrics}, 2, "aisle") == {0: {"heldback_success": 0.5, "train_browsed": 0.25}}


def test_the_rerun_arm_is_the_recipe_with_resuming_off_and_only_it(tmp_path):
    from hydra.core.global_hydra import GlobalHydra
    from submit_fixtures import compose_recipe

    from nemo_gym_browser import settings
    from nemo_gym_browser.local import run_spec as rs

    module, args = learning_curve_args(tmp_path, "--suite", "aisle", "--arms", "recipe", "rerun", "stock")
    data = {"model": tmp_path, "train": tmp_path / "t.jsonl", "val": (tmp_path / "a", tmp_path / "b")}
    resumes = {}
    for arm in ("recipe", "rerun", "stock"):
        spec = module.run_spec(args, arm=arm, seed=0, rate=0.3, url="http://127.0.0.1:1", data=data)
        GlobalHydra.instance().clear()
        config = compose_recipe(rs.hydra_overrides(spec))
        GlobalHydra.instance().clear()
        resumes[arm] = settings.resolve_settings({}, config).resume.max_per_episode
        assert config.algorithm.adv_estimator == (rs.STOCK_ESTIMATOR if arm == "stock" else rs.RECIPE_ESTIMATOR)
    assert resumes == {"recipe": 4, "rerun": 0, "stock": 4}
    # without failures every arm makes the recipe's episodes: only the recipe runs at rate 0
    args.rates = [0.0, 0.3]
    assert {(rate, arm) for _, rate, _, arm in module.run_plan(args)} == {
        (0.0, "recipe"),
        (0.3, "recipe"),
        (0.3, "rerun"),
        (0.3, "stock"),
    }


def test_a_run_records_steps_to_the_target_seconds_per_step_and_tokens_per_sample_per_mode():
    module = load("learning_curve")
    metrics = {
        1: {"prompt_length/mean": 600.0, "prompt_length/max": 620.0, "response_length/mean": 100.0,
            "response_length/max": 300.0, "perf/total_num_tokens": 14000.0, "env/samples": 16.0,
            "env/step_samples": 40.0},
        2: {"prompt_length/mean": 610.0, "prompt_length/max": 640.0, "response_length/mean": 90.0,
            "response_length/max": 200.0, "perf/total_num_tokens": 16000.0, "env/samples": 16.0},
    }  # fmt: skip
    tokens = module.sample_tokens(metrics)
    assert tokens[1]["tokens_per_sample_mean"] == 14000 / 40  # step samples, where there are any
    assert tokens[2]["tokens_per_sample_mean"] == 1000.0 and tokens[2]["samples"] == 16.0
    run = {
        "arm": "recipe", "seed": 0, "rate": 0.0, "suite": "aisle", "sample_mode": "stepwise", "peak_memory_gib": 3.0,
        "evaluated": {0: {"heldback_success": 0.3}, 2: {"heldback_success": 0.7}, 4: {"heldback_success": 0.85}},
        "training": {1: {"step_s": 10.0}, 2: {"step_s": 20.0}},
        "tokens": tokens,
    }  # fmt: skip
    costs = module.run_costs(run, mini_batch=16)
    assert costs["steps_to_target"] == 4 and costs["seconds_per_step"] == 15.0
    assert costs["minutes_to_target"] == 0.5  # the steps' own 10 + 20 s
    # 40 step samples are 3 mini-batches of 16 (the last padded), 16 episodes one: verl's updates per step
    assert costs["updates_per_step"] == 2.0 and costs["updates_to_target"] == 4
    at_start = module.run_costs({**run, "evaluated": {0: {"heldback_success": 0.9}}}, mini_batch=16)
    assert at_start["steps_to_target"] == 0 and at_start["updates_to_target"] == 0  # there before any update
    assert costs["tokens_per_sample_max"] == 920.0 and costs["peak_memory_gib"] == 3.0
    stock = module.run_costs({**run, "tokens": {1: {"prompt_length/mean": 600.0, "response_length/mean": 50.0}}})
    assert stock["tokens_per_sample_mean"] == 650.0 and stock["samples_per_step"] is None  # no env/ counts logged
    never = {**run, "seed": 1, "evaluated": {0: {"heldback_success": 0.3}}}
    (row,) = module.by_mode([{**run, "costs": costs}, {**never, "costs": module.run_costs(never)}])
    assert (row["suite"], row["sample_mode"], row["arm"], row["rate"]) == ("aisle", "stepwise", "recipe", 0.0)
    assert row["steps_to_target"] == [4, None] and row["seconds_per_step"] == 15.0
    assert row["updates_to_target"] == [4, None] and row["updates_per_step"] == 2.0  # over the runs that know it
    assert row["minutes_to_target"] == 0.5  # over the runs that reached it


def test_report_only_redraws_a_benchmark_from_its_json_and_runs_nothing(tmp_path, monkeypatch, capsys):
    module = load("learning_curve")
    monkeypatch.setattr(module, "run_one", lambda *a, **k: pytest.fail("--report-only ran a training run"))
    monkeypatch.setattr(module.tr, "shop_environment", lambda *a: pytest.fail("--report-only started a shop"))
    stored = json.loads((BENCH / "learning_curve_aisle.json").read_text())
    runs = [run for run in stored["runs"] if run["sample_mode"] == "stepwise" and run["rate"] == 0]  # 3 of 18
    report, plot = tmp_path / "report.json", tmp_path / "curve.png"
    report.write_text(json.dumps({"settings": stored["settings"], "runs": runs}))

    assert module.main(["--report-only", "--json", str(report), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert (
        "aisle tasks (stepwise samples), 20 steps x 8 tasks x 8 episodes" in out
        and "seeds 0 1 2, " in out
        and "; 3 runs" in out
    )
    assert plot.stat().st_size > 0
    written = json.loads(report.read_text())
    assert written["settings"] == stored["settings"] and len(written["runs"]) == 3
    (row,) = written["by_mode"]
    assert row["steps_to_target"] == [4, 4, 4]

    assert module.main(["--report-only", "--json", str(report)]) == 0
    assert report.with_suffix(".png").stat().st_size > 0  # without --plot: beside its JSON, not the default's
    report.write_text(json.dumps({"settings": stored["settings"], "runs": []}))
    assert module.main(["--report-only", "--json", str(report)]) == 2
    assert "holds no runs" in capsys.readouterr().err
    assert module.main(["--report-only", "--json", str(tmp_path / "absent.json")]) == 2
    assert "absent.json" in capsys.readouterr().err


def test_a_long_benchmark_runs_without_failures_first_and_resumes_where_it_stopped(tmp_path):
    module, args = learning_curve_args(
        tmp_path, "--suite", "aisle", "--sample-mode", "trajectory", "stepwise", "--steps", "40"
    )
    plan = module.run_plan(args)
    assert plan[:4] == [("trajectory", 0.0, 0, "recipe"), ("trajectory", 0.0, 1, "recipe"),
                        ("trajectory", 0.0, 2, "recipe"), ("stepwise", 0.0, 0, "recipe")]  # fmt: skip
    assert len(plan) == 2 * 3 + 2 * 3 * 2 and ("stepwise", 0.85, 2, "stock") == plan[-1]
    settings = vars(args) | {"workdir": str(tmp_path), "model": "/m"}
    run = {"arm": "recipe", "seed": 1, "rate": 0.0, "sample_mode": "stepwise", "evaluated": {2: {}, 10: {}},
           "training": {1: {"step_s": 30.0}}, "tokens": {1: {"samples": 100.0}}, "peak_memory_gib": 7.0}  # fmt: skip
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"settings": settings, "runs": [run]}, default=str))
    (kept,) = module.resumed_runs(report, settings)
    assert module.run_key(kept) in plan and max(kept["evaluated"]) == 10  # a step again, not the text "2"
    assert kept["costs"]["updates_per_step"] == 2.0  # costs recomputed: 100 step samples, mini-batches of 8 x 8
    assert module.resumed_runs(tmp_path / "absent.json", settings) == []
    for folder, weights in (("a", b"1 w"), ("b", b"1 w"), ("c", b"2 w")):  # one policy in two checkouts, another
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "SHA256SUMS").write_bytes(weights)
    report.write_text(json.dumps({"settings": settings | {"model": str(tmp_path / "a")}, "runs": [run]}, default=str))
    assert len(module.resumed_runs(report, settings | {"model": str(tmp_path / "b")})) == 1
    with pytest.raises(ValueError, match=r"model .* there, .* now"):
        module.resumed_runs(report, settings | {"model": str(tmp_path / "c")})
    with pytest.raises(ValueError, match=r"steps 40 there, 20 now"):
        module.resumed_runs(report, settings | {"steps": 20, "json": "elsewhere"})
    report.write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"not a learning_curve\.py report"):
        module.resumed_runs(report, settings)
