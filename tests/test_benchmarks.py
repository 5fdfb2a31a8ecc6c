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
