"""The GPU run, the Slurm run and the CPU tier's vLLM run compose the same config, classified differences apart.

Three ``main_ppo`` configs, each composed by hydra from the recipe's ``configs/webvoyager_grpo.yaml`` as ``main_ppo``
composes it, flattened to dotted keys and compared key by key with the CPU tier's vLLM run
(``local/training_run.py --engine vllm``: verl's vLLM rollout on vLLM's CPU build):

- the GPU run (``scripts/gpu_check.sh``: ``training_run.py --rollout vllm`` with its overrides) may differ only in
  :data:`DEVICE_DIFFERENCES`;
- the Slurm run (``submit_webvoyager.sh``'s overrides from the shipped ``config.env.example``, on the nodes its
  ``#SBATCH`` lines ask for) may differ only in :data:`DEVICE_DIFFERENCES`, in :data:`RUN_SIZE_DIFFERENCES` (sizes,
  paths, addresses, names, schedule) and in :data:`BEHAVIOUR_DIFFERENCES` (settings that change what a run does,
  each reviewed and kept for the reason given).

A new difference fails until it is classified, with its key and both values, so the CPU tier keeps running the code
path a GPU or cluster user runs; an entry that no longer differs fails too.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf
from submit_fixtures import EXAMPLE, SCRIPT, compose_recipe, script_overrides

from nemo_gym_browser.local import run_spec as rs

GPU_CHECK = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
ABSENT = "<absent>"

# key -> why the CPU run differs there from a run on GPUs
DEVICE_DIFFERENCES = {
    "trainer.device": "cuda on the GPU, cpu here",
    "ray_kwargs.ray_init.num_gpus": "a logical GPU resource for Ray: verl's resource pool counts only GPUs/NPUs",
    "actor_rollout_ref.rollout.dtype": "bf16 matmuls are slow on most CPUs: float32 here",
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": "the actor computes in the rollout's dtype",
    "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype": "the reference too",
    "actor_rollout_ref.actor.strategy": "the CPU platform runs FSDP2 (gloo); the GPU run keeps verl's default FSDP",
    "actor_rollout_ref.ref.strategy": "as the actor's",
    "actor_rollout_ref.rollout.enable_sleep_mode": "vLLM's sleep mode needs CUDA's allocator",
    "actor_rollout_ref.rollout.free_cache_engine": "freeing the KV cache between steps goes with sleep mode",
    "actor_rollout_ref.rollout.gpu_memory_utilization": "on CPU the KV cache is a fixed size instead",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.kv_cache_memory_bytes": "a fixed 256 MiB KV cache in host memory",
    "actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend": "the model in vLLM's engine-core "
    "process (uni): one process fewer holding torch",
    "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": "64 MB shared-memory buckets, "
    "not 2 GB of CUDA IPC",
    "reward.num_workers": "one reward worker on a 2-core machine (the loop scores every episode itself)",
    "actor_rollout_ref.rollout.enforce_eager": "CUDA graphs are a GPU's (verl's default); vLLM's CPU build runs eager",
    "actor_rollout_ref.model.override_config.attn_implementation": "flash-attn's kernels need CUDA: sdpa here, "
    "verl's flash_attention_2 on a GPU that has flash-attn",
    "actor_rollout_ref.model.use_remove_padding": "remove-padding needs flash-attn's kernels: off with sdpa",
}

# Device keys where gpu_check.sh runs as the CPU run does, so that only the Slurm run differs there: key -> why
GPU_CHECK_AS_ON_CPU = {"actor_rollout_ref.rollout.enforce_eager": "eager: vLLM starts in seconds"}
# ... and these two when its python has no flash-attn: it then passes this override, as the CPU run does
SDPA_OVERRIDE = "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"
WITHOUT_FLASH_ATTN = (
    "actor_rollout_ref.model.override_config.attn_implementation",
    "actor_rollout_ref.model.use_remove_padding",
)

# key -> what the Slurm run sizes, places or names differently from the CPU run (config.env's variable, if any)
RUN_SIZE_DIFFERENCES = {
    "data.train_batch_size": "prompts per step (TRAIN_BATCH_SIZE)",
    "actor_rollout_ref.actor.ppo_mini_batch_size": "prompts per optimiser step (PPO_MINI_BATCH_SIZE)",
    "actor_rollout_ref.rollout.n": "episodes per task, the GRPO group (ROLLOUT_N)",
    "data.max_prompt_length": "MAX_PROMPT_LENGTH: WebVoyager's system prompt, tools and task",
    "data.max_response_length": "MAX_RESPONSE_LENGTH: ten turns of real web pages",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": "one whole episode per micro-batch: follows the lengths",
    "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu": "as the actor's",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "as the actor's",
    "actor_rollout_ref.rollout.max_model_len": "the engine's context: the model's own on the cluster (Qwen2.5's "
    "32768 = prompt + response), the run's lengths here",
    "actor_rollout_ref.rollout.tensor_model_parallel_size": "GPUs per vLLM engine (ROLLOUT_TP), one device here",
    "actor_rollout_ref.rollout.agent.num_workers": "agent-loop worker processes: AGENT_WORKERS_PER_NODE x nodes",
    "data.dataloader_num_workers": "processes reading rows: none on 2 cores (the sampler fixes the order either way)",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units": "storage units for a step's samples: verl's 8 "
    "for a cluster step, one for a few dozen samples",
    "trainer.nnodes": "nodes (Slurm's)",
    "trainer.n_gpus_per_node": "GPUS_PER_NODE",
    "trainer.total_training_steps": "a local run's --steps; the cluster run trains TOTAL_EPOCHS",
    "trainer.save_freq": "SAVE_FREQ; a local run keeps no checkpoint",
    "trainer.test_freq": "TEST_FREQ; a local run validates only with --test-freq",
    "trainer.val_before_train": "validation before step 1 goes with test_freq",
    "actor_rollout_ref.model.path": "the policy's folder (MODEL_PATH)",
    "data.train_files": "the data's path (DATA_DIR)",
    "data.val_files": "the data's path (DATA_DIR)",
    "trainer.default_local_dir": "the checkpoints' path (CHECKPOINT_DIR/PROJECT_NAME/EXPERIMENT_NAME)",
    "trainer.project_name": "PROJECT_NAME",
    "trainer.experiment_name": "EXPERIMENT_NAME",
    "trainer.max_actor_ckpt_to_keep": "CHECKPOINTS_TO_KEEP; a local run saves none (verl's null)",
    "trainer.max_critic_ckpt_to_keep": "CHECKPOINTS_TO_KEEP (no critic under GRPO); verl's null in a local run",
    "nemo_gym_browser.environment.server_urls": "ENV_SERVERS_PER_NODE loopback servers on every node; one "
    "server (behind the fault proxy) here",
    "ray_kwargs.ray_init.address": "the job's Ray cluster (RAY_ADDRESS, started by the script); a private local "
    "instance here",
    "ray_kwargs.ray_init._node_ip_address": "each node's own address; loopback here",
    "ray_kwargs.ray_init.include_dashboard": "Ray's default on the cluster; none for a private local instance",
    "ray_kwargs.ray_init.num_cpus": "detected by `ray start` (RAY_NUM_CPUS); 16 logical CPUs here",
}

# key -> why a setting that changes what a run does rightly differs between the Slurm run and the CPU run
_JUDGE = (
    "the judge scores tasks without verifier_metadata: the shipped config.env enables one for WebVoyager's open-ended "
    "tasks; every Corner Shop task has a verifier, so the CPU run has none (tests/test_agent_loop_judge.py and the "
    "Slurm tests' host judge run the judge's path)"
)
BEHAVIOUR_DIFFERENCES = {
    "actor_rollout_ref.actor.optim.lr": "tuned to the policy: 1e-6 (LR) for a 7B model; the CPU tier's tiny policy "
    "learns within a few steps at 1e-4",
    "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": "the turn budget fills the response length: 10 "
    "turns of real pages fit 28672 tokens (tests/test_agent_loop_turn_budget.py); the Corner Shop's longest task "
    "takes 4 turns, 8 leave room to err",
    "nemo_gym_browser.environment.max_sessions_per_server": "browsers at once per server: 64 on a node, 2 per core "
    "here (bench/session_capacity.py); an episode beyond it waits for a browser, none is lost",
    "nemo_gym_browser.episode_deadline_s": "environment time per attempt, sized to the site: real websites take "
    "minutes; the loopback Corner Shop answers a call in about a second, so a local run never reaches 300 s",
    "data.seed": "the data order: a local run's --seed; the script sets none, so verl's null leaves torch's fixed "
    "default generator seed (a fixed order too; data.seed=N on the command line picks another)",
    "trainer.resume_mode": "a resubmitted Slurm job continues from its last checkpoint (verl's auto); a local run "
    "starts fresh unless --resume",
    "nemo_gym_browser.judge.base_url": _JUDGE,
    "nemo_gym_browser.judge.model": _JUDGE,
    "nemo_gym_browser.judge.max_concurrency": _JUDGE,
    "nemo_gym_browser.judge.timeout_s": _JUDGE,
    "nemo_gym_browser.judge.max_attempts": _JUDGE,
    **{
        f"nemo_gym_browser.judge.{key}": _JUDGE
        for key in (
            "backoff_s",
            "backoff_max_s",
            "connect_timeout_s",
            "evidence_budget_chars",
            "max_tokens",
            "max_trajectory_steps",
            "temperature",
        )
    },
}

# What a run does, never a size: the key or anything under it (the environment servers' addresses excepted)
BEHAVIOUR_SETTINGS = (
    "algorithm",
    "data.custom_cls",
    "data.return_raw_chat",
    "actor_rollout_ref.actor.optim",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_coef",
    "actor_rollout_ref.rollout.name",
    "actor_rollout_ref.rollout.mode",
    "actor_rollout_ref.rollout.temperature",
    "actor_rollout_ref.rollout.calculate_log_probs",
    "actor_rollout_ref.rollout.multi_turn",
    "actor_rollout_ref.rollout.agent.default_agent_loop",
    "actor_rollout_ref.rollout.agent.agent_loop_config_path",
    "trainer.use_v1",
    "nemo_gym_browser",
)
ADDRESSES = ("nemo_gym_browser.environment.server_urls",)


def gpu_overrides(tmp_path: Path) -> list[str]:
    printed = subprocess.run(
        ["bash", str(GPU_CHECK), "--python", sys.executable, "--print-command", "--workdir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    train = next(shlex.split(line) for line in printed.splitlines() if "nemo_gym_browser.local.training_run" in line)
    return [train[i + 1] for i, word in enumerate(train) if word == "--override"]


def flat(config: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(config, dict):
        return {prefix[:-1]: config}
    found: dict[str, Any] = {}
    for key, value in config.items():
        found.update(flat(value, f"{prefix}{key}."))
    return found


def composed(spec: rs.RunSpec) -> dict[str, Any]:
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(rs.CONFIG_DIR), version_base=None):
            config = compose("webvoyager_grpo", overrides=rs.hydra_overrides(spec))
    finally:
        GlobalHydra.instance().clear()
    return flat(OmegaConf.to_container(config, resolve=False))


def local_run(tmp_path: Path) -> rs.RunSpec:
    return rs.RunSpec(
        model_path=tmp_path / "policy",
        train_file=tmp_path / "train.jsonl",
        val_file=tmp_path / "val.jsonl",
        server_urls=("http://127.0.0.1:8100",),
        output_dir=tmp_path / "run",
        max_sessions_per_server=4,
    )


def cpu_vllm_run(tmp_path: Path) -> dict[str, Any]:
    return composed(local_run(tmp_path).replace(rollout_name=rs.VLLM_CPU_ENGINE))


def slurm_run(tmp_path: Path) -> dict[str, Any]:
    """The shipped config.env.example, with the model and judge a user must set, on as many nodes as the script's
    ``#SBATCH --nodes`` line asks for."""
    nodes = re.search(r"^#SBATCH --nodes=(\d+)$", SCRIPT.read_text(), flags=re.MULTILINE)
    assert nodes, "submit_webvoyager.sh has no #SBATCH --nodes line"
    config_env = tmp_path / "config.env"
    config_env.write_text(
        EXAMPLE.read_text() + "MODEL_PATH=/models/policy\nJUDGE_BASE_URL=http://judge.test/v1\nJUDGE_MODEL=judge\n"
    )
    overrides = script_overrides(config_env, env={"SLURM_JOB_NUM_NODES": nodes.group(1)})
    return flat(OmegaConf.to_container(compose_recipe(overrides), resolve=False))


def differences(run: dict[str, Any], cpu: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    return {
        key: (run.get(key, ABSENT), cpu.get(key, ABSENT))
        for key in sorted(set(run) | set(cpu))
        if run.get(key, ABSENT) != cpu.get(key, ABSENT)
    }


def listed(found: dict[str, tuple[Any, Any]], keys: set[str], name: str) -> str:
    return "\n".join(f"{key}: {name} {found[key][0]!r} / CPU {found[key][1]!r}" for key in sorted(keys))


def under(key: str, settings: tuple[str, ...]) -> bool:
    return any(key == setting or key.startswith(f"{setting}.") for setting in settings)


def test_the_gpu_run_and_the_cpu_vllm_run_differ_only_in_device_settings(tmp_path: Path) -> None:
    overrides = gpu_overrides(tmp_path)
    gpu = composed(local_run(tmp_path).replace(rollout_name="vllm", extra_overrides=tuple(overrides)))
    cpu = cpu_vllm_run(tmp_path)
    found = differences(gpu, cpu)

    as_on_cpu = set(GPU_CHECK_AS_ON_CPU) | (set(WITHOUT_FLASH_ATTN) if SDPA_OVERRIDE in overrides else set())
    expected = set(DEVICE_DIFFERENCES) - as_on_cpu
    assert not set(found) - expected, "unclassified:\n" + listed(found, set(found) - expected, "GPU")
    assert not expected - set(found), f"classified, but the same on the GPU: {sorted(expected - set(found))}"
    assert gpu["actor_rollout_ref.rollout.name"] == cpu["actor_rollout_ref.rollout.name"] == "vllm"
    assert gpu["trainer.use_v1"] == cpu["trainer.use_v1"]


def test_the_slurm_run_differs_from_the_cpu_vllm_run_only_in_device_settings_run_size_and_reviewed_behaviour(
    tmp_path: Path,
) -> None:
    slurm, cpu = slurm_run(tmp_path), cpu_vllm_run(tmp_path)
    found = differences(slurm, cpu)

    print(listed(found, set(found), "Slurm"))
    unclassified = set(found) - set(DEVICE_DIFFERENCES) - set(RUN_SIZE_DIFFERENCES) - set(BEHAVIOUR_DIFFERENCES)
    assert not unclassified, "unclassified differences:\n" + listed(found, unclassified, "Slurm")
    stale = (set(RUN_SIZE_DIFFERENCES) | set(BEHAVIOUR_DIFFERENCES)) - set(found)
    assert not stale, f"classified but the same in both runs: {sorted(stale)}"
    assert slurm["actor_rollout_ref.rollout.name"] == cpu["actor_rollout_ref.rollout.name"] == "vllm"
    assert slurm["algorithm.adv_estimator"] == cpu["algorithm.adv_estimator"] == rs.RECIPE_ESTIMATOR


def test_no_behaviour_setting_is_classified_as_a_run_size_and_no_key_twice() -> None:
    sized_behaviour = {key for key in RUN_SIZE_DIFFERENCES if under(key, BEHAVIOUR_SETTINGS) and key not in ADDRESSES}
    assert not sized_behaviour, f"behaviour settings in RUN_SIZE_DIFFERENCES: {sorted(sized_behaviour)}"
    tables = (DEVICE_DIFFERENCES, RUN_SIZE_DIFFERENCES, BEHAVIOUR_DIFFERENCES)
    assert sum(map(len, tables)) == len(set().union(*tables)), "a key classified in two tables"
