"""The recipe's wiring, exercised through verl's own trainer functions (legacy and V1, real TransferQueue)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl import DataProto
from verl.trainer.ppo import core_algos, ray_trainer
from verl.trainer.ppo.v1 import trainer_base
from verl.trainer.ppo.v1 import utils as v1_utils

from nemo_gym_browser import patches
from nemo_gym_browser.trainer_side import wiring

ROOT = Path(__file__).resolve().parents[1]
SUBPROCESS_TIMEOUT_S = 300
STOCK_ESTIMATORS = ["gae", "grpo", "grpo_vectorized", "rloo", "reinforce_plus_plus", "grpo_passk"]
LOOPBACK_ONLY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
ALGORITHM = {"gamma": 1.0, "lam": 0.95, "use_pf_ppo": False, "norm_adv_by_std_in_grpo": True}


@pytest.fixture(scope="module", autouse=True)
def installed():
    assert patches.install() is True
    return patches


def object_column(values: list) -> np.ndarray:
    """A non_tensor_batch column as verl's agent-loop manager builds one from extra_fields."""
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def legacy_batch(scores: list[float], uids: list[str], flags: list | None = None, *, length: int = 4) -> DataProto:
    generator = torch.Generator().manual_seed(len(scores))
    mask = torch.ones(len(scores), length, dtype=torch.int64)
    mask[:, -1] = (torch.rand(len(scores), generator=generator) < 0.5).long()  # some responses end early
    rewards = torch.zeros(len(scores), length)
    last = mask.sum(-1) - 1
    rewards[torch.arange(len(scores)), last] = torch.tensor(scores)
    non_tensors = {"uid": object_column(uids)}
    if flags is not None:
        non_tensors["env_invalid"] = object_column(flags)
    return DataProto.from_dict(
        tensors={
            "token_level_rewards": rewards,
            "response_mask": mask,
            "values": torch.randn(len(scores), length, generator=generator),
        },
        non_tensors=non_tensors,
    )


def scalar_advantages(data: DataProto) -> torch.Tensor:
    return data.batch["advantages"][:, 0]


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Legacy trainer: ray_trainer.compute_advantage, the name RayPPOTrainer.fit calls.


def test_legacy_compute_advantage_keeps_an_invalid_sample_out_of_its_groups_baseline():
    data = legacy_batch([1.0, 1.0, 0.0, 0.0], ["p"] * 4, [False, True, False, False])
    stock = ray_trainer.compute_advantage.__wrapped__(
        legacy_batch([1.0, 1.0, 0.0, 0.0], ["p"] * 4), adv_estimator="grpo", norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(scalar_advantages(stock), torch.tensor([0.5, 0.5, -0.5, -0.5]))  # the zero counts
    out = ray_trainer.compute_advantage(data, adv_estimator="grpo", norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(scalar_advantages(out), torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))
    assert torch.equal(out.batch["advantages"], out.batch["returns"])
    assert torch.equal(out.batch["advantages"], out.batch["advantages"] * out.batch["response_mask"])


def test_legacy_flagged_batch_with_std_normalisation_uses_only_valid_members():
    data = legacy_batch([1.0, 1.0, 0.0, 0.0, 0.5, 0.2], ["p"] * 4 + ["q"] * 2, [False, True, False, False, None, True])
    out = ray_trainer.compute_advantage(data, adv_estimator=core_algos.AdvantageEstimator.GRPO)
    valid = torch.tensor([1.0, 0.0, 0.0])
    expected = (valid - valid.mean()) / (valid.std() + 1e-6)
    torch.testing.assert_close(scalar_advantages(out)[[0, 2, 3]], expected)
    assert scalar_advantages(out)[[1, 4, 5]].tolist() == [0.0, 0.0, 0.0]  # invalid; q keeps one valid sample


def test_legacy_explicit_grpo_env_aware_estimator_works_with_and_without_flags():
    flagged = legacy_batch([1.0, 1.0, 0.0, 0.0], ["p"] * 4, [False, True, False, False])
    out = ray_trainer.compute_advantage(
        flagged, adv_estimator="grpo_env_aware", norm_adv_by_std_in_grpo=False, config=OmegaConf.create(ALGORITHM)
    )
    torch.testing.assert_close(scalar_advantages(out), torch.tensor([2 / 3, 0.0, -1 / 3, -1 / 3]))

    # No flags: verl's generic estimator call (which passes config, not norm_adv_by_std_in_grpo) reaches it.
    plain = legacy_batch([1.0, 0.0, 0.0, 0.7], ["p", "p", "p", "lone"])
    config = OmegaConf.create({**ALGORITHM, "norm_adv_by_std_in_grpo": False})
    out = ray_trainer.compute_advantage(plain, adv_estimator="grpo_env_aware", config=config)
    torch.testing.assert_close(scalar_advantages(out), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0]))


def test_legacy_flags_on_a_non_grpo_estimator_change_nothing():
    config = OmegaConf.create(ALGORITHM)
    flagged = legacy_batch([1.0, 1.0, 0.0, 0.0], ["p"] * 4, [False, True, False, False])
    stock = ray_trainer.compute_advantage.__wrapped__(
        legacy_batch([1.0, 1.0, 0.0, 0.0], ["p"] * 4), adv_estimator="rloo", config=config
    )
    out = ray_trainer.compute_advantage(flagged, adv_estimator="rloo", config=config)
    assert torch.equal(out.batch["advantages"], stock.batch["advantages"])


def test_legacy_missing_response_mask_is_derived_as_verl_does():
    data = legacy_batch([1.0, 0.0], ["p", "p"], [False, False])
    expected = data.batch.pop("response_mask")
    prompt = torch.ones(2, 3, dtype=torch.int64)
    data.batch["responses"] = torch.ones_like(expected)
    data.batch["attention_mask"] = torch.cat([prompt, expected], dim=1)
    out = ray_trainer.compute_advantage(data, adv_estimator="grpo")
    assert torch.equal(out.batch["response_mask"], expected)
    assert torch.count_nonzero(out.batch["advantages"] * (1 - expected)) == 0


# ---------------------------------------------------------------------------------------------------------------
# Unflagged batches: the same tensors as stock verl, computed in a process where the recipe is switched off.

STOCK_SCRIPT = textwrap.dedent(
    """
    import sys, torch
    from omegaconf import OmegaConf
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import utils as v1_utils
    from nemo_gym_browser import patches

    assert patches.install() is False and patches.install_on_import() is False
    assert patches.installed_targets() == [], patches.installed_targets()
    cases = torch.load(sys.argv[1], weights_only=False)
    results = {}
    for name, case in cases.items():
        data = DataProto.from_dict(tensors=case["tensors"], non_tensors=case["non_tensors"])
        config = OmegaConf.create(case["config"])
        if case.get("batch_keys"):
            out = v1_utils.compute_advantage_for_multi_trajectories(
                data, batch_keys=case["batch_keys"], adv_estimator=case["estimator"], config=config
            )
        else:
            out = ray_trainer.compute_advantage(data, adv_estimator=case["estimator"], config=config)
        results[name] = {"advantages": out.batch["advantages"], "returns": out.batch["returns"]}
    try:  # the recipe's explicit estimator where its wiring is off: must not run silently
        ray_trainer.compute_advantage(data, adv_estimator="grpo_env_aware", config=config)
        results["explicit-estimator-without-wiring"] = "ran"
    except ValueError as exc:
        results["explicit-estimator-without-wiring"] = str(exc)
    torch.save(results, sys.argv[2])
    """
)


def multi_output_keys(n: int) -> list[str]:
    """V1 keys ``{uid}_{session}_{index}`` for prompts of 6 rows: session 0 stored two outputs, sessions 1-4 one."""
    layout = [(0, 0), (0, 1), (1, 0), (2, 0), (3, 0), (4, 0)]
    return [f"u{row // 6}_{layout[row % 6][0]}_{layout[row % 6][1]}" for row in range(n)]


def stock_cases() -> dict[str, dict]:
    generator = torch.Generator().manual_seed(3)
    n, length = 48, 6
    uids = object_column([f"u{i // 6}" for i in range(n)])
    mask = (torch.rand(n, length, generator=generator) < 0.9).long()
    mask[:, 0] = 1
    rewards = torch.zeros(n, length)
    rewards[torch.arange(n), mask.sum(-1) - 1] = torch.rand(n, generator=generator)
    tensors = {"token_level_rewards": rewards, "response_mask": mask, "values": torch.randn(n, length)}
    cases = {
        name: {"tensors": tensors, "non_tensors": {"uid": uids}, "config": ALGORITHM, "estimator": name}
        for name in STOCK_ESTIMATORS
    }
    cases["rloo-with-flags"] = {
        "tensors": tensors,
        "non_tensors": {"uid": uids, "env_invalid": object_column([i % 5 == 0 for i in range(n)])},
        "config": ALGORITHM,
        "estimator": "rloo",
    }
    cases["v1-multi-output-sessions"] = {
        "tensors": tensors,
        "non_tensors": {"uid": uids},
        "config": ALGORITHM,
        "estimator": "grpo",
        "batch_keys": multi_output_keys(n),
    }
    return cases


@pytest.fixture(scope="module")
def stock_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stock")
    cases = stock_cases()
    torch.save(cases, folder / "cases.pt")
    env = {**os.environ, wiring.PATCHES_ENV: "0"}
    completed = subprocess.run(
        [sys.executable, "-c", STOCK_SCRIPT, str(folder / "cases.pt"), str(folder / "results.pt")],
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    return cases, torch.load(folder / "results.pt", weights_only=False)


@pytest.mark.parametrize("name", [*STOCK_ESTIMATORS, "rloo-with-flags", "v1-multi-output-sessions"])
def test_unflagged_batches_and_other_estimators_give_stock_verls_tensors_bit_for_bit(stock_results, name):
    cases, results = stock_results
    case = cases[name]
    data = DataProto.from_dict(tensors=dict(case["tensors"]), non_tensors=dict(case["non_tensors"]))
    config = OmegaConf.create(case["config"])
    if case.get("batch_keys"):
        out = v1_utils.compute_advantage_for_multi_trajectories(
            data, batch_keys=case["batch_keys"], adv_estimator=case["estimator"], config=config
        )
    else:
        out = ray_trainer.compute_advantage(data, adv_estimator=case["estimator"], config=config)
    for key in ("advantages", "returns"):
        assert torch.equal(bits(out.batch[key]), bits(results[name][key])), key


def test_the_explicit_estimator_fails_loudly_in_a_process_without_the_wiring(stock_results):
    _, results = stock_results
    assert results["explicit-estimator-without-wiring"] == "Unknown advantage estimator simply: grpo_env_aware"


# ---------------------------------------------------------------------------------------------------------------
# Installation behaviour


def test_install_is_idempotent_and_every_binding_shares_one_wrapper():
    before = (
        ray_trainer.compute_advantage,
        v1_utils.compute_advantage,
        v1_utils.compute_advantage_for_multi_trajectories,
        trainer_base.compute_advantage_for_multi_trajectories,
        trainer_base.PPOTrainer._compute_advantage,
    )
    assert patches.install() is True
    assert patches.install_on_import() is True
    after = (
        ray_trainer.compute_advantage,
        v1_utils.compute_advantage,
        v1_utils.compute_advantage_for_multi_trajectories,
        trainer_base.compute_advantage_for_multi_trajectories,
        trainer_base.PPOTrainer._compute_advantage,
    )
    assert all(a is b for a, b in zip(before, after, strict=True))
    assert v1_utils.compute_advantage is ray_trainer.compute_advantage
    assert trainer_base.compute_advantage_for_multi_trajectories is v1_utils.compute_advantage_for_multi_trajectories
    for wrapper in after:  # one layer deep, around verl's own function
        assert wrapper.__wrapped__.__module__.startswith("verl.")
        assert not hasattr(wrapper.__wrapped__, "__wrapped__")
    assert patches.installed_targets() == list(patches.TARGETS)
    assert sum(finder.__class__.__name__ == "_PostImportFinder" for finder in sys.meta_path) == 1


def test_every_trainer_mode_inherits_the_wired_v1_method():
    from verl.trainer.ppo.v1 import get_trainer_cls  # the package imports (and so registers) every mode

    for mode in ("sync", "colocate_async", "separate_async"):
        assert get_trainer_cls(mode)._compute_advantage is trainer_base.PPOTrainer._compute_advantage


@pytest.mark.parametrize(
    "breakage",
    [
        (ray_trainer, "compute_advantage", None),
        (ray_trainer, "compute_advantage", lambda data: data),
        (v1_utils, "compute_advantage_for_multi_trajectories", lambda data, batch_keys, adv_estimator: data),
        (trainer_base.PPOTrainer, "_compute_advantage", lambda self, batch, metrics: batch),
    ],
    ids=["missing", "new-signature", "no-longer-calls-compute_advantage", "no-longer-calls-multi-trajectories"],
)
def test_install_fails_loudly_naming_the_verl_version_when_verl_changed(monkeypatch, breakage):
    owner, name, replacement = breakage
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(patches.PatchError, match=r"verl 0\.9\.1: .*" + name):
        patches.install()


# The loggers of the wiring: installing it (patches) and what the wrappers do (trainer_wrappers).
LOGGERS = ("LOG nemo_gym_browser.patches ", "LOG nemo_gym_browser.trainer_side.trainer_wrappers ")
LOG_ONCE_SCRIPT = textwrap.dedent(
    """
    import logging
    logging.basicConfig(level=logging.INFO, format="LOG %(name)s %(message)s")
    import numpy as np, torch
    from nemo_gym_browser import patches
    assert patches.install_on_import()
    from verl import DataProto
    from verl.trainer.ppo import ray_trainer
    from verl.trainer.ppo.v1 import trainer_base  # the hook patches core_algos, ray_trainer, v1.utils, trainer_base
    assert patches.installed_targets() == list(patches.TARGETS), patches.installed_targets()
    for _ in range(3):
        assert patches.install() and patches.install_on_import()
    for _ in range(2):
        flagged = DataProto.from_dict(
            tensors={"token_level_rewards": torch.ones(2, 3), "response_mask": torch.ones(2, 3)},
            non_tensors={"uid": np.array(["a", "a"], dtype=object), "env_invalid": np.array([True, False])},
        )
        ray_trainer.compute_advantage(flagged, adv_estimator="rloo")
    print("OK")
    """
)


def test_the_import_hook_patches_each_module_once_and_logs_once_per_module():
    completed = subprocess.run(
        [sys.executable, "-c", LOG_ONCE_SCRIPT],
        env={**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "none"},
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.strip().endswith("OK")
    lines = [line for line in completed.stderr.splitlines() if line.startswith(LOGGERS)]
    patched = [line for line in lines if "patched" in line]
    assert [line.split()[4] for line in patched] == list(patches.TARGETS)
    assert all("verl 0.9.1" in line for line in patched)
    ignored = [line for line in lines if "flags ignored" in line]
    assert len(ignored) == 1 and "rloo" in ignored[0]
    assert len(lines) == len(patches.TARGETS) + 1, lines


# ---------------------------------------------------------------------------------------------------------------
# V1 trainer: verl's real PPOTrainer._compute_advantage over a real (local) TransferQueue, fed by verl's own
# AgentLoopWorkerTQ._agent_loop_postprocess. Only the surrounding fit loop (GPU workers) is not run.


def agent_loop_worker():
    """verl's AgentLoopWorkerTQ without its Ray actor and servers: only what _agent_loop_postprocess touches."""
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    worker = object.__new__(AgentLoopWorkerTQ.__ray_actor_class__)
    worker.reward_loop_worker_handles = None  # rewards are set on the outputs, as the browser loop does
    worker.processor = None
    worker.distillation_enabled = False
    return worker


def output(reward: float, extra_fields: dict, *, masked: bool = False):
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    return AgentLoopOutput(
        prompt_ids=[1, 2, 3],
        response_ids=[4, 5, 6, 7],
        response_mask=[0, 0, 0, 0] if masked else [1, 1, 0, 1],  # a tool token in the middle
        reward_score=reward,
        num_turns=2,
        metrics=AgentLoopMetrics(),
        extra_fields=dict(extra_fields, min_global_steps=1, max_global_steps=1),
    )


def flags(invalid: bool) -> dict:
    return {
        "env_invalid": invalid,
        "env_failure_kind": "session_lost" if invalid else None,
        "env_attempts": 1,
        "reward_extra_info": {},
    }


def put_group(uid: str, sessions: list) -> list[str]:
    """Store one prompt's sessions the way the V1 agent-loop worker does; returns the keys written."""
    worker = agent_loop_worker()
    for session_id, result in enumerate(sessions):
        asyncio.run(
            worker._agent_loop_postprocess(result, validate=False, uid=uid, session_id=session_id, global_steps=1)
        )
    return [
        f"{uid}_{session_id}_{index}"
        for session_id, result in enumerate(sessions)
        for index in range(len(result) if isinstance(result, list) else 1)
    ]


def v1_trainer(adv_estimator: str = "grpo", norm: bool = False):
    from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

    trainer = object.__new__(PPOTrainerSync)
    trainer.config = OmegaConf.create(
        {
            "algorithm": {
                "adv_estimator": adv_estimator,
                "gamma": 1.0,
                "lam": 1.0,
                "norm_adv_by_std_in_grpo": norm,
                "use_kl_in_reward": False,
            },
            "actor_rollout_ref": {"rollout": {"n": 4}},
        }
    )
    return trainer


def run_v1(tq, keys: list[str], trainer, *, stock: bool = False) -> tuple[dict[str, float], dict]:
    from transfer_queue import KVBatchMeta

    batch = KVBatchMeta(keys=list(keys), tags=[{"status": "success"} for _ in keys], partition_id="train")
    metrics: dict = {}
    method = trainer_base.PPOTrainer._compute_advantage
    (method.__wrapped__ if stock else method)(trainer, batch, metrics=metrics)
    stored = tq.kv_batch_get(keys=list(keys), partition_id="train", select_fields=["advantages", "response_mask"])
    advantages = stored.get("advantages").unbind()
    masks = stored.get("response_mask").unbind()
    values = {}
    for key, advantage, mask in zip(keys, advantages, masks, strict=True):
        assert torch.equal(advantage, advantage * mask)  # nothing outside the response mask
        values[key] = float(advantage[mask.bool()][0]) if mask.any() else 0.0
    return values, metrics


def new_uid() -> str:
    return uuid.uuid4().hex


def test_v1_stores_extra_fields_as_one_transfer_queue_field_holding_a_dict_per_sample(tq):
    uid = new_uid()
    keys = put_group(uid, [output(1.0, flags(False)), output(0.0, flags(True))])
    as_field = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["env_invalid"])
    assert "env_invalid" not in as_field.keys()
    stored = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["extra_fields"])
    assert [entry["env_invalid"] for entry in stored.get("extra_fields").tolist()] == [False, True]


def test_v1_compute_advantage_keeps_an_invalid_sample_out_of_its_groups_baseline(tq):
    uid = new_uid()
    keys = put_group(
        uid,
        [
            output(1.0, flags(False)),
            output(0.0, flags(True), masked=True),
            output(0.0, flags(False)),
            output(0.0, flags(False)),
        ],
    )
    values, metrics = run_v1(tq, keys, v1_trainer())
    assert [round(values[key], 5) for key in keys] == [0.66667, 0.0, -0.33333, -0.33333]
    assert metrics[wiring.INVALID_FRACTION_METRIC] == 0.25


def test_v1_advantage_log_records_every_samples_group_flag_score_and_advantage(tq, tmp_path, monkeypatch):
    log = tmp_path / "advantages.jsonl"
    monkeypatch.setenv(wiring.ADVANTAGE_LOG_ENV, str(log))
    uid = new_uid()
    keys = put_group(
        uid,
        [
            output(1.0, flags(False)),
            output(0.0, flags(True), masked=True),
            output(0.0, flags(False)),
            output(0.0, flags(False)),
        ],
    )
    trainer = v1_trainer()
    trainer.global_steps = 7
    values, _ = run_v1(tq, keys, trainer)
    (record,) = [json.loads(line) for line in log.read_text().splitlines()]
    assert record["step"] == 7
    assert [s["key"] for s in record["samples"]] == keys
    assert {s["uid"] for s in record["samples"]} == {uid}
    assert [s["env_invalid"] for s in record["samples"]] == [False, True, False, False]
    assert [s["score"] for s in record["samples"]] == [1.0, 0.0, 0.0, 0.0]
    assert [s["response_tokens"] for s in record["samples"]] == [3, 0, 3, 3]
    assert [s["advantage"] for s in record["samples"]] == pytest.approx([values[key] for key in keys])
    assert [round(s["advantage"], 5) for s in record["samples"]] == [0.66667, 0.0, -0.33333, -0.33333]


def test_v1_multi_output_sessions_still_broadcast_the_final_outputs_advantage(tq):
    uid = new_uid()
    keys = put_group(
        uid,
        [
            [output(0.0, flags(False)), output(1.0, flags(False))],  # one session, two stored outputs
            output(0.0, flags(False)),
            output(1.0, flags(True), masked=True),
            output(0.0, flags(False)),
        ],
    )
    assert keys[:2] == [f"{uid}_0_0", f"{uid}_0_1"]
    for adv_estimator in ("grpo", "grpo_env_aware"):
        values, _ = run_v1(tq, keys, v1_trainer(adv_estimator))
        # valid final outputs: 1, 0, 0 -> mean 1/3; the first output of session 0 takes its session's advantage
        assert round(values[keys[0]], 5) == round(values[keys[1]], 5) == 0.66667, adv_estimator
        assert [round(values[key], 5) for key in keys[2:]] == [-0.33333, 0.0, -0.33333], adv_estimator


def test_v1_drop_switch_leaves_a_lone_survivor_its_raw_reward_under_stock_grpo_and_zero_with_the_recipe(tq):
    lone, pair = new_uid(), new_uid()
    # NEMO_GYM_BROWSER_DROP_INVALID=1: an invalid rollout returns [] and verl stores nothing for it.
    lone_keys = put_group(lone, [[], [], output(1.0, flags(False)), []])
    pair_keys = put_group(pair, [output(1.0, flags(False)), [], output(0.0, flags(False)), []])
    assert lone_keys == [f"{lone}_2_0"] and pair_keys == [f"{pair}_0_0", f"{pair}_2_0"]
    keys = lone_keys + pair_keys
    for norm in (True, False):
        stock, _ = run_v1(tq, keys, v1_trainer(norm=norm), stock=True)
        ours, _ = run_v1(tq, keys, v1_trainer(norm=norm))
        assert stock[lone_keys[0]] == pytest.approx(1.0, abs=1e-5)  # raw reward as advantage
        assert ours[lone_keys[0]] == 0.0
        assert [stock[key] for key in pair_keys] == [ours[key] for key in pair_keys]  # survivors' GRPO unchanged
        assert ours[pair_keys[0]] > 0 > ours[pair_keys[1]]


def test_v1_batch_without_flags_is_computed_by_stock_verl_untouched(tq):
    uid = new_uid()
    plain = {"turn_scores": [], "reward_extra_info": {}}  # another agent loop: no env_invalid anywhere
    keys = put_group(uid, [output(1.0, plain), output(0.0, plain), output(0.5, plain), output(0.0, plain)])
    for norm in (True, False):
        stock, _ = run_v1(tq, keys, v1_trainer(norm=norm), stock=True)
        ours, metrics = run_v1(tq, keys, v1_trainer(norm=norm))
        assert stock == ours
        assert wiring.INVALID_FRACTION_METRIC not in metrics


def test_v1_flags_on_a_non_grpo_estimator_change_nothing(tq):
    uid = new_uid()
    keys = put_group(uid, [output(1.0, flags(False)), output(0.0, flags(True)), output(0.5, flags(False))])
    stock, _ = run_v1(tq, keys, v1_trainer("rloo"), stock=True)
    ours, metrics = run_v1(tq, keys, v1_trainer("rloo"))
    assert stock == ours
    assert wiring.INVALID_FRACTION_METRIC not in metrics


def test_a_ray_worker_with_the_recipe_folder_on_its_pythonpath_is_wired_by_sitecustomize(tq, tmp_path):
    import ray

    folder = tmp_path / "recipe"
    folder.mkdir()
    for source in ROOT.glob("*.py"):
        shutil.copy(source, folder / source.name)

    @ray.remote(num_cpus=0)
    def wiring_in_worker() -> dict:
        import sys

        from verl.trainer.ppo.v1 import trainer_base  # noqa: F401  (what TaskRunnerV1 imports)

        import sitecustomize

        return {
            "sitecustomize": sitecustomize.__file__,
            "targets": sys.modules["nemo_gym_browser.patches"].installed_targets(),
        }

    env = {"PYTHONPATH": str(folder), "VERL_USE_EXTERNAL_PLUGINS": "none", LOOPBACK_ONLY_ENV: "0"}
    state = ray.get(wiring_in_worker.options(runtime_env={"env_vars": env}).remote(), timeout=SUBPROCESS_TIMEOUT_S)
    assert state["sitecustomize"] == str(folder / "sitecustomize.py")
    assert state["targets"] == list(patches.TARGETS)


def test_stock_grpo_counts_each_stepwise_episode_once_in_its_group_baseline(stock_results):
    """What the stock arm of the step-wise learning benchmark trains with: verl's V1 GRPO, recipe off, takes each
    session's final sample as the episode and gives its advantage to every step sample of the session, so an episode
    of two steps weighs in the baseline as much as one of a single step (the recipe's estimator does the same)."""
    cases, results = stock_results
    case = cases["v1-multi-output-sessions"]
    scores = case["tensors"]["token_level_rewards"].sum(-1)
    mask = case["tensors"]["response_mask"].bool()
    sessions = [key.rsplit("_", 1)[0] for key in case["batch_keys"]]
    advantages = results["v1-multi-output-sessions"]["advantages"]
    for first in range(0, len(sessions), 6):  # one prompt: rows first..first+5, sessions 0 (two steps) to 4
        rows = range(first, first + 6)
        final = {sessions[row]: row for row in rows}  # the highest index of each session comes last
        episode_scores = torch.stack([scores[row] for row in final.values()])
        once = (episode_scores - episode_scores.mean()) / (episode_scores.std() + 1e-6)
        for session, expected in zip(final, once, strict=True):
            for row in (row for row in rows if sessions[row] == session):
                assert torch.allclose(advantages[row][mask[row]], expected.expand(int(mask[row].sum())))
        every_step = torch.stack([scores[row] for row in rows])  # two samples of session 0 in the baseline
        assert not torch.allclose(once, (episode_scores - every_step.mean()) / (every_step.std() + 1e-6))
