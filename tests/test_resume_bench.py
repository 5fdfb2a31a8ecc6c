"""``bench/resume_lean.py``: its fault rule draws per browser call and nowhere else, its arithmetic is the issue's
"about a third", and a short run writes a report of the right shape whose cells share their first draws.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from nemo_gym_browser.local.faults.kinds import SeenRequest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "resume_lean.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_resume_lean", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def seen(endpoint: str, task_id: str | None = "lean-3") -> SeenRequest:
    return SeenRequest(endpoint=endpoint, session_id="r3-ab.1.0", received_at=0.0, task_id=task_id)


def test_the_fault_rule_draws_each_browser_call_of_an_episode_alike_in_every_run_and_spares_the_rest(bench) -> None:
    calls = ["browser_observe", "browser_click", "browser_observe", "browser_click"] * 25

    def faulted(seed: int) -> list[bool]:
        rule = bench.call_faults(0.5, seed=seed)  # one episode's calls, in order
        return [rule(seen(endpoint)) is not None for endpoint in calls]

    first, again, other_seed = faulted(1), faulted(1), faulted(2)

    assert first == again and first != other_seed and 0 < sum(first) < len(calls)
    always = bench.call_faults(1.0, seed=1)
    assert all(always(seen(e)) is None for e in ("seed_session", "browser_finish", "verify", "close_session"))
    assert always(seen("browser_click")).kind == "lose_session" and always(seen("browser_click", None)) is None


def test_the_re_run_arithmetic_keeps_about_a_third_browsing_at_thirty_percent(bench) -> None:
    assert bench.rerun_expected_share(0.0, 0.5) == 0.5
    assert bench.rerun_expected_share(0.3, 0.5) == pytest.approx(0.329, abs=0.001)


def test_the_benchmark_explains_itself_and_refuses_impossible_settings(bench, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0 and "examples:" in capsys.readouterr().out
    assert bench.main(["--episodes", "0"]) == 2 and "error" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--rates", "1.0"])
    assert exit_.value.code == 2


def test_a_short_run_writes_every_arm_and_rate_with_the_same_first_draws_and_states_each_target(
    bench, tmp_path
) -> None:
    path = tmp_path / "lean.json"

    assert bench.main(["--episodes", "20", "--latency-s", "0", "--json", str(path)]) == 0

    figures = json.loads(path.read_text())["figures"]
    cells = {(c["arm"], c["rate"]): c for c in figures["cells"]}
    assert sorted(cells) == [(arm, rate) for arm in ("rerun", "resume") for rate in (0.0, 0.3, 0.85)]
    assert len({c["drawn_browse_share"] for c in cells.values()}) == 1  # routes keyed by the rollout, not the arm
    assert all(c["episodes"] == 20 for c in cells.values()) and figures["problems"] == []
    assert cells["rerun", 0.0]["lean"] == 0.0 and cells["resume", 0.0]["resumed"] == 0
    assert cells["rerun", 0.0]["wasted_tokens_per_kept"] == 0 < cells["rerun", 0.85]["wasted_tokens_per_kept"]
    assert cells["rerun", 0.85]["resumed"] == 0 and cells["resume", 0.85]["resumed"] > 0
    assert cells["rerun", 0.85]["rerun_after_action"] > 0
    assert {t["name"] for t in figures["targets"]} == {
        "rerun_leans_at_30",
        "rerun_matches_the_arithmetic_at_30",
        "resume_keeps_the_drawn_share_at_30",
    }
    assert all(isinstance(t["met"], bool) for t in figures["targets"])
