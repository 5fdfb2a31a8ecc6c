"""The loop's flags and metrics through verl 0.9.1's own worker, post-processing and metric aggregation.

A real ``AgentLoopWorker`` (not a Ray actor, otherwise unchanged) is built from verl's composed config with the
recipe's YAML files: it registers ``nemo_gym_browser_agent`` from ``configs/agent_loop.yaml``, loads the tools
from ``configs/browser_tool.yaml``, reads the environment URL from the trainer config section
``nemo_gym_browser`` (a command-line override), runs the rows and turns the outputs into a ``DataProto`` with
its own ``_postprocess``.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker
from verl.protocol import DataProto
from verl.trainer.ppo.ray_trainer import RayPPOTrainer
from verl.trainer.ppo.reward import extract_reward
from verl.trainer.ppo.v1 import agent_loop_tq
from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

from nemo_gym_browser.local import scripted_policy as sp
from nemo_gym_browser.local.chat_tokenizer import build_chat_tokenizer
from nemo_gym_browser.local.environment_server.site_model import BUNDLED_ROOT
from nemo_gym_browser.local.faults.kinds import Fault
from nemo_gym_browser.local.in_process_loop import build_loop, compose_trainer_config, load_tools, make_row
from nemo_gym_browser.trainer_side.episode_metrics import episode_metrics, metrics_from_columns

ABOUT = {"url_contains": "about.html"}


def batch_of(rows: list[dict], uid: str = "group-1") -> DataProto:
    columns = {}
    for key in rows[0]:
        column = np.empty(len(rows), dtype=object)
        column[:] = [row[key] for row in rows]
        columns[key] = column
    columns["uid"] = np.array([uid] * len(rows), dtype=object)
    tensors = TensorDict({"dummy_tensor": torch.zeros(len(rows), 1, dtype=torch.uint8)}, batch_size=len(rows))
    return DataProto(batch=tensors, non_tensor_batch=columns, meta_info={"global_steps": 1, "validate": False})


async def run_group(server, model_dir) -> DataProto:
    """Three samples of one prompt group: one clean, one failing every attempt, one recovering on its second."""
    tokenizer = build_chat_tokenizer()
    config = compose_trainer_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"+nemo_gym_browser.environment.server_urls='{server.url}'",
            "+nemo_gym_browser.resample_backoff_s=0",
            "+nemo_gym_browser.max_attempts=2",
            "+nemo_gym_browser.resume.max_per_episode=0",  # failures re-run, as these flags count them
        ]
    )
    scripts = {
        "clean": sp.walk_and_finish("About", "ALPHA-42"),
        "broken": sp.steps(sp.observe(), sp.type_into("nothing", "x")),
        "flaky": sp.steps(sp.observe(), sp.navigate(BUNDLED_ROOT + "site/about.html"), sp.finish("ok")),
    }
    worker = AgentLoopWorker(config, sp.ScriptedPolicy(tokenizer, scripts))
    server.inject("browser_type", Fault.status(503))  # every attempt of "broken"
    server.inject("browser_navigate", Fault.status(503), on_call=1)  # the first attempt of "flaky"
    rows = [make_row(task=f"{name}: reach the About page", verifier_metadata=ABOUT) for name in scripts]
    return await worker.generate_sequences(batch_of(rows))


async def test_the_flags_arrive_in_non_tensor_batch_through_verls_worker_and_post_processing(server, model_dir):
    output = await run_group(server, model_dir)

    columns = output.non_tensor_batch
    assert columns["env_invalid"].tolist() == [False, True, False]
    assert columns["env_failure_kind"].tolist() == [None, "server_error", None]
    assert columns["env_attempts"].tolist() == [1, 2, 2]
    assert columns["deadline_hit"].tolist() == [False, False, False]
    assert columns["reward_source"].tolist() == ["verify", None, "verify"]
    assert columns["env_failure_reason"][1].startswith("session ")
    assert columns["env_failed_attempt_kinds"].tolist() == [[], ["server_error", "server_error"], ["server_error"]]
    # Rewards come from the loop (verl's reward function is skipped); the invalid sample is out of the loss.
    assert output.batch["rm_scores"].sum(-1).tolist() == [1.0, 0.0, 1.0]
    response_tokens = output.batch["response_mask"].sum(-1).tolist()
    assert response_tokens[1] == 0 and response_tokens[0] > 0 and response_tokens[2] > 0
    assert server.open_sessions == 0


async def test_verls_validation_metrics_average_the_flags(server, model_dir):
    output = await run_group(server, model_dir)

    # Exactly what RayPPOTrainer._validate does with a generated batch (both trainers share the aggregation), with
    # verl's own method: the recipe's wrapper, when a test module installed it, leaves the flagged sample out.
    reward_tensor, reward_extra_info = extract_reward(output)
    infos = {"reward": reward_tensor.sum(-1).tolist()}
    infos.update({key: np.asarray(values).tolist() for key, values in reward_extra_info.items()})
    verls = inspect.unwrap(RayPPOTrainer._val_metrics_update)
    metrics = verls(None, output.non_tensor_batch["data_source"], list(output.non_tensor_batch["uid"]), infos, [])

    assert output.meta_info["reward_extra_keys"][:2] == ["env/invalid", "env/attempts"]
    assert metrics["val-aux/nemo_gym/env/invalid/mean@3"] == pytest.approx(1 / 3)
    assert metrics["val-aux/nemo_gym/env/attempts/mean@3"] == pytest.approx(5 / 3)
    assert metrics["val-aux/nemo_gym/env/reward_from_verify/mean@3"] == pytest.approx(2 / 3)
    assert metrics["val-core/nemo_gym/reward/mean@3"] == pytest.approx(2 / 3)


async def test_the_step_metrics_count_invalid_rollouts_failure_kinds_and_attempts(server, model_dir):
    output = await run_group(server, model_dir)

    metrics = metrics_from_columns(output.non_tensor_batch)

    assert metrics["env/invalid_rate"] == pytest.approx(1 / 3)
    assert metrics["env/resampled_rate"] == pytest.approx(2 / 3)
    assert metrics["env/recovered_rate"] == pytest.approx(1 / 3)
    assert metrics["env/attempts/mean"] == pytest.approx(5 / 3) and metrics["env/attempts/max"] == 2.0
    assert metrics["env/failed_attempts/server_error"] == 3.0
    assert metrics["env/invalid/server_error"] == 1.0 and metrics["env/invalid/timeout"] == 0.0
    assert metrics["env/reward_source/verify"] == pytest.approx(2 / 3)
    assert metrics["env/deadline_hit_rate"] == 0.0
    assert 0.0 < metrics["env/episode_wall_s/mean"] <= metrics["env/episode_wall_s/max"]


async def test_verls_timing_metrics_include_the_work_of_every_attempt(server, model_dir):
    output = await run_group(server, model_dir)

    timing = AgentLoopManager._performance_metrics(None, [output.meta_info["metrics"]], output)

    per_sample = output.meta_info["metrics"]
    assert all(sample["tool_calls"] > 0 for sample in per_sample)
    assert timing["agent_loop/tool_calls/max"] == max(sample["tool_calls"] for sample in per_sample)


def test_episode_metrics_skip_samples_of_other_agent_loops_and_are_empty_without_flags():
    row = {
        "env_invalid": True,
        "env_failure_kind": "timeout",
        "env_attempts": 3,
        "deadline_hit": False,
        "reward_source": None,
        "env_failed_attempt_kinds": ["timeout", "unreachable", "timeout"],
        "env_episode_wall_s": 4.0,
        "env_refused_navigations": 2,
        "env_browser_actions": 3,
    }
    answered_at_once = {**row, "env_invalid": False, "env_attempts": 1, "env_browser_actions": 0}

    both = episode_metrics([row, answered_at_once])
    assert both["env/browsed_rate"] == 0.5 and both["env/browser_actions/mean"] == 1.5
    metrics = episode_metrics([row, None, {"other": 1}])

    assert metrics["env/samples"] == 1.0 and metrics["env/invalid_rate"] == 1.0
    assert metrics["env/failed_attempts/timeout"] == 2.0 and metrics["env/failed_attempts/unreachable"] == 1.0
    assert metrics["env/invalid/timeout"] == 1.0 and metrics["env/recovered_rate"] == 0.0
    assert metrics["env/refused_navigations/mean"] == 2.0
    assert episode_metrics([{"other": 1}]) == {}
    assert metrics_from_columns({"reward": np.array([1.0])}) == {}


async def test_the_v1_workers_post_processing_stores_flagged_samples_and_skips_dropped_ones(
    server, model_dir, monkeypatch
):
    tokenizer = build_chat_tokenizer()
    config = compose_trainer_config(
        overrides=[
            f"actor_rollout_ref.model.path={model_dir}",
            f"+nemo_gym_browser.environment.server_urls='{server.url}'",
        ]
    )
    worker = AgentLoopWorker(config, None)  # provides the helpers the V1 post-processing calls on itself
    v1_postprocess = AgentLoopWorkerTQ.__ray_metadata__.modified_class._agent_loop_postprocess
    stored = []

    async def kv_batch_put(*, keys, fields, tags, partition_id):
        stored.append((keys, fields, tags))

    monkeypatch.setattr(agent_loop_tq.tq, "async_kv_batch_put", kv_batch_put)
    server.inject("seed_session", Fault.fail_seed(), on_call=2, times=10)  # every seed but the first fails
    tools = load_tools()

    async def v1_sample(session_id: int, **settings):
        row = {**make_row(task="go to About", verifier_metadata=ABOUT), "uid": "uid-9", "global_steps": 4}
        loop = build_loop(
            sp.ScriptedPolicy(tokenizer, sp.walk_and_finish("About", "x")),
            tokenizer=tokenizer,
            tools=tools,
            trainer_config=config,
            resample_backoff_s=0,
            max_attempts=2,
            **settings,
        )
        output = await loop.run({}, **row, session_id=session_id)
        await v1_postprocess(worker, output, False, **row, session_id=session_id)
        return output

    clean = await v1_sample(0)
    flagged = await v1_sample(1, drop_invalid=False)
    dropped = await v1_sample(2, drop_invalid=True)

    assert clean.reward_score == 1.0 and flagged.extra_fields["env_invalid"] is True and dropped == []
    assert [keys for keys, _, _ in stored] == [["uid-9_0_0"], ["uid-9_1_0"]]  # nothing stored for the dropped one
    extra = [fields["extra_fields"][0] for _, fields, _ in stored]
    extra = [getattr(item, "data", item) for item in extra]
    assert [e["env_invalid"] for e in extra] == [False, True]
    assert [e["env_failure_kind"] for e in extra] == [None, "seed_failed"]
    assert [e["reward_extra_info"]["env/invalid"] for e in extra] == [0.0, 1.0]
    # The weight-version tags the V1 trainer turns into integers are set even when no model call happened.
    assert [(t[0]["min_global_steps"], t[0]["max_global_steps"]) for _, _, t in stored] == [(0, 0), (4, 4)]
    rewards = [fields["rm_scores"][0] for _, fields, _ in stored]
    assert [float(r.sum()) for r in rewards] == [1.0, 0.0]
    assert server.open_sessions == 0
