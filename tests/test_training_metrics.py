"""The loop's per-sample flags reach the *training* step metrics of both verl 0.9.1 trainers as ``env/*`` keys.

Legacy: rollouts of the real ``BrowserToolAgentLoop`` through verl's own ``AgentLoopWorker`` and ``_postprocess``,
then the steps ``RayPPOTrainer.fit`` runs on the driver (``extract_reward``, ``compute_advantage``) and the very
function it builds the step's data metrics with, ``ray_trainer.compute_data_metrics``.

V1: a real ``PPOTrainerSync`` (built from verl's composed config; no GPU workers) registers the prompts of its
dataloader and dispatches them to a real ``AgentLoopWorkerTQ`` running in this process, which stores the samples in
a local TransferQueue; verl's ``ReplayBuffer`` samples the step's batch, verl's padding makes it divisible, and the
trainer's own ``_compute_old_log_prob`` (bypass mode), ``_compute_advantage``, ``MetricsAggregator`` and
``_compute_metrics`` build the step's metrics dict, the one ``fit`` hands to its logger. Only the stages that need GPU
workers (balancing across data-parallel ranks, actor update) are not run.
"""

from __future__ import annotations

import asyncio
import os
import uuid

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from torchdata.stateful_dataloader import StatefulDataLoader
from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
from verl.protocol import DataProto
from verl.single_controller.ray.base import ResourcePoolManager
from verl.trainer.ppo import metric_utils, ray_trainer
from verl.trainer.ppo.padding_utils import upsample_batch_to_divisible_size
from verl.trainer.ppo.reward import extract_reward
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1.utils import MetricsAggregator
from verl.utils.dataset.rl_dataset import collate_fn

from nemo_gym_browser import patches
from nemo_gym_browser.agent_attempt.sample_flags import FLAG_KEYS, SampleFlags
from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.local.environment_server.site_model import BUNDLED_ROOT
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import compose_trainer_config, make_row
from nemo_gym_browser.trainer_side import dropped_rollouts, wiring
from nemo_gym_browser.trainer_side.episode_metrics import FAILURE_KINDS, episode_metrics, metrics_from_columns

ABOUT = {"url_contains": "about.html"}
ROLLOUT_TIMEOUT_S = 120
# A rollout that could not open a session on either attempt, as the loop records it when it drops it.
DROPPED = SampleFlags(
    invalid=True, failure_kind="seed_failed", attempts=2, failed_attempt_kinds=("seed_failed",) * 2, episode_wall_s=1.5
)
# The step every flagged batch below must report: one clean sample; one whose type call fails in every session (each
# attempt resumes twice, the per-call budget, then fails: still failing after both attempts); one whose first
# navigation fails and is resumed (every failure a 503 from the environment).
EXPECTED = {
    "env/samples": 3.0,
    "env/invalid_rate": 1 / 3,
    "env/invalid_count": 1.0,
    "env/resampled_rate": 1 / 3,
    "env/recovered_rate": 0.0,
    "env/attempts/mean": 4 / 3,
    "env/attempts/max": 2.0,
    "env/deadline_hit_rate": 0.0,
    "env/reward_source/verify": 2 / 3,
    "env/reward_source/judge": 0.0,
    "env/refused_navigations/mean": 0.0,
    "env/failed_attempts/server_error": 2.0,
    "env/invalid/server_error": 1.0,
    "env/resumed_rate": 2 / 3,
    "env/resumes/mean": 5 / 3,
    "env/resumed/server_error": 5.0,
    "env/resume_diverged_rate": 0.0,
    "env/rerun_after_action_rate": 1 / 3,
    # Every failed attempt came after the policy's first tool call (it observed, then typed).
    "env/failed_after_action/server_error": 2.0,
    "env/failed_after_action_rate": 2 / 4,
    "env/failed_before_action_rate": 0.0,
}


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert patches.install() is True


def scripted_group(server, tokenizer) -> sp.ScriptedPolicy:
    """Three tasks, told apart by their text: clean, failing in every session, resumed after its first navigation."""
    scripts = {
        "clean": sp.walk_and_finish("About", "ALPHA-42"),
        "broken": sp.steps(sp.observe(), sp.type_into("nothing", "x")),
        "flaky": sp.steps(sp.observe(), sp.navigate(BUNDLED_ROOT + "site/about.html"), sp.finish("ok")),
    }
    server.inject("browser_type", Fault.status(503))  # every attempt of "broken" (the only task that types)
    server.inject("browser_navigate", Fault.status(503), on_call=1)  # the first navigation of "flaky"
    return sp.ScriptedPolicy(tokenizer, scripts)


def group_rows() -> list[dict]:
    return [
        make_row(task=f"{name}: reach the About page", verifier_metadata=ABOUT, index=index)
        for index, name in enumerate(("clean", "broken", "flaky"))
    ]


def trainer_config(server, model_dir, *overrides: str):
    """verl's composed config with the recipe's settings; rollout log-probs stand in for the actor's (bypass mode)."""
    return compose_trainer_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"+nemo_gym_browser.environment.server_urls='{server.url}'",
            "+nemo_gym_browser.resample_backoff_s=0",
            "+nemo_gym_browser.max_attempts=2",
            "algorithm.adv_estimator=grpo_env_aware",
            "algorithm.rollout_correction.bypass_mode=true",
            *overrides,
        ]
    )


def assert_env_metrics(metrics: dict) -> None:
    for key, value in EXPECTED.items():
        assert metrics[key] == pytest.approx(value), key
    for kind in FAILURE_KINDS:
        if kind != "server_error":
            assert metrics[f"env/failed_attempts/{kind}"] == 0.0 and metrics[f"env/invalid/{kind}"] == 0.0, kind
    assert 0.0 < metrics["env/episode_wall_s/mean"] <= metrics["env/episode_wall_s/max"] < ROLLOUT_TIMEOUT_S


# ---------------------------------------------------------------------------------------------------------------
# Legacy trainer (RayPPOTrainer.fit)


def object_column(values: list) -> np.ndarray:
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


async def legacy_step_batch(server, model_dir) -> DataProto:
    """The step's batch as ``RayPPOTrainer.fit`` holds it when it computes the step's metrics (no GPU stages)."""
    config = trainer_config(server, model_dir, "trainer.use_v1=false", "actor_rollout_ref.rollout.n=3")
    worker = AgentLoopWorker(config, scripted_group(server, build_chat_tokenizer()))
    rows = group_rows()
    prompts = DataProto(
        batch=TensorDict({"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)}, batch_size=len(rows)),
        non_tensor_batch={
            **{key: object_column([row[key] for row in rows]) for key in rows[0]},
            "uid": object_column(["group-1"] * len(rows)),  # one prompt group of three rollouts
        },
        meta_info={"global_steps": 1, "validate": False},
    )
    batch = await asyncio.wait_for(worker.generate_sequences(prompts), ROLLOUT_TIMEOUT_S)
    assert server.open_sessions == 0

    # What fit does between generation and its metrics, in its order (reward -> adv), on the driver.
    reward_tensor, reward_extra_infos_dict = extract_reward(batch)
    batch.batch["token_level_scores"] = reward_tensor
    batch.non_tensor_batch.update({k: np.array(v) for k, v in reward_extra_infos_dict.items()})
    batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
    algorithm = config.algorithm
    return ray_trainer.compute_advantage(
        batch,
        adv_estimator=algorithm.adv_estimator,
        gamma=algorithm.gamma,
        lam=algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True),
        config=algorithm,
    )


async def test_the_legacy_step_metrics_carry_the_env_metrics_next_to_verls_data_metrics(server, model_dir):
    batch = await legacy_step_batch(server, model_dir)

    metrics = ray_trainer.compute_data_metrics(batch=batch, use_critic=False)  # the name fit calls, once per step

    assert_env_metrics(metrics)
    stock = metric_utils.compute_data_metrics(batch=batch, use_critic=False)
    assert {key: value for key, value in metrics.items() if not key.startswith("env/")} == stock
    assert {key: value for key, value in metrics.items() if key.startswith("env/")} == metrics_from_columns(
        batch.non_tensor_batch
    )
    assert metrics["critic/score/mean"] == pytest.approx(2 / 3)  # verl's own keys, computed from the same batch
    assert batch.batch["advantages"][1].abs().sum() == 0  # the invalid sample learns nothing


async def test_a_legacy_batch_without_flags_gets_exactly_verls_data_metrics(server, model_dir):
    batch = await legacy_step_batch(server, model_dir)
    for key in FLAG_KEYS:
        batch.non_tensor_batch.pop(key)

    metrics = ray_trainer.compute_data_metrics(batch=batch, use_critic=False)

    assert metrics == metric_utils.compute_data_metrics(batch=batch, use_critic=False)
    assert not any(key.startswith("env/") for key in metrics)


def test_the_legacy_fit_loop_builds_its_step_metrics_with_the_wired_name():
    assert "compute_data_metrics" in ray_trainer.RayPPOTrainer.fit.__code__.co_names
    assert ray_trainer.compute_data_metrics.__wrapped__ is metric_utils.compute_data_metrics
    assert trainer_base.compute_data_metrics is metric_utils.compute_data_metrics  # V1's binding stays verl's


# ---------------------------------------------------------------------------------------------------------------
# V1 trainer (PPOTrainer.fit): real trainer object, real worker, real TransferQueue and replay buffer.


class InProcessRollout:
    """Stands in for ``AgentLoopManagerTQ`` (whose workers are Ray actors): hands each batch to one real
    ``AgentLoopWorkerTQ`` in this process, on the test's event loop. Like verl's manager it returns once the batch
    is handed over; the worker stores each finished sample in TransferQueue itself."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.dispatched: list[asyncio.Task] = []

    def generate_sequences(self, prompts: TensorDict) -> None:
        self.dispatched.append(asyncio.ensure_future(self.worker.generate_sequences(prompts)))

    async def settled(self) -> None:
        await asyncio.gather(*self.dispatched)
        while self.worker.background_tasks:
            await asyncio.gather(*list(self.worker.background_tasks))


def v1_trainer(config, rollout: InProcessRollout, rows: list[dict]):
    """verl's sync-mode trainer built by its own constructor, with what ``init_workers`` would have added."""
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = PPOTrainerSync(config)
    trainer.global_steps = 1
    trainer.agent_loop_manager = rollout
    trainer.train_dataloader = StatefulDataLoader(
        dataset=rows, batch_size=config.data.train_batch_size, collate_fn=collate_fn, shuffle=False
    )
    trainer.train_dataloader_it = None
    trainer.resource_pool_manager = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={})
    return trainer


async def v1_step_metrics(
    config, rollout: InProcessRollout, tq, *, batch_multiple: int, rows: list[dict] | None = None
) -> tuple[dict, object, object]:
    """One step of ``PPOTrainer.fit`` minus its GPU stages: the metrics dict fit would log, the batch, the trainer."""
    rows = group_rows() if rows is None else rows
    trainer = v1_trainer(config, rollout, rows)
    trainer.prepare_step()  # dataloader -> uids -> prompts registered in TransferQueue -> dispatched
    await asyncio.wait_for(rollout.settled(), ROLLOUT_TIMEOUT_S)
    statuses = [tag.get("status") for tag in tq.kv_list("train")["train"].values() if tag.get("is_prompt")]
    assert statuses == ["finished"] * len(statuses) and statuses, statuses  # else sample() would wait or refill

    iteration: dict = {}
    batch, sample_metrics = trainer.replay_buffer.sample(global_steps=1, partition_id="train", batch_size=len(rows))
    iteration.update(sample_metrics)
    batch = upsample_batch_to_divisible_size(batch, batch_multiple, rollout.worker.tokenizer.eos_token_id)
    batch = trainer._compute_old_log_prob(batch, metrics=iteration)  # bypass mode: no actor needed
    batch = trainer._compute_advantage(batch, metrics=iteration)
    aggregator = MetricsAggregator()  # what step() does with each iteration's metrics
    aggregator.add_step_metrics(iteration, sample_count=sum(not tag.get("is_padding") for tag in batch.tags))
    metrics = aggregator.get_aggregated_metrics()
    trainer._compute_metrics(batch, metrics, {"step": 1.0}, global_steps=1, epoch=0)
    return metrics, batch, trainer


def tq_worker(config, policy):
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    return AgentLoopWorkerTQ.__ray_actor_class__(config, policy)


async def test_the_v1_step_metrics_carry_the_env_metrics_of_the_real_samples_only(server, model_dir, tq):
    config = trainer_config(server, model_dir, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3")
    rollout = InProcessRollout(tq_worker(config, scripted_group(server, build_chat_tokenizer())))

    metrics, batch, _ = await v1_step_metrics(config, rollout, tq, batch_multiple=4)

    assert [tag.get("is_padding", False) for tag in batch.tags].count(True) == 1  # a copy of a real sample
    assert_env_metrics(metrics)  # env/samples == 3: the padding sample is not counted
    assert metrics["critic/score/mean"] == pytest.approx(2 / 3)  # verl's own keys, in the same dict
    assert metrics["training/num_turns/mean"] > 0
    assert metrics[wiring.INVALID_FRACTION_METRIC] == pytest.approx(1 / 3)
    assert server.open_sessions == 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)  # what fit does after logging


async def test_with_the_drop_switch_on_each_dropped_rollout_counts_once_at_the_step_that_consumes_its_group(
    server, model_dir, tq
):
    drop = "+nemo_gym_browser.drop_invalid=true"
    config = trainer_config(server, model_dir, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3", drop)
    rollout = InProcessRollout(tq_worker(config, scripted_group(server, build_chat_tokenizer())))

    metrics, batch, trainer = await v1_step_metrics(config, rollout, tq, batch_multiple=4)

    real = [key for key, tag in zip(batch.keys, batch.tags, strict=True) if not tag.get("is_padding", False)]
    assert len(real) == 2  # the rollout that failed both attempts returned [], so verl stored nothing for it
    assert_env_metrics(metrics)  # the same numbers as with the switch off: the dropped rollout is counted
    assert metrics["env/dropped_count"] == 1.0
    next_step: dict = {}
    trainer._compute_metrics(batch, next_step, {"step": 1.0}, global_steps=2, epoch=0)
    assert next_step["env/dropped_count"] == 0.0 and next_step["env/invalid_rate"] == 0.0  # counted once

    # An async trainer: a group generated now is trained a step later. Its drop waits with the group.
    later = str(uuid.uuid4())
    tq.kv_put(key=later, partition_id="train", tag={"is_prompt": True, "status": "finished", "global_steps": 2})
    await dropped_rollouts.record(later, DROPPED)
    while_waiting: dict = {}
    trainer._compute_metrics(batch, while_waiting, {"step": 1.0}, global_steps=2, epoch=0)
    tq.kv_clear(keys=[later], partition_id="train")  # what the replay buffer does when it samples the group
    when_trained: dict = {}
    trainer._compute_metrics(batch, when_trained, {"step": 1.0}, global_steps=3, epoch=0)
    assert while_waiting["env/dropped_count"] == 0.0
    assert when_trained["env/dropped_count"] == 1.0 and when_trained["env/invalid/seed_failed"] == 1.0
    assert when_trained["env/failed_attempts/seed_failed"] == 2.0
    # The dropped rollout's two seeds failed before the policy could act, of four attempts with the batch's two.
    assert when_trained["env/failed_before_action_rate"] == pytest.approx(2 / 4)
    assert when_trained["env/failed_after_action/seed_failed"] == 0.0
    assert server.open_sessions == 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_validation_reports_its_dropped_rollouts_and_keeps_them_out_of_the_training_metrics(tq):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)  # _val_metrics_update reads nothing of the trainer's state
    validation, training = str(uuid.uuid4()), str(uuid.uuid4())
    for uid in (validation, validation, training):
        asyncio.run(dropped_rollouts.record(uid, DROPPED))
    survivors = {"reward": [1.0, 0.0], "env/invalid": [0.0, 0.0]}  # two of the group's four rollouts kept

    metrics = trainer._val_metrics_update(
        ["site"] * 2, [validation] * 2, survivors, [3, 3], expected_acc_counts={("site", validation): 4}
    )

    assert metrics["val-core/site/reward/mean@2"] == 0.5  # verl averages the survivors only
    assert metrics["val-aux/env/dropped_count"] == 2.0 and metrics["val-aux/env/dropped_rate"] == 0.5
    assert len(dropped_rollouts.take(waiting=set())) == 1  # the training drop is still there for training


def test_a_rollout_dropped_in_another_process_reaches_the_trainers_process(tq):
    import ray

    @ray.remote(num_cpus=0)
    def drop_one(uid: str) -> int:
        import os

        from nemo_gym_browser.trainer_side import dropped_rollouts as ledger

        asyncio.run(ledger.record(uid, DROPPED))
        return os.getpid()

    uid = str(uuid.uuid4())
    assert ray.get(drop_one.remote(uid), timeout=ROLLOUT_TIMEOUT_S) != os.getpid()

    assert dropped_rollouts.take(only={uid}) == [DROPPED]
    assert dropped_rollouts.take(only={uid}) == []


def test_a_sync_step_in_which_every_rollout_was_dropped_stops_verls_trainer(tq):
    """Why the drop switch is off by default: with it on, one step of total environment outage ends the run."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.v1.replay_buffer import ReplayBuffer

    group = str(uuid.uuid4())  # its every rollout was dropped: verl stored no trajectory for it
    tq.kv_put(key=group, partition_id="train", tag={"is_prompt": True, "status": "finished", "global_steps": 1})
    replay_buffer = ReplayBuffer(
        trainer_mode="sync",
        trainer_config=OmegaConf.create({}),
        max_off_policy_threshold=None,
        max_off_policy_strategy="drop",
        sampler_kwargs=OmegaConf.create({}),
        poll_interval=0.01,
    )
    try:
        with pytest.raises(RuntimeError, match="no materializable trajectories"):
            replay_buffer.sample(global_steps=1, partition_id="train", batch_size=1)
    finally:
        tq.kv_clear(keys=[group], partition_id="train")


async def test_a_v1_step_without_flags_gets_exactly_verls_metrics(server, model_dir, tq):
    config = trainer_config(
        server, model_dir, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3", "algorithm.adv_estimator=grpo"
    )
    worker = tq_worker(config, scripted_group(server, build_chat_tokenizer()))
    postprocess = worker._agent_loop_postprocess

    async def another_recipes_samples(output, validate, **kwargs):  # the same samples, minus the recipe's flags
        outputs = output if isinstance(output, list) else [output]
        for item in outputs:
            for key in FLAG_KEYS:
                item.extra_fields.pop(key, None)
        return await postprocess(output, validate, **kwargs)

    worker._agent_loop_postprocess = another_recipes_samples
    rollout = InProcessRollout(worker)
    metrics, batch, trainer = await v1_step_metrics(config, rollout, tq, batch_multiple=1)
    stock: dict = {}
    trainer_base.PPOTrainer._compute_metrics.__wrapped__(trainer, batch, stock, {"step": 1.0}, global_steps=1, epoch=0)

    assert not any(key.startswith("env/") for key in metrics) and wiring.INVALID_FRACTION_METRIC not in metrics
    assert set(stock) <= set(metrics)
    assert {key: metrics[key] for key in stock} == stock
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


def test_every_v1_trainer_mode_builds_its_step_metrics_with_the_wired_method():
    from verl.trainer.ppo.v1 import get_trainer_cls  # the package imports (and so registers) every mode

    wired = trainer_base.PPOTrainer._compute_metrics
    assert wired.__wrapped__.__module__ == trainer_base.__name__
    assert "_compute_metrics" in trainer_base.PPOTrainer.fit.__code__.co_names
    for mode in ("sync", "colocate_async", "separate_async"):
        assert get_trainer_cls(mode)._compute_metrics is wired, mode
        assert get_trainer_cls(mode).fit is trainer_base.PPOTrainer.fit, mode


# ---------------------------------------------------------------------------------------------------------------
# Installation


def test_install_twice_keeps_one_wrapper_around_each_metrics_function():
    def wrapped():
        return (
            ray_trainer.compute_data_metrics,
            trainer_base.PPOTrainer._compute_metrics,
            trainer_base.PPOTrainer._val_metrics_update,
        )

    before = wrapped()
    assert patches.install() is True and patches.install_on_import() is True
    after = wrapped()
    assert all(a is b for a, b in zip(before, after, strict=True))
    for wrapper in after:
        assert wrapper.__wrapped__.__module__.startswith("verl.") and not hasattr(wrapper.__wrapped__, "__wrapped__")
    assert patches.installed_targets() == list(patches.TARGETS)


@pytest.mark.parametrize(
    ("owner", "name", "replacement", "named"),
    [
        (ray_trainer, "compute_data_metrics", None, "compute_data_metrics"),
        (ray_trainer, "compute_data_metrics", lambda data: {}, "compute_data_metrics"),
        (ray_trainer.RayPPOTrainer, "fit", lambda self: None, "fit no longer calls compute_data_metrics"),
        (trainer_base.PPOTrainer, "_compute_metrics", None, "_compute_metrics"),
        (trainer_base.PPOTrainer, "_compute_metrics", lambda self, batch: None, "_compute_metrics"),
        (trainer_base.PPOTrainer, "fit", lambda self: None, "fit no longer calls _compute_metrics"),
        (trainer_base.PPOTrainer, "_val_metrics_update", lambda self, data_sources: {}, "_val_metrics_update"),
        (trainer_base.PPOTrainer, "_validate", lambda self: {}, "_validate no longer calls _val_metrics_update"),
    ],
    ids=[
        "legacy-missing",
        "legacy-new-signature",
        "legacy-fit",
        "v1-missing",
        "v1-new-signature",
        "v1-fit",
        "v1-validation-new-signature",
        "v1-validate",
    ],
)
def test_install_fails_loudly_naming_the_verl_version_when_a_metrics_function_moved(
    monkeypatch, owner, name, replacement, named
):
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(patches.PatchError, match=r"verl 0\.9\.1: .*" + named):
        patches.install()


def test_deadline_hits_and_the_judge_share_are_rates_over_the_flagged_samples():
    base = {"env_invalid": False, "env_failure_kind": None, "env_attempts": 1, "env_episode_wall_s": 2.0}
    rows = [
        {**base, "deadline_hit": True, "reward_source": "verify"},
        {**base, "deadline_hit": True, "reward_source": "judge"},
        {**base, "deadline_hit": False, "reward_source": "judge", "env_episode_wall_s": 6.0},
        {**base, "deadline_hit": False, "reward_source": "judge"},
        None,  # a sample of another agent loop
    ]

    metrics = episode_metrics(rows)

    assert metrics["env/samples"] == 4.0 and metrics["env/deadline_hit_rate"] == 0.5
    assert metrics["env/reward_source/judge"] == 0.75 and metrics["env/reward_source/verify"] == 0.25
    assert metrics["env/episode_wall_s/mean"] == 3.0 and metrics["env/episode_wall_s/max"] == 6.0


# ---------------------------------------------------------------------------------------------------------------
# Rollouts that never reached the model (every attempt failed to seed), placed first in the chunk: verl decides from
# the first sample which optional tensors a chunk carries, so each such sample must carry the generated ones' fields.

LOG_PROBS = "actor_rollout_ref.rollout.calculate_log_probs=true"


def unseedable(server, *task_ids: str) -> None:
    """Every seed of these tasks fails (the start page never loads): their rollouts never call the model."""
    server.set_rule(
        lambda seen: Fault.fail_seed() if seen.endpoint == "seed_session" and seen.task_id in task_ids else None
    )


def rows_named(*task_ids: str) -> list[dict]:
    return [
        make_row(task=f"clean: reach the About page ({task_id})", task_id=task_id, verifier_metadata=ABOUT, index=i)
        for i, task_id in enumerate(task_ids)
    ]


def debug_metrics_of(tq, batch) -> dict:
    """What ``_compute_old_log_prob`` reads and hands to ``calculate_debug_metrics`` when log-probs are on."""
    from verl.utils.debug.metrics import calculate_debug_metrics

    fields = ["responses", "rollout_log_probs", "old_log_probs", "response_mask"]
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
    return calculate_debug_metrics(DataProto(batch=data.to_padded_tensor()))


@pytest.mark.parametrize("mode", ["trajectory", "stepwise"])
@pytest.mark.parametrize("drop", [False, True])
async def test_a_v1_step_survives_a_first_rollout_that_never_reached_the_model(server, model_dir, tq, mode, drop):
    settings = [LOG_PROBS, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3"]
    if mode == "stepwise":
        settings += [
            "+nemo_gym_browser.stepwise.enabled=true",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=4",
        ]
    if drop:
        settings.append("+nemo_gym_browser.drop_invalid=true")
    config = trainer_config(server, model_dir, *settings)
    unseedable(server, "never-seeded")
    policy = sp.ScriptedPolicy(build_chat_tokenizer(), sp.walk_and_finish("About", "ALPHA-42"))
    rollout = InProcessRollout(tq_worker(config, policy))

    metrics, batch, _ = await v1_step_metrics(
        config, rollout, tq, batch_multiple=1, rows=rows_named("never-seeded", "ok-1", "ok-2")
    )

    assert metrics["env/invalid/seed_failed"] == 1.0 and metrics["env/invalid_count"] == 1.0
    assert metrics["env/dropped_count" if drop else "env/invalid_rate"] == (1.0 if drop else pytest.approx(1 / 3))
    debug = debug_metrics_of(tq, batch)  # the step that died with KeyError: 'rollout_log_probs'
    assert debug["training/rollout_probs_diff_valid"] == 1
    extra = [
        getattr(e, "data", e)
        for e in tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"])[
            "extra_fields"
        ]
    ]
    assert sum(bool(e["env_invalid"]) for e in extra) == (0 if drop else 1)
    assert server.open_sessions == 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


async def test_a_v1_step_in_which_every_rollout_failed_gives_zero_advantages_and_finite_metrics(server, model_dir, tq):
    config = trainer_config(server, model_dir, LOG_PROBS, "actor_rollout_ref.rollout.n=1", "data.train_batch_size=3")
    unseedable(server, "a", "b", "c")
    policy = sp.ScriptedPolicy(build_chat_tokenizer(), sp.walk_and_finish("About", "ALPHA-42"))
    rollout = InProcessRollout(tq_worker(config, policy))

    metrics, batch, _ = await v1_step_metrics(config, rollout, tq, batch_multiple=1, rows=rows_named("a", "b", "c"))

    assert policy.calls == 0 and metrics["env/invalid_rate"] == 1.0
    data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=["advantages"])
    advantages = data.to_padded_tensor()["advantages"]
    assert torch.isfinite(advantages).all() and not advantages.any()
    not_finite = {key for key, value in metrics.items() if isinstance(value, float) and not np.isfinite(value)}
    # verl's own means over an empty response mask are NaN (its update skips a step whose gradient is not finite)
    assert not_finite <= {
        f"critic/{name}/{stat}" for name in ("advantages", "returns") for stat in ("mean", "max", "min")
    }
    assert all(np.isfinite(value) for key, value in metrics.items() if key.startswith(("env/", "grpo_env_aware/")))
    debug_metrics_of(tq, batch)
    assert server.open_sessions == 0
    tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)


@pytest.mark.parametrize("failed", [("never-seeded",), ("never-seeded", "ok-1", "ok-2")])
async def test_legacy_post_processing_keeps_the_log_probs_when_the_first_rollouts_never_reached_the_model(
    server, model_dir, failed
):
    from verl.utils.debug.metrics import calculate_debug_metrics

    config = trainer_config(server, model_dir, LOG_PROBS, "trainer.use_v1=false", "actor_rollout_ref.rollout.n=3")
    unseedable(server, *failed)
    policy = sp.ScriptedPolicy(build_chat_tokenizer(), sp.walk_and_finish("About", "ALPHA-42"))
    worker = AgentLoopWorker(config, policy)
    rows = rows_named("never-seeded", "ok-1", "ok-2")
    prompts = DataProto(
        batch=TensorDict({"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)}, batch_size=len(rows)),
        non_tensor_batch={
            **{key: object_column([row[key] for row in rows]) for key in rows[0]},
            "uid": object_column(["group-1"] * len(rows)),  # one group: with every member failed, nothing to learn
        },
        meta_info={"global_steps": 1, "validate": False},
    )
    batch = await asyncio.wait_for(worker.generate_sequences(prompts), ROLLOUT_TIMEOUT_S)

    assert batch.batch["rollout_log_probs"].shape == batch.batch["responses"].shape
    assert batch.non_tensor_batch["env_invalid"].tolist() == [True, len(failed) > 1, len(failed) > 1]
    batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
    served = len(failed) < 3
    assert calculate_debug_metrics(batch)["training/rollout_probs_diff_valid"] == int(served)  # 0: no token to compare
    reward_tensor, _ = extract_reward(batch)
    batch.batch["token_level_rewards"] = reward_tensor
    batch = ray_trainer.compute_advantage(
        batch, adv_estimator="grpo_env_aware", num_repeat=3, norm_adv_by_std_in_grpo=True, config=config.algorithm
    )
    advantages = batch.batch["advantages"]
    assert torch.isfinite(advantages).all() and not advantages[0].any()
    if not served:  # a group where every member failed: no baseline, no signal
        assert not advantages.any()
    assert server.open_sessions == 0


@pytest.mark.parametrize("trainer_name", ["v1", "legacy"])
def test_validation_leaves_out_rollouts_the_environment_never_served_and_reports_them(trainer_name):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    if trainer_name == "v1":
        trainer = object.__new__(PPOTrainerSync)

        def update(sources, uids, infos, turns):
            return trainer._val_metrics_update(sources, uids, infos, turns, expected_acc_counts={})
    else:  # the legacy trainer: no expected counts, and the turns of each validation batch as one array
        trainer = object.__new__(ray_trainer.RayPPOTrainer)

        def update(sources, uids, infos, turns):
            return trainer._val_metrics_update(np.array(sources), uids, infos, [np.array(turns)])

    infos = {"reward": [1.0, 0.0, 0.0, 0.0], "env/invalid": [0.0, 1.0, 0.0, 1.0]}
    metrics = update(["site"] * 4, ["g1", "g1", "g2", "g2"], infos, [3, 1, 3, 1])
    every_attempt_failed = update(["site"] * 2, ["g", "g"], {"reward": [0.0, 0.0], "env/invalid": [1.0, 1.0]}, [1, 1])

    assert metrics["val-core/site/reward/mean@1"] == 0.5  # the two served rollouts, not 1 / 4
    assert metrics["val-aux/env/invalid_count"] == 2.0 and metrics["val-aux/env/left_out_rate"] == 0.5
    assert not any(key.startswith("val-core/") for key in every_attempt_failed)  # reported, not scored as 0
    assert every_attempt_failed["val-aux/env/invalid_count"] == 2.0
