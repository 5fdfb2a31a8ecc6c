"""Step-wise samples through verl 0.9.1's real V1 advantage computation: episodes, not steps, form the GRPO group.

The samples are stored by verl's own ``AgentLoopWorkerTQ._agent_loop_postprocess`` (a list of outputs per session,
keyed ``{uid}_{session}_{index}``) in a real local TransferQueue, and their advantages computed by the wired
``PPOTrainer._compute_advantage`` (harness shared with ``test_patches.py``). Each case is computed by hand.
"""

from __future__ import annotations

import pytest
from test_patches import new_uid, output, put_group, run_v1, v1_trainer

from nemo_gym_browser.trainer_side import wiring
from nemo_gym_browser.trainer_side.episode_metrics import episode_metrics


def episode(reward: float, steps: int, *, invalid: bool = False) -> list:
    """One session's step samples as the loop returns them: every step carries the episode's reward and flags."""
    fields = {
        "env_invalid": invalid,
        "env_failure_kind": "session_lost" if invalid else None,
        "env_attempts": 1,
        "env_steps": steps,
        "reward_extra_info": {},
    }
    return [output(reward, {**fields, "env_step": number}, masked=invalid) for number in range(1, steps + 1)]


# One prompt, four episodes of 3, 1, 2 and 5 steps; the third was spoiled by the infrastructure.
GROUP = [(1.0, 3, False), (0.0, 1, False), (0.0, 2, True), (1.0, 5, False)]


@pytest.mark.parametrize(
    ("norm", "expected"),
    [
        # valid episodes score 1, 0, 1: mean 2/3
        (False, [1 / 3, -2 / 3, 0.0, 1 / 3]),
        # ... and unbiased std sqrt(1/3)
        (True, [(1 / 3) / 3**-0.5, (-2 / 3) / 3**-0.5, 0.0, (1 / 3) / 3**-0.5]),
    ],
    ids=["mean-only", "std-normalised"],
)
def test_grpo_compares_episodes_and_gives_every_step_its_episodes_advantage(tq, norm, expected):
    uid = new_uid()
    keys = put_group(uid, [episode(*case[:2], invalid=case[2]) for case in GROUP])
    assert len(keys) == 3 + 1 + 2 + 5

    values, metrics = run_v1(tq, keys, v1_trainer("grpo_env_aware", norm=norm))

    for session, want in enumerate(expected):
        steps = [key for key in keys if key.startswith(f"{uid}_{session}_")]
        assert [values[key] for key in steps] == pytest.approx([want] * len(steps), abs=1e-5), session
    # a baseline over step samples would have been 8/9 (eight valid steps score 1, one scores 0), not 2/3
    assert metrics[wiring.INVALID_FRACTION_METRIC] == 0.25  # one episode of four, not 2 step samples of 11


def test_a_long_episode_counts_once_in_the_baseline_however_many_steps_it_has(tq):
    short, long = new_uid(), new_uid()
    short_keys = put_group(short, [episode(1.0, 1), episode(0.0, 1)])
    long_keys = put_group(long, [episode(1.0, 30), episode(0.0, 1)])

    values, _ = run_v1(tq, short_keys + long_keys, v1_trainer("grpo_env_aware"))

    # the same two outcomes give the same advantages whether the winner took 1 step or 30
    assert values[f"{short}_0_0"] == pytest.approx(values[f"{long}_0_29"]) == pytest.approx(0.5)
    assert values[f"{short}_1_0"] == pytest.approx(values[f"{long}_1_0"]) == pytest.approx(-0.5)
    assert {round(values[f"{long}_0_{index}"], 6) for index in range(30)} == {0.5}


def test_step_metrics_count_each_episode_once():
    rows = [sample.extra_fields for case in GROUP for sample in episode(*case[:2], invalid=case[2])]

    metrics = episode_metrics(rows)

    assert metrics["env/samples"] == 4 and metrics["env/step_samples"] == 11
    assert metrics["env/invalid_count"] == 1 and metrics["env/invalid_rate"] == 0.25
    assert metrics["env/steps/mean"] == (3 + 1 + 2 + 5) / 4 and metrics["env/steps/max"] == 5
