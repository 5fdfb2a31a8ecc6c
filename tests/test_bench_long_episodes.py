"""bench/long_episodes.py explains itself, rejects impossible settings, and its flatness check can fail."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "long_episodes.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_long_episodes", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_explains_itself_with_examples_under_help(bench, capsys):
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "examples:" in out and "exit codes" in out


@pytest.mark.parametrize("argv", [["--lengths", "1,5"], ["--lengths", "x"], ["--episodes", "0"]])
def test_impossible_settings_exit_with_code_two(bench, argv, capsys):
    assert bench.main(argv) == 2
    assert "error" in capsys.readouterr().err


def test_the_flatness_check_fails_when_stepwise_samples_grow_with_the_episode(bench):
    def cell(steps, mode, tokens):
        return bench.Cell(steps, mode, 1.0, tokens, tokens, 1.0, 1.0)

    flat = [
        cell(5, "one-sample", 100),
        cell(5, "step-wise", 50),
        cell(30, "one-sample", 600),
        cell(30, "step-wise", 55),
    ]
    grown = [*flat[:3], cell(30, "step-wise", 80)]
    assert bench.flat(flat)[0] is True
    assert bench.flat(grown)[0] is False
