"""The warning that the share of episodes kept out of the baseline keeps rising while the environment is healthy,
and the per-step counts of failures after the policy acted that it names."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from nemo_gym_browser.trainer_side import exclusion_watch as ew
from nemo_gym_browser.trainer_side import trainer_wrappers
from nemo_gym_browser.trainer_side.episode_metrics import episode_metrics


def step(invalid_rate: float, before_action: float = 0.0, **after_action: float) -> dict[str, float]:
    metrics = {"env/invalid_rate": invalid_rate, "env/failed_before_action_rate": before_action}
    metrics.update({f"env/failed_after_action/{kind}": count for kind, count in after_action.items()})
    return metrics


def warnings_over(steps: list[dict[str, float]]) -> list[str | None]:
    watch = ew.ExclusionWatch()
    return [watch.observe(metrics) for metrics in steps]


def test_three_rises_in_a_row_while_the_environment_is_healthy_warn_and_name_the_kinds():
    seen = warnings_over([step(0.02), step(0.03), step(0.04), step(0.05, session_lost=6, timeout=2)])

    assert seen[:3] == [None, None, None]
    assert seen[3] is not None and f"rose {ew.CONSECUTIVE_RISES_TO_WARN} step(s) in a row" in seen[3]
    assert "0.020 -> 0.030 -> 0.040 -> 0.050" in seen[3] and "session_lost 6, timeout 2" in seen[3]


def test_a_single_jump_beyond_the_threshold_warns_at_once():
    seen = warnings_over([step(0.02), step(0.02 + ew.SINGLE_RISE_TO_WARN)])

    assert seen[0] is None and seen[1] is not None


def test_a_rise_while_failures_before_the_policy_acted_are_high_is_the_environments_and_stays_quiet():
    unhealthy = ew.HEALTHY_BEFORE_ACTION_FAILURE_RATE + 0.01
    seen = warnings_over([step(0.02, unhealthy), step(0.2, unhealthy), step(0.3, unhealthy), step(0.4, unhealthy)])

    assert seen == [None] * 4


def test_a_fall_resets_the_run_of_rises():
    seen = warnings_over([step(0.02), step(0.03), step(0.04), step(0.01), step(0.02), step(0.03)])

    assert seen == [None] * 6


def test_the_warning_is_logged(caplog):
    caplog.set_level(logging.WARNING, logger=ew.__name__)

    warnings_over([step(0.0), step(0.5)])

    assert "may have found a way to fail as infrastructure" in caplog.text


def flags(*, attempts: int, failed: list[str], after: list[str], invalid: bool) -> dict:
    return {
        "env_invalid": invalid,
        "env_failure_kind": failed[-1] if invalid else None,
        "env_attempts": attempts,
        "env_failed_attempt_kinds": failed,
        "env_failed_after_action_kinds": after,
    }


def test_failures_after_the_policy_acted_are_counted_by_kind_apart_from_those_before():
    rows = [
        flags(attempts=1, failed=[], after=[], invalid=False),
        flags(attempts=2, failed=["seed_failed"], after=[], invalid=False),
        flags(
            attempts=3, failed=["session_lost", "seed_failed", "session_lost"], after=["session_lost"] * 2, invalid=True
        ),
    ]

    metrics = episode_metrics(rows)

    assert metrics["env/failed_after_action/session_lost"] == 2.0
    assert metrics["env/failed_after_action/seed_failed"] == 0.0
    assert metrics["env/failed_after_action_rate"] == pytest.approx(2 / 6)
    assert metrics["env/failed_before_action_rate"] == pytest.approx(2 / 6)


def test_the_legacy_step_metrics_feed_the_watch(monkeypatch):
    seen: list[dict] = []
    monkeypatch.setattr(ew, "observe_step", lambda metrics: seen.append(dict(metrics)))

    batch = SimpleNamespace(non_tensor_batch={"env_invalid": [True, False], "env_attempts": [1, 1]})

    def compute_data_metrics(batch, use_critic=True):
        return {"verl/own": 1.0}

    metrics = trainer_wrappers.make_data_metrics_wrapper(compute_data_metrics)(batch=batch)

    assert metrics["env/invalid_rate"] == 0.5 and seen and seen[0]["env/invalid_rate"] == 0.5
