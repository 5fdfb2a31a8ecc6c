"""The per-sample flags cross verl as extra fields under names users' dashboards and the trainer wiring rely on, and
come back from either trainer's shape unchanged."""

from __future__ import annotations

import numpy as np

from nemo_gym_browser.agent_attempt.sample_flags import SampleFlags

FAILED = SampleFlags(
    invalid=True,
    attempts=3,
    failure_kind="session_lost",
    failure_reason="session s1 lost",
    deadline_hit=False,
    reward_source=None,
    failed_attempt_kinds=("server_error", "session_lost", "session_lost"),
    failed_after_action_kinds=("session_lost",),
    episode_wall_s=12.5,
    refused_navigations=1,
    browser_actions=4,
    resumed_kinds=("timeout",),
    resume_diverged=1,
)


def test_the_extra_fields_carry_the_names_verl_and_the_dashboards_have_always_seen():
    fields = FAILED.extra_fields()

    assert fields == {
        "env_invalid": True,
        "env_failure_kind": "session_lost",
        "env_failure_reason": "session s1 lost",
        "env_attempts": 3,
        "deadline_hit": False,
        "reward_source": None,
        "env_failed_attempt_kinds": ["server_error", "session_lost", "session_lost"],
        "env_failed_after_action_kinds": ["session_lost"],
        "env_episode_wall_s": 12.5,
        "env_refused_navigations": 1,
        "env_browser_actions": 4,
        "env_resumed_kinds": ["timeout"],
        "env_resume_diverged": 1,
        "reward_extra_info": {
            "env/invalid": 1.0,
            "env/attempts": 3.0,
            "env/deadline_hit": 0.0,
            "env/reward_from_verify": 0.0,
            "env/reward_from_judge": 0.0,
            "env/episode_wall_s": 12.5,
            "env/browsed": 1.0,
            "env/browser_actions": 4.0,
            "env/resumed": 1.0,
        },
    }
    step_fields = FAILED.at_step(2, 5).extra_fields()
    assert (step_fields["env_step"], step_fields["env_steps"]) == (2, 5)  # step-wise samples only


def test_flags_come_back_from_a_v1_record_and_a_legacy_row_of_numpy_values_unchanged():
    stepwise = FAILED.at_step(5, 5)
    legacy_row = {
        key: np.asarray(value, dtype=object) if isinstance(value, list) else np.asarray(value)[()]
        for key, value in FAILED.extra_fields().items()
        if key != "reward_extra_info"
    }

    assert SampleFlags.from_extra_fields(stepwise.extra_fields()) == stepwise and stepwise.stands_for_episode
    assert SampleFlags.from_extra_fields(legacy_row) == FAILED
    assert not FAILED.at_step(4, 5).stands_for_episode


def test_a_sample_of_another_agent_loop_has_no_flags_and_missing_counters_read_as_their_defaults():
    assert SampleFlags.from_extra_fields({"turn_scores": []}) is None
    assert SampleFlags.from_extra_fields(None) is None
    assert SampleFlags.from_extra_fields({"env_invalid": False}) == SampleFlags(invalid=False)
