"""Checkpoints by choice: the resume mode and the number kept come from config.env, a checkpoint made from another
model or other data is not resumed unless the user says so, the disk is checked against what the kept checkpoints
need, and the default logger leaves the metrics in the run folder.

The configs are composed from the script's own overrides (``--print-overrides``) with verl 0.9.1's real
configuration; checkpoint folders are laid out as verl's trainer writes them (``global_step_N/actor``,
``latest_checkpointed_iteration.txt``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from submit_fixtures import SCRIPT, compose_recipe, script_overrides
from test_submit_config import TASKS, prepared_data, write_config_env

from nemo_gym_browser import checkpointing
from nemo_gym_browser.local.chat_tokenizer import save_tokenizer_and_config

OTHER_TASKS = [task | {"ques": task["ques"] + " Answer in French."} for task in TASKS]


@pytest.fixture(scope="module")
def recipe_inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model folder (in-process tokenizer, tiny Qwen2 config) and prepared data, as a user would have them."""
    root = tmp_path_factory.mktemp("recipe_inputs")
    save_tokenizer_and_config(root / "model")
    prepared_data(root / "data", TASKS)
    return root


def without_slurm() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}


def saved_by_verl(folder: Path, step: int) -> Path:
    """A checkpoint as verl's trainer leaves it: ``global_step_N`` with the actor's shards, the data loader state,
    and the tracker naming it."""
    checkpoint = folder / f"global_step_{step}"
    (checkpoint / "actor").mkdir(parents=True)
    (checkpoint / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"\0" * 64)
    (checkpoint / "data.pt").write_bytes(b"\0" * 8)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(step))
    return checkpoint


def composed(recipe_inputs: Path, tmp_path: Path, name: str, **values: str) -> Any:
    """The composed config of a config.env with the test's model and data and ``values``; checkpoints in tmp."""
    values = {"CHECKPOINT_DIR": str(tmp_path / "checkpoints"), **values}
    return compose_recipe(script_overrides(write_config_env(tmp_path / f"{name}.env", recipe_inputs, **values)))


def test_the_scripts_overrides_carry_the_resume_mode_and_the_number_of_checkpoints_to_keep(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    default = script_overrides(write_config_env(tmp_path / "a.env", recipe_inputs))
    assert "trainer.resume_mode=auto" in default
    assert "trainer.max_actor_ckpt_to_keep=2" in default and "trainer.max_critic_ckpt_to_keep=2" in default
    assert not any(line.startswith("trainer.resume_from_path") for line in default)

    config = composed(recipe_inputs, tmp_path, "b", RESUME="off", CHECKPOINTS_TO_KEEP="0")
    assert config.trainer.resume_mode == "disable"
    assert config.trainer.max_actor_ckpt_to_keep is None  # verl's "keep every one"

    checkpoint = tmp_path / "old" / "global_step_40"
    config = composed(recipe_inputs, tmp_path, "c", RESUME=f"{checkpoint}/", CHECKPOINTS_TO_KEEP="3")
    assert config.trainer.resume_mode == "resume_path"
    assert config.trainer.resume_from_path == str(checkpoint)  # verl reads the step after the last global_step_
    assert config.trainer.max_actor_ckpt_to_keep == 3 and config.trainer.max_critic_ckpt_to_keep == 3

    result = subprocess.run(
        [
            "bash",
            str(SCRIPT),
            "--config",
            str(write_config_env(tmp_path / "d.env", recipe_inputs, RESUME="yes")),
            "--print-overrides",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=without_slurm(),
    )
    assert result.returncode == 1
    assert "RESUME must be off, auto or the path of a global_step_<N> checkpoint folder, not 'yes'" in result.stderr


def test_a_dry_run_refuses_a_reused_experiment_name_with_other_data_before_starting_anything(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    first = composed(recipe_inputs, tmp_path, "first")
    checkpointing.record(first, "first-run")  # as the first job did when its training started
    checkpoint = saved_by_verl(Path(first.trainer.default_local_dir), 2)

    other = prepared_data(tmp_path / "other", OTHER_TASKS)
    config_env = write_config_env(
        tmp_path / "config.env",
        recipe_inputs,
        DATA_DIR=str(other),
        CHECKPOINT_DIR=str(tmp_path / "checkpoints"),  # the same EXPERIMENT_NAME, so the same folder
        ENV_SERVER_URLS="http://127.0.0.1:9",
        PYTHON=sys.executable,
    )
    result = subprocess.run(
        ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env=without_slurm(),
    )
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    refusal = next(line for line in result.stdout.splitlines() if line.startswith("checkpoints: FAIL resume: "))
    assert f"RESUME=auto would resume from {checkpoint}" in refusal
    assert f"train data: the checkpoint was made from {recipe_inputs / 'data' / 'train.jsonl'}" in refusal
    assert f"this run reads {other / 'train.jsonl'}" in refusal
    assert "val data:" in refusal and "model:" not in refusal
    assert "new EXPERIMENT_NAME" in refusal and "RESUME_ACROSS_CHANGES=1" in refusal
    assert "the checkpoint checks failed" in result.stderr
    assert "preflight:" not in result.stdout  # stopped before the longer checks,
    assert "cleanup: stopping 0 process(es)" in result.stdout  # and before any server or Ray


def test_the_same_data_resumes_and_other_data_resumes_only_when_told_with_a_warning(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    first = composed(recipe_inputs, tmp_path, "first")
    checkpointing.record(first, "first-run")
    checkpoint = saved_by_verl(Path(first.trainer.default_local_dir), 4)

    # the same data copied elsewhere is the same data: the content decides
    copied = shutil.copytree(recipe_inputs / "data", tmp_path / "copied")
    same = checkpointing.check_resume(composed(recipe_inputs, tmp_path, "same", DATA_DIR=str(copied)))
    assert same.status == "ok"
    assert same.detail.startswith(f"resumes from {checkpoint} (step 4, RESUME=auto); made from the same model")

    other = composed(recipe_inputs, tmp_path, "other", DATA_DIR=str(prepared_data(tmp_path / "o", OTHER_TASKS)))
    with pytest.raises(checkpointing.CheckFailed, match="train data: the checkpoint was made from"):
        checkpointing.check_resume(other)
    told = checkpointing.check_resume(other, across_changes=True)
    assert told.status == "warn"
    assert "although RESUME_ACROSS_CHANGES=1 and train data: " in told.detail

    batch = composed(recipe_inputs, tmp_path, "batch", TRAIN_BATCH_SIZE="1", PPO_MINI_BATCH_SIZE="1")
    with pytest.raises(checkpointing.CheckFailed, match=r"data.train_batch_size: 2 then, 1 now"):
        checkpointing.check_resume(batch)

    model = shutil.copytree(recipe_inputs / "model", tmp_path / "model")
    with pytest.raises(checkpointing.CheckFailed, match=f"this run names {model}"):
        checkpointing.check_resume(composed(recipe_inputs, tmp_path, "model", MODEL_PATH=str(model)))


def test_each_checkpoint_keeps_the_fingerprint_of_the_run_that_saved_it(recipe_inputs: Path, tmp_path: Path) -> None:
    first = composed(recipe_inputs, tmp_path, "first")
    checkpointing.record(first, "first-run")
    step_2 = saved_by_verl(Path(first.trainer.default_local_dir), 2)

    # a second job continues step 2 on other data, as told, and saves step 4 under its own fingerprint
    other_data = str(prepared_data(tmp_path / "o", OTHER_TASKS))
    second = composed(recipe_inputs, tmp_path, "second", DATA_DIR=other_data)
    assert checkpointing.check_resume(second, across_changes=True).status == "warn"
    checkpointing.record(second, "second-run")
    saved_by_verl(Path(second.trainer.default_local_dir), 4)
    assert json.loads((step_2 / checkpointing.FINGERPRINT_FILE).read_text())["run_id"] == "first-run"

    assert checkpointing.check_resume(second).status == "ok"  # step 4: the second job's data
    back_to_2 = {"RESUME": str(step_2), "DATA_DIR": other_data, "CHECKPOINT_DIR": str(tmp_path / "branch")}
    with pytest.raises(checkpointing.CheckFailed, match="train data"):  # step 2: the first job's
        checkpointing.check_resume(composed(recipe_inputs, tmp_path, "branch", **back_to_2))


def test_a_checkpoint_without_a_fingerprint_is_refused_unless_told(recipe_inputs: Path, tmp_path: Path) -> None:
    config = composed(recipe_inputs, tmp_path, "a")
    saved_by_verl(Path(config.trainer.default_local_dir), 3)  # by a run this script did not start
    with pytest.raises(checkpointing.CheckFailed, match="it has no fingerprint"):
        checkpointing.check_resume(config)
    assert checkpointing.check_resume(config, across_changes=True).status == "warn"


@pytest.mark.parametrize(("resume", "starts_at"), [("off", 0), ("global_step_2", 2)])
def test_a_run_never_starts_in_a_folder_holding_checkpoints_past_its_first_step(
    recipe_inputs: Path, tmp_path: Path, resume: str, starts_at: int
) -> None:
    folder = tmp_path / "checkpoints" / "nemo_gym_browser" / "webvoyager_grpo"
    saved_by_verl(folder, 2)
    saved_by_verl(folder, 4)
    resume_value = resume if resume == "off" else str(folder / resume)
    config = composed(recipe_inputs, tmp_path, "a", RESUME=resume_value)
    with pytest.raises(checkpointing.CheckFailed) as refused:
        checkpointing.check_resume(config)
    assert f"holds checkpoints past step {starts_at}, where this run starts" in str(refused.value)
    assert "global_step_4" in str(refused.value) and "new EXPERIMENT_NAME" in str(refused.value)


def test_a_resume_path_without_the_actors_shards_is_refused(recipe_inputs: Path, tmp_path: Path) -> None:
    rotated = saved_by_verl(tmp_path / "old", 6)
    shutil.rmtree(rotated / "actor")  # what verl's rotation leaves of an old checkpoint
    config = composed(recipe_inputs, tmp_path, "a", RESUME=str(rotated))
    with pytest.raises(checkpointing.CheckFailed, match="has no actor/"):
        checkpointing.resume_plan(config)


def qwen2_config(**values: Any) -> dict[str, Any]:
    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 320,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    return config | values


@pytest.mark.parametrize(
    "config",
    [
        qwen2_config(),
        qwen2_config(tie_word_embeddings=False),
        qwen2_config(architectures=["LlamaForCausalLM"], model_type="llama", num_key_value_heads=4),
    ],
    ids=["qwen2-tied", "qwen2-untied", "llama"],
)
def test_the_parameter_count_from_config_json_is_the_count_of_the_model_transformers_builds(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(config))
    built = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    assert checkpointing.parameter_count(tmp_path) == (sum(p.numel() for p in built.parameters()), "config.json")

    built.save_pretrained(tmp_path / "saved")  # with weights: counted exactly from the safetensors headers
    count, source = checkpointing.parameter_count(tmp_path / "saved")
    assert source == "model.safetensors"
    assert count == sum(p.numel() for p in built.parameters())


def test_the_checkpoints_on_disk_at_once_are_the_most_verls_own_rotation_leaves(tmp_path: Path) -> None:
    """verl's rotation (BaseCheckpointManager.ensure_checkpoint_capacity before a save, register_checkpoint after)
    played on real folders for every keep count, against what the disk check assumes."""
    from verl.utils.checkpoint.checkpoint_manager import BaseCheckpointManager

    saves = 5
    config = compose_recipe(
        [
            *("actor_rollout_ref.model.path=m", "data.train_files=t", "data.val_files=v", "trainer.save_freq=1"),
            f"trainer.total_training_steps={saves}",
            "nemo_gym_browser.environment.server_urls=[http://127.0.0.1:9]",
        ]
    )
    for keep in (0, 1, 2, 3, 7):
        manager = BaseCheckpointManager.__new__(BaseCheckpointManager)  # the rotation needs no model or process group
        manager.previous_saved_paths = []
        most = 0
        for step in range(1, saves + 1):
            manager.ensure_checkpoint_capacity(keep or None)
            (tmp_path / f"k{keep}" / f"global_step_{step}").mkdir(parents=True)
            most = max(most, len(list((tmp_path / f"k{keep}").iterdir())))
            manager.register_checkpoint(str(tmp_path / f"k{keep}" / f"global_step_{step}"), keep or None)
        config.trainer.max_actor_ckpt_to_keep = keep or None  # CHECKPOINTS_TO_KEEP=0 is verl's null
        assert checkpointing.checkpoints_held(config, start_step=0)[0] == most, keep


def test_the_disk_check_names_what_the_kept_checkpoints_need_and_what_is_free(
    recipe_inputs: Path, tmp_path: Path
) -> None:
    config = composed(recipe_inputs, tmp_path, "a", SAVE_FREQ="1", TOTAL_EPOCHS="2")  # 3 rows / 2 -> 1 step per epoch
    finding = checkpointing.check_disk(config)
    assert finding.status == "ok"
    # the test model: 2 layers of hidden size 16, tied embeddings; fp32 weights + AdamW's moments, 12 bytes each
    parameters = checkpointing.parameter_count(recipe_inputs / "model")[0]
    assert "2 save(s) in steps 1-2, at most 2 on disk at once (keep 2)" in finding.detail
    assert f"({parameters:,} parameters from config.json x 12 bytes: fp32 weights 4 + AdamW's" in finding.detail
    assert f"free at {tmp_path}" in finding.detail  # the checkpoint folder's nearest existing parent

    huge = shutil.copytree(recipe_inputs / "model", tmp_path / "huge")
    (huge / "config.json").write_text(json.dumps(qwen2_config(hidden_size=1 << 20, num_hidden_layers=1 << 12)))
    with pytest.raises(checkpointing.CheckFailed) as refused:
        checkpointing.check_disk(composed(recipe_inputs, tmp_path, "b", MODEL_PATH=str(huge)))
    need, free = re.search(r"= ([\d.]+) GB; ([\d.]+) GB free at ", str(refused.value)).groups()
    assert float(need) > float(free)
    assert "keep fewer (CHECKPOINTS_TO_KEEP)" in str(refused.value) and "CHECKPOINT_DIR" in str(refused.value)

    hub = checkpointing.check_disk(composed(recipe_inputs, tmp_path, "c", MODEL_PATH="Qwen/Qwen2.5-7B-Instruct"))
    assert (
        hub.status == "ok" and "size not estimated: Qwen/Qwen2.5-7B-Instruct is not a local model folder" in hub.detail
    )

    assert checkpointing.check_disk(composed(recipe_inputs, tmp_path, "d", SAVE_FREQ="0")).detail == (
        "trainer.save_freq=0: no checkpoint is saved"
    )


def test_the_default_logger_writes_every_steps_metrics_into_the_run_folder(
    recipe_inputs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from verl.utils.tracking import Tracking

    config_env = write_config_env(
        tmp_path / "config.env", recipe_inputs, PYTHON=sys.executable, GYM_VENV=str(tmp_path / "no-gym")
    )
    result = subprocess.run(  # stops at the missing GYM_VENV, after the metrics line and before anything starts
        ["bash", str(SCRIPT), "--config", str(config_env), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=300,
        env={key: value for key, value in without_slurm().items() if key != "VERL_FILE_LOGGER_PATH"},
    )
    assert result.returncode == 1 and "config composed" not in result.stdout, result.stdout + result.stderr
    line = next(line for line in result.stdout.splitlines() if "metrics: LOGGER=console,file" in line)
    metrics = Path(line.split("verl's file logger writes ")[1])
    (run_folder,) = (tmp_path / "logs").iterdir()
    assert metrics == run_folder / "metrics.jsonl"

    trainer = compose_recipe(script_overrides(config_env)).trainer
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(metrics))  # as the script exports it before `ray start`
    tracking = Tracking(trainer.project_name, trainer.experiment_name, default_backend=list(trainer.logger))
    tracking.log({"env/invalid_rate": 0.25, "val-core/webvoyager/reward/mean@1": 0.5}, step=1)
    tracking.log({"env/invalid_rate": 0.0}, step=2)
    tracking.finish()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert records == [
        {"step": 1, "data": {"env/invalid_rate": 0.25, "val-core/webvoyager/reward/mean@1": 0.5}},
        {"step": 2, "data": {"env/invalid_rate": 0.0}},
    ]


def test_the_cli_records_a_fingerprint_only_after_its_checks_pass(
    recipe_inputs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from omegaconf import OmegaConf

    config = composed(recipe_inputs, tmp_path, "a", RESUME="off")
    folder = Path(config.trainer.default_local_dir)
    composed_yaml = tmp_path / "composed_config.yaml"
    composed_yaml.write_text(OmegaConf.to_yaml(config))

    assert checkpointing.main(["--config", str(composed_yaml), "--record", "--run-id", "run-1"]) == 0
    recorded = json.loads((folder / checkpointing.FINGERPRINT_FILE).read_text())
    assert recorded["run_id"] == "run-1" and recorded["model"] == str(recipe_inputs / "model")
    assert f"checkpoints: ok   resume: RESUME=off: training starts at step 0, checkpoints go to {folder}" in (
        capsys.readouterr().out
    )

    saved_by_verl(folder, 2)  # a fresh start would now overwrite it: refused, and nothing is written
    assert checkpointing.main(["--config", str(composed_yaml), "--record", "--run-id", "run-2"]) == 1
    assert "checkpoints: FAIL resume: " in capsys.readouterr().out
    assert json.loads((folder / checkpointing.FINGERPRINT_FILE).read_text())["run_id"] == "run-1"
    assert not (folder / "global_step_2" / checkpointing.FINGERPRINT_FILE).exists()
