"""verl's real ``main_ppo`` trains with this recipe: V1 trainer, ``BrowserToolAgentLoop``, ``grpo_env_aware`` through
``patches.py``, the real nemo-gym 0.7.0 server with Chromium on 127.0.0.1, and infrastructure failures injected by
the fault proxy between the rollouts and the server.

The model is the project's warm-started tiny policy on the CPU backend (``local/cpu_backend``: a ``cpu`` platform
and the ``hfcpu`` rollout in place of vLLM); the tasks are four Corner Shop training tasks, one of each kind.
Everything asserted is read from what the trainer itself logged (verl's ``file`` logger and the recipe's advantage
log), from the checkpoint folder it wrote, and from the proxy's and the server's view of the sessions.

The plan of faults (by dataset row, see ``PLAN``) is deterministic: every row is in every step (the batch is the whole
training set), and the first rollout of a row to open a session is the one the plan breaks, on its planned attempts.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from nemo_gym_browser.local import main_ppo_process as mp
from nemo_gym_browser.local import run_spec as rs
from nemo_gym_browser.local import training_run as tr
from nemo_gym_browser.local.faults import injected as inj
from nemo_gym_browser.rehearsal import expected_advantages

pytestmark = pytest.mark.integration

KINDS = ("open", "browse", "search", "price")
GROUP_SIZE = 4
# A cold Ray start, model load and two CPU steps take 1-3 minutes here; a loaded machine several times that.
RUN_TIMEOUT_S = 1200
# Row 0: its first rollout's seed fails once (resampled, recovered). Row 1: its first rollout's verify fails on every
# attempt (still invalid after 3 attempts: flagged, advantage 0), and its second rollout's verify is graded 1.0
# whatever the policy did, so that group's valid scores always differ from the ones stock GRPO would see (a zero in
# place of the failure): the baseline check below cannot pass on a group of equal scores.
PLAN = {
    0: inj.RowFault("seed_session", attempts=(1,), rollouts=1),
    1: (
        inj.RowFault("verify", attempts=(1, 2, 3), rollouts=1),
        inj.RowFault("verify", attempts=(1,), rollouts=1, fault="regrade", skip=1),
    ),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("main_ppo")


@pytest.fixture(scope="module")
def data(workdir: Path) -> tuple[Path, Path, int]:
    """Rows of the first training task of each kind, in that order (row i is the task of KINDS[i])."""
    from nemo_gym_browser.local import shop_tasks

    records = [next(r for r in shop_tasks.task_records("train") if r["kind"] == kind) for kind in KINDS]
    tasks = workdir / "tasks.jsonl"
    tasks.write_text("".join(json.dumps(record) + "\n" for record in records))
    train, _ = tr.prepare_task_rows(workdir, tasks, tasks)
    assert [json.loads(line)["task_id"] for line in train.read_text().splitlines()] == [r["id"] for r in records]
    # verl needs validation rows even when it never validates: the training rows serve.
    return train, train, len(records)


@dataclass(frozen=True)
class PlannedRun:
    """A run under ``PLAN``, and the proxy's and the server's view of the sessions after it."""

    spec: rs.RunSpec
    result: mp.RunResult
    rows: int
    left_open: tuple[str, ...]
    injected: dict[str, int]
    state: object  # launch_environment.BrowserState


def train_under_the_plan(environment, policy: Path, workdir: Path, data, name: str, plan=PLAN, **changes) -> PlannedRun:
    train, val, rows = data
    with inj.InjectedFaults(environment.url, inj.planned_faults(plan)) as faults:
        spec = rs.RunSpec(
            model_path=policy,
            train_file=train,
            val_file=val,
            server_urls=(faults.url,),
            output_dir=workdir / name,
            **{"steps": 2, "prompts_per_step": rows, "group_size": GROUP_SIZE, **changes},
        )
        result = mp.run_main_ppo(spec, timeout_s=RUN_TIMEOUT_S)
        left_open, injected = faults.open_session_ids, faults.counts()
    return PlannedRun(spec, result, rows, left_open, injected, environment.browser_state())


@pytest.fixture(scope="module")
def first_run(real_environment, shop_site, tiny_policy: Path, workdir: Path, data: tuple[Path, Path, int]):
    """Two training steps, a checkpoint at step 2."""
    run = train_under_the_plan(real_environment, tiny_policy, workdir, data, "run", save_freq=2)
    return run.spec, run.result, run.rows, run.left_open, run.injected, run.state


def _require_ok(result: mp.RunResult) -> None:
    assert result.ok, f"main_ppo exited with {result.returncode}; the end of {result.log_path}:\n{result.log_tail()}"


def test_main_ppo_runs_two_real_training_steps_with_the_recipe(first_run) -> None:
    _, result, rows, *_ = first_run
    _require_ok(result)
    assert sorted(result.steps) == [1, 2]
    for step in (1, 2):
        metrics = result.steps[step]
        assert metrics["training/global_step"] == step
        # the actor was really updated and the rollout received the new weights
        assert "actor/pg_loss" in metrics and "timing_s/update_weights" in metrics
        assert mp.metric(result.steps, step, "env/samples") == rows * GROUP_SIZE


def test_the_trainer_logs_env_metrics_that_match_the_injected_faults(first_run) -> None:
    _, result, rows, _, injected, _ = first_run
    _require_ok(result)
    samples = rows * GROUP_SIZE
    first = {key: mp.metric(result.steps, 1, key) for key in result.steps[1] if key.startswith("env/")}
    assert first["env/failed_attempts/seed_failed"] == 1
    assert first["env/failed_attempts/verify_unavailable"] == 3
    assert first["env/invalid_count"] == 1
    assert first["env/invalid/verify_unavailable"] == 1
    assert first["env/invalid/seed_failed"] == 0
    assert math.isclose(first["env/invalid_rate"], 1 / samples)
    assert math.isclose(first["env/resampled_rate"], 2 / samples)
    assert math.isclose(first["env/recovered_rate"], 1 / samples)
    assert first["env/attempts/max"] == 3
    # the proxy answered 503 exactly where the plan says (one seed, three verifies) and planted one grade
    assert injected == {"status": 4, "regrade": 1}
    # step 2: the plan is spent, nothing failed
    assert mp.metric(result.steps, 2, "env/invalid_count") == 0
    assert mp.metric(result.steps, 2, "env/resampled_rate") == 0


def test_flagged_samples_get_advantage_zero_and_stay_out_of_their_groups_baseline_in_the_real_fit_loop(
    first_run,
) -> None:
    _, result, rows, *_ = first_run
    _require_ok(result)
    assert math.isclose(mp.metric(result.steps, 1, "grpo_env_aware/invalid_fraction"), 1 / (rows * GROUP_SIZE))
    assert mp.metric(result.steps, 2, "grpo_env_aware/invalid_fraction") == 0.0
    assert sorted(result.advantages) == [1, 2]
    for step, samples in result.advantages.items():
        assert len(samples) == rows * GROUP_SIZE
        invalid = [bool(s["env_invalid"]) for s in samples]
        assert sum(invalid) == (1 if step == 1 else 0)
        # the estimator's contract, computed independently: GRPO over each group's valid samples, 0 for the rest
        expected = expected_advantages([s["score"] for s in samples], invalid, [s["uid"] for s in samples], norm=True)
        for sample, want in zip(samples, expected, strict=True):
            assert sample["advantage"] == pytest.approx(want, abs=1e-4), sample
        for sample in (s for s, bad in zip(samples, invalid, strict=True) if bad):
            assert sample["advantage"] == 0.0 and sample["response_tokens"] == 0  # out of the loss as well
    assert_the_failure_stayed_out_of_its_groups_baseline(result.advantages[1])


def assert_the_failure_stayed_out_of_its_groups_baseline(samples: list[dict]) -> None:
    """The flagged sample's group (one sample per episode): its valid members hold the planted 1.0, and stock GRPO
    (the failure a zero in the baseline) would have given each of them another advantage than the trainer did."""
    flagged = next(s["uid"] for s in samples if s["env_invalid"])
    group = [s for s in samples if s["uid"] == flagged]
    assert any(s["score"] == 1.0 for s in group if not s["env_invalid"])
    stock = expected_advantages([s["score"] for s in group], [False] * len(group), [flagged] * len(group), norm=True)
    for sample, stock_advantage in zip(group, stock, strict=True):
        if not sample["env_invalid"]:  # the closest case, scores 1, 0, 0 plus the failure: 0.077 apart
            assert abs(sample["advantage"] - stock_advantage) > 0.05, (sample, stock_advantage)


def test_no_browser_session_is_left_open_after_training(first_run) -> None:
    _, result, _, left_open, _, state = first_run
    _require_ok(result)
    assert left_open == ()
    assert state.idle, f"the server still holds {state}"


def test_a_checkpoint_is_written_and_training_resumes_from_it(first_run, real_environment) -> None:
    spec, result, *_ = first_run
    _require_ok(result)
    assert (spec.checkpoint_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert (spec.checkpoint_dir / "global_step_2" / "actor").is_dir()
    resumed = mp.run_main_ppo(
        spec.replace(steps=3, resume=True, server_urls=(real_environment.url,), save_freq=-1),
        timeout_s=RUN_TIMEOUT_S,
    )
    _require_ok(resumed)
    # verl resumed at step 3: steps 1 and 2 were not trained again
    assert sorted(resumed.steps) == [3]
    assert mp.metric(resumed.steps, 3, "env/samples") > 0


# ----- rollouts that never reach the model: a whole group unseedable, first in the worker's chunk, every step ----

# Row 0 (first in the batch: no shuffling) cannot be seeded on any attempt of any of its rollouts, in every step: its
# group is all placeholders, and the first sample of the agent-loop worker's chunk is one of them. verl decides from
# that first sample which optional tensors the chunk carries (rollout_log_probs: the CPU backend computes them).
UNSEEDABLE = {0: inj.RowFault("seed_session", attempts=(1, 2, 3), rollouts=GROUP_SIZE * 3, fault="fail_seed")}


@pytest.fixture(scope="module")
def unseedable_run(real_environment, shop_site, tiny_policy: Path, workdir: Path, data: tuple[Path, Path, int]):
    return train_under_the_plan(
        real_environment,
        tiny_policy,
        workdir,
        data,
        "unseedable",
        plan=UNSEEDABLE,
        steps=3,
        extra_overrides=("data.shuffle=false",),
    )


def test_a_run_survives_three_steps_whose_first_group_never_reached_the_model(unseedable_run) -> None:
    run = unseedable_run
    _require_ok(run.result)
    assert sorted(run.result.steps) == [1, 2, 3]
    for step in (1, 2, 3):
        metrics = run.result.steps[step]
        assert "actor/pg_loss" in metrics and "training/rollout_probs_diff_valid" in metrics
        assert mp.metric(run.result.steps, step, "env/invalid/seed_failed") == GROUP_SIZE
        assert mp.metric(run.result.steps, step, "env/failed_attempts/seed_failed") == GROUP_SIZE * 3
        samples = run.result.advantages[step]
        failed = [s for s in samples if s["env_invalid"]]
        assert len(failed) == GROUP_SIZE and len({s["uid"] for s in failed}) == 1  # the whole group
        assert all(s["advantage"] == 0.0 and s["response_tokens"] == 0 for s in failed)
    assert run.injected == {"status": 3 * GROUP_SIZE * 3}  # the server's 500 for a start page that never loads
    assert run.left_open == () and run.state.idle


# ----- step-wise mode: one sample per policy step, the same plan of faults ----------------------------------------

STEPWISE_OVERRIDES = (
    "nemo_gym_browser.stepwise.enabled=true",
    "nemo_gym_browser.stepwise.history_observations=1",
    "nemo_gym_browser.stepwise.history_steps=10",
)


@pytest.fixture(scope="module")
def stepwise_run(real_environment, shop_site, tiny_policy: Path, workdir: Path, data: tuple[Path, Path, int]):
    """Two training steps in step-wise mode under the same fault plan as ``first_run``; no checkpoint."""
    run = train_under_the_plan(
        real_environment, tiny_policy, workdir, data, "stepwise", extra_overrides=STEPWISE_OVERRIDES
    )
    return run.result, run.rows, run.left_open, run.state


def _sessions(samples: list[dict]) -> dict[str, list[dict]]:
    """Step samples by episode: verl keys them ``{uid}_{session}_{index}``, in step order."""
    episodes: dict[str, list[dict]] = {}
    for sample in samples:
        session, index = sample["key"].rsplit("_", 1)
        episodes.setdefault(session, []).append((int(index), sample))
    return {key: [sample for _, sample in sorted(steps, key=lambda pair: pair[0])] for key, steps in episodes.items()}


def test_stepwise_mode_trains_two_real_steps_with_env_metrics_counting_episodes(stepwise_run) -> None:
    result, rows, *_ = stepwise_run
    _require_ok(result)
    assert sorted(result.steps) == [1, 2]
    episodes = rows * GROUP_SIZE
    for step in (1, 2):
        assert "actor/pg_loss" in result.steps[step]
        assert mp.metric(result.steps, step, "env/samples") == episodes  # episodes, not step samples
        assert mp.metric(result.steps, step, "env/step_samples") == len(result.advantages[step])
        assert mp.metric(result.steps, step, "env/step_samples") >= episodes
    assert mp.metric(result.steps, 1, "env/invalid_count") == 1
    assert math.isclose(mp.metric(result.steps, 1, "env/invalid_rate"), 1 / episodes)
    assert math.isclose(mp.metric(result.steps, 1, "grpo_env_aware/invalid_fraction"), 1 / episodes)
    assert mp.metric(result.steps, 2, "env/invalid_count") == 0


def test_stepwise_mode_gives_every_step_its_episodes_advantage_and_invalid_episodes_zero(stepwise_run) -> None:
    result, rows, *_ = stepwise_run
    _require_ok(result)
    assert sorted(result.advantages) == [1, 2]
    for step, samples in result.advantages.items():
        episodes = _sessions(samples)
        assert len(episodes) == rows * GROUP_SIZE
        finals = [steps[-1] for steps in episodes.values()]
        invalid = [bool(s["env_invalid"]) for s in finals]
        assert sum(invalid) == (1 if step == 1 else 0)
        # GRPO over each group's valid episodes (their final steps), computed independently
        expected = expected_advantages([s["score"] for s in finals], invalid, [s["uid"] for s in finals], norm=True)
        for (session, steps), want, bad in zip(episodes.items(), expected, invalid, strict=True):
            for sample in steps:
                assert sample["advantage"] == pytest.approx(want, abs=1e-4), (session, sample)
                assert bool(sample["env_invalid"]) is bad and sample["score"] == steps[-1]["score"]
                if bad:
                    assert sample["advantage"] == 0.0 and sample["response_tokens"] == 0
        if step == 1:
            assert_the_failure_stayed_out_of_its_groups_baseline(finals)


def test_stepwise_mode_leaves_no_browser_session_open(stepwise_run) -> None:
    result, _, left_open, state = stepwise_run
    _require_ok(result)
    assert left_open == ()
    assert state.idle, f"the server still holds {state}"


# ----- step-wise mode on tasks two dependent browser calls deep (the aisle suite) ---------------------------------


@pytest.fixture(scope="module")
def aisle_run(real_environment, shop_site, workdir: Path):
    """Two step-wise training steps of the shipped aisle policy on four aisle training days, no fault injected."""
    from nemo_gym_browser.local import shop_tasks
    from nemo_gym_browser.local.tiny_policy import AISLE_POLICY_DIR

    train_file, _ = shop_tasks.SUITE_FILES["aisle"]
    tasks = workdir / "aisle_tasks.jsonl"
    tasks.write_text("".join(train_file.read_text().splitlines(keepends=True)[:4]))
    train, _ = tr.prepare_task_rows(workdir / "aisle", tasks, tasks)
    run = train_under_the_plan(
        real_environment,
        AISLE_POLICY_DIR,
        workdir,
        (train, train, 4),
        "aisle-stepwise",
        plan={},
        group_size=8,
        max_assistant_turns=4,
        extra_overrides=STEPWISE_OVERRIDES,
    )
    return run.result, run.left_open, run.state


def test_stepwise_mode_trains_on_episodes_of_two_dependent_browser_calls(aisle_run) -> None:
    """Every browsing episode of the aisle policy observes, clicks and finishes: one sample per policy step, each
    with its episode's advantage; the reward is the server's own verdict on the named fruit."""
    result, left_open, state = aisle_run
    _require_ok(result)
    assert sorted(result.advantages) == [1, 2]
    multi_step = 0
    for step, samples in result.advantages.items():
        episodes = _sessions(samples)
        assert mp.metric(result.steps, step, "env/samples") == len(episodes) == 4 * 8
        assert mp.metric(result.steps, step, "env/invalid_count") == 0
        for steps in episodes.values():
            assert len({sample["advantage"] for sample in steps}) == 1  # the episode's advantage on every step
            assert steps[-1]["score"] in (0.0, 1.0)
            multi_step += len(steps) >= 3  # observe, click, finish: three policy steps
    assert multi_step > 0  # the policy browses on some episodes (17 % held back at the start)
    assert left_open == () and state.idle
