"""The GPU run (``scripts/gpu_check.sh``) and the CPU tier's vLLM run differ only where the device makes them.

Both are ``local/training_run.py`` runs of the same :class:`~nemo_gym_browser.local.run_spec.RunSpec` (the GPU one
with ``--rollout vllm`` and gpu_check's overrides, the CPU one with ``--engine vllm``); their configs are composed
by hydra from the recipe's ``configs/webvoyager_grpo.yaml`` as ``main_ppo`` composes them, flattened, and compared
key by key. Every difference must be one of :data:`DEVICE_DIFFERENCES`, each with the reason it exists; a new one
fails the test until it is classified here, so the CPU tier keeps running the code path a GPU user runs.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from nemo_gym_browser.local import run_spec as rs

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
ABSENT = "<absent>"

# key -> why the CPU run differs there
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
}


def gpu_overrides(tmp_path: Path) -> list[str]:
    printed = subprocess.run(
        ["bash", str(SCRIPT), "--python", sys.executable, "--print-command", "--workdir", str(tmp_path / "work")],
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


def test_the_gpu_run_and_the_cpu_vllm_run_differ_only_in_device_settings(tmp_path: Path) -> None:
    base = rs.RunSpec(
        model_path=tmp_path / "policy",
        train_file=tmp_path / "train.jsonl",
        val_file=tmp_path / "val.jsonl",
        server_urls=("http://127.0.0.1:8100",),
        output_dir=tmp_path / "run",
        max_sessions_per_server=4,
    )
    gpu = composed(base.replace(rollout_name="vllm", extra_overrides=tuple(gpu_overrides(tmp_path))))
    cpu = composed(base.replace(rollout_name=rs.VLLM_CPU_ENGINE))

    differences = {
        key: (gpu.get(key, ABSENT), cpu.get(key, ABSENT))
        for key in sorted(set(gpu) | set(cpu))
        if gpu.get(key, ABSENT) != cpu.get(key, ABSENT)
    }

    print(
        "\n".join(
            f"{key}: GPU {g!r} / CPU {c!r} ({DEVICE_DIFFERENCES.get(key)})" for key, (g, c) in differences.items()
        )
    )
    assert set(differences) == set(DEVICE_DIFFERENCES), set(differences) ^ set(DEVICE_DIFFERENCES)
    assert gpu["actor_rollout_ref.rollout.name"] == cpu["actor_rollout_ref.rollout.name"] == "vllm"
    assert gpu["trainer.use_v1"] == cpu["trainer.use_v1"]
